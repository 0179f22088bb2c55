//! Transfer events reach a Rust handler on the library's progress thread; the handler may call back
//! into the binding (non-blocking calls on the event's transfer) without deadlock, and a panic in
//! it does not cross into C.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use smartgen::{Context, Event, EventKind, LayerState, Status, Transfer, TransferFlags, TransferOptions};

const BLOCKS: [u32; 3] = [4, 9, 2];

/// Moves one request and returns its two transfers, unreleased: the library delivers no event of a
/// released transfer, and events may still be on their way when the waits return.
fn run_transfer(prefill_ctx: &Context, decode_ctx: &Context, request: &str) -> (Transfer, Transfer) {
    let (prefill, decode) = connect(prefill_ctx, decode_ctx);
    let mut src = register(prefill_ctx, SMALL);
    fill(&mut src, &BLOCKS);
    let dst = register(decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let expected = decode
        .expect(request, &dst, &BLOCKS, 48, &TransferOptions::default())
        .unwrap();
    let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
    let posted = prefill.post(request, &src, &BLOCKS, 48, &all).unwrap();
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    assert_eq!(mismatches(&dst, &BLOCKS), 0);
    (expected, posted)
}

/// What the handler saw for one event, including what it read back through the binding.
#[derive(Debug)]
struct Seen {
    kind: EventKind,
    layer: u32,
    request_id: String,
    state: Option<LayerState>,
    status: Option<Status>,
}

#[test]
fn handler_calls_back_into_the_transfer() {
    let key = random_key();
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let sink = seen.clone();
    let decode_ctx = Context::with_event_handler(&options(&key), move |event: &Event| {
        let transfer = event.transfer().expect("a live transfer inside the handler");
        assert_eq!(transfer.id(), event.transfer_id());
        let state = transfer.layer_state(event.layer).ok();
        let status = transfer.status().ok().map(|(status, _)| status);
        transfer.test().ok();
        sink.lock().unwrap().push(Seen {
            kind: event.kind,
            layer: event.layer,
            request_id: event.request_id.clone(),
            state,
            status,
        });
    })
    .unwrap();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let _transfers = run_transfer(&prefill_ctx, &decode_ctx, "ev-1");

    // FINISHED may come just after the wait returned.
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !seen.lock().unwrap().iter().any(|s| s.kind == EventKind::FINISHED) {
        assert!(
            std::time::Instant::now() < deadline,
            "no FINISHED event: {:?}",
            seen.lock().unwrap()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let seen = seen.lock().unwrap();
    for layer in 0..SMALL.num_layers {
        let ready = seen
            .iter()
            .find(|s| s.kind == EventKind::LAYER_READY && s.layer == layer)
            .unwrap_or_else(|| panic!("no LAYER_READY for layer {}: {:?}", layer, seen));
        assert_eq!(ready.request_id, "ev-1");
        assert!(ready
            .state
            .expect("layer_state from the handler")
            .contains(LayerState::READY));
    }
    let finished = seen.iter().find(|s| s.kind == EventKind::FINISHED).unwrap();
    assert_eq!(finished.status, Some(Status::OK));
}

#[test]
fn events_arrive_on_a_channel_as_copies() {
    let key = random_key();
    let (decode_ctx, events) = Context::with_event_channel(&options(&key)).unwrap();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let _transfers = run_transfer(&prefill_ctx, &decode_ctx, "ev-2");
    let mut kinds = Vec::new();
    while let Ok(event) = events.recv_timeout(TIMEOUT) {
        assert_eq!(event.request_id, "ev-2");
        assert!(event.transfer().is_none(), "a copy has no live transfer");
        kinds.push(event.kind);
        if event.kind == EventKind::FINISHED {
            assert_eq!(event.status, Status::OK);
            break;
        }
    }
    assert!(kinds.contains(&EventKind::FINISHED), "{:?}", kinds);
    assert_eq!(
        kinds.iter().filter(|&&k| k == EventKind::LAYER_READY).count(),
        SMALL.num_layers as usize
    );
}

const DELIBERATE_PANIC: &str = "handler failure (deliberate)";

/// Keeps the test's deliberate panics off stderr; every other panic is reported as usual.
fn quiet_panics(message: &'static str) {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if info.payload().downcast_ref::<&str>() != Some(&message) {
            report(info)
        }
    }));
}

#[test]
fn a_panicking_handler_does_not_unwind_into_the_library() {
    let key = random_key();
    let calls = Arc::new(AtomicUsize::new(0));
    let counter = calls.clone();
    quiet_panics(DELIBERATE_PANIC);
    let decode_ctx = Context::with_event_handler(&options(&key), move |_: &Event| {
        counter.fetch_add(1, Ordering::SeqCst);
        std::panic::panic_any(DELIBERATE_PANIC);
    })
    .unwrap();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let first = run_transfer(&prefill_ctx, &decode_ctx, "ev-3");
    let deadline = std::time::Instant::now() + TIMEOUT;
    while calls.load(Ordering::SeqCst) == 0 {
        assert!(std::time::Instant::now() < deadline, "the handler never ran");
        std::thread::sleep(Duration::from_millis(2));
    }
    drop(first);
    // The context still works after the panics.
    run_transfer(&prefill_ctx, &decode_ctx, "ev-4");
}

/// A `Transfer` dropped inside the handler (the last owner) is released, on a thread of its own,
/// not leaked (0.4: the library refused the release there and Drop ignored it), and `pool_mut`
/// refuses while a transfer holds the pool.
#[test]
fn a_transfer_dropped_in_the_handler_is_released_and_pool_mut_waits_for_it() {
    let key = random_key();
    let slot: Arc<Mutex<Option<Transfer>>> = Arc::default();
    let in_handler = slot.clone();
    let dropped = Arc::new(AtomicUsize::new(0));
    let dropped_in_handler = dropped.clone();
    let decode_ctx = Context::with_event_handler(&options(&key), move |event: &Event| {
        if event.kind == EventKind::QUIESCED {
            if let Some(t) = in_handler.lock().unwrap().take() {
                drop(t); // the last owner, inside the handler
                dropped_in_handler.fetch_add(1, Ordering::SeqCst);
            }
        }
    })
    .unwrap();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &BLOCKS);
    let mut dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
    let expected = decode
        .expect("dropped-in-handler", &dst, &BLOCKS, 48, &TransferOptions::default())
        .unwrap();
    let refused = dst.pool_mut().err().map(|e| e.status());
    assert_eq!(refused, Some(Status::INVALID_STATE), "pool_mut while a transfer holds the pool");
    *slot.lock().unwrap() = Some(expected);
    let posted = prefill.post("dropped-in-handler", &src, &BLOCKS, 48, &all).unwrap();
    posted.wait(TIMEOUT).unwrap();
    drop(posted);
    // Once the deferred release has returned, nothing holds the pool: pool_mut answers again.
    let start = std::time::Instant::now();
    while dst.pool_mut().is_err() {
        assert!(start.elapsed() < TIMEOUT, "the transfer dropped in the handler was never released");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(dropped.load(Ordering::SeqCst), 1);
    // Released for real: the request id is free again on the session (a leaked transfer keeps it).
    let again = decode
        .expect("dropped-in-handler", &dst, &BLOCKS, 48, &TransferOptions::default())
        .expect("the request id is free: the transfer was released");
    let posted = prefill.post("dropped-in-handler", &src, &BLOCKS, 48, &all).unwrap();
    again.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    assert_eq!(mismatches(&dst, &BLOCKS), 0);
}

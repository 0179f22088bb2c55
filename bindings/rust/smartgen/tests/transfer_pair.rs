//! A full transfer between two contexts of this process: every byte arrives, blocks outside the
//! request stay untouched, and the handles close cleanly (twice, for the session).

mod common;

use common::*;
use smartgen::{Context, Plane, Status, TransferFlags, TransferOptions, WireQuant};

const PREFILL_BLOCKS: [u32; 7] = [1, 2, 20, 21, 7, 30, 4];
const DECODE_BLOCKS: [u32; 7] = [5, 3, 9, 0, 31, 17, 12];
const TOKENS: u64 = 7 * 16;

#[test]
fn full_transfer_moves_every_byte() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    assert!(prefill.provider().unwrap().contains("tcp"));

    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &PREFILL_BLOCKS);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();

    let expected = decode
        .expect("req-1", &dst, &DECODE_BLOCKS, TOKENS, &TransferOptions::default())
        .unwrap();
    let posted = prefill
        .post(
            "req-1",
            &src,
            &PREFILL_BLOCKS,
            TOKENS,
            &TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN),
        )
        .unwrap();
    for layer in 0..SMALL.num_layers {
        expected.wait_layer(layer, TIMEOUT).unwrap();
    }
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    assert!(expected.test().unwrap());
    assert_eq!(expected.status().unwrap().0, Status::OK);

    assert_eq!(mismatches(&dst, &DECODE_BLOCKS), 0);
    for block in (0..SMALL.num_blocks as u32).filter(|b| !DECODE_BLOCKS.contains(b)) {
        assert!(
            dst.pool().block(1, Plane::V, block).iter().all(|&b| b == 0),
            "block {} was written",
            block
        );
    }
    let payload = 2 * u64::from(SMALL.num_layers) * 7 * dst.pool().plane_bytes() as u64;
    assert!(posted.stats().unwrap().bytes >= payload);

    posted.release().unwrap();
    expected.release().unwrap();
    prefill.close(TIMEOUT).unwrap();
    prefill.close(TIMEOUT).unwrap();
}

#[test]
fn layer_by_layer_post_and_notifications() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &PREFILL_BLOCKS);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();

    assert_eq!(prefill.next_notification().unwrap(), None);
    let expected = decode
        .expect("req-2", &dst, &DECODE_BLOCKS, TOKENS, &TransferOptions::default())
        .unwrap();
    decode.notify(b"ready req-2").unwrap();
    let note = loop {
        if let Some(note) = prefill.next_notification().unwrap() {
            break note;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    };
    assert_eq!(note, b"ready req-2");

    let posted = prefill
        .post("req-2", &src, &PREFILL_BLOCKS, TOKENS, &TransferOptions::default())
        .unwrap();
    // Nothing moves before a layer is marked written.
    let not_yet = expected
        .wait_layer(0, std::time::Duration::from_millis(50))
        .unwrap_err();
    assert!(not_yet.is_timeout(), "{}", not_yet);
    for layer in 0..SMALL.num_layers {
        posted.layer_written(layer).unwrap();
        expected.wait_layer(layer, TIMEOUT).unwrap();
        assert!(expected
            .layer_state(layer)
            .unwrap()
            .contains(smartgen::LayerState::READY));
    }
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    assert_eq!(mismatches(&dst, &DECODE_BLOCKS), 0);
    assert!(expected.residency(0).unwrap().iter().all(|&resident| resident));
}

/// In-flight quantization: both sides ask for int8, every pool byte goes quantized, and the wire
/// carries about half of fp16's (codes plus a scale per block, plane and KV head).
#[test]
fn quantized_transfer_halves_the_wire_bytes() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &PREFILL_BLOCKS);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let quantized = TransferOptions::default().with_wire_quant(WireQuant::INT8);
    let expected = decode
        .expect("req-q", &dst, &DECODE_BLOCKS, TOKENS, &quantized)
        .unwrap();
    let posted = prefill
        .post(
            "req-q",
            &src,
            &PREFILL_BLOCKS,
            TOKENS,
            &quantized.clone().with_flags(TransferFlags::ALL_LAYERS_WRITTEN),
        )
        .unwrap();
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    let stats = expected.stats().unwrap();
    let payload = 2 * u64::from(SMALL.num_layers) * 7 * dst.pool().plane_bytes() as u64;
    assert_eq!(stats.quantized_bytes, payload);
    assert!(
        stats.quantized_wire_bytes * 2 >= payload && stats.quantized_wire_bytes * 100 <= payload * 51,
        "{} wire bytes for {} pool bytes",
        stats.quantized_wire_bytes,
        payload
    );
}

//! Handles may be dropped in any order: objects keep their context alive, so the context is
//! destroyed last whatever the program does.

mod common;

use std::time::Duration;

use common::*;
use smartgen::{Context, TransferFlags, TransferOptions};

#[test]
fn transfer_outlives_every_other_handle() {
    let key = random_key();
    let (decode_transfer, prefill_transfer) = {
        let prefill_ctx = Context::new(&options(&key)).unwrap();
        let decode_ctx = Context::new(&options(&key)).unwrap();
        let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
        let mut src = register(&prefill_ctx, SMALL);
        fill(&mut src, &[0, 1]);
        let dst = register(&decode_ctx, SMALL);
        prefill.export_kv(&src).unwrap();
        decode.export_kv(&dst).unwrap();
        let expected = decode
            .expect("d-1", &dst, &[5, 6], 32, &TransferOptions::default())
            .unwrap();
        let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
        let posted = prefill.post("d-1", &src, &[0, 1], 32, &all).unwrap();
        (expected, posted)
        // Contexts, sessions and pools go out of scope here.
    };
    decode_transfer.wait(TIMEOUT).unwrap();
    prefill_transfer.wait(TIMEOUT).unwrap();
    assert!(decode_transfer.stats().unwrap().bytes > 0);
    drop(decode_transfer);
    drop(prefill_transfer);
}

#[test]
fn dropping_an_unfinished_transfer_cancels_it() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let src = register(&prefill_ctx, SMALL);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let expected = decode
        .expect("d-2", &dst, &[1], 16, &TransferOptions::default())
        .unwrap();
    // The post never marks a layer written, so the transfer cannot finish by itself.
    let posted = prefill
        .post("d-2", &src, &[2], 16, &TransferOptions::default())
        .unwrap();
    drop(expected);
    let err = posted.wait(TIMEOUT).unwrap_err();
    assert_eq!(err.status(), smartgen::Status::CANCELED, "{}", err);
    drop(posted);
    drop(decode_ctx);
    decode.close(Duration::from_secs(1)).unwrap();
}

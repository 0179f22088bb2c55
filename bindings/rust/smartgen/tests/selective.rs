//! A selective transfer (proactive + on-demand + speculative, with a profile) between two contexts
//! of this process: digests arrive with the essential blocks, fetched blocks arrive, every byte
//! arrives in the end.

mod common;

use common::*;
use smartgen::{Context, LayerState, Paths, Plane, Profile, Selector, Status, TransferOptions};

const BLOCKS: u32 = 16;

/// Finite fp16 keys and values (in [0.5, 1)), different per layer, block and element: digests are
/// min and max, which NaN would make depend on the order of the comparisons.
fn fill_finite(kv: &mut smartgen::KvHandle, table: &[u32]) {
    for layer in 0..SMALL.num_layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &block) in table.iter().enumerate() {
                for (e, pair) in kv
                    .pool_mut()
                    .expect("no transfer holds the pool")
                    .block_mut(layer, plane, block)
                    .chunks_exact_mut(2)
                    .enumerate()
                {
                    let mantissa = (layer as usize * 31 + plane as usize * 17 + i * 131 + e * 7) % 1024;
                    pair.copy_from_slice(&(0x3800u16 + mantissa as u16).to_ne_bytes());
                }
            }
        }
    }
}
const TOKENS: u64 = BLOCKS as u64 * 16;

#[test]
fn selective_paths_deliver_digests_fetches_and_every_byte() {
    let key = random_key();
    let prefill_ctx = Context::new(&options(&key)).unwrap();
    let decode_ctx = Context::new(&options(&key)).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let src_table: Vec<u32> = (0..BLOCKS).collect();
    let dst_table: Vec<u32> = (0..BLOCKS).map(|i| 31 - i).collect();
    let mut src = register(&prefill_ctx, SMALL);
    fill_finite(&mut src, &src_table);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();

    let profile = Profile::parse(
        r#"{"version":1,"model":"t","num_layers":2,"num_kv_heads":2,"block_tokens":16,
            "defaults":{"policy":"sinks_recent","budget":{"fraction":0.25},"sinks":16,"recent":32}}"#,
    )
    .unwrap();
    let expected = decode
        .expect("sel", &dst, &dst_table, TOKENS, &TransferOptions::default())
        .unwrap();
    let options = TransferOptions::default().with_paths(Paths::PROACTIVE | Paths::ON_DEMAND | Paths::SPECULATIVE).with_profile(Some(profile.clone()));
    let posted = prefill.post("sel", &src, &src_table, TOKENS, &options).unwrap();

    // Queries shorter than num_queries × num_q_heads × head_dim never reach the library.
    let short = vec![0f32; 8];
    let err = posted.layer_written_with_queries(0, &short, 1, 2).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
    posted.layer_written(0).unwrap();
    expected.wait_layer_state(0, LayerState::ESSENTIAL, TIMEOUT).unwrap();
    let wanted = [1, BLOCKS / 2, BLOCKS - 2];
    expected.fetch(1, &wanted).unwrap();
    posted.layer_written(1).unwrap();
    expected.wait_blocks(1, &wanted, TIMEOUT).unwrap();
    let resident = expected.residency(1).unwrap();
    assert!(wanted.iter().all(|&b| resident[b as usize]), "{:?}", resident);

    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
    for layer in 0..SMALL.num_layers {
        for plane in [Plane::K, Plane::V] {
            for (&from, &to) in src_table.iter().zip(&dst_table) {
                assert!(src.pool().block(layer, plane, from) == dst.pool().block(layer, plane, to));
            }
        }
    }

    // The digests the decode side holds are those of the keys the prefill side wrote.
    let selector = Selector::new(&profile, &SMALL, TOKENS).unwrap();
    let received = expected.digests(0).unwrap();
    assert_eq!(received.len(), selector.digest_floats());
    let computed = selector.digest(src.pool(), 0, &src_table).unwrap();
    let differ = received
        .iter()
        .zip(&computed)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    assert_eq!(differ, 0, "{} of {} digest floats differ", differ, computed.len());

    let stats = expected.stats().unwrap();
    assert!(stats.bytes_proactive > 0, "{:?}", stats);
    assert_eq!(
        stats.bytes_proactive + stats.bytes_on_demand + stats.bytes_speculative,
        2 * 2 * u64::from(BLOCKS) * dst.pool().plane_bytes() as u64,
        "{:?}",
        stats
    );
}

//! Selectors apply a profile without a transfer; inputs are checked against the shape before any
//! pointer reaches the library.

mod common;

use common::SMALL;
use smartgen::{Plane, Pool, PoolLayout, Profile, Selector, SelectorInput, Status};

const TOKENS: u64 = 32 * 16;

fn profile(policy: &str) -> Profile {
    Profile::parse(&format!(
        r#"{{"version":1,"model":"t","num_layers":2,"num_kv_heads":2,"block_tokens":16,
            "defaults":{{"policy":"{}","budget":{{"fraction":0.25}},"sinks":16,"recent":32}}}}"#,
        policy
    ))
    .unwrap()
}

#[test]
fn sinks_recent_keeps_the_first_and_last_blocks() {
    let selector = Selector::new(&profile("sinks_recent"), &SMALL, TOKENS).unwrap();
    let budget = selector.budget_blocks(0).unwrap();
    assert_eq!(budget, 8, "a quarter of 32 blocks");
    let blocks = selector.select(0, &SelectorInput::default()).unwrap();
    assert!(
        blocks.windows(2).all(|w| w[0] < w[1]),
        "sorted and distinct: {:?}",
        blocks
    );
    assert_eq!(blocks.first(), Some(&0), "the sink block: {:?}", blocks);
    assert_eq!(blocks.last(), Some(&31), "the recent window: {:?}", blocks);
    assert!(blocks.len() as u64 <= budget, "{:?}", blocks);
}

#[test]
fn quest_needs_queries_and_reads_digests() {
    let selector = Selector::new(&profile("quest"), &SMALL, TOKENS).unwrap();
    let missing = selector.select(0, &SelectorInput::default()).unwrap_err();
    assert_eq!(missing.status(), Status::INVALID_ARGUMENT);

    let mut pool = Pool::new(SMALL).unwrap();
    let table: Vec<u32> = (0..32).collect();
    // fp16 1.0 (0x3C00) in block 20's keys, 0 elsewhere: quest should rank block 20 first.
    for pair in pool.block_mut(0, Plane::K, 20).chunks_exact_mut(2) {
        pair.copy_from_slice(&0x3C00u16.to_ne_bytes());
    }
    let digests = selector.digest(&pool, 0, &table).unwrap();
    assert_eq!(digests.len(), selector.digest_floats());
    let queries = vec![1.0f32; 2 * SMALL.head_dim as usize];
    let input = SelectorInput {
        queries: Some(&queries),
        num_queries: 1,
        num_q_heads: 2,
        digests: Some(&digests),
        ..Default::default()
    };
    let blocks = selector.select(0, &input).unwrap();
    assert!(blocks.contains(&20), "{:?}", blocks);

    let short = SelectorInput {
        queries: Some(&queries[..10]),
        ..input
    };
    let err = selector.select(0, &short).unwrap_err();
    assert_eq!(err.status(), Status::INVALID_ARGUMENT);
    assert!(err.message().contains("queries"), "{}", err);
}

#[test]
fn a_profile_of_another_shape_is_refused() {
    let other = PoolLayout { num_layers: 3, ..SMALL };
    let err = Selector::new(&profile("sinks_recent"), &other, TOKENS).err().unwrap();
    assert_eq!(err.status(), Status::LAYOUT_MISMATCH, "{}", err);
}

#[test]
fn thread_safety_follows_the_header() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<smartgen::Context>();
    send_sync::<smartgen::Listener>();
    send_sync::<smartgen::Session>();
    send_sync::<smartgen::KvHandle>();
    send_sync::<smartgen::Transfer>();
    send_sync::<smartgen::Profile>();
    send_sync::<smartgen::Pool>();
    send::<smartgen::Event>();
    send::<Selector>();
}

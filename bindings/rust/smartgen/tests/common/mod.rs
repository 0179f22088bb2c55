//! Shared setup of the integration tests: two contexts in this process joined by a session over
//! tcp on 127.0.0.1, with a random key passed in the options (not SG_AUTH_KEY_FILE: tests run on
//! several threads and the environment is process-wide).

#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::thread;
use std::time::Duration;

use smartgen::{BlockOrder, Context, ContextOptions, Dtype, KvHandle, Listener, Plane, Pool, PoolLayout, Session};

pub const TIMEOUT: Duration = Duration::from_secs(10);

/// 2 layers × 2 KV heads × head_dim 64 × 16 tokens, fp16: 4096 bytes per plane, 32 blocks.
pub const SMALL: PoolLayout = PoolLayout {
    num_layers: 2,
    num_kv_heads: 2,
    head_dim: 64,
    tokens_per_block: 16,
    num_blocks: 32,
    dtype: Dtype::FP16,
    block_order: BlockOrder::TOKEN_MAJOR,
};

pub fn random_key() -> Vec<u8> {
    let mut key = vec![0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .expect("read /dev/urandom");
    key
}

pub fn options(key: &[u8]) -> ContextOptions {
    ContextOptions::default()
        .with_provider(Some("tcp".into()))
        .with_auth_key(Some(key.to_vec()))
}

/// A session between `listening` (accepts) and `connecting`, in that order.
pub fn connect(listening: &Context, connecting: &Context) -> (Session, Session) {
    let listener = Listener::bind(listening, "127.0.0.1", 0).expect("listener");
    let port = listener.port().expect("port");
    thread::scope(|scope| {
        let connector = scope.spawn(|| Session::connect(connecting, "127.0.0.1", port, TIMEOUT));
        let accepted = listener.accept(TIMEOUT).expect("accept");
        (accepted, connector.join().expect("connect thread").expect("connect"))
    })
}

/// The byte a test writes at `offset` of logical block `i`, layer `layer`, plane `plane`.
pub fn pattern(layer: u32, plane: Plane, i: usize, offset: usize) -> u8 {
    (layer as usize * 131 + plane as usize * 71 + i * 29 + offset * 7) as u8
}

pub fn fill(kv: &mut KvHandle, blocks: &[u32]) {
    let layers = kv.pool().layout().num_layers;
    for layer in 0..layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &block) in blocks.iter().enumerate() {
                for (o, byte) in kv.pool_mut().expect("no transfer holds the pool").block_mut(layer, plane, block).iter_mut().enumerate() {
                    *byte = pattern(layer, plane, i, o);
                }
            }
        }
    }
}

/// Number of bytes of `blocks` that differ from the pattern.
pub fn mismatches(kv: &KvHandle, blocks: &[u32]) -> usize {
    let layers = kv.pool().layout().num_layers;
    let mut bad = 0;
    for layer in 0..layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &block) in blocks.iter().enumerate() {
                let bytes = kv.pool().block(layer, plane, block);
                bad += bytes
                    .iter()
                    .enumerate()
                    .filter(|&(o, &b)| b != pattern(layer, plane, i, o))
                    .count();
            }
        }
    }
    bad
}

pub fn register(ctx: &Context, layout: PoolLayout) -> KvHandle {
    KvHandle::register(ctx, Pool::new(layout).expect("pool")).expect("register")
}

//! selective: one request moved by the three selective paths at once, in one process with two
//! contexts (prefill and decode) joined over tcp on 127.0.0.1.
//!
//! - proactive: as each layer is written, its essential blocks (chosen by the profile: sinks,
//!   recent window, a budget of 1/8) and its page digests go at once, so decode can start;
//! - on-demand: decode fetches three blocks of layer 0 it lacks, ahead of all other traffic;
//! - speculative: whatever is left goes in the background until decode holds everything.
//!
//! Decode watches the transfer's events on a channel (ESSENTIAL_READY per layer, BLOCKS_READY for
//! the fetch, FINISHED), then checks every byte and prints the bytes each path carried.
//!
//! Usage: selective [--profile FILE]   (a profile JSON file, docs/profiles.md; default: inline)

use std::fs::File;
use std::io::Read;
use std::path::Path;
use std::process::exit;
use std::thread;
use std::time::Duration;

use smartgen::{
    BlockOrder, Context, ContextOptions, Dtype, EventKind, KvHandle, LayerState, Listener, Paths, Plane, Pool,
    PoolLayout, Profile, Session, TransferOptions,
};

const LAYOUT: PoolLayout = PoolLayout {
    num_layers: 4,
    num_kv_heads: 8,
    head_dim: 128,
    tokens_per_block: 16,
    num_blocks: 96,
    dtype: Dtype::FP16,
    block_order: BlockOrder::TOKEN_MAJOR,
};
const BLOCKS: u32 = 64; // 1024 tokens
const PROFILE: &str = r#"{"version":1,"model":"selective-example","num_layers":4,"num_kv_heads":8,"block_tokens":16,
  "defaults":{"policy":"sinks_recent","budget":{"fraction":0.125},"sinks":16,"recent":64}}"#;
const TIMEOUT: Duration = Duration::from_secs(10);

fn byte(layer: u32, plane: Plane, logical: u32, offset: usize) -> u8 {
    (layer as usize * 131 + plane as usize * 71 + logical as usize * 29 + offset * 7) as u8
}

fn check<T>(what: &str, result: smartgen::Result<T>) -> T {
    result.unwrap_or_else(|e| {
        eprintln!("{} failed: {}", what, e);
        exit(1);
    })
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let profile = match args.as_slice() {
        [] => check("Profile::parse", Profile::parse(PROFILE)),
        [flag, path] if flag == "--profile" => check("Profile::load", Profile::load(Path::new(path))),
        _ => {
            eprintln!("usage: selective [--profile FILE]");
            exit(1);
        }
    };
    println!("profile: {}", check("Profile::to_json", profile.to_json()));

    let mut key = vec![0u8; 32];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .expect("read /dev/urandom");
    let options = ContextOptions::default().with_provider(Some("tcp".into())).with_auth_key(Some(key));
    let prefill_ctx = check("prefill context", Context::new(&options));
    let (decode_ctx, events) = check("decode context", Context::with_event_channel(&options));

    let listener = check("listen", Listener::bind(&prefill_ctx, "127.0.0.1", 0));
    let port = check("port", listener.port());
    let (prefill, decode) = thread::scope(|s| {
        let connecting = s.spawn(|| Session::connect(&decode_ctx, "127.0.0.1", port, TIMEOUT));
        let accepted = check("accept", listener.accept(TIMEOUT));
        (accepted, check("connect", connecting.join().expect("connect thread")))
    });

    // Prefill keeps the request in blocks 0.., decode receives it into blocks 32.. (mod 96).
    let src_table: Vec<u32> = (0..BLOCKS).collect();
    let dst_table: Vec<u32> = (0..BLOCKS).map(|i| (i + 32) % LAYOUT.num_blocks as u32).collect();
    let mut src_pool = check("Pool::new", Pool::new(LAYOUT));
    for layer in 0..LAYOUT.num_layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &block) in src_table.iter().enumerate() {
                for (o, b) in src_pool.block_mut(layer, plane, block).iter_mut().enumerate() {
                    *b = byte(layer, plane, i as u32, o);
                }
            }
        }
    }
    let src = check("register", KvHandle::register(&prefill_ctx, src_pool));
    let dst = check(
        "register",
        KvHandle::register(&decode_ctx, check("Pool::new", Pool::new(LAYOUT))),
    );
    check("export", prefill.export_kv(&src));
    check("export", decode.export_kv(&dst));

    let tokens = u64::from(BLOCKS * LAYOUT.tokens_per_block);
    let expected = check(
        "expect",
        decode.expect("sel-1", &dst, &dst_table, tokens, &TransferOptions::default()),
    );
    let post_options = TransferOptions::default().with_paths(Paths::PROACTIVE | Paths::ON_DEMAND | Paths::SPECULATIVE).with_profile(Some(profile));
    let posted = check("post", prefill.post("sel-1", &src, &src_table, tokens, &post_options));
    // Prefill has written layer 0 only. Once its essential blocks are in place (the request is
    // matched), decode asks for three blocks of layer 1, which is not written yet: they are
    // served as soon as it is, ahead of everything else.
    check("layer_written", posted.layer_written(0));
    check(
        "wait ESSENTIAL",
        expected.wait_layer_state(0, LayerState::ESSENTIAL, TIMEOUT),
    );
    let wanted = [1, BLOCKS / 2, BLOCKS - 2];
    check("fetch", expected.fetch(1, &wanted));

    // The engine writes the other layers; speculative traffic fills in what is left.
    for layer in 1..LAYOUT.num_layers {
        check("layer_written", posted.layer_written(layer));
    }
    check("wait_blocks", expected.wait_blocks(1, &wanted, TIMEOUT));
    println!("decode: logical blocks {:?} of layer 1 in place", wanted);
    for layer in 0..LAYOUT.num_layers {
        check(
            "wait ESSENTIAL",
            expected.wait_layer_state(layer, LayerState::ESSENTIAL, TIMEOUT),
        );
    }
    check("wait", expected.wait(TIMEOUT));
    check("wait (prefill)", posted.wait(TIMEOUT));

    let mut bad = 0usize;
    for layer in 0..LAYOUT.num_layers {
        for plane in [Plane::K, Plane::V] {
            for (i, &block) in dst_table.iter().enumerate() {
                let got = dst.pool().block(layer, plane, block);
                bad += got
                    .iter()
                    .enumerate()
                    .filter(|&(o, &b)| b != byte(layer, plane, i as u32, o))
                    .count();
            }
        }
    }
    let stats = check("stats", expected.stats());
    println!(
        "decode: {} bytes: proactive {}, on demand {}, speculative {}, digests {}; {} fetch requests",
        stats.bytes,
        stats.bytes_proactive,
        stats.bytes_on_demand,
        stats.bytes_speculative,
        stats.digest_bytes,
        stats.fetch_requests
    );
    while let Ok(event) = events.recv_timeout(Duration::from_millis(100)) {
        if event.kind != EventKind::LAYER_READY {
            println!(
                "event: {:?} layer {} blocks {:?} status {}",
                event.kind, event.layer, event.blocks, event.status
            );
        }
    }
    check("release", posted.release());
    check("release", expected.release());
    if bad != 0 {
        println!("FAIL: {} bytes differ", bad);
        exit(1);
    }
    println!(
        "PASS: every byte of {} layers x K/V x {} blocks in place",
        LAYOUT.num_layers, BLOCKS
    );
}

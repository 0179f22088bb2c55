//! transfer_pair: the smallest complete SmartGen transfer, in two processes on one host (what
//! examples/c/transfer_pair.c does, in Rust).
//!
//!   prefill (parent)                              decode (child, this program re-run)
//!   context, listener on 127.0.0.1:0
//!   send port and key down the child's stdin ---> read them
//!                                                 context (its own)
//!   accept  <------------------ bootstrap ------- connect
//!   register + export the source pool             register + export the destination pool
//!   post("req-1", blocks A)                       expect("req-1", blocks B)
//!   layer_written(0), (1), ...                    wait_layer(0), (1), ...
//!   wait                                          wait, then check every byte
//!   print stats, exit with the child's verdict
//!
//! Both sides use the same layout (2 layers, 2 KV heads, head_dim 64, 16 tokens per block, fp16, K
//! and V separate, 32 blocks per layer) but put the request's tokens in different blocks: the
//! runtime maps prefill's block table onto decode's. The child is a fresh process (not a fork), so
//! each side creates its context in a process that owns nothing of the other's.
//!
//! Usage: transfer_pair [--provider NAME]   (NAME as ContextOptions::provider; default automatic)
//! Exit status: 0 when decode received exactly the bytes prefill wrote, 1 otherwise.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{exit, Command, Stdio};
use std::time::Duration;

use smartgen::{
    BlockOrder, Context, ContextOptions, Dtype, KvHandle, Listener, Plane, Pool, PoolLayout, Session, TransferOptions,
};

const LAYOUT: PoolLayout = PoolLayout {
    num_layers: 2,
    num_kv_heads: 2,
    head_dim: 64,
    tokens_per_block: 16,
    num_blocks: 32,
    dtype: Dtype::FP16,
    block_order: BlockOrder::TOKEN_MAJOR,
};
/// 7 blocks: 6 full, the last holds 4 tokens.
const NUM_TOKENS: u32 = 100;
const PREFILL_BLOCKS: [u32; 7] = [1, 2, 20, 21, 7, 30, 4];
const DECODE_BLOCKS: [u32; 7] = [5, 3, 9, 0, 31, 17, 12];
const REQUEST_ID: &str = "req-1";
const TIMEOUT: Duration = Duration::from_secs(5);
/// Fill values outside the request, so a block written where it should not be is noticed.
const PREFILL_FILL: u16 = 0xDEAD;
const DECODE_FILL: u16 = 0xBEEF;
/// fp16 elements in one token row of a block (KV heads × head_dim).
const TOKEN_ELEMS: usize = 2 * 64;

/// The value of element `elem` of token `token` in K (kv = 0) or V (kv = 1) of `layer`.
fn pattern(layer: u32, kv: u32, token: u32, elem: u32) -> u16 {
    let x = layer * 0x9E37 + kv * 0x7F4B + token * 0x0131 + elem * 0x0007;
    ((x ^ (x >> 7)) & 0xFFFF) as u16
}

/// Byte offset of element `elem` of token `token` in its layer's region (token-major blocks).
fn element_offset(pool: &Pool, blocks: &[u32], token: u32, elem: usize) -> usize {
    let block = blocks[(token / LAYOUT.tokens_per_block) as usize] as usize;
    let slot = (token % LAYOUT.tokens_per_block) as usize;
    block * pool.plane_bytes() + (slot * TOKEN_ELEMS + elem) * 2
}

fn planes() -> impl Iterator<Item = (u32, Plane)> {
    (0..LAYOUT.num_layers).flat_map(|l| [(l, Plane::K), (l, Plane::V)])
}

fn fill_pool(pool: &mut Pool, value: u16) {
    for (layer, plane) in planes() {
        for pair in pool.region_mut(layer, plane).chunks_exact_mut(2) {
            pair.copy_from_slice(&value.to_ne_bytes());
        }
    }
}

fn fail(role: &str, what: &str, err: smartgen::Error) -> ! {
    eprintln!("[{}] {} failed: {}", role, what, err);
    exit(1);
}

fn context(role: &str, provider: Option<String>, key: Vec<u8>) -> Context {
    // A key file named by SG_AUTH_KEY_FILE wins: the library reads it when auth_key is None.
    let from_file = std::env::var_os("SG_AUTH_KEY_FILE").map_or(false, |f| !f.is_empty());
    let options = ContextOptions::default()
        .with_provider(provider)
        .with_auth_key(if from_file { None } else { Some(key) });
    Context::new(&options).unwrap_or_else(|e| fail(role, "Context::new", e))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{:02x}", b)).collect()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len() / 2)
        .filter_map(|i| u8::from_str_radix(&text[2 * i..2 * i + 2], 16).ok())
        .collect()
}

/// Checks every element the request covers and that the pool's other blocks were not touched.
/// (Slots of the last block past NUM_TOKENS are not checked.) Returns the number of mismatches.
fn verify(pool: &Pool) -> usize {
    let mut bad = 0;
    for (layer, plane) in planes() {
        let region = pool.region(layer, plane);
        let kv = plane as u32;
        for token in 0..NUM_TOKENS {
            for elem in 0..TOKEN_ELEMS {
                let at = element_offset(pool, &DECODE_BLOCKS, token, elem);
                let got = u16::from_ne_bytes([region[at], region[at + 1]]);
                let want = pattern(layer, kv, token, elem as u32);
                if got != want {
                    bad += 1;
                    if bad <= 5 {
                        eprintln!(
                            "[decode] layer {} {:?} token {} elem {}: got {:#06x} want {:#06x}",
                            layer, plane, token, elem, got, want
                        );
                    }
                }
            }
        }
        for block in (0..LAYOUT.num_blocks as u32).filter(|b| !DECODE_BLOCKS.contains(b)) {
            let untouched = pool
                .block(layer, plane, block)
                .chunks_exact(2)
                .all(|p| u16::from_ne_bytes([p[0], p[1]]) == DECODE_FILL);
            if !untouched {
                bad += 1;
                eprintln!(
                    "[decode] layer {} {:?} block {} (not in the request) was written",
                    layer, plane, block
                );
            }
        }
    }
    bad
}

fn run_decode(provider: Option<String>) -> i32 {
    let mut line = String::new();
    if BufReader::new(std::io::stdin()).read_line(&mut line).unwrap_or(0) == 0 {
        eprintln!("[decode] parent closed the pipe without a port");
        return 1;
    }
    let mut words = line.split_whitespace();
    let port: u16 = words.next().and_then(|p| p.parse().ok()).unwrap_or(0);
    let key = unhex(words.next().unwrap_or(""));
    let ctx = context("decode", provider, key);
    let session = Session::connect(&ctx, "127.0.0.1", port, TIMEOUT).unwrap_or_else(|e| fail("decode", "connect", e));
    println!(
        "[decode] connected to 127.0.0.1:{} over {}",
        port,
        session.provider().unwrap_or_default()
    );

    // The destination pool must be exported to the session before the expect: exporting is what
    // lets this peer, and only this peer, write into it.
    let mut pool = Pool::new(LAYOUT).unwrap_or_else(|e| fail("decode", "Pool::new", e));
    fill_pool(&mut pool, DECODE_FILL);
    let kv = KvHandle::register(&ctx, pool).unwrap_or_else(|e| fail("decode", "register", e));
    session
        .export_kv(&kv)
        .unwrap_or_else(|e| fail("decode", "export_kv", e));
    let transfer = session
        .expect(
            REQUEST_ID,
            &kv,
            &DECODE_BLOCKS,
            u64::from(NUM_TOKENS),
            &TransferOptions::default(),
        )
        .unwrap_or_else(|e| fail("decode", "expect", e));

    // Layers become ready one by one as prefill marks them written; an engine would start
    // decoding layer l here while later layers are still on the wire.
    for layer in 0..LAYOUT.num_layers {
        transfer
            .wait_layer(layer, TIMEOUT)
            .unwrap_or_else(|e| fail("decode", "wait_layer", e));
        let took = transfer.layer_time(layer).unwrap_or_default();
        println!("[decode] layer {} ready ({:.1} us)", layer, took.as_secs_f64() * 1e6);
    }
    transfer.wait(TIMEOUT).unwrap_or_else(|e| fail("decode", "wait", e));
    let bad = verify(kv.pool());
    if bad == 0 {
        println!(
            "[decode] {}: all {} tokens x {} layers x K/V match",
            REQUEST_ID, NUM_TOKENS, LAYOUT.num_layers
        );
    } else {
        println!("[decode] {}: {} mismatches", REQUEST_ID, bad);
    }
    transfer.release().unwrap_or_else(|e| fail("decode", "release", e));
    if bad == 0 {
        0
    } else {
        1
    }
}

fn run_prefill(provider: Option<String>) -> i32 {
    let mut key = vec![0u8; 32];
    if File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut key))
        .is_err()
    {
        eprintln!("cannot read /dev/urandom for the session key");
        return 1;
    }
    let me = std::env::current_exe().expect("own path");
    let mut args = vec!["--decode-child".to_string()];
    if let Some(p) = &provider {
        args.extend(["--provider".to_string(), p.clone()]);
    }
    let mut child = Command::new(me)
        .args(&args)
        .stdin(Stdio::piped())
        .spawn()
        .expect("start the decode process");

    let ctx = context("prefill", provider, key.clone());
    // Port 0: the kernel picks a free port, so parallel runs do not collide.
    let listener = Listener::bind(&ctx, "127.0.0.1", 0).unwrap_or_else(|e| fail("prefill", "listen", e));
    let port = listener.port().unwrap_or_else(|e| fail("prefill", "port", e));
    println!(
        "[prefill] context on {}, listening on 127.0.0.1:{}",
        ctx.provider().unwrap_or_default(),
        port
    );
    {
        let mut pipe = child.stdin.take().expect("child stdin");
        writeln!(pipe, "{} {}", port, hex(&key)).expect("send the port to the child");
    }
    let session = listener
        .accept(TIMEOUT)
        .unwrap_or_else(|e| fail("prefill", "accept", e));
    drop(listener); // one peer is all this program expects; the session outlives its listener

    let mut pool = Pool::new(LAYOUT).unwrap_or_else(|e| fail("prefill", "Pool::new", e));
    fill_pool(&mut pool, PREFILL_FILL);
    for (layer, plane) in planes() {
        for token in 0..NUM_TOKENS {
            for elem in 0..TOKEN_ELEMS {
                let at = element_offset(&pool, &PREFILL_BLOCKS, token, elem);
                let value = pattern(layer, plane as u32, token, elem as u32).to_ne_bytes();
                pool.region_mut(layer, plane)[at..at + 2].copy_from_slice(&value);
            }
        }
    }
    let kv = KvHandle::register(&ctx, pool).unwrap_or_else(|e| fail("prefill", "register", e));
    session
        .export_kv(&kv)
        .unwrap_or_else(|e| fail("prefill", "export_kv", e));

    // No flags: nothing is sent until layers are marked written, as a prefill engine marks each
    // layer when its forward pass finishes it.
    let transfer = session
        .post(
            REQUEST_ID,
            &kv,
            &PREFILL_BLOCKS,
            u64::from(NUM_TOKENS),
            &TransferOptions::default(),
        )
        .unwrap_or_else(|e| fail("prefill", "post", e));
    for layer in 0..LAYOUT.num_layers {
        transfer
            .layer_written(layer)
            .unwrap_or_else(|e| fail("prefill", "layer_written", e));
    }
    // Prefill completes when every byte is delivered and acknowledged by decode.
    transfer.wait(TIMEOUT).unwrap_or_else(|e| fail("prefill", "wait", e));
    let stats = transfer.stats().unwrap_or_else(|e| fail("prefill", "stats", e));
    println!(
        "[prefill] {}: {} bytes in {} RMA ops ({} segments, {} staged bytes), {:.1} us",
        REQUEST_ID,
        stats.bytes,
        stats.rma_ops,
        stats.segments,
        stats.staged_bytes,
        stats.end_ns.saturating_sub(stats.start_ns) as f64 / 1e3
    );
    transfer.release().unwrap_or_else(|e| fail("prefill", "release", e));
    drop(session);

    let status = child.wait().expect("wait for the decode process");
    let passed = status.success();
    println!(
        "[prefill] decode exited with {}: {}",
        status.code().unwrap_or(-1),
        if passed { "PASS" } else { "FAIL" }
    );
    if passed {
        0
    } else {
        1
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut provider = None;
    let mut child = false;
    let mut i = 0;
    while i < args.len() {
        match args[i].as_str() {
            "--provider" if i + 1 < args.len() => {
                provider = Some(args[i + 1].clone());
                i += 1;
            }
            "--decode-child" => child = true,
            _ => {
                eprintln!("usage: transfer_pair [--provider NAME]");
                exit(1);
            }
        }
        i += 1;
    }
    exit(if child {
        run_decode(provider)
    } else {
        run_prefill(provider)
    });
}

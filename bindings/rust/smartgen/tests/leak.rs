//! Memory and descriptors stay flat over many cycles of two contexts, a session, two pools and a
//! transfer, everything dropped. SMARTGEN_LEAK_CYCLES sets the count (default 200; the release
//! phase's rust_leak runs 400 by default); shm contexts, which take milliseconds to make.

mod common;

use std::time::Instant;

use common::*;
use smartgen::{Context, TransferFlags, TransferOptions};

fn rss_kib() -> i64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

fn fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn cycle(key: &[u8]) {
    let opts = options(key).with_provider(Some("shm".into()));
    let prefill_ctx = Context::new(&opts).unwrap();
    let decode_ctx = Context::new(&opts).unwrap();
    let (prefill, decode) = connect(&prefill_ctx, &decode_ctx);
    let mut src = register(&prefill_ctx, SMALL);
    fill(&mut src, &[0, 1]);
    let dst = register(&decode_ctx, SMALL);
    prefill.export_kv(&src).unwrap();
    decode.export_kv(&dst).unwrap();
    let expected = decode.expect("leak", &dst, &[5, 6], 32, &TransferOptions::default()).unwrap();
    let all = TransferOptions::default().with_flags(TransferFlags::ALL_LAYERS_WRITTEN);
    let posted = prefill.post("leak", &src, &[0, 1], 32, &all).unwrap();
    expected.wait(TIMEOUT).unwrap();
    posted.wait(TIMEOUT).unwrap();
}

/// A leak grows with every cycle; the allocator's arenas grow only until the load they see has been
/// met once, in steps (CI measured 44 KiB a cycle over 200 cycles that way). So after a warm-up of
/// a quarter the bound is on the median slope of the measured half's four quarters. Runs as rust_leak
/// (SMARTGEN_LEAK_CYCLES, 400 by default); without the variable it says so and passes (cargo has no skip).
#[test]
fn cycles_leak_neither_memory_nor_descriptors() {
    let cycles: usize = match std::env::var("SMARTGEN_LEAK_CYCLES").ok().and_then(|s| s.parse().ok()) {
        Some(n) if n >= 4 => n,
        _ => {
            println!("skipped: the leak test runs as rust_leak (400 cycles by default); set SMARTGEN_LEAK_CYCLES to run it here");
            return;
        }
    };
    let key = random_key();
    for _ in 0..cycles / 4 {
        cycle(&key);
    }
    // Four quarters of the measured half; the bound is on the median quarter's slope: a leak grows
    // in every quarter, an arena step in one.
    let mut rss = vec![rss_kib()];
    let fd0 = fds();
    let start = Instant::now();
    for _ in 0..4 {
        for _ in 0..cycles / 8 {
            cycle(&key);
        }
        rss.push(rss_kib());
    }
    let fd1 = fds();
    let mut slopes: Vec<f64> = rss.windows(2).map(|w| (w[1] - w[0]) as f64 / (cycles / 8) as f64).collect();
    slopes.sort_by(|x, y| x.partial_cmp(y).unwrap());
    let per_cycle = (slopes[1] + slopes[2]) / 2.0;
    println!(
        "[ info ] rust, {} cycles in {:.1} s: RSS by quarter {:?} KiB (median {:.1} KiB a cycle), fds {} -> {}",
        cycles,
        start.elapsed().as_secs_f64(),
        rss,
        per_cycle,
        fd0,
        fd1
    );
    assert!(fd1 <= fd0 + 4, "descriptors grew from {} to {}", fd0, fd1);
    assert!(per_cycle <= 16.0, "RSS grew a median {:.1} KiB a cycle over the quarters {:?} KiB", per_cycle, rss);
}

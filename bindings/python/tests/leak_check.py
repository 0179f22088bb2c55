"""Memory and descriptors stay flat over many cycles of two contexts, a session, two pools over
NumPy arrays and a transfer, everything closed (python_leak: SMARTGEN_LEAK_CYCLES, 400 by default, one malloc
arena). The same measure as the Go, Java and Rust leak tests: a warm-up quarter, then the bound on
the median slope of the measured half's four quarters (a leak grows in every quarter, an allocator
arena step in one)."""

import gc
import os
import sys
import time

import numpy as np

import smartgen

SHAPE = (2, 8, 16, 2, 64)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def cycle(key: bytes, k, v) -> None:
    with smartgen.Context("shm", auth_key=key) as a, smartgen.Context("shm", auth_key=key) as b:
        sb = b.session_from_metadata(a.metadata)
        sa = a.session_from_metadata(b.metadata)
        k2, v2 = np.zeros_like(k), np.zeros_like(v)
        pa, pb = a.register_pool(k, v), b.register_pool(k2, v2)
        sa.export(pa)
        sb.export(pb)
        with sb.expect("leak", pb, [5, 6], 32) as x, sa.post("leak", pa, [0, 1], 32, all_layers_written=True) as y:
            x.wait(20)
            y.wait(20)
        if not np.array_equal(k2[:, [5, 6]], k[:, [0, 1]]):
            raise SystemExit("bytes differ")


def main() -> int:
    cycles = int(os.environ.get("SMARTGEN_LEAK_CYCLES", "200"))
    key = os.urandom(32)
    k = (np.arange(np.prod(SHAPE)) % 1000).astype(np.float16).reshape(SHAPE)
    v = k + 1
    for _ in range(cycles // 4):
        cycle(key, k, v)
    gc.collect()
    rss = [rss_kib()]
    fd0 = fds()
    start = time.monotonic()
    for _ in range(4):
        for _ in range(cycles // 8):
            cycle(key, k, v)
        gc.collect()
        rss.append(rss_kib())
    fd1 = fds()
    slopes = sorted((rss[i + 1] - rss[i]) / (cycles // 8) for i in range(4))
    per_cycle = (slopes[1] + slopes[2]) / 2
    print(f"[ info ] python, {cycles} cycles in {time.monotonic() - start:.1f} s: RSS by quarter {rss} KiB "
          f"(median {per_cycle:.1f} KiB a cycle), fds {fd0} -> {fd1}")
    if fd1 > fd0 + 4:
        print(f"FAIL: descriptors grew from {fd0} to {fd1}")
        return 1
    if per_cycle > 16:
        print(f"FAIL: RSS grew a median {per_cycle:.1f} KiB a cycle over the quarters {rss} KiB")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

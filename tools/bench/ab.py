#!/usr/bin/env python3
"""A/B the whole request between two builds, alternated run by run on the same machine.

    tools/bench/ab.py BASE_BUILD NEW_BUILD [--runs 8] [--hog N] [--tokens 8192] [--new-tokens 256]
                      [--cases full,selective,"staged tcp","staged shm","direct tcp"]
                      [--base-env NAME=VALUE ...] [--new-env NAME=VALUE ...]

Runs smartgen-disagg (emulated Llama-3-8B over tcp on loopback) in full-streaming and selective
modes, BASE then NEW then BASE ... so drift in the machine's state hits both alike, and
smartgen-bench xfer with every byte through staging slots (16 KiB scattered blocks, tcp and shm),
the path where per-byte work in the runtime shows first. Each run's CPU seconds are the children's
user + system time. Prints min / median / max per figure and NEW / BASE of the medians and of the
worst runs, with the CPU model, as docs/benchmarks.md records them. --hog N runs N busy threads
(scripts/cpu-hog.sh) beside every run. BASE and NEW may be the same build with different
environments (--new-env SG_TRANSFER_VERIFY=1: what verification costs).
"""
import argparse, json, os, resource, statistics, subprocess, sys, time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run(cmd, env):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, timeout=600,
                         env={**os.environ, **env})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        sys.exit(f"ab.py: {' '.join(cmd)} exited {out.returncode}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    return lines, cpu


def disagg(build, env, mode, args):
    cmd = [os.path.join(build, "examples/disagg/smartgen-disagg"), "--provider", "tcp", "--emulate", "llama3-8b",
           "--emulate-tokens", str(args.tokens), "--max-new-tokens", str(args.new_tokens), "--json"]
    cmd += ["--mode", "full", "--full-stream", "on"] if mode == "full" else \
           ["--mode", "selective", "--budget", "0.125", "--attend", "resident"]
    lines, cpu = run(cmd, env)
    r = lines[-1]
    return {"TTST ms": r["ttst_ms"], "end to end ms": r["e2e_ms"], "TPOT ms": r["tpot_ms"], "CPU s": cpu}


def xfer(build, env, provider, staging):
    cmd = [os.path.join(build, "tools/smartgen-bench"), "xfer", "--provider", provider, "--staging", staging,
           "--pattern", "scattered", "--sizes", "16K", "--reps", "1", "--no-figures", "--no-baseline",
           "--total", "256M", "--json"]
    lines, cpu = run(cmd, env)
    r = next(l for l in lines if l.get("op") == "write")
    return {"GB/s": r["value"], "CPU s": cpu}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("new")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--hog", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--cases", default="full,selective,staged tcp,staged shm",
                    help="comma-separated subset of: full, selective, staged tcp, staged shm, direct tcp")
    ap.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE")
    ap.add_argument("--new-env", action="append", default=[], metavar="NAME=VALUE")
    args = ap.parse_args()
    envs = {}
    for side in ("base", "new"):
        pairs = getattr(args, side + "_env")
        if any("=" not in p for p in pairs):
            sys.exit(f"ab.py: --{side}-env takes NAME=VALUE")
        envs[side] = dict(p.split("=", 1) for p in pairs)
    hog = None
    if args.hog:
        hog = subprocess.Popen(["bash", os.path.join(ROOT, "scripts/cpu-hog.sh"), str(args.hog), "3600"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
    cases = [("full", lambda b, e: disagg(b, e, "full", args)),
             ("selective", lambda b, e: disagg(b, e, "selective", args)),
             ("staged tcp", lambda b, e: xfer(b, e, "tcp", "always")),
             ("staged shm", lambda b, e: xfer(b, e, "shm", "always")),
             ("direct tcp", lambda b, e: xfer(b, e, "tcp", "never"))]
    wanted = [c.strip() for c in args.cases.split(",")]
    cases = [c for c in cases if c[0] in wanted]
    if not cases:
        sys.exit("ab.py: --cases names none of: full, selective, staged tcp, staged shm, direct tcp")
    results = {name: {"base": [], "new": []} for name, _ in cases}
    try:
        for i in range(args.runs):
            for name, fn in cases:
                for side in ("base", "new"):
                    results[name][side].append(fn(getattr(args, side), envs[side]))
            print(f"ab.py: run {i + 1} of {args.runs} done", file=sys.stderr, flush=True)
    finally:
        if hog:
            hog.terminate()  # its trap ends the spinning processes it started
            hog.wait()
    print(f"{cpu_model()}, {os.cpu_count()} CPUs; {args.runs} runs each, alternated; "
          f"{'with ' + str(args.hog) + ' busy thread(s) beside' if args.hog else 'quiet'}")
    for side in ("base", "new"):
        if envs[side]:
            print(f"{side}: {getattr(args, side)} with " + " ".join(f"{k}={v}" for k, v in envs[side].items()))
    print("| case: figure | base min / median / max | new min / median / max | new ÷ base (median; worst) |")
    print("|---|---|---|---|")
    for name, _ in cases:
        for fig in results[name]["base"][0]:
            b = [r[fig] for r in results[name]["base"]]
            n = [r[fig] for r in results[name]["new"]]
            higher_better = fig == "GB/s"
            worst_b, worst_n = (min(b), min(n)) if higher_better else (max(b), max(n))
            fmt = lambda v: f"{min(v):.3g} / {statistics.median(v):.3g} / {max(v):.3g}"
            print(f"| {name}: {fig} | {fmt(b)} | {fmt(n)} | "
                  f"{statistics.median(n) / statistics.median(b):.3f}; {worst_n / worst_b:.3f} |")


if __name__ == "__main__":
    main()

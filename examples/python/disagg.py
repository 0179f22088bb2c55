"""A prefill engine and a decode engine in Python, connected through SmartGenConnector: the tiny
Llama (stories260K) in NumPy, its KV cache in each engine's own paged pool, moved layer by layer
while prefill runs. Greedy tokens equal the C engine's (examples/disagg) and llama2.c's.

    python3 disagg.py --pair [--selective --budget F] [--prompt-tokens FILE] [--json]
    python3 disagg.py --role prefill --listen 127.0.0.1:5555      (and, elsewhere:)
    python3 disagg.py --role decode --peer 127.0.0.1:5555

The key comes from SG_AUTH_KEY_FILE (--pair makes one). Needs the smartgen module (python3-smartgen,
or PYTHONPATH=<build>/bindings/python) and NumPy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

import smartgen
from llama import Cache, Model, layer_step, logits
from smartgen_connector import LoadSpec, SmartGenConnector

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_MODEL = os.path.join(HERE, "..", "models", "stories260K.bin")
DEFAULT_PROMPTS = os.path.join(HERE, "..", "disagg", "data", "prompts-tinystories.json")
TPB, POOL_BLOCKS, REQUEST = 16, 64, "req-0"
PROFILE = ('{"version":1,"model":"stories260K","num_layers":%d,"num_kv_heads":%d,"block_tokens":%d,'
           '"defaults":{"policy":"sinks_recent","budget":{"fraction":%s},"sinks":16,"recent":32}}')


def prompt_tokens(path):
    if path:
        with open(path) as f:
            return json.load(f)
    with open(DEFAULT_PROMPTS) as f:
        return json.load(f)[0]["tokens"]


def tables(n_blocks):
    # Each engine's own scattered placement: the transfer maps one onto the other.
    return ([(i * 7 + 3) % POOL_BLOCKS for i in range(n_blocks)], [(i * 11 + 5) % POOL_BLOCKS for i in range(n_blocks)])


def make_pool(m: Model):
    shape = (m.layers, POOL_BLOCKS, TPB, m.kv_heads, m.head_dim)
    return np.zeros(shape, np.float32), np.zeros(shape, np.float32)


def session_of(ctx, a):
    host, _, port = (a.listen or a.peer).rpartition(":")
    if a.listen:
        with ctx.listen(host, int(port)) as lis:
            print(f"listening on {host}:{lis.port}", file=sys.stderr, flush=True)
            return lis.accept(a.timeout)
    end = time.monotonic() + a.timeout
    while True:
        try:
            return ctx.connect(host, int(port), timeout=a.timeout)
        except smartgen.Error as e:
            if e.status != smartgen.SG_ERR_CONNECT or time.monotonic() > end:
                raise
            time.sleep(0.05)


def run_prefill(a, m: Model, prompt):
    n_blocks = (len(prompt) + a.max_new_tokens + TPB - 1) // TPB
    src_table, _ = tables(n_blocks)
    k, v = make_pool(m)
    with smartgen.Context("tcp") as ctx:
        session = session_of(ctx, a)
        profile = smartgen.Profile(PROFILE % (m.layers, m.kv_heads, TPB, a.budget)) if a.selective else None
        conn = SmartGenConnector("producer", session, selective=a.selective, profile=profile, timeout=a.timeout)
        conn.register_kv_caches(k, v)
        conn.start_save(LoadSpec(REQUEST, src_table[:(len(prompt) + TPB - 1) // TPB], len(prompt)))
        cache = Cache(k, v, src_table, TPB)
        start = time.monotonic()
        xs = [m.emb[t].copy() for t in prompt]
        for layer in range(m.layers):  # batched prefill: a layer for every prompt position, then hand it over
            xs = [layer_step(m, layer, xs[p], p, cache) for p in range(len(prompt))]
            conn.save_kv_layer(layer)
        first = int(np.argmax(logits(m, xs[-1])))
        session.notify(f"first {first}")
        conn.wait_for_save()
        sent, _ = conn.get_finished()
        assert REQUEST in sent
        session.close(timeout=a.timeout)
        if profile:
            profile.close()
        print(f"prefill: {len(prompt)} tokens, first token {first}, prefill + transfer {1e3 * (time.monotonic() - start):.1f} ms",
              file=sys.stderr)


def run_decode(a, m: Model, prompt):
    n_blocks = (len(prompt) + a.max_new_tokens + TPB - 1) // TPB
    _, dst_table = tables(n_blocks)
    k, v = make_pool(m)
    with smartgen.Context("tcp") as ctx:
        session = session_of(ctx, a)
        conn = SmartGenConnector("consumer", session, selective=a.selective, timeout=a.timeout)
        conn.register_kv_caches(k, v)
        start = time.monotonic()
        conn.start_load_kv([LoadSpec(REQUEST, dst_table[:(len(prompt) + TPB - 1) // TPB], len(prompt))])
        while (note := session.next_notification()) is None:
            if time.monotonic() - start > a.timeout:
                raise SystemExit("no first token from the prefill engine")
            time.sleep(0.0002)
        tokens = [int(note.decode().split()[1])]
        ttft = time.monotonic() - start
        cache = Cache(k, v, dst_table, TPB)
        pos, sparse_steps, second = len(prompt), 0, None
        received = False
        while len(tokens) < a.max_new_tokens:
            x = m.emb[tokens[-1]].copy()
            sparse = False
            for layer in range(m.layers):
                conn.wait_for_layer_load(layer)
                visible = None
                if not received:
                    blocks = conn.visible_blocks(REQUEST, layer)
                    if blocks is not None:  # attend to what is here: the prompt's resident blocks and our own rows
                        sparse = True
                        visible = np.ones(pos + 1, bool)
                        for i, here in enumerate(blocks):
                            visible[i * TPB:min((i + 1) * TPB, len(prompt))] = here
                x = layer_step(m, layer, x, pos, cache, visible)
            sparse_steps += sparse
            tokens.append(int(np.argmax(logits(m, x))))
            if second is None:
                second = time.monotonic() - start
            pos += 1
            if not received:
                _, got = conn.get_finished()
                received = REQUEST in got
                if received:
                    transfer_ms = 1e3 * (time.monotonic() - start)
        while not received:
            _, got = conn.get_finished()
            received = REQUEST in got
            transfer_ms = 1e3 * (time.monotonic() - start)
        session.close(timeout=a.timeout)
        result = {"mode": "selective" if a.selective else "full", "budget": a.budget if a.selective else 1.0,
                  "tokens": tokens, "prompt_tokens": len(prompt), "ttft_ms": round(1e3 * ttft, 3),
                  "ttst_ms": round(1e3 * second, 3) if second else None, "sparse_steps": sparse_steps,
                  "transfer_done_ms": round(transfer_ms, 3), "total_ms": round(1e3 * (time.monotonic() - start), 3)}
        print(json.dumps(result))


def run_pair(a):
    with tempfile.TemporaryDirectory() as d:
        keyfile = os.path.join(d, "key")
        # Hex text: a key file's trailing CR or LF is not part of the key (an editor adds one), so
        # 32 raw random bytes that happen to end in one would read as 31 and be refused.
        with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
        env = dict(os.environ, SG_AUTH_KEY_FILE=keyfile)
        common = [sys.executable, os.path.abspath(__file__), "--model", a.model, "--max-new-tokens", str(a.max_new_tokens),
                  "--timeout", str(a.timeout)] + (["--prompt-tokens", a.prompt_tokens] if a.prompt_tokens else []) + \
                 (["--selective", "--budget", str(a.budget)] if a.selective else [])
        # The prefill side listens on a port of the kernel's choosing and says which: a port picked
        # here and closed could be taken by another process's socket before it binds.
        pre = subprocess.Popen(common + ["--role", "prefill", "--listen", "127.0.0.1:0"], env=env,
                               stderr=subprocess.PIPE, text=True)
        port = None
        for line in pre.stderr:
            sys.stderr.write(line)
            if line.startswith("listening on 127.0.0.1:"):
                port = int(line.rsplit(":", 1)[1])
                break
        if port is None:
            raise SystemExit(f"the prefill side exited without listening ({pre.wait()})")
        relay = threading.Thread(target=lambda: sys.stderr.writelines(pre.stderr), daemon=True)
        relay.start()
        dec = subprocess.run(common + ["--role", "decode", "--peer", f"127.0.0.1:{port}"], env=env,
                             capture_output=True, text=True, timeout=a.timeout * 4)
        pre.wait(timeout=a.timeout * 4)
        relay.join(timeout=5)
        sys.stderr.write(dec.stderr)
        if dec.returncode or pre.returncode:
            raise SystemExit(f"decode exited {dec.returncode}, prefill {pre.returncode}")
        result = json.loads(dec.stdout.strip().splitlines()[-1])
        if a.json:
            print(json.dumps(result))
        else:
            print(f"| mode | budget | prompt | TTFT ms | TTST ms | sparse steps | transfer done ms | total ms |\n"
                  f"|---|---|---|---|---|---|---|---|\n"
                  f"| {result['mode']} | {result['budget']} | {result['prompt_tokens']} | {result['ttft_ms']} | "
                  f"{result['ttst_ms']} | {result['sparse_steps']} | {result['transfer_done_ms']} | {result['total_ms']} |\n"
                  f"tokens: {result['tokens']}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--role", choices=("prefill", "decode"))
    p.add_argument("--listen")
    p.add_argument("--peer")
    p.add_argument("--pair", action="store_true", help="run both engines here, in two processes")
    p.add_argument("--model", default=os.environ.get("SMARTGEN_MODEL", DEFAULT_MODEL))
    p.add_argument("--prompt-tokens", help="JSON array of token ids starting with BOS (1)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--selective", action="store_true")
    p.add_argument("--budget", type=float, default=0.25, help="selective: fraction of each layer sent first")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    if not os.path.exists(a.model):
        raise SystemExit(f"model {a.model} not found (examples/models/stories260K.bin in the repository)")
    if a.pair:
        return run_pair(a)
    if a.role is None or (a.listen is None) == (a.peer is None):
        p.error("give --pair, or --role with one of --listen / --peer")
    m = Model(a.model)
    prompt = prompt_tokens(a.prompt_tokens)
    (run_prefill if a.role == "prefill" else run_decode)(a, m, prompt)


if __name__ == "__main__":
    main()

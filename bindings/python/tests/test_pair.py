"""Transfers driven from Python: engine memory in and out, full and selective, every byte checked,
in one process and in two."""

import array
import asyncio
import os
import re
import queue
import subprocess
import sys
import tempfile

import numpy as np
import pytest

import smartgen
from conftest import BLOCKS, HEAD_DIM, HEADS, LAYERS, TPB, connect, exported, pools

SRC = [0, 3, 5, 7, 9]
DST = [15, 1, 2, 12, 4]
TOKENS = len(SRC) * TPB - 5  # the last block partly filled


def move(sa, sb, pa, pb, rid="r", **post):
    x = sb.expect(rid, pb, DST, TOKENS)
    y = sa.post(rid, pa, SRC, TOKENS, all_layers_written=True, **post)
    x.wait(20)
    y.wait(20)
    return x, y


def test_numpy_pools_move_every_byte(pair):
    a, b, sa, sb = pair
    k, v, k2, v2 = pools()
    pa, pb = a.register_pool(k, v), b.register_pool(k2, v2)
    assert pa.layout["tokens_per_block"] == TPB and pa.layout["num_kv_heads"] == HEADS
    assert pa.layout["num_blocks"] == BLOCKS and pa.layout["dtype"] == "float16"
    sa.export(pa)
    sb.export(pb)
    x, y = move(sa, sb, pa, pb)
    full, last = TOKENS // TPB, TOKENS % TPB
    for i, (s, d) in enumerate(zip(SRC, DST)):
        rows = TPB if i < full else last
        assert np.array_equal(k2[:, d, :rows], k[:, s, :rows]) and np.array_equal(v2[:, d, :rows], v[:, s, :rows])
    stats = x.stats()
    assert stats["layers_ready"] == LAYERS and stats["bytes"] > 0
    assert all(x.residency(l) == [True] * len(DST) for l in range(LAYERS))
    assert x.layer_state(0) & smartgen.LAYER_READY
    assert x.status[0] == smartgen.SG_OK
    x.release()
    y.release()
    # Untouched blocks stay untouched.
    others = [i for i in range(BLOCKS) if i not in DST]
    assert not k2[:, others].any() and not v2[:, others].any()


def test_layer_by_layer_with_events_before_the_wait_returns(key):
    got = queue.Queue()
    a = smartgen.Context("tcp", auth_key=key)
    b = smartgen.Context("tcp", auth_key=key, events=got)
    try:
        sa, sb = connect(a, b)
        k, v, k2, v2, pa, pb = exported((a, b, sa, sb))
        x = sb.expect("layers", pb, DST, TOKENS)
        y = sa.post("layers", pa, SRC, TOKENS)
        assert x.test() == smartgen.SG_IN_PROGRESS and x.status[0] == smartgen.SG_IN_PROGRESS
        for l in range(LAYERS):
            y.layer_written(l)
            x.wait_layer(l, 20)
        x.wait(20)
        seen = []
        while not got.empty():
            seen.append(got.get_nowait())
        ready = sorted(e.layer for e in seen if e.kind == smartgen.EVENT_LAYER_READY)
        assert ready == list(range(LAYERS))
        finished = [e for e in seen if e.kind == smartgen.EVENT_FINISHED]
        assert len(finished) == 1 and finished[0].status == smartgen.SG_OK
        assert finished[0].transfer is x and finished[0].request_id == "layers"
        y.wait(20)
    finally:
        b.close()
        a.close()


def test_torch_cpu_tensors_register_as_they_are(pair):
    torch = pytest.importorskip("torch", reason="torch is not installed (Debian: python3-torch)")
    a, b, sa, sb = pair
    shape = (LAYERS, BLOCKS, TPB, HEADS, HEAD_DIM)
    k = torch.arange(int(np.prod(shape)), dtype=torch.float32).remainder(997).to(torch.bfloat16).reshape(shape)
    v = k + 1
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    pa, pb = a.register_pool(k, v), b.register_pool(k2, v2)
    assert pa.layout["dtype"] == "bfloat16"
    sa.export(pa)
    sb.export(pb)
    x, y = move(sa, sb, pa, pb)
    full = TOKENS // TPB
    for s, d in list(zip(SRC, DST))[:full]:
        assert torch.equal(k2[:, d], k[:, s]) and torch.equal(v2[:, d], v[:, s])
    x.release()
    y.release()


def test_per_layer_lists_fused_head_major_and_raw_buffers(pair):
    a, b, sa, sb = pair
    # vLLM keeps one tensor per layer; here fused blocks [blocks, 2, heads, tpb, head_dim] head-major.
    shape = (BLOCKS, 2, HEADS, TPB, HEAD_DIM)
    src = [np.random.default_rng(l).integers(0, 2**15, size=shape, dtype=np.int16).view(np.float16) for l in range(LAYERS)]
    dst = [np.zeros(shape, np.float16) for _ in range(LAYERS)]
    pa = a.register_pool(src, fused=True, head_major=True)
    pb = b.register_pool(dst, fused=True, head_major=True)
    assert pa.layout["fused"] and pa.layout["head_major"] and pa.layout["tokens_per_block"] == TPB
    sa.export(pa)
    sb.export(pb)
    x = sb.expect("fused", pb, DST, len(DST) * TPB)
    y = sa.post("fused", pa, SRC, len(SRC) * TPB, all_layers_written=True)
    x.wait(20)
    y.wait(20)
    for l in range(LAYERS):
        assert np.array_equal(dst[l][DST].view(np.int16), src[l][SRC].view(np.int16))
    x.release()
    y.release()
    # Any writable buffer, with the layout given: a bytearray per layer and plane.
    plane = TPB * HEADS * HEAD_DIM * 2
    raw = [bytearray(BLOCKS * plane) for _ in range(2 * LAYERS)]
    p = a.register_pool(raw[:LAYERS], raw[LAYERS:], tokens_per_block=TPB, num_kv_heads=HEADS, head_dim=HEAD_DIM,
                        dtype="fp16")
    assert p.layout["num_blocks"] == BLOCKS
    p.close()


def test_selective_paths_with_a_profile(pair):
    a, b, sa, sb = pair
    k, v, k2, v2, pa, pb = exported(pair)
    profile = smartgen.Profile('{"version":1,"model":"t","num_layers":%d,"num_kv_heads":%d,"block_tokens":%d,'
                               '"defaults":{"policy":"sinks_recent","budget":{"fraction":0.25},"sinks":16,"recent":16}}'
                               % (LAYERS, HEADS, TPB))
    n = len(DST)
    x = sb.expect("sel", pb, DST, n * TPB)
    y = sa.post("sel", pa, SRC, n * TPB, paths=smartgen.PATHS_SELECTIVE, all_layers_written=True, profile=profile)
    for l in range(LAYERS):
        x.wait_layer_state(l, smartgen.LAYER_ESSENTIAL, 20)
    x.fetch(0, [1, 2])
    x.wait_blocks(0, [1, 2], 20)
    x.wait(20)
    y.wait(20)
    for s, d in zip(SRC, DST):
        assert np.array_equal(k2[:, d], k[:, s]) and np.array_equal(v2[:, d], v[:, s])
    s = x.stats()
    assert s["bytes_proactive"] > 0 and s["bytes_proactive"] + s["bytes_on_demand"] + s["bytes_speculative"] == \
        s["bytes"] - s["digest_bytes"]
    x.release()
    y.release()
    profile.close()


def test_asyncio_waits(pair):
    a, b, sa, sb = pair
    k, v, k2, v2, pa, pb = exported(pair)

    async def run():
        x = sb.expect("aio", pb, DST, TOKENS)
        y = sa.post("aio", pa, SRC, TOKENS, all_layers_written=True)
        await asyncio.gather(x.wait_layer_async(LAYERS - 1, 20), x.wait_async(20), y.wait_async(20))
        return x, y

    x, y = asyncio.run(run())
    assert x.test() == smartgen.SG_OK
    x.release()
    y.release()


def test_block_tables_of_every_kind(pair):
    a, b, sa, sb = pair
    k, v, k2, v2, pa, pb = exported(pair)
    for i, table in enumerate([array.array("I", DST), np.array(DST, np.uint32), np.array(DST, np.int64), tuple(DST)]):
        x = sb.expect(f"t{i}", pb, table, TOKENS)
        y = sa.post(f"t{i}", pa, SRC, TOKENS, all_layers_written=True)
        x.wait(20)
        y.wait(20)
        x.release()
        y.release()
    with pytest.raises(ValueError):
        sb.expect("neg", pb, [1, -2], 2 * TPB)


@pytest.mark.parametrize("prefill,decode", [("python", "python")])
def test_two_processes_full_and_selective(prefill, decode):
    """The interop program on both sides: two processes, both transfers, every byte checked."""
    with tempfile.TemporaryDirectory() as d:
        keyfile = os.path.join(d, "key")
        # Hex text: a key file's trailing CR or LF is not part of the key, so 32 raw random bytes
        # ending in one would read as 31 and be refused (1 run in 128).
        with open(os.open(keyfile, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(os.urandom(32).hex())
        env = dict(os.environ, SG_AUTH_KEY_FILE=keyfile)
        cmd = [sys.executable, "-m", "smartgen.interop", "--layers", "4", "--timeout-s", "60"]
        # The listener takes a port of the kernel's choosing and says which. A port picked here and
        # closed before the listener bound it could be taken meanwhile by any other process's
        # ephemeral socket (a fabric endpoint of a test running beside this one): the decode side
        # then connected to a stranger, which hung up on it.
        p = subprocess.Popen(cmd + ["--role", "prefill", "--listen", "127.0.0.1:0"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []
        port = None
        for line in p.stderr:  # ends when the prefill process exits without listening
            seen.append(line)
            m = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if m:
                port = int(m.group(1))
                break
        assert port, "the prefill side never listened:\n" + "".join(seen)
        q = subprocess.run(cmd + ["--role", "decode", "--peer", f"127.0.0.1:{port}"], env=env,
                           capture_output=True, text=True, timeout=120)
        out, err = p.communicate(timeout=120)
        err = "".join(seen) + err
        assert q.returncode == 0, q.stdout + q.stderr
        assert p.returncode == 0, out + err
        assert "result=ok full=ok selective=ok" in q.stdout and "result=ok" in out

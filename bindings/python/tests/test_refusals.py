"""A call the library refuses changes nothing on the binding's side either (docs/bindings.md): no
handle dropped, no owner released, no state flipped. And what outside integrators of 0.5 hit:
closes from an event callback, a pool closed in use with its arrays dropped, Ctrl-C after import,
contexts with callbacks dropped without close(), a cancelled wait_async, arguments taken wrongly."""

import asyncio
import gc
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import smartgen
from conftest import BLOCKS, HEAD_DIM, HEADS, LAYERS, TPB, connect, exported, pools, unanswered_expect


def _decode_with(key, on_event):
    """A prefill context a and a decode context b whose events go to on_event, connected and with
    pools exported: (a, b, sa, sb, k, v, k2, v2, pa, pb)."""
    a = smartgen.Context("tcp", auth_key=key)
    b = smartgen.Context("tcp", auth_key=key, on_event=on_event)
    sa, sb = connect(a, b)
    return (a, b, sa, sb) + exported((a, b, sa, sb))


def _refused(call):
    """The status of the Error call raised, or None when it returned."""
    try:
        call()
    except smartgen.Error as e:
        return e.status, e.message
    return None


def test_a_context_closed_from_its_callback_is_refused_and_stays_open(key):
    seen = []

    def on_event(ev):
        if ev.kind == smartgen.EVENT_LAYER_READY and ev.transfer is not None and not seen:
            seen.append(_refused(ev.transfer.session.context.close))

    a, b, sa, sb, k, v, k2, v2, pa, pb = _decode_with(key, on_event)
    try:
        x = sb.expect("ctx-close", pb, [3, 4], 2 * TPB)
        y = sa.post("ctx-close", pa, [0, 1], 2 * TPB, all_layers_written=True)
        x.wait(20)
        y.wait(20)
        assert seen and seen[0] is not None, "close() from the callback returned instead of raising"
        assert seen[0][0] == smartgen.SG_ERR_INVALID_STATE, seen
        assert "callback" in seen[0][1], seen[0][1]
        assert not b.closed and not sb.closed and not pb.closed and not x.closed
        assert np.array_equal(k2[:, [3, 4]], k[:, [0, 1]])
        b.stats()  # the context still answers
        x.release()
        y.release()
    finally:
        b.close()
        a.close()
    assert b.closed and sb.closed and pb.closed


def test_release_and_session_and_pool_close_from_a_callback_are_refused_and_change_nothing(key):
    seen = {}
    pools_of = {}

    def on_event(ev):
        if ev.kind == smartgen.EVENT_LAYER_READY and ev.transfer is not None and "release" not in seen:
            seen["release"] = _refused(ev.transfer.release)
            seen["session"] = _refused(ev.transfer.session.close)
            seen["wait"] = _refused(lambda: ev.transfer.wait(1))
            seen["pool"] = _refused(pools_of["decode"].close)

    a, b, sa, sb, k, v, k2, v2, pa, pb = _decode_with(key, on_event)
    pools_of["decode"] = pb
    try:
        x = sb.expect("refused", pb, [5], TPB)
        y = sa.post("refused", pa, [2], TPB, all_layers_written=True)
        x.wait(20)
        y.wait(20)
        for what in ("release", "session", "wait", "pool"):
            assert seen.get(what) is not None, f"{what} from the callback returned instead of raising"
            assert seen[what][0] == smartgen.SG_ERR_INVALID_STATE, (what, seen[what])
        assert not pb.closed and pb._owners, "the refused pool close let the pool or its arrays go"
        # The library's own sentence, not the status's name (0.5 replaced it with "SG_ERR_INVALID_STATE").
        assert "callback" in seen["wait"][1], seen["wait"][1]
        assert not x.closed and not sb.closed
        assert np.array_equal(k2[:, 5], k[:, 2])
        x.release()  # the refused release left the transfer held: this one releases it
        assert x.closed
        pb.close()  # possible only because the transfer was really released
        assert pb.closed
        y.release()
        sb.close()
        assert sb.closed
    finally:
        b.close()
        a.close()


def test_a_pool_closed_while_a_transfer_uses_it_keeps_its_arrays(key):
    a = smartgen.Context("tcp", auth_key=key)
    b = smartgen.Context("tcp", auth_key=key)
    try:
        sa, sb = connect(a, b)
        k, v, _, _ = pools()
        pa = a.register_pool(k, v)
        # Nothing but the pool holds the decode side's arrays.
        shape = (LAYERS, BLOCKS, TPB, HEADS, HEAD_DIM)
        pb = b.register_pool(np.zeros(shape, np.float16), np.zeros(shape, np.float16))
        held = [weakref.ref(o) for o in pb._owners]
        sa.export(pa)
        sb.export(pb)
        x = sb.expect("in-use", pb, list(range(BLOCKS)), BLOCKS * TPB)
        with pytest.raises(smartgen.Error) as e:
            pb.close()
        assert "transfer" in e.value.message, e.value.message
        assert not pb.closed
        gc.collect()
        assert all(r() is not None for r in held), "the refused close let the arrays go"
        y = sa.post("in-use", pa, list(range(BLOCKS)), BLOCKS * TPB, all_layers_written=True)
        x.wait(20)
        y.wait(20)
        kd, vd = held[0](), held[1]()
        assert np.array_equal(kd, k) and np.array_equal(vd, v)
        del kd, vd
        x.release()
        y.release()
        pb.close()
        assert pb.closed
        del pb
        gc.collect()
        assert all(r() is None for r in held), "a closed pool still holds its arrays"
    finally:
        b.close()
        a.close()


def test_ctrl_c_after_import_reaches_the_interpreter(key, tmp_path):
    # A real SIGINT to a child interpreter, not _thread.interrupt_main: 0.5 left SIGINT at the
    # default action after `import smartgen`, so Ctrl-C killed the process with no KeyboardInterrupt.
    code = textwrap.dedent("""
        import os, signal, sys, time, ctypes
        import smartgen
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with smartgen.Context("tcp", auth_key=bytes.fromhex(sys.argv[1])) as ctx:
            lis = ctx.listen()
            print("ready", flush=True)
            start = time.monotonic()
            try:
                lis.accept(timeout=None)
            except KeyboardInterrupt:
                print("interrupted %.3f" % (time.monotonic() - start), flush=True)
                sys.exit(0)
        sys.exit(3)
    """)
    env = dict(os.environ)
    env.pop("IPATH_NO_BACKTRACE", None)
    p = subprocess.Popen([sys.executable, "-c", code, key.hex()], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, f"exit {p.returncode}: {out} {err}"
    assert out.startswith("interrupted"), out
    assert time.monotonic() - sent < 5


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_dropped_contexts_with_callbacks_are_collected(key):
    def on_event(ev):
        pass

    # A first pair, closed, starts whatever the process keeps once (the library's own threads).
    with smartgen.Context("shm", auth_key=key, on_event=on_event) as a, smartgen.Context("shm", auth_key=key) as b:
        b.session_from_metadata(a.metadata)
        a.session_from_metadata(b.metadata)
    gc.collect()
    threads0, fds0 = _threads(), _fds()
    for _ in range(10):
        a = smartgen.Context("shm", auth_key=key, on_event=on_event)
        b = smartgen.Context("shm", auth_key=key, on_event=lambda ev: None)
        sb = b.session_from_metadata(a.metadata)
        sa = a.session_from_metadata(b.metadata)
        del a, b, sa, sb  # no close()
    gc.collect()
    deadline = time.monotonic() + 5
    while _threads() > threads0 and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert _threads() <= threads0, f"threads {threads0} -> {_threads()}: dropped contexts were not destroyed"
    assert _fds() <= fds0 + 4, f"descriptors {fds0} -> {_fds()}"


def test_a_cancelled_wait_async_ends_its_executor_wait(pair):
    x = unanswered_expect(pair, "never")
    outcome = {}

    async def main():
        try:
            await asyncio.wait_for(x.wait_async(), 0.3)
        except asyncio.TimeoutError:
            outcome["timeout"] = True

    def run():
        start = time.monotonic()
        asyncio.run(main())
        outcome["returned_after"] = time.monotonic() - start

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "asyncio.run() did not return: the executor's wait outlived the cancel"
    assert outcome.get("timeout") and outcome["returned_after"] < 3, outcome
    x.release()


def test_arguments_are_checked_not_truncated(pair):
    a, b, sa, sb = pair
    k, v, k2, v2, pa, pb = exported(pair)
    with pytest.raises(ValueError, match="integer"):
        sb.expect("f", pb, [0.5], TPB)
    with pytest.raises(ValueError, match="negative|2\\*\\*32"):
        sb.expect("f", pb, [-1], TPB)
    with pytest.raises(ValueError, match="int16"):
        b.register_pool(k2, v2.view(np.int16))
    with pytest.raises(ValueError, match="port -1"):
        a.listen("127.0.0.1", -1)
    with pytest.raises(ValueError, match="port 70000"):
        a.connect("127.0.0.1", 70000)
    with pytest.raises(ValueError, match="NaN"):
        sb.wait_ready(math.nan)
    x = sb.expect("inf", pb, [7], TPB)
    y = sa.post("inf", pa, [1], TPB, all_layers_written=True)
    x.wait(math.inf)  # no limit, as None
    y.wait(float("inf"))
    assert np.array_equal(k2[:, 7], k[:, 1])
    x.release()
    y.release()

"""What a host gets wrong: closed objects, wrong arrays, callbacks that raise, Ctrl-C in a wait,
bad addresses. Each is a clear exception; nothing crashes and nothing is left behind."""

import _thread
import threading
import time

import numpy as np
import pytest

import smartgen
from conftest import LAYERS, TPB, connect, exported, pools, unanswered_expect


def test_errors_carry_the_status_and_the_message(key, monkeypatch):
    with smartgen.Context("tcp", auth_key=key) as a:
        with pytest.raises(smartgen.Error) as e:
            a.connect("127.0.0.1", 1, timeout=2)
        assert e.value.status == smartgen.SG_ERR_CONNECT and e.value.name == "SG_ERR_CONNECT"
        assert e.value.message
    monkeypatch.delenv("SG_AUTH_KEY_FILE", raising=False)
    with pytest.raises(smartgen.Error) as e:
        smartgen.Context("tcp")  # no key, no key file, not allowed unauthenticated
    assert e.value.status == smartgen.SG_ERR_AUTH_REQUIRED and "auth" in e.value.message
    with pytest.raises(smartgen.Error) as e:
        smartgen.Profile("{not json")
    assert e.value.status == smartgen.SG_ERR_INVALID_ARGUMENT


def test_use_after_close_raises_and_closing_twice_is_harmless(pair):
    a, b, sa, sb = pair
    k, v, k2, v2, pa, pb = exported(pair)
    x = sb.expect("c", pb, [1, 2], 2 * TPB)
    x.release()
    x.release()
    for call in (lambda: x.layer_state(0), lambda: x.wait(1), x.stats, lambda: x.fetch(0, [0])):
        with pytest.raises(smartgen.Error) as e:
            call()
        assert e.value.status == smartgen.SG_ERR_INVALID_HANDLE
    pb.close()
    pb.close()
    with pytest.raises(smartgen.Error):
        sb.expect("c2", pb, [1], TPB)
    sb.close()
    with pytest.raises(smartgen.Error):
        sb.export(pa)
    a.close()
    for call in (a.stats, lambda: a.metadata, lambda: a.listen()):
        with pytest.raises(smartgen.Error) as e:
            call()
        assert e.value.status == smartgen.SG_ERR_INVALID_HANDLE
    with pytest.raises(smartgen.Error):  # the context's pools went with it
        sa.post("c3", pa, [0], TPB)


def test_arrays_that_cannot_be_pools(key):
    with smartgen.Context("tcp", auth_key=key) as a:
        k, v, _, _ = pools()
        with pytest.raises(ValueError, match="dtype"):
            a.register_pool(k.astype(np.int32), v.astype(np.int32))
        with pytest.raises(ValueError, match="contiguous"):
            a.register_pool(k[:, :, ::2], v[:, :, ::2])
        with pytest.raises(ValueError, match="read-only"):
            ro = k.copy()
            ro.setflags(write=False)
            a.register_pool(ro, v)
        with pytest.raises(ValueError, match="derive the layout"):
            a.register_pool(k.reshape(LAYERS, -1), v.reshape(LAYERS, -1))
        with pytest.raises(ValueError, match="layers"):
            a.register_pool(k, v[:2])
        with pytest.raises(ValueError):
            a.register_pool(k, v, fused=True)
        with pytest.raises(TypeError):
            a.register_pool(object(), object())
        with pytest.raises(ValueError, match="whole number"):
            a.register_pool([bytearray(1000)], [bytearray(1000)], tokens_per_block=16, num_kv_heads=2, head_dim=64,
                            dtype="fp16")


def _one_transfer_to_a_context_with(key, on_event, rid, check):
    """Blocks 0, 1 posted into blocks 3, 4 of a decode context whose events go to on_event;
    check(b, k, k2) runs once the decode side's wait returned, before either transfer is released."""
    a = smartgen.Context("tcp", auth_key=key)
    b = smartgen.Context("tcp", auth_key=key, on_event=on_event)
    try:
        sa, sb = connect(a, b)
        k, v, k2, v2, pa, pb = exported((a, b, sa, sb))
        x = sb.expect(rid, pb, [3, 4], 2 * TPB)
        y = sa.post(rid, pa, [0, 1], 2 * TPB, all_layers_written=True)
        x.wait(20)
        check(b, k, k2)
        y.wait(20)
        x.release()
        y.release()
    finally:
        b.close()
        a.close()


def test_a_callback_that_raises_costs_the_host_nothing(key, monkeypatch):
    reported = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: reported.append(u.exc_type))

    def bad(event):
        raise RuntimeError("the host's bug")

    def check(b, k, k2):
        assert np.array_equal(k2[:, [3, 4]], k[:, [0, 1]])
        assert b.callback_errors >= LAYERS + 1 and RuntimeError in reported

    _one_transfer_to_a_context_with(key, bad, "cb", check)


def test_a_wait_returns_once_every_callback_of_the_transfer_has_run(key):
    # Waits run in 100 ms slices (to look at Ctrl-C); a slice that ran out while the callbacks ran
    # returned before they had all run (CI: two of four), against the header's promise. Each
    # callback here takes longer than a slice.
    seen = []

    def slow(event):
        time.sleep(0.15)
        seen.append(event.kind)

    def check(b, k, k2):
        assert len(seen) >= LAYERS + 1, f"wait returned after {len(seen)} of the transfer's {LAYERS + 1} callbacks"

    _one_transfer_to_a_context_with(key, slow, "slow-cb", check)


def test_ctrl_c_interrupts_a_wait_and_the_transfer_can_still_be_released(pair):
    x = unanswered_expect(pair, "never-posted")
    threading.Timer(0.3, _thread.interrupt_main).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        x.wait(30)
    assert time.monotonic() - start < 5
    x.release()


def test_timeouts_are_errors_with_their_own_status(pair):
    x = unanswered_expect(pair, "slow")
    start = time.monotonic()
    with pytest.raises(smartgen.Error) as e:
        x.wait(0.25)
    assert e.value.status == smartgen.SG_ERR_TIMEOUT and 0.2 < time.monotonic() - start < 3
    with pytest.raises(ValueError):
        x.wait(-1)
    x.release()

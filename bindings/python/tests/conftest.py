"""Shared pieces of the Python binding's tests: a key, a connected pair of contexts in this
process, and pools over NumPy arrays."""

import os
import threading

import numpy as np
import pytest

import smartgen

LAYERS, BLOCKS, TPB, HEADS, HEAD_DIM = 3, 16, 16, 2, 64


@pytest.fixture(scope="session")
def key():
    return os.urandom(32)


def connect(a, b, timeout=10):
    """A session each way between contexts a and b (a listens, b connects)."""
    got = {}
    with a.listen("127.0.0.1", 0) as lis:
        t = threading.Thread(target=lambda: got.setdefault("s", lis.accept(timeout)))
        t.start()
        sb = b.connect("127.0.0.1", lis.port, timeout=timeout)
        t.join()
    return got["s"], sb


@pytest.fixture
def pair(key):
    """(prefill context, decode context, prefill session, decode session) over tcp."""
    a = smartgen.Context("tcp", auth_key=key)
    b = smartgen.Context("tcp", auth_key=key)
    sa, sb = connect(a, b)
    yield a, b, sa, sb
    b.close()
    a.close()


def pools(dtype=np.float16):
    """Source and destination K/V arrays [layers, blocks, tpb, heads, head_dim]; the source numbered."""
    shape = (LAYERS, BLOCKS, TPB, HEADS, HEAD_DIM)
    n = int(np.prod(shape))
    k = (np.arange(n) % 2039).astype(dtype).reshape(shape)
    v = (np.arange(n) % 1021 + 7).astype(dtype).reshape(shape)
    return k, v, np.zeros_like(k), np.zeros_like(v)


def exported(pair, dtype=np.float16):
    """The arrays of pools() registered on each side of the pair and exported: (k, v, k2, v2, pa, pb)."""
    a, b, sa, sb = pair
    k, v, k2, v2 = pools(dtype)
    pa, pb = a.register_pool(k, v), b.register_pool(k2, v2)
    sa.export(pa)
    sb.export(pb)
    return k, v, k2, v2, pa, pb


def unanswered_expect(pair, rid):
    """A decode-side expect into block 1 of a fresh exported pool, which nobody posts."""
    a, b, sa, sb = pair
    _, _, k2, v2 = pools()
    pb = b.register_pool(k2, v2)
    sb.export(pb)
    return sb.expect(rid, pb, [1], TPB)

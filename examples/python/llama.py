"""A llama2.c model (legacy v0 checkpoint) in NumPy, float32, with its KV cache in a paged pool the
engine owns: K and V as [layers, blocks, tokens_per_block, kv_heads, head_dim] arrays, a request's
positions in the blocks of its block table. The arithmetic follows llama2.c's run.c (RMSNorm with
eps 1e-5, RoPE on pairs of dimensions, grouped-query attention, SwiGLU, tied classifier), so greedy
tokens equal run.c's and examples/disagg's C engine's."""

from __future__ import annotations

import numpy as np


class Model:
    def __init__(self, path: str):
        raw = np.fromfile(path, dtype=np.int32, count=7)
        self.dim, self.hidden, self.layers, self.heads, self.kv_heads, vocab, self.seq_len = (int(x) for x in raw)
        self.vocab, shared = abs(vocab), vocab > 0
        w = np.fromfile(path, dtype=np.float32, offset=28)
        self.head_dim = self.dim // self.heads
        kv_dim = self.kv_heads * self.head_dim
        at = 0

        def take(*shape):
            nonlocal at
            n = int(np.prod(shape))
            out = w[at:at + n].reshape(shape)
            at += n
            return out

        L, d, h = self.layers, self.dim, self.hidden
        self.emb = take(self.vocab, d)
        self.rms_att = take(L, d)
        self.wq, self.wk, self.wv, self.wo = take(L, d, d), take(L, kv_dim, d), take(L, kv_dim, d), take(L, d, d)
        self.rms_ffn = take(L, d)
        self.w1, self.w2, self.w3 = take(L, h, d), take(L, d, h), take(L, h, d)
        self.rms_final = take(d)
        at += self.seq_len * self.head_dim  # the two RoPE tables, which readers skip
        self.wcls = self.emb if shared else take(self.vocab, d)
        i = np.arange(0, self.head_dim, 2, dtype=np.float32)
        self.freq = (1.0 / np.power(np.float32(10000.0), i / np.float32(self.head_dim))).astype(np.float32)

    @staticmethod
    def rmsnorm(x, weight):
        ss = np.float32(np.dot(x, x) / np.float32(x.shape[-1]) + np.float32(1e-5))
        return (weight * (x * np.float32(1.0 / np.sqrt(ss)))).astype(np.float32)

    def rope(self, vec, pos, n_heads):
        v = vec.reshape(n_heads, self.head_dim // 2, 2)
        val = np.float32(pos) * self.freq
        fcr, fci = np.cos(val).astype(np.float32), np.sin(val).astype(np.float32)
        v0, v1 = v[..., 0].copy(), v[..., 1].copy()
        v[..., 0] = v0 * fcr - v1 * fci
        v[..., 1] = v0 * fci + v1 * fcr
        return v.reshape(-1)


class Cache:
    """One request's view of a paged pool: position p lives in block table[p // tpb], row p % tpb."""

    def __init__(self, k, v, table, tokens_per_block):
        self.k, self.v, self.table, self.tpb = k, v, list(table), tokens_per_block

    def put(self, layer, pos, kvec, vvec, kv_heads, head_dim):
        b, r = self.table[pos // self.tpb], pos % self.tpb
        self.k[layer, b, r] = kvec.reshape(kv_heads, head_dim)
        self.v[layer, b, r] = vvec.reshape(kv_heads, head_dim)

    def rows(self, layer, upto):
        """K and V of positions 0..upto-1 as [upto, kv_heads, head_dim]."""
        blocks = (upto + self.tpb - 1) // self.tpb
        idx = self.table[:blocks]
        k = self.k[layer, idx].reshape(blocks * self.tpb, *self.k.shape[3:])[:upto]
        v = self.v[layer, idx].reshape(blocks * self.tpb, *self.v.shape[3:])[:upto]
        return k, v


def layer_step(m: Model, l: int, x, pos: int, cache: Cache, visible=None):
    """One layer of one position: writes its K and V into the cache and returns the new x. visible:
    a boolean mask over positions 0..pos that attention may read (selective decode), else all."""
    xb = m.rmsnorm(x, m.rms_att[l])
    q = m.rope((m.wq[l] @ xb).astype(np.float32), pos, m.heads)
    k = m.rope((m.wk[l] @ xb).astype(np.float32), pos, m.kv_heads)
    v = (m.wv[l] @ xb).astype(np.float32)
    cache.put(l, pos, k, v, m.kv_heads, m.head_dim)
    keys, vals = cache.rows(l, pos + 1)
    group = m.heads // m.kv_heads
    out = np.empty(m.dim, np.float32)
    for h in range(m.heads):
        qh = q[h * m.head_dim:(h + 1) * m.head_dim]
        kh, vh = keys[:, h // group], vals[:, h // group]
        att = (kh @ qh) / np.float32(np.sqrt(m.head_dim))
        if visible is not None:
            att = np.where(visible, att, np.float32(-np.inf))
        att = np.exp(att - att.max()).astype(np.float32)
        att /= att.sum(dtype=np.float32)
        out[h * m.head_dim:(h + 1) * m.head_dim] = att @ vh
    x = (x + m.wo[l] @ out).astype(np.float32)
    xb = m.rmsnorm(x, m.rms_ffn[l])
    h1, h3 = m.w1[l] @ xb, m.w3[l] @ xb
    hb = (h1 * (1.0 / (1.0 + np.exp(-h1))) * h3).astype(np.float32)
    return (x + m.w2[l] @ hb).astype(np.float32)


def logits(m: Model, x):
    return m.wcls @ m.rmsnorm(x, m.rms_final)

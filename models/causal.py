"""Causal self-attention over a whole prompt in query and key blocks (the prefill's attention).

`causal_attention` never builds the [T, T] scores: it walks the (query block, key block) pairs
that causality (and a sliding window shared by every layer) leaves, in one `lax.scan` of a
static length, with an online softmax per query block (flash attention's recurrence). Its
memory is O(T x block) (the output and one block pair's scores), its work the causal triangle's
blocks only. `causal_attention_reference` is the dense softmax it is tested against.

GQA mapping: query head h reads KV head h // (q_heads // kv_heads).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 512  # tokens per query and key block


def block_pairs(num_blocks: int, block: int, band: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The (query block, key block) pairs a causal attention reads, query-major, key blocks
    ascending: every j <= i, and with `band` (a window of that many tokens that every layer
    applies) only the key blocks holding a key some query of block i sees."""
    qi, kj = [], []
    for i in range(num_blocks):
        lo = 0 if band is None else max(0, (i * block - band + 1) // block)
        qi += [i] * (i - lo + 1)
        kj += list(range(lo, i + 1))
    return np.asarray(qi, np.int32), np.asarray(kj, np.int32)


def causal_attention(
    q, k, v, window=None, *, band: int | None = None, block: int = BLOCK, precision=None
):
    """Causal attention of every position over the positions up to it.

    Args:
      q: [batch, T, q_heads, head_dim]; k, v: [batch, T, kv_heads, head_dim] (after RoPE).
      window: None, or an int / traced int32 scalar sliding window (<= 0: none): the query at
        p attends the keys t with p - t < window (HF's rule).
      band: a static bound on `window` that holds for every call of the compiled program (a
        model whose every layer slides by it), or None: key blocks wholly outside it are
        skipped. The window itself is applied token by token either way.
      block: tokens per query and key block (capped at T).
      precision: the products' `jax.lax.Precision`.
    Returns:
      [batch, T, q_heads, head_dim] in v's dtype; logits and softmax in float32.
    """
    B, T, H, D = q.shape
    KV = k.shape[2]
    if H % KV or k.shape != (B, T, KV, D) or v.shape != k.shape:
        raise ValueError(
            f"causal_attention: q {q.shape}, k {k.shape}, v {v.shape}: expected q [batch, T, "
            "heads, head_dim] and k, v [batch, T, kv_heads, head_dim] with kv_heads dividing heads"
        )
    if block < 1:
        raise ValueError(f"causal_attention block={block}: expected >= 1")
    G, blk = H // KV, min(block, T)
    n = -(-T // blk)
    pad = n * blk - T  # padded keys sit after every real query: causality masks them
    if pad:
        q, k, v = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
    qg = q.reshape(B, n * blk, KV, G, D)
    scale = 1.0 / math.sqrt(D)
    w = None if window is None else jnp.asarray(window, jnp.int32)
    qi, kj = block_pairs(n, blk, band)
    first = np.r_[True, qi[1:] != qi[:-1]]  # the pair that starts its query block
    off = jnp.arange(blk)

    def pair(carry, x):
        out, m, den, acc = carry  # out [B, n*blk, H, D]; m, den [B, KV, G, blk]; acc [.., D]
        i, j, start = x
        qb = jax.lax.dynamic_slice_in_dim(qg, i * blk, blk, axis=1)  # [B, blk, KV, G, D]
        kb = jax.lax.dynamic_slice_in_dim(k, j * blk, blk, axis=1)  # [B, blk, KV, D]
        vb = jax.lax.dynamic_slice_in_dim(v, j * blk, blk, axis=1)
        s = jnp.einsum(
            "bqkgd,bskd->bkgqs", qb, kb, precision=precision, preferred_element_type=jnp.float32
        )
        dist = (i * blk + off)[:, None] - (j * blk + off)[None, :]  # [blk, blk] query - key
        see = dist >= 0
        if w is not None:
            see &= (w <= 0) | (dist < w)
        s = jnp.where(see, s * scale, -jnp.inf)
        m = jnp.where(start, -jnp.inf, m)
        den = jnp.where(start, 0.0, den)
        acc = jnp.where(start, 0.0, acc)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)  # 0 where m was -inf
        p = jnp.exp(s - m_safe[..., None])
        den = alpha * den + p.sum(-1)
        pv = jnp.einsum(
            "bkgqs,bskd->bkgqd", p.astype(v.dtype), vb, precision=precision,
            preferred_element_type=jnp.float32,
        )  # fmt: skip
        acc = alpha[..., None] * acc + pv
        o = acc / jnp.where(den > 0, den, 1.0)[..., None]  # [B, KV, G, blk, D]
        o = o.transpose(0, 3, 1, 2, 4).reshape(B, blk, H, D).astype(out.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, o, i * blk, axis=1)
        return (out, m_new, den, acc), None

    stats = jnp.zeros((B, KV, G, blk), jnp.float32)
    init = (
        jnp.zeros((B, n * blk, H, D), v.dtype),
        stats - jnp.inf,
        stats,
        jnp.zeros((B, KV, G, blk, D), jnp.float32),
    )
    xs = (jnp.asarray(qi), jnp.asarray(kj), jnp.asarray(first))
    (out, *_), _ = jax.lax.scan(pair, init, xs)
    return out[:, :T]


def causal_attention_reference(q, k, v, window=None, *, precision=None):
    """`causal_attention` as one dense softmax over [T, T] scores (for tests)."""
    B, T, H, D = q.shape
    KV = k.shape[2]
    qg = q.reshape(B, T, KV, H // KV, D)
    s = jnp.einsum(
        "bqkgd,bskd->bkgqs", qg, k, precision=precision, preferred_element_type=jnp.float32
    )
    dist = jnp.arange(T)[:, None] - jnp.arange(T)[None, :]
    see = dist >= 0
    if window is not None:
        w = jnp.asarray(window, jnp.int32)
        see &= (w <= 0) | (dist < w)
    s = jnp.where(see, s / math.sqrt(D), -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    o = jnp.einsum("bkgqs,bskd->bqkgd", p, v, precision=precision)
    return o.reshape(B, T, H, D)

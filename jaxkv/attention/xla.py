"""Attention on the XLA path: over blocks read where they lie (`attend_pool`: a pool's blocks
through a slot table, or a staging buffer already laid out per sequence), and the dense
reference the tiered result is tested against.

A part's blocks are given as [batch, K] entries (`compact_ids`: each sequence's selected blocks
in logical order, -1 past its count) and read with an index expression that XLA fuses into the
consumer, so no contiguous copy of the selection is built by the program. Which formulation
compiles to one read of the bytes depends on the backend (measured 2026-12-07,
bench/notebook/2026-12-07-hot-path.md):

- "reduce" (GPU): logits and the weighted sum of V as multiply-and-reduce; XLA:GPU fuses the
  block gather into its reduction fusions, which read each selected block once from the pool
  (compiled H200 step: bytes accessed within 1.2x of the KV bytes read).
- "dot" (CPU): the two products as `dot_general` with (batch, kv head) as batch dimensions;
  XLA:CPU fuses the gather with the one transpose the matrix product needs (what the dense
  cache's slice of a layer costs too) and the softmax with the second product.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.attention.select import window_starts
from pallas_kernels.common import on_gpu

FORMS = ("auto", "dot", "reduce")


def compact_ids(mask, width: int):
    """[batch, width] int32: the column indices where `mask` [batch, M] is set, in order, -1
    past each row's count (rows with more than `width` set keep their first `width`)."""
    B, M = mask.shape
    rank = jnp.cumsum(mask, axis=1) - 1
    at = jnp.where(mask & (rank < width), rank, width)
    cols = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    return jnp.full((B, width), -1, jnp.int32).at[jnp.arange(B)[:, None], at].set(cols, mode="drop")


def resolve_form(form: str) -> str:
    """The formulation `form` stands for on the platform being traced for (module docstring)."""
    if form not in FORMS:
        raise ValueError(f"unknown attention form {form!r}; expected one of {FORMS}")
    if form != "auto":
        return form
    return "reduce" if on_gpu() else "dot"


def block_softmax(q, k, v, valid, scale: float, form: str = "auto"):
    """Attention of one query per sequence over its blocks, in fp32, with each block's
    log-sum-exp: the softmax of the XLA path, in the formulation `form` (`resolve_form`).

    Args:
      q: [batch, q_heads, head_dim]; k, v: [batch, K, block_size, kv_heads, head_dim] (query
        head h reads KV head h // (q_heads // kv_heads)), any float dtype (converted to fp32
        where read: pass the gather itself, XLA fuses it); valid: [batch, K, block_size] bool.
      scale: the logits' scale.
    Returns:
      out [batch, q_heads, head_dim] f32 (normalised over the attended tokens; 0 where none),
      lse [batch, q_heads] (-inf where nothing is attended), block_lse [batch, q_heads, K]
      (-inf for a block with nothing attended).
    """
    B, H, D = q.shape
    _, K, bs, KV, _ = k.shape
    G = H // KV
    qg = q.reshape(B, KV, G, D).astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST
    if resolve_form(form) == "dot":
        # s[b, h, g, k, t] = sum_d q[b, h, g, d] k[b, k, t, h, d]
        s = jax.lax.dot_general(
            qg, k.astype(jnp.float32), (((3,), (4,)), ((0, 1), (0, 3))), precision=hi
        )
    else:  # [B, K, bs, KV, G] -> [B, KV, G, K, bs]: a reduction over head_dim
        prod = k.astype(jnp.float32)[..., None, :] * qg[:, None, None]
        s = prod.sum(-1).transpose(0, 3, 4, 1, 2)
    s = jnp.where(valid[:, None, None], s * scale, -jnp.inf)  # [B, KV, G, K, bs]
    m = s.max(axis=(-2, -1), keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    pb = p.sum(axis=-1)  # [B, KV, G, K]
    total = pb.sum(axis=-1)  # [B, KV, G]
    if resolve_form(form) == "dot":
        o = jax.lax.dot_general(
            p, v.astype(jnp.float32), (((3, 4), (1, 2)), ((0, 1), (0, 3))), precision=hi
        )  # [B, KV, G, D]
    else:
        pt = p.transpose(0, 3, 4, 1, 2)[..., None]  # [B, K, bs, KV, G, 1]
        o = (pt * v.astype(jnp.float32)[..., None, :]).sum(axis=(1, 2))  # [B, KV, G, D]
    out = o / jnp.where(total > 0, total, 1.0)[..., None]
    m0 = m_safe[..., 0, 0]
    lse = jnp.where(total > 0, m0 + jnp.log(total), -jnp.inf)
    blse = jnp.where(pb > 0, m0[..., None] + jnp.log(jnp.where(pb > 0, pb, 1.0)), -jnp.inf)
    return out.reshape(B, H, D), lse.reshape(B, H), blse.reshape(B, H, K)


def attend_pool(
    q, k, v, ids, lengths, scale: float, max_blocks: int, starts=None, form: str = "auto"
):
    """Attention over the blocks `ids` marks, read where they lie, its per-block log-sum-exp
    scattered to logical blocks.

    Args:
      q: [batch, q_heads, head_dim].
      k, v: [batch, K, block_size, kv_heads, head_dim]: entry e of sequence b is its logical
        block ids[b, e], given as the read of that block (`pool[layer, slots]`, a staging
        buffer's reshape), which XLA fuses into the attention rather than copying it.
      ids: [batch, K] int32 logical block of each entry (-1: unused, never attended);
      lengths: [batch] tokens; starts: [batch] first attended token (a sliding window), None
      for 0; form: `block_softmax`'s.
    Returns:
      out [batch, q_heads, head_dim] f32, lse [batch, q_heads] (-inf where nothing is
      attended) and block_lse [batch, q_heads, max_blocks] (-inf for blocks not attended).
    """
    B, H, _ = q.shape
    bs = k.shape[2]
    pos = ids[:, :, None] * bs + jnp.arange(bs)[None, None, :]  # [B, K, bs]
    valid = (ids[:, :, None] >= 0) & (pos < lengths[:, None, None])
    if starts is not None:
        valid &= pos >= starts[:, None, None]
    out, lse, blse = block_softmax(q, k, v, valid, scale, form)
    at = jnp.where(ids >= 0, ids, max_blocks)  # -> dropped
    block_lse = (
        jnp.full((B, H, max_blocks), -jnp.inf, jnp.float32)
        .at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], at[:, None, :]]
        .set(blse, mode="drop")
    )
    return out, lse, block_lse


def dense_attention_reference(q, k, v, lengths, *, scale=None, window=None):
    """Exact attention over dense K/V (the ground truth for tests).

    Args:
      q: [batch, q_heads, head_dim]; k, v: [batch, T, kv_heads, head_dim]; lengths: [batch].
      window: a sliding window (`window_starts`), None for none.
    Returns:
      [batch, q_heads, head_dim] f32.
    """
    B, H, D = q.shape
    KV = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
    logits = jnp.einsum("bkgd,btkd->bkgt", qg, k.astype(jnp.float32)) * scale
    t = jnp.arange(k.shape[1])[None]
    valid = t < lengths[:, None]
    starts = window_starts(lengths, window)
    if starts is not None:
        valid &= t >= starts[:, None]
    logits = jnp.where(valid[:, None, None], logits, -jnp.inf)
    p = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bkgt,btkd->bkgd", p, v.astype(jnp.float32)).reshape(B, H, D)

"""Attention on the XLA path: over blocks laid out per sequence (`attend_compact`, each part
touching only the blocks it reads, compacted by `compact_ids`), and the dense reference the
tiered result is tested against."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.attention.select import window_starts
from pallas_kernels.blocked_attention_ref import attend_blocks


def compact_ids(mask, width: int):
    """[batch, width] int32: the column indices where `mask` [batch, M] is set, in order, -1
    past each row's count (rows with more than `width` set keep their first `width`)."""
    B, M = mask.shape
    rank = jnp.cumsum(mask, axis=1) - 1
    at = jnp.where(mask & (rank < width), rank, width)
    cols = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))
    return jnp.full((B, width), -1, jnp.int32).at[jnp.arange(B)[:, None], at].set(cols, mode="drop")


def attend_compact(q, k, v, ids, lengths, scale, max_blocks: int, starts=None):
    """Attention over blocks laid out per sequence (the XLA path, no gather of unread blocks):
    `pallas_kernels.blocked_attention_ref.attend_blocks`, the softmax the kernel's reference
    computes, over the entries `ids` marks, its per-block log-sum-exp scattered to logical blocks.

    Args:
      q: [batch, q_heads, head_dim]; k, v: [batch, K, block_size, kv_heads, head_dim];
      ids: [batch, K] int32 logical block of each entry (-1: unused); lengths: [batch] tokens;
      starts: [batch] first attended token (a sliding window), None for 0.
    Returns:
      out [batch, q_heads, head_dim] f32, lse [batch, q_heads] (-inf where nothing is
      attended) and block_lse [batch, q_heads, max_blocks] (-inf for blocks not attended).
    """
    B, H, D = q.shape
    bs = k.shape[2]
    pos = ids[:, :, None] * bs + jnp.arange(bs)[None, None, :]  # [B, K, bs]
    valid = (ids[:, :, None] >= 0) & (pos < lengths[:, None, None])
    if starts is not None:
        valid &= pos >= starts[:, None, None]
    out, lse, blse = attend_blocks(q, k, v, valid, scale)  # the reference's softmax
    at = jnp.where(ids >= 0, ids, max_blocks)  # -> dropped
    block_lse = (
        jnp.full((B, H, max_blocks), -jnp.inf, jnp.float32)
        .at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], at[:, None, :]]
        .set(blse, mode="drop")
    )
    return out.reshape(B, H, D), lse.reshape(B, H), block_lse


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

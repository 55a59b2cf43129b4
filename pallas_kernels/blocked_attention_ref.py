"""Pure-jnp reference of `blocked_attention` (gather + masked softmax in fp32), the kernel's test
oracle; `attend_blocks`, its masked softmax over gathered blocks (jaxkv's XLA path computes the
same softmax over blocks read in place, `jaxkv.attention.xla.block_softmax`); and
`merge_partials`, the log-sum-exp merge of partial results. `pallas_kernels.blocked_attention`
re-exports the reference and the merge."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.paging import check_inputs, token_ranges


def attend_blocks(q, k, v, valid, scale: float, softcap: float | None = None):
    """Attention of one query per sequence over its blocks, in fp32: the one softmax of the XLA
    path and of this reference.

    Args:
      q: [batch, q_heads, head_dim]; k, v: [batch, K, block_size, kv_heads, head_dim] (query
        head h reads KV head h // (q_heads // kv_heads)); valid: [batch, K, block_size] bool,
        the tokens attended.
      scale: the logits' scale; softcap: None, or c for c * tanh(logits / c).
    Returns:
      out [batch, kv_heads, group, head_dim] f32, normalised over the attended tokens;
      lse [batch, kv_heads, group] (-inf where nothing is attended); block_lse [batch, q_heads,
      K], each block's log-sum-exp (-inf for a block with nothing attended).
    """
    B, H, D = q.shape
    _, K, _, KV, _ = k.shape
    qg = q.reshape(B, KV, H // KV, D).astype(jnp.float32)
    s = jnp.einsum("bhgd,bkthd->bhgkt", qg, k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(valid[:, None, None], s, -jnp.inf)
    m = s.max(axis=(-2, -1), keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe)
    total = p.sum(axis=(-2, -1))
    out = jnp.einsum("bhgkt,bkthd->bhgd", p, v.astype(jnp.float32))
    out = out / jnp.where(total > 0, total, 1.0)[..., None]
    m0 = m_safe[..., 0, 0]
    lse = jnp.where(total > 0, m0 + jnp.log(total), -jnp.inf)
    pb = p.sum(axis=-1)  # [B, KV, G, K]
    blse = jnp.where(pb > 0, m0[..., None] + jnp.log(jnp.where(pb > 0, pb, 1.0)), -jnp.inf)
    return out, lse, blse.reshape(B, H, K)


@functools.partial(jax.jit, static_argnames=("scale", "softcap", "return_block_lse"))
def _blocked_attention_reference(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    layer,
    starts=None,
    k_scale=None,
    v_scale=None,
    *,
    scale,
    softcap,
    return_block_lse=False,
):
    batch, q_heads, head_dim = q.shape
    num_slots, block_size = k_pool.shape[-4:-2]
    first, ntok = token_ranges(block_mask, lengths, block_size, starts)  # [batch, max_blocks]
    t = jnp.arange(block_size)[None, None, :]
    valid = (t >= first[:, :, None]) & (t < ntok[:, :, None])  # [batch, blocks, bs]
    slots = jnp.where(ntok > 0, jnp.clip(block_table, 0, num_slots - 1), 0)
    if k_pool.ndim == 5:  # one gather of the needed blocks, not a copy of the layer
        layer = jnp.clip(layer, 0, k_pool.shape[0] - 1)
        k, v = k_pool[layer, slots], v_pool[layer, slots]
    else:
        k, v = k_pool[slots], v_pool[slots]
    # k, v: [batch, max_blocks, block_size, kv_heads, head_dim]
    if k_scale is not None:  # fp8 pools: dequantize the gathered blocks per (slot, kv head)
        if k_pool.ndim == 5:
            k_scale, v_scale = k_scale[layer], v_scale[layer]
        # scales of the gathered blocks: [batch, max_blocks, 1, kv_heads, 1]
        k = k.astype(jnp.float32) * k_scale[slots][:, :, None, :, None]
        v = v.astype(jnp.float32) * v_scale[slots][:, :, None, :, None]
    out, lse, block_lse = attend_blocks(q, k, v, valid, scale, softcap)
    out, lse = out.reshape(batch, q_heads, head_dim), lse.reshape(batch, q_heads)
    # block_lse, per-block log-sum-exp for attention-mass statistics: [batch, q_heads, blocks]
    return (out, lse, block_lse) if return_block_lse else (out, lse)


def blocked_attention_reference(
    q,
    k_pool,
    v_pool,
    block_table,
    block_mask,
    lengths,
    *,
    scale: float | None = None,
    softcap: float | None = None,
    block_sizes=None,
    interpret: bool | None = None,
    layer=None,
    starts=None,
    return_block_lse: bool = False,
    k_scale=None,
    v_scale=None,
):
    """Pure-jnp `blocked_attention` (gather + masked softmax, fp32); any block size, fp32 too.

    Same arguments and results as `blocked_attention` (fp8 pools with `k_scale` / `v_scale`
    included: the gathered blocks are dequantized in fp32); `block_sizes` and `interpret` are
    accepted for a uniform signature and ignored. With `return_block_lse=True` it also returns
    block_lse [batch, q_heads, max_blocks] f32, each attended block's log-sum-exp (-inf where
    nothing is attended), so exp(block_lse - lse) is the block's share of the attention.
    """
    del block_sizes, interpret
    check_inputs(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        layer,
        kernel=False,
        starts=starts,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    head_dim = q.shape[-1]
    return _blocked_attention_reference(
        q,
        k_pool,
        v_pool,
        block_table,
        block_mask,
        lengths,
        None if layer is None else jnp.asarray(layer, jnp.int32),
        starts,
        k_scale,
        v_scale,
        scale=float(1.0 / math.sqrt(head_dim) if scale is None else scale),
        softcap=None if softcap is None else float(softcap),
        return_block_lse=return_block_lse,
    )


def merge_partials(out, lse):
    """Merges partial results along axis 0 by log-sum-exp.

    Args:
      out: [parts, ...rows, head_dim] float32, each part normalised over its own tokens.
      lse: [parts, ...rows] float32; -inf for a part with nothing attended.

    Returns:
      (out [...rows, head_dim], lse [...rows]); rows empty in every part give 0 and -inf.
    """
    m = lse.max(axis=0)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - m_safe)  # 0 for empty parts
    total = w.sum(axis=0)
    merged = (w[..., None] * out).sum(axis=0) / jnp.where(total > 0, total, 1.0)[..., None]
    return merged, jnp.where(total > 0, m_safe + jnp.log(total), -jnp.inf)

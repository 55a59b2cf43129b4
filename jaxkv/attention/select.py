"""Which blocks a decode step reads: every live block (exact attention) or the top-k by the
Quest bound on each block's logit, plus sink and recent blocks (sparse attention); a layer's
sliding window limits both."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.cache.layout import TieredKVCache
from jaxkv.config import PlacementConfig
from pallas_kernels.common import on_gpu


def quest_scores(q, kmin, kmax):
    """Quest upper bound on each block's attention logit, summed over query heads.

    Args:
      q: [batch, q_heads, head_dim]; kmin, kmax: [batch, max_blocks, kv_heads, head_dim].
    Returns:
      [batch, max_blocks] f32.
    """
    B, H, D = q.shape
    KV = kmin.shape[2]
    qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
    if on_gpu():  # [B, M, KV, G, D] reduced over its minor dims: the summaries read once, in
        # place (the einsums' [B, KV, G, M, D] layout made XLA:GPU copy them transposed)
        qb = qg[:, None]
        bound = jnp.maximum(kmin[:, :, :, None] * qb, kmax[:, :, :, None] * qb).sum(-1)
        return bound.sum(axis=(2, 3))
    bound = jnp.maximum(
        jnp.einsum("bkgd,bmkd->bkgmd", qg, kmin), jnp.einsum("bkgd,bmkd->bkgmd", qg, kmax)
    ).sum(-1)
    return bound.sum(axis=(1, 2))


def window_starts(lengths, window):
    """[batch] int32 first token a sliding window of `window` tokens attends (HF's rule: the
    query at position p attends keys k with p - k < window), or None without a window.

    Args:
      lengths: [batch] tokens including the current one (the query is at lengths - 1).
      window: None, or an int / traced int32 scalar, <= 0 meaning no window (a layer with
        full attention in a model whose other layers slide).
    """
    if window is None:
        return None
    window = jnp.asarray(window, jnp.int32)
    return jnp.where(window > 0, jnp.maximum(lengths - window, 0), 0).astype(jnp.int32)


def live_blocks(lengths, block_size: int, max_blocks: int, starts=None):
    """[batch, max_blocks] bool: the written blocks holding a token in [starts, lengths)."""
    j = jnp.arange(max_blocks)[None]
    live = j * block_size < lengths[:, None]
    if starts is not None:
        live &= (j + 1) * block_size > starts[:, None]
    return live


def select_blocks(
    q, cache: TieredKVCache, layer: int, lengths, placement: PlacementConfig, *, window=None
):
    """Logical blocks to read this step.

    Args:
      q: [batch, q_heads, head_dim]; lengths: [batch] tokens including the current one.
      window: the layer's sliding window (`window_starts`): only blocks holding a token
        inside it are selected, in exact and sparse mode (sink blocks included).
    Returns:
      [batch, max_blocks] bool.
    """
    c = cache.config
    if placement.attention == "exact":
        return live_blocks(lengths, c.block_size, c.max_blocks, window_starts(lengths, window))
    written, rank, k = quest_ranks(q, cache, layer, lengths, placement, window=window)
    return written & (rank < k[:, None])


def quest_ranks(
    q, cache: TieredKVCache, layer: int, lengths, placement: PlacementConfig, *, window=None
):
    """The sparse selection's ranking (`select_blocks` reads the blocks with rank < k): the
    blocks written ([batch, max_blocks] bool), each one's rank by Quest score ([batch,
    max_blocks] int, 0 the best; the sink and recent blocks first) and k ([batch] int)."""
    c = cache.config
    M = c.max_blocks
    j = jnp.arange(M)
    n_written = -(-lengths // c.block_size)  # [B]
    written = live_blocks(lengths, c.block_size, M, window_starts(lengths, window))
    score = quest_scores(q, cache.kmin[layer], cache.kmax[layer])
    forced = (j[None] < placement.sink_blocks) | (
        j[None] >= n_written[:, None] - placement.recent_blocks
    )
    score = jnp.where(forced, jnp.inf, score)
    score = jnp.where(written, score, -jnp.inf)
    n_live = jnp.sum(written, axis=1)  # n_written but for a window's dead blocks
    if isinstance(placement.topk, int):
        k = jnp.minimum(placement.topk, n_live)
    else:
        k = jnp.ceil(placement.topk * n_live).astype(jnp.int32)
    k = jnp.maximum(k, jnp.sum(forced & written, axis=1))
    rank = jnp.argsort(jnp.argsort(-score, axis=1, stable=True), axis=1)
    return written, rank, k

"""The prompt's observation window: which blocks the prompt's last queries would select.

At prefill the decode loop knows nothing of the reads to come: its read statistics are empty and
HBM holds the first blocks written. But the prompt's last `PROMPT_QUERIES` positions are queries
like the decode's (SnapKV's observation window: the end of a prompt attends where generation
will). `prompt_queries` recomputes those positions' queries with the model's own `decode_step`,
batched, its attention exact over the prompt's K and V; `prompt_prior` gives each sealed block
the share of those queries whose sparse selection (`select_blocks`) reads it. A policy that
asks for it (`Policy.prompt_prior`, `jaxkv.placement.policies.Lrfu`) starts from that prior: it
is the blocks' read frequency before step 0 (`Stats.read_ema`) and the order in which sealed
blocks fill HBM at prefill (`jaxkv.cache.ops`' prefill with a priority). Measured in
bench/notebook/2026-12-06-prompt-prior.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxkv.attention.select import select_blocks
from jaxkv.cache import ops as cache_ops
from jaxkv.cache.layout import TieredKVCache
from jaxkv.config import PROMPT_QUERIES, STEADY_QUERIES, CacheConfig, PlacementConfig
from jaxkv.decode.state import Prefilled


def observed_positions(lengths, n: int = PROMPT_QUERIES):
    """([batch, n] int32 positions, [batch, n] bool valid): each prompt's last `n` positions;
    those before position 0 (a prompt shorter than `n`) are clipped to 0 and not valid."""
    pos = jnp.asarray(lengths, jnp.int32)[:, None] - n + jnp.arange(n, dtype=jnp.int32)[None]
    return jnp.maximum(pos, 0), pos >= 0


def _chunked(x, axis: int, what: str):
    """`x` with its `axis` of n entries (a multiple of `PROMPT_QUERIES`, else a ValueError
    that starts with `what`) split into chunks of that many, the chunk index leading:
    [n / PROMPT_QUERIES, ..., PROMPT_QUERIES, ...], for a `lax.map` over the chunks."""
    n, c = x.shape[axis], PROMPT_QUERIES
    if n % c:
        raise ValueError(f"{what} expected a multiple of {c}")
    return jnp.moveaxis(x.reshape(*x.shape[:axis], n // c, c, *x.shape[axis + 1 :]), axis, 0)


def prompt_queries(model, prompts, lengths, k, v, windows=None, n: int = PROMPT_QUERIES):
    """Each layer's queries at each prompt's last `n` positions (`observed_positions`).

    Runs `model.decode_step` (a `jaxkv.model_api.bind` model) on batch x n rows, with an
    `attend` that attends exactly over the prompt's own K and V up to each row's position (and
    the layer's sliding window), so the rows follow the prefill's residual stream. Past
    `PROMPT_QUERIES` rows a sequence it runs in chunks of that many (`lax.map`), so the
    attention's scores take the same memory at any n (n must then be a multiple of it).

    Args:
      prompts: [batch, T] int32; lengths: [batch] int32.
      k, v: [layers, batch, T, kv_heads, head_dim], the prefill's.
      windows: [layers] int32 sliding windows (0: full), or None.
    Returns:
      [layers, batch, n, q_heads, head_dim] in the queries' dtype.
    """
    L, B, T, KV, D = k.shape
    pos, _ = observed_positions(lengths, n)
    if n > PROMPT_QUERIES:
        chunks = _chunked(pos, 1, f"prompt_queries n={n}:")  # [n / c, B, c]
        qs = jax.lax.map(lambda p: _queries_at(model, prompts, k, v, windows, p), chunks)
        return qs.transpose(1, 2, 0, 3, 4, 5).reshape(L, B, n, *qs.shape[-2:])
    return _queries_at(model, prompts, k, v, windows, pos)


def _queries_at(model, prompts, k, v, windows, pos):
    """`prompt_queries` at positions `pos` [batch, n]: [layers, batch, n, q_heads, head_dim]."""
    L, B, T, KV, D = k.shape
    n = pos.shape[1]
    tokens = jnp.take_along_axis(prompts, pos, axis=1).reshape(B * n)
    flat_pos = pos.reshape(B * n)
    seen = {}

    def probe(layer, q, k_new, v_new, carry):  # learns the query heads and dtype
        seen["q"] = jax.ShapeDtypeStruct(q.shape, q.dtype)
        return q, carry

    jax.eval_shape(lambda: model.decode_step(tokens, flat_pos, probe, jnp.zeros((), jnp.int32)))
    H, dtype = seen["q"].shape[1], seen["q"].dtype
    t = jnp.arange(T)

    def attend(layer, q, k_new, v_new, qs):
        del k_new, v_new  # the prompt's own K and V at these positions
        kl, vl = k[layer].astype(jnp.float32), v[layer].astype(jnp.float32)  # [B, T, KV, D]
        qg = q.astype(jnp.float32).reshape(B, n, KV, H // KV, D)
        s = jnp.einsum("bnkgd,btkd->bnkgt", qg, kl) / math.sqrt(D)
        see = t[None, None] <= pos[..., None]  # [B, n, T]
        if windows is not None:
            w = windows[layer]
            see &= (w <= 0) | (pos[..., None] - t[None, None] < w)
        p = jax.nn.softmax(jnp.where(see[:, :, None, None], s, -jnp.inf), axis=-1)
        out = jnp.einsum("bnkgt,btkd->bnkgd", p, vl).reshape(B * n, H, D).astype(q.dtype)
        return out, qs.at[layer].set(q.reshape(B, n, H, D))

    qs0 = jnp.zeros((L, B, n, H, D), dtype)
    _, qs = model.decode_step(tokens, flat_pos, attend, qs0)
    return qs


def queries_needed(policy, shared: bool = False) -> int:
    """The prompt queries a Decoder of `policy` keeps at prefill: `PROMPT_QUERIES`, or the
    adaptive estimator's `steady_queries` when more (`jaxkv.placement.policies.Lrfu`);
    `shared` (a `Decoder.model_prefill` that other decoders start from): at least lrfu's
    default `STEADY_QUERIES`, so that one forward pass serves every policy's decoder."""
    n = max(PROMPT_QUERIES, int(getattr(policy, "steady_queries", 0)))
    return max(n, STEADY_QUERIES) if shared else n


def forward_prompts(model, prompts, lengths, windows=None, n=PROMPT_QUERIES) -> Prefilled:
    """`Decoder.model_prefill`'s body: the model's prefill over `prompts` (a `bind` model),
    the logits after each prompt's last token (`prefill_at`: the LM head on those rows only,
    where the model offers it) and the last `n` positions' queries."""
    last, k, v = model.prefill_at(prompts, lengths - 1)
    q = prompt_queries(model, prompts, lengths, k, v, windows, n)
    return Prefilled(last_logits=last, k=k, v=v, lengths=lengths, queries=q)


def prompt_prior(queries, cache: TieredKVCache, placement: PlacementConfig, windows=None):
    """[layers, batch, max_blocks] float32: for each sealed block, the share of its prompt's
    valid observation queries (`queries` from `prompt_queries`) whose sparse selection at their
    own position (`select_blocks`) reads it; 0 for blocks not sealed. Past `PROMPT_QUERIES`
    queries it selects in chunks of that many (`lax.map`; XLA:CPU took minutes to compile the
    256 queries of the real model's 30 layers at once)."""
    L, n = queries.shape[0], queries.shape[2]
    pos, valid = observed_positions(cache.lengths, n)

    def count(qs, pos, valid):  # [layers, batch, max_blocks]: the rows of `qs` that select
        def one(layer, i):  # [batch, max_blocks] bool: query i of `layer` selects
            w = None if windows is None else windows[layer]
            return select_blocks(qs[layer, :, i], cache, layer, pos[:, i] + 1, placement, window=w)

        # one layer at a time (lax.map), its queries vmapped: the selection's [batch, kv_heads,
        # group, blocks, head_dim] bounds exist for one layer's queries at once, not for all
        # layers' (18 GB at batch 16 x 8k for SmolLM2)
        per_layer = jax.vmap(one, (None, 0))
        sel = jax.lax.map(lambda layer: per_layer(layer, jnp.arange(qs.shape[2])), jnp.arange(L))
        sel &= valid.T[None, :, :, None]  # [L, n, B, M]
        return sel.sum(1)

    if n > PROMPT_QUERIES:
        what = f"prompt_prior: {n} queries,"
        parts = (_chunked(queries, 2, what), _chunked(pos, 1, what), _chunked(valid, 1, what))
        total = jax.lax.map(lambda x: count(*x), parts).sum(0)
    else:
        total = count(queries, pos, valid)
    share = total / jnp.maximum(valid.sum(1), 1)[None, :, None]
    return jnp.where(cache.sealed, share, 0.0).astype(jnp.float32)


def uses_prompt_prior(policy, placement: PlacementConfig) -> bool:
    """Whether a Decoder starts `policy` from the prompt's prior: the policy asks for it
    (`prompt_prior`) and attention is sparse (under exact attention every block is read)."""
    return bool(getattr(policy, "prompt_prior", False)) and placement.attention == "sparse"


def start_cache(c: CacheConfig, pre, placement: PlacementConfig, policy, windows=None):
    """The cache after prefill from a `Prefilled` and, when `uses_prompt_prior`, the priors:
    (cache, prior, steady), each prior [layers, batch * max_blocks] float32 or None: the read
    frequency of the last `PROMPT_QUERIES` queries and, with the policy's `steady_queries`
    n, that of the last n (the adaptive estimator's). With the prior the sealed blocks fill
    HBM in its order (ties in write order), per layer."""
    kv = (pre.k.astype(c.jnp_dtype), pre.v.astype(c.jnp_dtype))
    cache = cache_ops._prefill(TieredKVCache.create(c), *kv, pre.lengths)
    if not uses_prompt_prior(policy, placement):
        return cache, None, None
    # the selection reads this first cache's key bounds only: XLA drops its pools, and the
    # second prefill, in the prior's order, is the one kept
    shape = (c.num_layers, c.batch * c.max_blocks)
    prior = prompt_prior(pre.queries[:, :, -PROMPT_QUERIES:], cache, placement, windows)
    n, steady = int(getattr(policy, "steady_queries", 0)), None
    if n:
        steady = prompt_prior(pre.queries[:, :, -n:], cache, placement, windows).reshape(shape)
    cache = cache_ops._prefill(TieredKVCache.create(c), *kv, pre.lengths, priority=prior)
    return cache, prior.reshape(shape), steady

"""What `jaxkv.decode.Decoder` settles on the host, before anything is traced: the checks of its
arguments and of the prompts, the weight bytes a decode step reads besides the KV cache, the
cost model its plans are priced in, and the placement policy a live decode can run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import CostModel
from jaxkv.presets import BASES, Settings, resolve, split_name
from jaxkv.pricing import AdaptiveWindow


def check_decoder_args(model_config, cache_config: CacheConfig, max_new_tokens) -> None:
    """ValueError unless the cache's geometry matches the model's and max_new_tokens >= 1."""
    mc = model_config
    geometry = (mc.num_layers, mc.num_kv_heads, mc.head_dim)
    have = (cache_config.num_layers, cache_config.kv_heads, cache_config.head_dim)
    if geometry != have:
        raise ValueError(
            f"cache_config (num_layers, kv_heads, head_dim)={have} does not match the "
            f"model's {geometry}"
        )
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")


def model_weight_bytes(params) -> float:
    """Bytes of all arrays in a parameter pytree."""
    return float(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(params)))


def layer_weight_bytes(params, num_layers: int) -> float:
    """Bytes one decode step reads per layer: that layer's weights, plus the final norm and
    the output head spread over the layers (the embedding is a gather of one row per token)."""
    total = model_weight_bytes(params)
    embed = getattr(params, "embed", None)
    if embed is not None and getattr(params, "lm_head", None) is not None:
        total -= model_weight_bytes(embed)  # untied: the table is not read, only B rows
    return total / num_layers


def plan_env(
    profile: HardwareProfile, cache_config: CacheConfig, weight_bytes_per_layer: float
) -> CostModel:
    """The environment plans are priced in; the cache is exclusive: a demotion copies the
    block over the link. Under fp8="age" a block is priced at its FP8 bytes in both tiers (the
    ring's recent blocks, read at full precision wherever they are placed, are priced so too:
    they are `ring_blocks` per sequence, a small share at long context)."""
    return CostModel(
        profile=profile,
        block_bytes=float(cache_config.hbm_block_bytes),
        host_block_bytes=float(cache_config.host_block_bytes),
        fixed_bytes=weight_bytes_per_layer,
        demote_cost=1.0,
        block_size=cache_config.block_size,
    )


def live_policy(p: PlacementConfig, env: CostModel, overrides: dict):
    """The placement policy of `p.policy` (`jaxkv.presets.resolve`) with `p`'s window and
    migration budget. Names take the modifiers a live decode can honour: "anneal+reuse",
    "anneal+reuse+follow", "+aw", "+ec". The adaptive window is one controller
    (`jaxkv.pricing.adapt_window`): the anneal policy's own (as in the simulator), with the
    bounds of `p`, for anneal names; the decode loop's for the others."""
    base, mods = split_name(p.policy)
    if "now" in mods:
        raise ValueError(
            f"policy {p.policy!r}: +now anneals each layer on its critical path, between its "
            "block selection and its read; the decode loop plans between steps and follows "
            "the plan inside the step instead: use "
            f"{p.policy.replace('+now', '+follow')!r}"
        )
    if base == "unlimited":
        raise ValueError(
            f"policy {p.policy!r} is the Unlimited-HBM bound (every block in HBM), not a "
            "placement: use hbm_fraction=1.0 for an all-HBM decode, or an online policy "
            "(e.g. 'lru', 'anneal' or 'anneal+reuse+follow')"
        )
    if not BASES[base].online:
        raise ValueError(
            f"policy {p.policy!r} plans from perfect knowledge of future reads, which a live "
            "decode does not have; use it in `jaxkv simulate`, or an online policy here "
            "(e.g. 'lru', 'anneal' or 'anneal+reuse+follow')"
        )
    bounds = AdaptiveWindow(p.min_window, p.max_window, p.window_step)
    settings = Settings(window=p.window, budget=p.max_moves, adaptive=bounds)
    if base == "anneal" and p.adaptive_window:
        adaptive = dict(min_window=bounds.low, max_window=bounds.high, window_step=bounds.step)
        overrides = dict(adaptive=True, **adaptive, **overrides)
    return resolve(p.policy, env, settings, **overrides)


def check_prompts(prompts, lengths, cache_config: CacheConfig, vocab_size: int):
    """The prompts as an array and their lengths (default: all T) as numpy, checked: ValueError
    for a shape, dtype or length the cache cannot take, or a token id outside the vocabulary.

    Returns:
      (prompts [batch, T], lengths [batch])."""
    c = cache_config
    prompts = jnp.asarray(prompts)
    if prompts.ndim != 2 or prompts.shape[0] != c.batch:
        raise ValueError(f"prompts has shape {tuple(prompts.shape)}, expected (batch={c.batch}, T)")
    if not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts has dtype {prompts.dtype}, expected an integer dtype")
    T = prompts.shape[1]
    if T == 0:
        raise ValueError(
            f"the prompts are empty (shape {tuple(prompts.shape)}: 0 tokens): expected at least "
            "one token per sequence"
        )
    if T > c.max_len:
        raise ValueError(
            f"prompt length {T} exceeds the cache's max_len={c.max_len}: the cache cannot "
            "hold the prompt"
        )
    lengths = np.full((c.batch,), T) if lengths is None else np.asarray(lengths)
    said = lengths.tolist()
    if lengths.shape != (c.batch,):
        raise ValueError(
            f"lengths={said}: expected {c.batch} prompt lengths, one per sequence (batch={c.batch})"
        )
    check_lengths(lengths, T)
    _check_token_ids(prompts, lengths, vocab_size)
    return prompts, lengths


def check_lengths(lengths, T: int) -> None:
    """ValueError unless every prompt length is a whole number in [1, T] (T: the prompts'
    width), naming the first sequence that is not: a fraction is not truncated, an empty
    prompt is not an index range."""
    lengths = np.asarray(lengths)
    if lengths.dtype == bool or not np.issubdtype(lengths.dtype, np.number):
        raise ValueError(f"lengths={lengths.tolist()}: expected whole numbers of tokens")
    frac = np.flatnonzero(lengths != np.round(lengths))
    if frac.size:
        b = int(frac[0])
        raise ValueError(
            f"lengths={lengths.tolist()}: sequence {b}'s length {lengths[b].item()!r} is not a "
            "whole number of tokens"
        )
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        b = int(empty[0])
        raise ValueError(
            f"lengths={lengths.tolist()}: sequence {b}'s prompt is empty ({lengths[b].item()!r} "
            "tokens): expected at least one token"
        )
    over = np.flatnonzero(lengths > T)
    if over.size:
        b = int(over[0])
        raise ValueError(
            f"lengths={lengths.tolist()}: sequence {b}'s length {lengths[b].item()!r} exceeds the "
            f"prompts' width T={T}: expected at most {T}"
        )


def check_prefilled(pre, prompts, lengths, model_config) -> None:
    """ValueError unless `pre` (a `Prefilled`) has the shapes of a forward pass of this model
    over `prompts` with these `lengths` (its values are not checked)."""
    mc = model_config
    B, T = prompts.shape
    kv = (mc.num_layers, B, T, mc.num_kv_heads, mc.head_dim)
    want = dict(last_logits=(B, mc.vocab_size), k=kv, v=kv, lengths=(B,))
    for name, shape in want.items():
        have = tuple(getattr(pre, name, np.zeros(0)).shape)
        if have != shape:
            raise ValueError(
                f"prefilled.{name} has shape {have}: expected {shape}, a forward pass of this "
                "model over these prompts (`Decoder.model_prefill(params, prompts, lengths)`)"
            )
    if not np.array_equal(np.asarray(pre.lengths), np.asarray(lengths)):
        raise ValueError(
            f"prefilled.lengths={np.asarray(pre.lengths).tolist()} differ from the prompt "
            f"lengths {np.asarray(lengths).tolist()}"
        )


def _check_token_ids(prompts, lengths, vocab_size: int):
    """ValueError naming the first prompt token (inside its sequence's length) outside
    [0, vocab_size): the embedding lookup would clamp it silently."""
    ids = np.asarray(prompts)
    inside = np.arange(ids.shape[1])[None] < np.asarray(lengths)[:, None]
    bad = inside & ((ids < 0) | (ids >= vocab_size))
    if bad.any():
        b, t = (int(i[0]) for i in np.nonzero(bad))
        raise ValueError(
            f"prompts[{b}, {t}] = {int(ids[b, t])}: expected token ids in [0, "
            f"vocab_size={vocab_size}) ({int(bad.sum())} outside)"
        )

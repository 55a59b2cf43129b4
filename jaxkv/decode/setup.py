"""What `jaxkv.Decoder` settles on the host, before anything is traced: the checks of its
arguments, of the prompts and of a state handed back to it, the model's static part and the
weight bytes a decode step reads besides the KV cache (`split_model`), the cost model its plans
are priced in, and the placement policy a live decode can run (a name or a policy object).
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv._pytree import replace
from jaxkv.config import PROMPT_QUERIES, CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import CostModel
from jaxkv.decode.state import DecodeState, Prefilled
from jaxkv.model_api import FunctionalModel
from jaxkv.placement import registry
from jaxkv.placement.presets import Settings, check_policy, resolve
from jaxkv.placement.pricing import AdaptiveWindow


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


def split_model(model, num_layers: int):
    """(what the Decoder keeps of `model`: the nnx GraphDef or the `FunctionalModel` itself,
    the weight bytes a decode step reads per layer: `layer_weight_bytes`)."""
    if isinstance(model, FunctionalModel):
        return model, model.weight_bytes / num_layers
    from flax import nnx  # an nnx model brings flax; the decode loop itself does not need it

    graphdef, params = nnx.split(model)
    return graphdef, layer_weight_bytes(params, num_layers)


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
    """The environment plans are priced in: a demotion is free under a write-through host
    tier (the block keeps its host copy) and copies the block over the link under an
    exclusive one (`demote_cost` 1). Under fp8="age" a block is priced at its FP8 bytes in
    both tiers (the ring's recent blocks, read at full precision wherever they are placed, are
    priced so too: they are `ring_blocks` per sequence, a small share at long context)."""
    return CostModel(
        profile=profile,
        block_bytes=float(cache_config.hbm_block_bytes),
        host_block_bytes=float(cache_config.host_block_bytes),
        fixed_bytes=weight_bytes_per_layer,
        demote_cost=0.0 if cache_config.write_through else 1.0,
        block_size=cache_config.block_size,
    )


ONLINE_EXAMPLES = "e.g. 'lrfu', 'lru' or 'anneal+reuse+follow'"


def live_policy(p: PlacementConfig, env: CostModel, overrides: dict):
    """The placement policy of `p.policy` (`jaxkv.placement.presets.resolve`) with `p`'s window and
    migration budget. Names take the modifiers a live decode can honour: "anneal+reuse",
    "anneal+reuse+follow", "+aw", "+ec". The adaptive window is one controller
    (`jaxkv.placement.pricing.adapt_window`): the anneal policy's own (as in the simulator), with
    the bounds of `p`, for anneal names; the decode loop's for the others. A policy object is
    used as it is (`live_policy_object`)."""
    if not isinstance(p.policy, str):
        return live_policy_object(p, overrides)
    e, mods, _ = registry.parse(p.policy)
    base = e.name
    if "now" in mods:
        raise ValueError(
            f"policy {p.policy!r}: +now anneals each layer on its critical path, between its "
            "block selection and its read; the decode loop plans between steps and follows "
            "the plan inside the step instead: use "
            f"{p.policy.replace('+now', '+follow')!r}"
        )
    if e.kind == "bound":
        raise ValueError(
            f"policy {p.policy!r} is the Unlimited-HBM bound (every block in HBM), not a "
            "placement: use hbm_fraction=1.0 for an all-HBM decode, or an online policy "
            f"({ONLINE_EXAMPLES})"
        )
    if not e.online:
        raise ValueError(
            f"policy {p.policy!r} plans from perfect knowledge of future reads, which a live "
            "decode does not have; use it in `jaxkv simulate`, or an online policy here "
            f"({ONLINE_EXAMPLES})"
        )
    bounds = AdaptiveWindow(p.min_window, p.max_window, p.window_step)
    settings = Settings(window=p.window, budget=p.max_moves, adaptive=bounds)
    if base == "anneal" and p.adaptive_window:
        adaptive = dict(min_window=bounds.low, max_window=bounds.high, window_step=bounds.step)
        overrides = dict(adaptive=True, **adaptive, **overrides)
    return resolve(p.policy, env, settings, **overrides)


def live_policy_object(p: PlacementConfig, overrides: dict):
    """`p.policy`, a policy object (`jaxkv.placement.policies.Policy`), checked for a live decode:
    it needs no future reads, takes no knob overrides (they are set on the object), and a
    lookahead `window` of its own equals `p.window`, the steps between the loop's plans (a
    preset name gets both from `p.window`). ValueError / TypeError naming what differs."""
    pol = check_policy(p.policy, "PlacementConfig.policy")
    label = f"PlacementConfig.policy {pol.name!r} ({type(pol).__name__})"
    if pol.needs_forecast or pol.needs_values:
        what = "the true future reads" if pol.needs_forecast else "the LP dual's values"
        raise ValueError(
            f"{label} plans from {what}, which a live decode does not have; use it in "
            "jaxkv.sim.simulate, or an online policy here (e.g. policies.Anneal with the "
            "EMA or Reuse forecast, and Follow in place of Now)"
        )
    if overrides:
        raise ValueError(
            f"policy_kwargs {sorted(overrides)} set knobs of a preset name; {label} is an "
            "object: set them on it (dataclasses.replace(policy, ...))"
        )
    window = getattr(pol, "window", None)
    if isinstance(window, int) and window != p.window:
        raise ValueError(
            f"{label} looks window={window} steps ahead but PlacementConfig(window={p.window}) "
            f"plans every {p.window} steps: expected the same W, e.g. "
            f"PlacementConfig(policy=..., window={window})"
        )
    return pol


def best_seconds(fn, arg, repeats: int) -> float:
    """Wall seconds of `fn(arg)` on the present device, compiled and warmed first, best of
    `repeats`."""
    jax.block_until_ready(fn(arg))
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(arg))
        best = min(best, time.perf_counter() - t0)
    return best


def abstract_state(start, cache_config: CacheConfig, vocab_size: int, n: int = PROMPT_QUERIES):
    """The shapes and dtypes of a Decoder's states: `jax.eval_shape` of its `start`
    (`Decoder._start_impl`, a `Prefilled` with `n` prompt queries and a key -> DecodeState)."""
    c = cache_config
    kv = jax.ShapeDtypeStruct((c.num_layers, c.batch, 1, c.kv_heads, c.head_dim), c.jnp_dtype)
    pre = Prefilled(
        last_logits=jax.ShapeDtypeStruct((c.batch, vocab_size), jnp.float32),
        k=kv,
        v=kv,
        lengths=jax.ShapeDtypeStruct((c.batch,), jnp.int32),
        queries=jax.ShapeDtypeStruct(  # any query heads: the state keeps none
            (c.num_layers, c.batch, n, c.kv_heads, c.head_dim), c.jnp_dtype
        ),
    )
    return jax.eval_shape(start, pre, jax.random.key(0))


def check_state(state, expected, cache_config: CacheConfig, where: str) -> None:
    """ValueError unless `state` is a live `DecodeState` of the Decoder whose cache is
    `cache_config` and whose abstract state is `expected` (`jax.eval_shape` of its start): not
    donated to an earlier call, with the same cache config, and of the same structure, shapes
    and dtypes (another Decoder's state differs in its geometry, policy, sampler or
    max_new_tokens). `where` names the entry point."""
    if not isinstance(state, DecodeState):
        raise ValueError(
            f"{where}: expected a DecodeState (this Decoder's prefill returns one), got a "
            f"{type(state).__name__}"
        )
    leaves, tree = jax.tree_util.tree_flatten(state)  # paths only for a message: they cost
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
        raise ValueError(
            f"{where}: the state was donated to an earlier step, generate or score call (they "
            "consume their state, whose arrays are deleted): pass the state that call returned"
        )
    have_config = state.cache.config
    if have_config != cache_config:
        diff = [
            f"{f.name}={getattr(have_config, f.name)!r} (this Decoder's: "
            f"{getattr(cache_config, f.name)!r})"
            for f in dataclasses.fields(CacheConfig)
            if getattr(have_config, f.name) != getattr(cache_config, f.name)
        ]
        raise ValueError(
            f"{where}: the state comes from another Decoder, whose cache config has "
            f"{', '.join(diff)}: expected a state of this Decoder's prefill"
        )
    want, want_tree = jax.tree_util.tree_flatten(expected)
    same = tree == want_tree and all(
        np.shape(x) == y.shape and getattr(x, "dtype", None) == y.dtype
        for x, y in zip(leaves, want, strict=True)
    )
    if same:
        return
    leaves, want = (jax.tree_util.tree_flatten_with_path(t)[0] for t in (state, expected))
    if [p for p, _ in leaves] == [p for p, _ in want]:
        for (path, x), (_, y) in zip(leaves, want, strict=True):
            have = (tuple(np.shape(x)), getattr(x, "dtype", type(x).__name__))
            if have != (y.shape, y.dtype):
                raise ValueError(
                    f"{where}: state{jax.tree_util.keystr(path)} has shape {have[0]} and dtype "
                    f"{have[1]}, this Decoder's {y.shape} and {y.dtype}: the state comes from "
                    "another Decoder (another max_new_tokens, policy or sampler)"
                )
    raise ValueError(
        f"{where}: the state's structure differs from this Decoder's (another policy or "
        "sampler): expected a state of this Decoder's prefill"
    )


def state_with_window(state, window: int):
    """`state` (a `DecodeState`) with a new window W: the loop's and, for a policy with a
    `window` of its own (an anneal policy: its energy's window, `Anneal.plan`), the policy
    state's, each a new buffer (the state is donated) placed as the old value (an uncommitted
    scalar would change the jit cache key). ValueError unless W is an int >= 1."""
    if not isinstance(window, int | np.integer) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    pl = state.placement
    w = jax.device_put(jnp.int32(window), pl.window.sharding)
    policy = pl.policy
    if dataclasses.is_dataclass(policy) and "window" in {
        f.name for f in dataclasses.fields(policy)
    }:
        policy = replace(policy, window=jax.device_put(jnp.int32(window), policy.window.sharding))
    return replace(state, placement=replace(pl, window=w, policy=policy))


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


def check_prefilled(pre, prompts, lengths, model_config, n: int = PROMPT_QUERIES) -> None:
    """ValueError unless `pre` (a `Prefilled`) has the shapes of a forward pass of this model
    over `prompts` with these `lengths`, with at least the `n` prompt queries the Decoder uses
    (its values are not checked)."""
    mc = model_config
    B, T = prompts.shape
    kv = (mc.num_layers, B, T, mc.num_kv_heads, mc.head_dim)
    want = dict(last_logits=(B, mc.vocab_size), k=kv, v=kv, lengths=(B,))
    qs = tuple(getattr(pre, "queries", np.zeros(0)).shape)
    heads = qs[3] if len(qs) == 5 and qs[3] % mc.num_kv_heads == 0 else "heads"
    rows = qs[2] if len(qs) == 5 and qs[2] >= n else n  # more queries than used: the last n
    want["queries"] = (mc.num_layers, B, rows, heads, mc.head_dim)
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

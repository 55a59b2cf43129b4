"""The window boundary of the decode loop (`jaxkv.Decoder.window_step`): every W steps,
between steps, the policy plans for all layers at once from the read statistics (`plan`); the
cache migrates to the plan in bulk unless the policy has an in-step rule (which follows the
plan inside the steps), compacts its HBM pool when due, and the next W is set (`end_window`).
W lives in the decode state, so changing it never recompiles (`window_due`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv import cache as kvc
from jaxkv._pytree import replace
from jaxkv.attention.tiered import resolve_impl
from jaxkv.decode.state import DecodeState, new_window, next_window
from jaxkv.placement.observation import observation, placeable


def window_due(state: DecodeState):
    """[] bool: this step ends the window."""
    return state.placement.since_plan + 1 >= state.placement.window


def plan(dec, state: DecodeState):
    """observe -> plan, all layers, for the Decoder `dec`: (the policy's new state, target
    [layers, N] bool)."""
    stats, step = state.statistics.blocks, state.sampling.step
    obs = observation(state.cache, stats, step, dec.cache_config, dec.model_config)
    return dec.policy.plan(state.placement.policy, obs, dec.env)


def end_window(dec, state: DecodeState) -> tuple[DecodeState, jax.Array]:
    """The window boundary of the Decoder `dec`, between steps: observe -> plan (-> migrate ->
    compact), and the next W (`next_window`).

    Returns:
      (state, [layers] int32 blocks migrated here)."""
    c, p = dec.cache_config, dec.placement
    cache = state.cache
    moved = jnp.zeros((c.num_layers,), jnp.int32)
    policy_state, target = plan(dec, state)
    if not dec.follows:  # a policy with an in-step rule has its target followed by the steps
        passed = None  # blocks behind every later step's window leave HBM first
        if dec._layer_windows() is not None:
            passed = cache.sealed.reshape(c.num_layers, -1) & ~placeable(cache, c, dec.model_config)
        moves = kvc.plan_moves(cache, target, p.max_moves, demote_first=passed)
        cache, moved = kvc.migrate(cache, moves)
    stats = state.statistics.blocks
    stats = replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
    windows = state.metrics.windows + 1
    if p.compact_every:
        impl = "pallas" if resolve_impl(dec.impl, c) == "pallas" else "xla"
        cache = jax.lax.cond(
            windows % p.compact_every == 0,
            lambda x: kvc.compact(x, impl=impl),
            lambda x: x,
            cache,
        )
    m = state.metrics
    metrics = replace(m, migrated_blocks=m.migrated_blocks + moved.sum(), windows=windows)
    window, hit = next_window(dec.policy, p, state.placement, policy_state)
    state = replace(
        state,
        cache=cache,
        placement=new_window(window.astype(jnp.int32), hit, policy_state, state.placement.rule),
        statistics=replace(state.statistics, blocks=stats),
        metrics=metrics,
    )
    return state, moved

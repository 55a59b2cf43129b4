"""The simulator's planning times: one compiled plan (`time_plan`) and one compiled per-step
rule of a `follow` policy (`time_rule`), each measured on the present device on the run's last
state, best of a few repeats. `jaxkv.sim.simulate` reports plan_seconds (the plan time x the
number of plans, charged serially in vs_unlimited_with_plan) and rule_seconds (the rule time x
the steps, not charged: the decode loop runs it on each layer's critical path).
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from jaxkv.placement.admission import StepView, admit
from jaxkv.placement.policies import Observation
from jaxkv.sim.replay import Setup, SimState


def plan_timing(
    pols: dict, states: dict, setup: Setup, reads_buf, n_steps: int, plans: dict, measure: bool
) -> dict:
    """{name: (seconds per plan, seconds per step of the follow rule, None without one)} of
    every policy on its last state (`states`) and the last chunk's reads; 0 where `measure` is
    False or, per plan, where the policy made no plan (`plans[name]`)."""
    out = {}
    for n, p in pols.items():
        per_plan = 0.0
        if measure and plans[n]:
            per_plan = time_plan(p, states[n], setup, reads_buf, n_steps - 1)
        per_rule = None
        if p.rule is not None:
            per_rule = time_rule(p, states[n], setup, reads_buf, n_steps - 1) if measure else 0.0
        out[n] = (per_plan, per_rule)
    return out


def _valid(setup: Setup, state: SimState, t):
    """[layers, N] bool: the blocks sealed at step t."""
    return jnp.broadcast_to(
        jnp.arange(setup.num_blocks) < (setup.prompt_len + t) // setup.block_size,
        state.in_hbm.shape,
    )


def time_plan(policy, state: SimState, setup: Setup, reads_buf, t, repeats: int = 2) -> float:
    """Seconds of one compiled plan on the run's last observation (best of `repeats`)."""
    obs = observation(policy, state, setup, reads_buf, t)
    env = setup.env
    fn = jax.jit(lambda p, o: policy.plan(p, o, env))
    return _best(fn, (state.pstate, obs), repeats)


def observation(policy, state: SimState, setup: Setup, reads_buf, t) -> Observation:
    """What `policy` sees planning at step t from `state` (a chunk's last state): the blocks
    sealed at t, the state's statistics, the forecast rows it needs from `reads_buf` (its
    first rows are step t's) and zeros for the LP dual's values."""
    h = policy.horizon
    valid = _valid(setup, state, t)
    st = state.stats
    fc = reads_buf[:h].astype(jnp.float32) if policy.needs_forecast else None
    vg = None
    if policy.needs_values:
        vg = jnp.zeros((h, *state.in_hbm.shape), jnp.float32)
    return Observation.of(
        state.in_hbm,
        valid,
        st,
        jnp.int32(t),
        setup.capacity,
        forecast=fc,
        forecast_mass=None if fc is None else jnp.zeros_like(fc),
        value_to_go=vg,
    )


def time_rule(policy, state: SimState, setup: Setup, reads_buf, t, repeats: int = 5) -> float:
    """Seconds of one compiled step of the policy's in-step rule over all layers
    (`jaxkv.placement.admission.admit`) on the run's last state (best of `repeats`)."""
    valid = _valid(setup, state, t)
    budget = policy.budget if policy.budget is not None else setup.num_blocks

    def rule(in_hbm, reads, pstate, stats, rstate):
        view = StepView(
            in_hbm=in_hbm,
            valid=valid,
            reads=reads,
            room=setup.capacity - jnp.sum(in_hbm, axis=-1),
            step=jnp.int32(t),
            stats=stats,
            pstate=pstate,
            slack=jnp.full(in_hbm.shape[:1], budget, jnp.int32),  # timed at its widest
        )
        adm, _ = admit(policy.rule, rstate, view, budget)
        return adm.apply(in_hbm)

    args = (state.in_hbm, reads_buf[0], state.pstate, state.stats, state.rule)
    return _best(jax.jit(rule), args, repeats)


def _best(fn, args, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls of fn(*args), after one call to compile."""
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t1 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t1)
    return best

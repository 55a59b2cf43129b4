"""The simulator's replay: a trace's steps run chunk by chunk, one compiled scan per policy.

`Setup` is everything static about a simulation, `SimState` one policy's state between chunks
(`init_state`: write order after prefill). `run_chunk` is one jit-compiled `lax.scan` over a
chunk's steps, planning inside it with `lax.cond`; each step is `_step`: the sealed block's
arrival (`_arrive`), the plan or its skip (`_plan`, `_skip`), the policy's in-step rule
(`_rule`: `jaxkv.placement.admission.admit`, the decode loop's own function) and the step's
latency, all charged in the paper's accounting (`jaxkv.placement.charging.paper_step_time`,
`paper_plan_charges`, `paper_rule_charges`), as the model of `jaxkv.sim.simulate`'s module
docstring says. `replay` is the loop over chunks: the reads of a chunk are computed once
and shared by every policy, and with them the per-chunk Unlimited and capacity bounds
(`chunk_bounds`) and the bit-packed reads of the cache bound (`pack`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cost
from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.cache.slots import seal_keeps
from jaxkv.config import HardwareProfile
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import StepView, admit, needs_next_use, rule_state
from jaxkv.placement.charging import (
    free_promotions,
    paper_plan_charges,
    paper_rule_charges,
    paper_step_time,
)
from jaxkv.placement.policies import Observation, looks_ahead
from jaxkv.sim.trace import read_mask


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything static about a simulation (hashable)."""

    prompt_len: int
    block_size: int
    num_layers: int
    num_blocks: int
    capacity: int  # HBM pool blocks per layer (the tail block is extra)
    token_bytes: int
    weight_bytes: float
    profile: HardwareProfile
    demote_cost: float = 0.0
    keep_fetched: bool = False
    host_block_bytes: float | None = None  # a host-tier block's link bytes (FP8); None: as HBM
    hbm_block_bytes: float | None = None  # a placed block's HBM bytes (fp8="age"); None: bf16

    @property
    def block_bytes(self) -> float:
        """Bytes of a placed block of one layer as HBM reads it."""
        if self.hbm_block_bytes is not None:
            return float(self.hbm_block_bytes)
        return float(self.token_bytes * self.block_size)

    @property
    def link_block_bytes(self) -> float:
        return self.block_bytes if self.host_block_bytes is None else self.host_block_bytes

    @property
    def link_profile(self) -> HardwareProfile:
        """The profile every time is computed with: blocks are counted at `block_bytes`, and
        the link's bandwidth is scaled so that a host block costs its real bytes
        (`jaxkv.cost.link_profile`)."""
        return cost.link_profile(self.profile, self.block_bytes, self.host_block_bytes)

    @property
    def fixed_bytes(self) -> float:
        """HBM bytes of every step besides the placed blocks: weights, write, about half a tail."""
        return self.weight_bytes + self.token_bytes * (1 + self.block_size / 2)

    @property
    def env(self) -> cost.CostModel:
        """The cost model the policies' plans are priced in: the simulator's own."""
        return cost.CostModel(
            profile=self.profile,
            block_bytes=self.block_bytes,
            fixed_bytes=self.fixed_bytes,
            demote_cost=self.demote_cost,
            keep_fetched=self.keep_fetched,
            prompt_len=self.prompt_len,
            block_size=self.block_size,
            host_block_bytes=self.host_block_bytes,
        )


@pytree_dataclass
class SimState:
    in_hbm: jax.Array  # [layers, N] bool
    stats: imp.Stats
    pstate: Any
    next_plan: jax.Array  # [] int32
    latency: jax.Array  # [] float32: seconds in this chunk (summed over layers)
    hbm_reads: jax.Array  # [] float32: placed-block reads served from HBM in this chunk
    reads: jax.Array  # [] float32: placed-block reads in this chunk
    migrated: jax.Array  # [] float32: blocks moved in this chunk
    plans: jax.Array  # [] int32: plans in this chunk
    rule: Any = ()  # the in-step rule's state (`Rule.init(layers, N)`)
    policy: Any = static_field(default=None)


def init_state(policy, setup: Setup) -> SimState:
    """Write-order placement after prefill, empty statistics."""
    sealed = setup.prompt_len // setup.block_size
    idx = jnp.arange(setup.num_blocks)
    in_hbm = jnp.broadcast_to(
        (idx < sealed) & (idx < setup.capacity), (setup.num_layers, setup.num_blocks)
    )
    z = jnp.float32(0)
    return SimState(
        in_hbm,
        imp.init_stats(setup.num_layers, setup.num_blocks),
        policy.init(setup.num_layers, setup.num_blocks),
        jnp.int32(0),
        z,
        z,
        z,
        z,
        jnp.int32(0),
        rule_state(policy, setup.num_layers, setup.num_blocks),
        policy,
    )


class _Chunk(NamedTuple):
    """What every step of a `run_chunk` trace shares (the arguments of `run_chunk`)."""

    setup: Setup
    policy: Any
    reads_buf: jax.Array  # [chunk + H, layers, N] bool
    mass: jax.Array  # [chunk + H, layers, N] float32
    values: jax.Array | None  # [chunk + H, layers, N] float32, or None
    t0: jax.Array  # [] int32
    blk: jax.Array  # [N] int32: block ids
    zero: jax.Array  # [] float32


@functools.partial(jax.jit, static_argnums=(0, 1))
def run_chunk(setup: Setup, chunk: int, state: SimState, reads_buf, mass, t0, values=None):
    """Simulates steps t0 .. t0 + chunk - 1 for `state.policy`.

    Args:
      setup: static geometry and costs.
      chunk: steps in this chunk (static).
      state: SimState (accumulators are reset here).
      reads_buf: [chunk + H, layers, N] bool, reads of these steps and the next H >= horizon.
      mass: [chunk + H, layers, N] float32, attention mass of these steps and the next H.
      t0: [] int32.
      values: [chunk + H, layers, N] float32 seconds, the LP dual's value-to-go of these steps
        and the next H (`jaxkv.sim.lp.dual.trace_dual_values`), for policies with `needs_values`.
    Returns:
      SimState.
    """
    policy = state.policy
    if policy.needs_values and values is None:
        raise ValueError(f"policy {policy.name!r} needs the dual's values (run_chunk values=)")
    if needs_next_use(policy):
        raise ValueError(
            f"policy {policy.name!r} reads every block's next read (an offline rule): it runs "
            "in the decode loop's accounting (jaxkv.sim.loop, bench/loop_traces.py); the trace "
            "simulator reports the same limit as its cache bound (result['bounds'])"
        )
    if looks_ahead(policy) and reads_buf.shape[0] <= chunk:
        raise ValueError(
            f"policy {policy.name!r} with lookahead reads the next step's reads of layer 0: "
            f"expected reads_buf of more than chunk={chunk} steps, got {reads_buf.shape[0]}"
        )
    blk = jnp.arange(setup.num_blocks)
    z = jnp.float32(0)
    k = _Chunk(setup, policy, reads_buf, mass, values, t0, blk, z)
    state = dataclasses.replace(
        state, latency=z, hbm_reads=z, reads=z, migrated=z, plans=jnp.int32(0)
    )
    return jax.lax.scan(functools.partial(_step, k), state, jnp.arange(chunk, dtype=jnp.int32))[0]


def _step(k: _Chunk, st: SimState, c):
    """Step t0 + c of the scan: arrival, plan (or not), the in-step rule, latency, statistics."""
    s, policy = k.setup, k.policy
    t = k.t0 + c
    in_hbm, valid = _arrive(k, st, t)
    in_hbm, stats, pstate, mig_h, mig_l, moved, nxt, planned, riding = jax.lax.cond(
        t >= st.next_plan,
        functools.partial(_plan, k, c, t, valid),
        functools.partial(_skip, k, st.next_plan),
        (in_hbm, st.stats, st.pstate),
    )
    r = k.reads_buf[c]  # [L, N]
    read_from = in_hbm  # what this step reads from HBM (the rule's victims included)
    rstate = st.rule
    if policy.rule is not None:
        in_hbm, riding, mig_h, mig_l, moved, rstate = _rule(
            k, c, t, valid, in_hbm, stats, pstate, rstate, riding, mig_h, mig_l, moved
        )
    tail = s.token_bytes * ((s.prompt_len + t) % s.block_size + 1)
    lat, n_hbm, n_all = paper_step_time(
        r,
        read_from,
        riding,
        mig_h,
        mig_l,
        block_bytes=s.block_bytes,
        tail_bytes=tail,
        token_bytes=s.token_bytes,
        weight_bytes=s.weight_bytes,
        profile=s.link_profile,
    )
    stats = imp.update_stats(stats, r, k.mass[c], t, valid)
    return SimState(
        in_hbm,
        stats,
        pstate,
        nxt,
        st.latency + jnp.sum(lat),
        st.hbm_reads + jnp.sum(n_hbm),
        st.reads + jnp.sum(n_all),
        st.migrated + moved,
        st.plans + planned,
        rstate,
        policy,
    ), None


def _arrive(k: _Chunk, st: SimState, t):
    """(in_hbm, valid) at step t before its plan: the block sealed at t (if any) goes to HBM when
    the layer's pool has a free slot (`jaxkv.cache.slots.seal_keeps`, the decode loop's rule,
    for the trace's one sequence); valid marks the sealed blocks."""
    s = k.setup
    sealed = (s.prompt_len + t) // s.block_size
    new = (sealed > (s.prompt_len + t - 1) // s.block_size) & (t > 0)
    valid = jnp.broadcast_to(k.blk < sealed, (s.num_layers, s.num_blocks))
    keep, _ = seal_keeps(new[None], s.capacity - jnp.sum(st.in_hbm, axis=-1))  # [L, 1]
    in_hbm = st.in_hbm | ((k.blk == sealed - 1)[None, :] & keep)
    return in_hbm, valid


def _observation(k: _Chunk, c, t, valid, in_hbm, stats) -> Observation:
    """What the policy sees at plan step t (chunk row c): the forecast rows it needs, if any."""
    s, policy = k.setup, k.policy
    shape = (policy.horizon, s.num_layers, s.num_blocks)
    fc = fm = None
    if policy.needs_forecast:
        fc = jax.lax.dynamic_slice(k.reads_buf, (c, 0, 0), shape)
        fc = fc.astype(jnp.float32)
        fm = jax.lax.dynamic_slice(k.mass, (c, 0, 0), shape)
    vg = None
    if policy.needs_values:
        vg = jax.lax.dynamic_slice(k.values, (c, 0, 0), shape)
    return Observation.of(
        in_hbm, valid, stats, t, s.capacity, forecast=fc, forecast_mass=fm, value_to_go=vg
    )


def _plan(k: _Chunk, c, t, valid, args):
    """The `lax.cond` branch of a plan step: the policy's target and the moves to it, charged
    to this step (`paper_plan_charges`) -> (in_hbm, stats, pstate, mig_h [L], mig_l [L], moved,
    next_plan, 1, riding)."""
    s, policy = k.setup, k.policy
    L = s.num_layers
    in_hbm, stats, pstate = args
    obs = _observation(k, c, t, valid, in_hbm, stats)
    pstate, target = policy.plan(pstate, obs, s.env)
    stats = dataclasses.replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
    nxt = t + jnp.maximum(policy.next_window(pstate), 1)
    if policy.rule is not None:  # the plan is a target (pstate.target) for the in-step rule
        zl = jnp.zeros((L,), jnp.float32)
        return in_hbm, stats, pstate, zl, zl, k.zero, nxt, 1, jnp.zeros_like(in_hbm)
    target = target & valid
    kept = imp.read_last_step(stats.last_read, t) & s.keep_fetched
    mig_h, mig_l, moved, riding = paper_plan_charges(
        target, in_hbm, k.reads_buf[c], kept, s.block_bytes, s.demote_cost
    )
    return target, stats, pstate, mig_h, mig_l, moved, nxt, 1, riding


def _skip(k: _Chunk, next_plan, args):
    """The `lax.cond` branch of a step without a plan: nothing moves."""
    in_hbm, stats, pstate = args
    zl = jnp.zeros((k.setup.num_layers,), jnp.float32)
    return in_hbm, stats, pstate, zl, zl, k.zero, next_plan, 0, jnp.zeros_like(in_hbm)


def _rule(k: _Chunk, c, t, valid, in_hbm, stats, pstate, rstate, riding, mig_h, mig_l, moved):
    """The policy's in-step rule at every step (`jaxkv.placement.admission.admit`, the decode
    loop's function): it promotes blocks this step reads from host (the read carries them over
    the link: an HBM write each, and the read is a host read) and demotes the blocks it picks,
    each charged `demote_cost` x block bytes on each side (`paper_rule_charges`) -> (in_hbm,
    riding, mig_h, mig_l, moved, rule state) with the rule's moves added. Under `lookahead`
    layer 0 knows its next reads (step c + 1's: in the decode loop they are known once the
    next token is sampled)."""
    s, policy = k.setup, k.policy
    N = s.num_blocks
    r = k.reads_buf[c]
    n_hbm = jnp.sum(r & in_hbm & ~riding, axis=-1)
    tail = s.token_bytes * ((s.prompt_len + t) % s.block_size + 1)
    slack = free_promotions(
        s.link_profile,
        s.block_bytes * n_hbm + tail,
        s.block_bytes * (jnp.sum(r, axis=-1) - n_hbm),
        s.weight_bytes + s.token_bytes,
        s.block_bytes,
    )
    view = StepView(
        in_hbm=in_hbm,
        valid=valid,
        reads=r,
        room=s.capacity - jnp.sum(in_hbm, axis=-1),
        step=t,
        stats=stats,
        pstate=pstate,
        ahead=k.reads_buf[c + 1][0] if looks_ahead(policy) else None,
        slack=slack,
    )
    budget = policy.budget if policy.budget is not None else N
    adm, rstate = admit(policy.rule, rstate, view, budget)
    pro, dem = adm.masks(N)
    in_hbm = (in_hbm | pro) & ~dem
    mh, ml = paper_rule_charges(pro, dem, s.block_bytes, s.demote_cost)
    moved = moved + jnp.sum(adm.num_promote) + jnp.sum(adm.num_demote)
    return in_hbm, riding | pro, mig_h + mh, mig_l + ml, moved, rstate


@functools.partial(jax.jit, static_argnums=(0,))
def chunk_bounds(setup: Setup, reads, t0):
    """Per-layer bounds of a chunk: reads [n, L, N] bool -> Unlimited and capacity sums over the
    steps, [L] float32 each."""
    s = setup
    t = t0 + jnp.arange(reads.shape[0])
    tail = s.token_bytes * ((s.prompt_len + t) % s.block_size + 1)  # [n]
    rb = s.block_bytes * jnp.sum(reads, -1).astype(jnp.float32) + tail[:, None]  # [n, L]
    kw = dict(
        profile=s.link_profile, weight_bytes=s.weight_bytes, hbm_write_bytes=float(s.token_bytes)
    )
    unl = cost.unlimited_step_time(rb, **kw)
    cap = cost.capacity_bound_step_time(rb, s.capacity * s.block_bytes + tail[:, None], **kw)
    return jnp.sum(unl, 0), jnp.sum(cap, 0)


pack = jax.jit(functools.partial(jnp.packbits, axis=-1))  # [n, L, N] bool -> [n, L, N / 8] u8


@dataclasses.dataclass
class Replay:
    """What `replay` leaves: each policy's last state and sums, and the per-layer bounds."""

    states: dict  # name -> SimState after the last chunk
    acc: dict  # name -> {latency, hbm, reads, migrated, plans, wall}: sums over the chunks
    unlimited: np.ndarray  # [L] float64: the Unlimited bound, seconds summed over the steps
    capacity_bound: np.ndarray  # [L] float64: the capacity bound, the same
    pack_wall: float  # seconds spent packing the reads for the cache bound
    reads: jax.Array  # the last chunk's reads ([c + horizon, L, N] bool)


def replay(
    trace,
    setup: Setup,
    pols: dict,
    states: dict,
    *,
    sparsity: float,
    n_steps: int,
    chunk: int,
    horizon: int,
    values,
    packed,
    progress: bool,
) -> Replay:
    """Runs the first n_steps steps of `trace` chunk by chunk for every policy of `pols` from its
    `states`, with the per-chunk bounds; `values` [steps, L, N] the LP dual's values (policies
    with `needs_values`), `packed` a `jaxkv.sim.bounds.PackedReads` filled with the reads (None:
    no cache bound), `progress` a tqdm bar over chunks."""
    states = dict(states)
    acc = {n: dict(latency=0.0, hbm=0.0, reads=0.0, migrated=0.0, plans=0, wall=0.0) for n in pols}
    unl_l, cap_l = np.zeros(setup.num_layers), np.zeros(setup.num_layers)
    pack_wall = 0.0
    bar = range(0, n_steps, chunk)
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"simulate s={sparsity:g}", unit="chunk")
    for t0 in bar:
        c = min(chunk, n_steps - t0)
        mass = trace.mass(t0, c + horizon)
        reads = read_mask(mass, trace.prompt_len, trace.block_size, sparsity, t0)
        live = (t0 + jnp.arange(c + horizon) < n_steps)[:, None, None]
        reads = reads & live
        u, cb = chunk_bounds(setup, reads[:c], jnp.int32(t0))
        unl_l += np.asarray(u, np.float64)
        cap_l += np.asarray(cb, np.float64)
        if packed is not None:
            w0 = time.perf_counter()
            packed.put(t0, pack(reads[:c]))
            pack_wall += time.perf_counter() - w0
        for n, p in pols.items():
            w0 = time.perf_counter()
            vals = _chunk_values(values, t0, c + horizon) if p.needs_values else None
            st = run_chunk(setup, c, states[n], reads, mass, jnp.int32(t0), vals)
            _accumulate(acc[n], st)
            acc[n]["wall"] += time.perf_counter() - w0
            states[n] = st
    return Replay(states, acc, unl_l, cap_l, pack_wall, reads)


def _chunk_values(values, t0: int, n: int):
    """Rows t0 .. t0 + n - 1 of the dual's values, zero past the run's last step."""
    vals = np.zeros((n, *values.shape[1:]), np.float32)
    got = values[t0 : t0 + n]
    vals[: got.shape[0]] = got
    return jnp.asarray(vals)


def _accumulate(a: dict, st: SimState) -> None:
    """Adds a chunk's sums (st) to a policy's running sums (a)."""
    a["latency"] += float(st.latency)
    a["hbm"] += float(st.hbm_reads)
    a["reads"] += float(st.reads)
    a["migrated"] += float(st.migrated)
    a["plans"] += int(st.plans)

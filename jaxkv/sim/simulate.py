"""Trace-driven simulator: the policies of `jaxkv.policies` judged by `jaxkv.cost`'s model.

Unit: a block of `block_size` tokens of one layer (block_size=1 = the paper's token granularity).
Per decode step t (context P + t + 1 tokens, P = prompt length):
  1. the block sealed at this step (if any) goes to HBM when the layer's pool has a free slot,
     else to host (write order, as after prefill);
  2. at a plan step (every W steps, W per policy, adaptive for `+aw`) the policy sees an
     Observation (oracles also the true reads of the next steps) and returns a target (`+follow`:
     a target the step's rule follows, see below; nothing moves at the plan); moving to
     it costs, per block, an HBM write plus a link read for a promotion (no separate link read
     when the block is read from host at this step, as in the paper: the promotion rides on the
     read, which counts as a host read; a block read at an earlier step crosses again, as in the
     decode loop, whose migrations read the host pool; with `keep_fetched`, a block read from
     host at the previous step needs only the HBM write and its read now is an HBM read, as if
     the fetched copy were kept for the next plan) and
     `demote_cost` x block bytes on each side for a demotion (0 by default: host memory keeps a
     copy of every block, as in the paper), all charged to this step;
  3. the step reads the top ceil((1 - s) x sealed blocks) blocks by attention mass (s = sparsity)
     plus the tail block (always HBM): max(T_hbm, T_link) per layer, weights and the new token's
     write on the HBM side (`jaxkv.cost.layer_step_time`).
The loop runs chunk by chunk (tqdm bar); each chunk is one jit-compiled `lax.scan` over steps per
policy, planning inside it with `lax.cond`; the reads of a chunk are computed once and shared.

Policy names: those of `jaxkv.policies.POLICIES`, with modifiers for `anneal` / `anneal-oracle`:
`+aw` (adaptive window) and `+ec` (forecast-error compensation), e.g. `anneal+aw+ec`; `anneal`
also takes `+reuse` (the re-read law learned online as its forecast, `importance.reuse_forecast`,
with the reads it cannot place charged to the link: `Anneal.unforeseen`), `+now` (the plan sees
the read set of the step it plans for, Page's one-step lookahead: `Anneal.now`, priced with
`ride` 1 and its later steps at their expected time, `Anneal.spread` = `now_spread`) or
`+follow` (`Anneal.follow`, what the decode loop runs in place of `+now`, whose annealer would
sit on each layer's critical path: every `follow_window` steps the annealer plans a target for
all layers between steps and nothing moves then; at every step the vector rule
`jaxkv.policies.follow_moves` promotes, per layer, host blocks the step reads (its `admit` rule,
`follow_admit`: "read" every one, the policy's default and the decode loop's; "ranked" one that
outranks its victim; "target" only those the target marks for HBM), each charged one block of
HBM write and no link transfer, the read that carries it being a host read, and demotes, only
to make room beyond the free slots, resident blocks the step does not read, ranked by (in the
target, expected reads) lowest first, each charged `demote_cost` x block bytes on each side;
priced like `+now`'s later steps, `ride` 1 and `spread` `NOW_SPREAD`; `rule_seconds` is the
rule's measured time over the run, not charged in `vs_unlimited_with_plan`); `anneal-oracle`
takes `+visits` (a diagnostic: the oracle told only
how long each visit in progress lasts, not when one starts, `importance.visits_forecast`: how
much of the online planners' gap no forecast of visit lengths can close) and `+dual` (the value
of a block after the oracle's window from the LP relaxation's dual prices over the whole run,
`jaxkv.sim.lp_bound.dual_values`, in place of Belady's next read; solved once before the run).
`paper-sa` runs every (lookahead, fraction) pair of `PAPER_SA_GRID` and reports the best (the
oracle tuning of its two knobs). `unlimited` is the bound of `jaxkv.cost.unlimited_step_time`.

Lower bounds (result["bounds"]): Unlimited; the capacity bound (`cost.capacity_bound_step_time`,
free re-placement before every step); and the cache bound (`jaxkv.sim.bounds`): a block not in HBM
must cross the link before HBM can serve it, Belady's rule with bypass gives the fewest crossings
F_l any placement needs per layer, and a layer's latency is at least max(Unlimited, F_l x block
bytes / B_link) (best_s: the capacity bound in place of Unlimited). On traces whose read set
churns this crossing traffic, not the capacity, is what limits every policy.

Planning is not part of `latency_s` (the model's decode time); `plan_seconds` is the compiled
plan time measured on the present device times the number of plans, and
`vs_unlimited_with_plan` charges it serially (planning on the critical path, no overlap).
The command line (`jaxkv simulate`) is in `jaxkv.sim.cli`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.sim import bounds as bnd
from jaxkv import cost
from jaxkv import importance as imp
from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.config import AnnealConfig, HardwareProfile, check_number
from jaxkv.policies import (
    NOW_SPREAD,
    NOW_WINDOW,
    POLICIES,
    Observation,
    Static,
    follow_moves,
    get_policy,
    modifier_kwargs,
    moves_mask,
    split_name,
)
from jaxkv.sim.trace import read_mask

PAPER_SA_GRID = ((2, 10, 50), (0.5, 1.0))  # lookahead W values, fraction R values
NEVER = 1 << 30
# W of `anneal-oracle+dual`: 2 beat 3 and 1 on recency-high 0.8, recency-low 0.6 and patterns
# 0.6 at 300 steps (bench/RESULTS.md)
DUAL_WINDOW = 2
# W of the `+follow` policies (steps between their plans and their lookahead), with follow_admit
# "read" (4 layers, 512 steps, recency-low / patterns / real-like at 0.5 / 0.6 / 0.8): without
# planning 4 ties 8 and 16 on recency-low and patterns (every host read is written to HBM, so
# those steps are HBM-bound whatever the victims) and beats them on real-like by 1-11%. Planning
# at W 4 adds 4-6.4 ms per step on the CPU (W 16: 2-3.3 ms), 3-5.5% of the CPU's time to read
# a 4-layer step's weights and KV once (94-151 ms, a lower bound on a decode step there), so
# small on the same device: with that share charged W 16 leads by 1.5-3% where placement does
# not matter and W 8 / 16 real-like 0.8 by 1.3%, W 4 leads real-like 0.6 by 5-11%, real-like
# 0.5 is level. Charged against the modeled GH200 step
# (vs_unlimited_with_plan) W 16 wins (bench/notebook/2026-12-01-follow.md, "admit=read")
FOLLOW_WINDOW = 4


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

    @property
    def block_bytes(self) -> float:
        return float(self.token_bytes * self.block_size)

    @property
    def fixed_bytes(self) -> float:
        """HBM bytes of every step besides the placed blocks: weights, write, about half a tail."""
        return self.weight_bytes + self.token_bytes * (1 + self.block_size / 2)


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
    policy: Any = static_field(default=None)


def _admit(policy) -> dict:
    """`follow_moves`'s admit rule of a follow policy, where the policy has one."""
    a = getattr(policy, "follow_admit", None)
    return {} if a is None else {"admit": a}


def _window_of(policy, pstate):
    if isinstance(policy, Static):
        return jnp.int32(NEVER)
    if hasattr(policy, "next_window"):
        return policy.next_window(pstate)
    return jnp.int32(getattr(policy, "window", 1))


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
        policy,
    )


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
        and the next H (`jaxkv.sim.lp_bound.trace_dual_values`), for policies with `needs_values`.
    Returns:
      SimState.
    """
    policy = state.policy
    s = setup
    L, N = s.num_layers, s.num_blocks
    b = s.block_bytes
    horizon = getattr(policy, "horizon", 1)
    needs = getattr(policy, "needs_forecast", False)
    needs_values = getattr(policy, "needs_values", False)
    follow = getattr(policy, "follow", False)
    if needs_values and values is None:
        raise ValueError(f"policy {policy.name!r} needs the dual's values (run_chunk values=)")
    blk = jnp.arange(N)
    z = jnp.float32(0)
    state = dataclasses.replace(
        state, latency=z, hbm_reads=z, reads=z, migrated=z, plans=jnp.int32(0)
    )

    def body(st: SimState, c):
        t = t0 + c
        sealed = (s.prompt_len + t) // s.block_size
        new = (sealed > (s.prompt_len + t - 1) // s.block_size) & (t > 0)
        valid = jnp.broadcast_to(blk < sealed, (L, N))
        free = jnp.sum(st.in_hbm, axis=-1) < s.capacity  # [L]
        in_hbm = st.in_hbm | ((blk == sealed - 1)[None, :] & new & free[:, None])

        def plan(args):
            in_hbm, stats, pstate = args
            fc = fm = None
            if needs:
                fc = jax.lax.dynamic_slice(reads_buf, (c, 0, 0), (horizon, L, N))
                fc = fc.astype(jnp.float32)
                fm = jax.lax.dynamic_slice(mass, (c, 0, 0), (horizon, L, N))
            vg = None
            if needs_values:
                vg = jax.lax.dynamic_slice(values, (c, 0, 0), (horizon, L, N))
            obs = Observation(
                in_hbm=in_hbm,
                valid=valid,
                last_read=stats.last_read,
                read_ema=stats.read_ema,
                mass_ema=stats.mass_ema,
                step=t,
                forecast=fc,
                forecast_mass=fm,
                window_reads=stats.window_reads,
                since_seen=stats.since_seen,
                since_read=stats.since_read,
                streak=stats.streak,
                value_to_go=vg,
                capacity=s.capacity,
            )
            pstate, target = policy.plan(pstate, obs)
            stats = dataclasses.replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
            nxt = t + jnp.maximum(_window_of(policy, pstate), 1)
            if follow:  # the plan is a target (pstate.target) for the per-step rule: no move
                zl = jnp.zeros((L,), jnp.float32)
                return in_hbm, stats, pstate, zl, zl, z, nxt, 1, jnp.zeros_like(in_hbm)
            target = target & valid
            pro = target & ~in_hbm
            dem = in_hbm & ~target
            mig_h = b * (jnp.sum(pro, -1) + s.demote_cost * jnp.sum(dem, -1))
            kept = pro & imp.read_last_step(stats.last_read, t) & s.keep_fetched
            # a block promoted while this step reads it is read over the link once and written
            # to HBM: no separate link transfer, and its read is a host read
            now = pro & reads_buf[c] & ~kept
            mig_l = b * (jnp.sum(pro & ~now & ~kept, -1) + s.demote_cost * jnp.sum(dem, -1))
            moved = jnp.sum(pro) + jnp.sum(dem)
            return target, stats, pstate, mig_h, mig_l, moved.astype(jnp.float32), nxt, 1, now

        def skip(args):
            in_hbm, stats, pstate = args
            zl = jnp.zeros((L,), jnp.float32)
            return in_hbm, stats, pstate, zl, zl, z, st.next_plan, 0, jnp.zeros_like(in_hbm)

        in_hbm, stats, pstate, mig_h, mig_l, moved, nxt, planned, now = jax.lax.cond(
            t >= st.next_plan, plan, skip, (in_hbm, st.stats, st.pstate)
        )
        r = reads_buf[c]  # [L, N]
        if follow:
            # every step: promote the blocks this step reads from host that the admit rule
            # takes (the read carries them over the link: an HBM write each, and the read is a
            # host read), demoting unread blocks, lowest (in target, expected) first, only to
            # make room
            budget = policy.budget if policy.budget is not None else N
            room = s.capacity - jnp.sum(in_hbm, axis=-1)
            pro_i, n_p, dem_i, n_d = follow_moves(
                in_hbm, valid, r, pstate.target, pstate.priority, room, budget, **_admit(policy)
            )
            pro, dem = moves_mask(pro_i, n_p, N), moves_mask(dem_i, n_d, N)
            in_hbm = (in_hbm | pro) & ~dem
            now = now | pro
            n_dem = jnp.sum(dem, -1).astype(jnp.float32)
            mig_h = mig_h + b * (jnp.sum(pro, -1) + s.demote_cost * n_dem)
            mig_l = mig_l + b * s.demote_cost * n_dem
            moved = moved + jnp.sum(n_p) + jnp.sum(n_d)
        n_hbm = jnp.sum(r & in_hbm & ~now, axis=-1).astype(jnp.float32)
        n_all = jnp.sum(r, axis=-1).astype(jnp.float32)
        tail = s.token_bytes * ((s.prompt_len + t) % s.block_size + 1)
        lat = cost.layer_step_time(
            b * n_hbm + tail,
            b * (n_all - n_hbm),
            profile=s.profile,
            weight_bytes=s.weight_bytes,
            hbm_write_bytes=float(s.token_bytes),
            hbm_migration_bytes=mig_h,
            link_migration_bytes=mig_l,
        )
        stats = imp.update_stats(stats, r, mass[c], t, valid)
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
            policy,
        ), None

    return jax.lax.scan(body, state, jnp.arange(chunk, dtype=jnp.int32))[0]


@functools.partial(jax.jit, static_argnums=(0,))
def _bounds(setup: Setup, reads, t0):
    """Per-layer bounds of a chunk: reads [n, L, N] bool -> Unlimited and capacity sums over the
    steps, [L] float32 each."""
    s = setup
    t = t0 + jnp.arange(reads.shape[0])
    tail = s.token_bytes * ((s.prompt_len + t) % s.block_size + 1)  # [n]
    rb = s.block_bytes * jnp.sum(reads, -1).astype(jnp.float32) + tail[:, None]  # [n, L]
    kw = dict(profile=s.profile, weight_bytes=s.weight_bytes, hbm_write_bytes=float(s.token_bytes))
    unl = cost.unlimited_step_time(rb, **kw)
    cap = cost.capacity_bound_step_time(rb, s.capacity * s.block_bytes + tail[:, None], **kw)
    return jnp.sum(unl, 0), jnp.sum(cap, 0)


_pack = jax.jit(functools.partial(jnp.packbits, axis=-1))  # [n, L, N] bool -> [n, L, N / 8] u8


def make_policy(
    name: str,
    setup: Setup,
    *,
    anneal_config: AnnealConfig | None = None,
    window: int = 50,
    interval: int = 0,
    discount: float = 1.0,
    seed: int = 0,
    **extra,
):
    """Builds a policy by (possibly modified) name with the simulator's cost model.

    Names: POLICIES keys, `anneal` and `anneal-oracle` with modifiers
    (`jaxkv.policies.split_name`); `paper-sa[W,R]` fixes the paper heuristic's knobs.
    """
    if name.startswith("paper-sa[") and name.endswith("]"):
        w, r = name[len("paper-sa[") : -1].split(",")
        return POLICIES["paper-sa"](name=name, lookahead=int(w), fraction=float(r), window=1)
    base, mods = split_name(name)
    if base == "page":
        return get_policy("page", page_blocks=max(1, 16 // setup.block_size))
    if base in ("anneal", "anneal-oracle"):
        kw = dict(
            name=name,
            window=window,
            interval=interval,
            discount=discount,
            profile=setup.profile,
            block_bytes=setup.block_bytes,
            fixed_bytes=setup.fixed_bytes,
            demote_cost=setup.demote_cost,
            keep_fetched=setup.keep_fetched,
            **modifier_kwargs(mods),
            prompt_len=setup.prompt_len,
            block_size=setup.block_size,
            seed=seed,
        )
        if "aw" in mods:  # the seed's +-10 in [20, 100] around W = 50, scaled to this W
            kw.update(
                min_window=max(1, window // 2),
                max_window=2 * window,
                window_step=max(1, window // 5),
            )
        if anneal_config is not None:
            kw["config"] = anneal_config
        kw.update(extra)
        return POLICIES[base](**kw)
    return get_policy(base)


def _expand(names, grid):
    out = []
    for n in names:
        if n == "paper-sa":
            out += [
                f"paper-sa[{w},{r}]"
                for w in grid[0]
                for r in grid[1]
                if f"paper-sa[{w},{r}]" not in out
            ]
        elif n != "unlimited" and n not in out:
            out.append(n)
    return out


def _time_plan(policy, state: SimState, setup: Setup, reads_buf, t, repeats: int = 2) -> float:
    """Seconds of one compiled plan on the run's last observation (best of `repeats`)."""
    h = getattr(policy, "horizon", 1)
    valid = jnp.broadcast_to(
        jnp.arange(setup.num_blocks) < (setup.prompt_len + t) // setup.block_size,
        state.in_hbm.shape,
    )
    st = state.stats
    fc = reads_buf[:h].astype(jnp.float32) if getattr(policy, "needs_forecast", False) else None
    vg = None
    if getattr(policy, "needs_values", False):
        vg = jnp.zeros((h, *state.in_hbm.shape), jnp.float32)
    obs = Observation(
        in_hbm=state.in_hbm,
        valid=valid,
        last_read=st.last_read,
        read_ema=st.read_ema,
        mass_ema=st.mass_ema,
        step=jnp.int32(t),
        forecast=fc,
        window_reads=st.window_reads,
        forecast_mass=None if fc is None else jnp.zeros_like(fc),
        since_seen=st.since_seen,
        since_read=st.since_read,
        streak=st.streak,
        value_to_go=vg,
        capacity=setup.capacity,
    )
    fn = jax.jit(lambda p, o: policy.plan(p, o))
    jax.block_until_ready(fn(state.pstate, obs))
    best = math.inf
    for _ in range(repeats):
        t1 = time.perf_counter()
        jax.block_until_ready(fn(state.pstate, obs))
        best = min(best, time.perf_counter() - t1)
    return best


def _time_rule(policy, state: SimState, setup: Setup, reads_buf, t, repeats: int = 5) -> float:
    """Seconds of one compiled `follow_moves` over all layers (a `follow` policy's per-step
    rule) on the run's last state (best of `repeats`)."""
    valid = jnp.broadcast_to(
        jnp.arange(setup.num_blocks) < (setup.prompt_len + t) // setup.block_size,
        state.in_hbm.shape,
    )
    budget = policy.budget if policy.budget is not None else setup.num_blocks
    n = setup.num_blocks

    def rule(in_hbm, reads, target, priority):
        room = setup.capacity - jnp.sum(in_hbm, axis=-1)
        p, n_p, d, n_d = follow_moves(
            in_hbm, valid, reads, target, priority, room, budget, **_admit(policy)
        )
        return (in_hbm | moves_mask(p, n_p, n)) & ~moves_mask(d, n_d, n)

    fn = jax.jit(rule)
    args = (state.in_hbm, reads_buf[0], state.pstate.target, state.pstate.priority)
    jax.block_until_ready(fn(*args))
    best = math.inf
    for _ in range(repeats):
        t1 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t1)
    return best


# The numeric arguments `simulate` checks: name -> `jaxkv.config.check_number` bounds (None is
# allowed where the argument's default is None). `jaxkv simulate` checks its options by them.
ARG_BOUNDS: dict[str, dict] = {
    "sparsity": dict(low=0.0, high=1.0, high_open=True),
    "hbm_budget": dict(low=0.0, low_open=True),
    "capacity_blocks": dict(integer=True, low=0),
    "chunk": dict(integer=True, low=1),
    "demote_cost": dict(low=0.0),
    "window": dict(integer=True, low=1),
    "interval": dict(integer=True, low=1),
    "discount": dict(low=0.0, high=1.0, low_open=True),
    "now_window": dict(integer=True, low=1),
    "now_spread": dict(low=0.0),
    "oracle_window": dict(integer=True, low=1),
    "oracle_discount": dict(low=0.0, high=1.0, low_open=True),
    "oracle_tail": dict(integer=True, low=0),
    "dual_window": dict(integer=True, low=1),
    "follow_window": dict(integer=True, low=1),
    "ride": dict(low=0.0, high=1.0),
    "steps": dict(integer=True, low=1),
    "seed": dict(integer=True, low=0, high=2**32 - 1),  # a uint32: synthetic traces hash it
}


def check_args(values: dict, label=lambda name: name) -> None:
    """Checks the `simulate` arguments in `values` (name -> value; None passes) against
    ARG_BOUNDS; errors name each by `label(name)` (the CLI passes its option names)."""
    for name, bounds in ARG_BOUNDS.items():
        if values.get(name) is not None:
            check_number(label(name), values[name], **bounds)


def check_policies(names, label: str = "policies") -> None:
    """Checks a list of policy names (see the module docstring) before any work; ValueError
    names the bad one and what is expected."""
    if isinstance(names, str) or not names:
        raise ValueError(
            f"{label}={names!r}: expected a non-empty list of policy names, e.g. "
            "['static', 'lru', 'anneal', 'unlimited']"
        )
    for n in names:
        if not isinstance(n, str):
            raise ValueError(f"{label}: policy {n!r} is not a name (expected a str)")
        if n.startswith("paper-sa["):
            w, r, *rest = (n[len("paper-sa[") : -1] + ",,").split(",")
            try:
                ok = n.endswith("]") and not any(rest) and int(w) >= 1 and 0 < float(r) <= 1
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{label}: policy {n!r}: expected paper-sa[W,R], W an integer lookahead "
                    ">= 1 and R a fraction in (0, 1], e.g. paper-sa[10,0.5]"
                )
            continue
        try:
            split_name(n)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None


def check_memory(setup: Setup, chunk: int, horizon: int, num_policies: int) -> None:
    """Refuses a simulation whose arrays cannot fit in the device's memory (on CPU, the
    machine's RAM), before allocating them: per chunk the dense mass of chunk + horizon steps
    ([steps, layers, blocks] float32, with its masked and sorted copies and the reads), and per
    policy its state (about eight [layers, blocks] arrays of 4 bytes)."""
    cells = setup.num_layers * setup.num_blocks
    need = (chunk + horizon) * cells * (3 * 4 + 2) + num_policies * cells * 8 * 4
    have = available_memory()
    if have and need > have:
        dev = jax.devices()[0]
        where = "this machine has" if dev.platform == "cpu" else f"the {dev.device_kind} has"
        raise ValueError(
            f"the simulation needs at least {need / 1e9:,.1f} GB ({setup.num_layers} layers x "
            f"{setup.num_blocks:,} blocks, chunks of {chunk} + {horizon} steps, {num_policies} "
            f"polic{'y' if num_policies == 1 else 'ies'}) but {where} {have / 1e9:,.1f} GB: "
            "expected a shorter prompt, fewer layers, a larger block size or a smaller chunk"
        )


def available_memory() -> int:
    """Bytes of memory on the default device: its allocator's limit on a GPU, else the
    machine's physical memory (0 when unknown)."""
    stats = getattr(jax.devices()[0], "memory_stats", lambda: None)() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def simulate(
    trace,
    policies,
    *,
    profile: HardwareProfile,
    geometry: cost.Geometry,
    sparsity: float,
    hbm_budget: float = cost.PAPER_HBM_BUDGET,
    capacity_blocks: int | None = None,
    chunk: int = 100,
    demote_cost: float = 0.0,
    keep_fetched: bool = False,
    window: int = 10,
    interval: int = 1,
    discount: float = 0.8,
    now_window: int = NOW_WINDOW,
    now_spread: float = NOW_SPREAD,
    oracle_window: int = 3,
    oracle_discount: float = 0.4,
    oracle_tail: int = 30,
    dual_window: int = DUAL_WINDOW,
    follow_window: int = FOLLOW_WINDOW,
    follow_admit: str | None = None,
    ride: float | None = None,
    anneal_config: AnnealConfig | None = None,
    paper_sa_grid=PAPER_SA_GRID,
    steps: int | None = None,
    progress: bool = True,
    seed: int = 0,
    time_plans: bool = True,
    cache_bound_max_bytes: float = 1e9,
    policy_kwargs: dict[str, dict] | None = None,
) -> dict:
    """Runs every policy over the trace and returns the table.

    Args:
      trace: a FileTrace or SyntheticTrace (`jaxkv.sim.trace`).
      policies: names (see the module docstring).
      profile, geometry: cost model.
      sparsity: s in [0, 1).
      hbm_budget: HBM bytes in all; the KV pool gets (budget - params) / layers per layer.
      capacity_blocks: overrides the HBM pool blocks per layer.
      chunk: steps per compiled chunk.
      demote_cost: bytes per side of a demotion, as a fraction of a block (0: inclusive host).
      keep_fetched: a block read from host at the previous step is promoted for the HBM write
        alone (a decode loop that keeps fetched copies for the next plan; the paper's rule and
        jaxkv's decode loop re-read it: False).
      window, interval, discount: the anneal policies' lookahead W, steps between plans
        (receding horizon) and per-step discount.
      now_window: W of the `+now` policies (they know the step they plan for and price later
        steps as re-plans: 3 steps beat 10 by 0-1.5% at 512 steps, bench/RESULTS.md).
      now_spread: the `+now` policies' `jaxkv.policies.Anneal.spread` (the later steps priced
        at their expected time under the forecast's uncertainty; 0 = the max of the expected
        loads).
      oracle_window, oracle_discount: W and discount of anneal-oracle (with the true future a
        short lookahead wins: a plan is one placement for its whole lookahead, so its later
        steps charge the link with every block first read there, which the re-plan at that
        step can promote instead; weighting them 0.4, 0.16 keeps the plan from promoting now
        for them: bench/RESULTS.md, fifth session).
      oracle_tail: anneal-oracle's steps after its window whose reads give a resident block a
        terminal value, so a full pool evicts the blocks needed latest, and, where a step reads
        more blocks than the pool holds, give every block it reads the value of all its reads
        there (`jaxkv.policies.Anneal.tail`, `overflow_value`; 0 = off).
      dual_window: W of `anneal-oracle+dual` (its discount is oracle_discount).
      follow_window: W of the `+follow` policies: they plan a target every W steps (interval 0)
        over a W-step window and follow it at every step (`jaxkv.policies.follow_moves`).
      follow_admit: the `+follow` policies' admit rule (`jaxkv.policies.follow_moves`:
        "read", "ranked" or "target"); None = the policy's default (`Anneal.follow_admit`).
      ride: the anneal policies' receding-horizon pricing (`jaxkv.policies.Anneal.ride`); None
        = each policy's default (0 for `anneal`, 1 for `+now` / `+follow`), 0.0 a real value.
      anneal_config: schedule of the anneal policies.
      paper_sa_grid: (lookaheads, fractions) searched for paper-sa.
      steps: simulate the first `steps` steps only.
      progress: tqdm bar over chunks.
      seed: anneal seed.
      time_plans: measure one compiled plan per policy (plan_seconds; 0 when False).
      cache_bound_max_bytes: the cache bound keeps every step's reads bit-packed (steps x
        layers x N / 8 bytes); above this it is skipped (cache_s and best_s None).
      policy_kwargs: {name: {field: value}}, fields of an anneal policy's dataclass
        (`jaxkv.policies.Anneal`, e.g. budget, error_threshold, min_window) set for that name
        after everything above (a sweep over one policy's knobs); only for anneal names.
    Returns:
      {"policies": {name: {latency_s, tokens_per_s, speedup_vs_static, vs_unlimited,
        hbm_hit_rate, migrated_bytes, plan_seconds, ...}}, "bounds": {...}, "setup": {...}}.
      Bounds (lower bounds on every policy's latency_s, seconds summed over layers):
      unlimited_s (`cost.unlimited_step_time`), capacity_s (`cost.capacity_bound_step_time`),
      cache_s (Unlimited or the fewest link crossings x block bytes / B_link, whichever is
      larger, per layer: `jaxkv.sim.bounds`), best_s (the same with the capacity bound in place of
      Unlimited, >= both), cache_crossings (the fewest crossings, per layer), cache_note (why
      cache_s is None, else absent) and cache_wall_s (seconds spent on the cache bound: packing
      the reads and Belady).
    Raises:
      ValueError, before any work: an argument outside ARG_BOUNDS, a bad policy name
      (`check_policies`), or arrays that cannot fit in the device's memory (`check_memory`).
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    check_args(
        dict(
            sparsity=sparsity,
            hbm_budget=hbm_budget,
            capacity_blocks=capacity_blocks,
            chunk=chunk,
            demote_cost=demote_cost,
            window=window,
            interval=interval,
            discount=discount,
            now_window=now_window,
            now_spread=now_spread,
            oracle_window=oracle_window,
            oracle_discount=oracle_discount,
            oracle_tail=oracle_tail,
            dual_window=dual_window,
            follow_window=follow_window,
            ride=ride,
            steps=steps,
            seed=seed,
        )
    )
    check_policies(policies)
    for n, kw in (policy_kwargs or {}).items():
        fields = {f.name for f in dataclasses.fields(POLICIES["anneal"])}
        if n not in policies or not n.startswith("anneal"):
            raise ValueError(
                f"policy_kwargs[{n!r}]: expected one of the anneal policies run here "
                f"{[p for p in policies if p.startswith('anneal')]}"
            )
        bad = sorted(set(kw) - fields)
        if bad:
            raise ValueError(f"policy_kwargs[{n!r}]: {bad} are not fields of Anneal")
    if follow_admit is not None:
        from jaxkv.policies import FOLLOW_ADMITS  # at call time: older policies lack it

        if follow_admit not in FOLLOW_ADMITS:
            raise ValueError(f"follow_admit must be one of {FOLLOW_ADMITS}, got {follow_admit!r}")
    geometry, capacity_blocks = cost.pool_capacity(
        geometry, hbm_budget, trace.num_layers, trace.block_size, capacity_blocks
    )
    setup = Setup(
        trace.prompt_len,
        trace.block_size,
        trace.num_layers,
        trace.num_blocks,
        int(min(capacity_blocks, trace.num_blocks)),
        geometry.token_bytes,
        float(geometry.weight_bytes),
        profile,
        float(demote_cost),
        bool(keep_fetched),
    )
    names = _expand(policies, paper_sa_grid)
    pols = {}
    for n in names:
        oracle = n.startswith("anneal-oracle")
        dual = oracle and "+dual" in n
        follow = n.startswith("anneal") and "follow" in split_name(n)[1]
        kw = dict(
            anneal_config=anneal_config,
            window=(
                dual_window
                if dual
                else oracle_window
                if oracle
                else now_window
                if "+now" in n
                else follow_window
                if follow
                else window
            ),
            interval=0 if follow else interval,
            discount=oracle_discount if oracle else discount,
            seed=seed,
            **(dict(tail=oracle_tail) if oracle and oracle_tail else {}),
            **({} if ride is None else dict(ride=float(ride))),
            **(dict(spread=now_spread) if "+now" in n else {}),
            **(dict(follow_admit=follow_admit) if follow and follow_admit is not None else {}),
        )
        pols[n] = make_policy(n, setup, **{**kw, **(policy_kwargs or {}).get(n, {})})
    n_steps = min(steps or trace.steps, trace.steps)
    horizon = max([getattr(p, "horizon", 1) for p in pols.values()] + [1])
    check_memory(setup, min(chunk, n_steps), horizon, len(pols))
    states = {n: init_state(p, setup) for n, p in pols.items()}
    acc = {n: dict(latency=0.0, hbm=0.0, reads=0.0, migrated=0.0, plans=0, wall=0.0) for n in names}
    L = setup.num_layers
    unl_l, cap_l = np.zeros(L), np.zeros(L)
    pack_bytes = bnd.PackedReads.nbytes(n_steps, L, setup.num_blocks)
    packed = None
    if pack_bytes <= cache_bound_max_bytes:
        packed = bnd.PackedReads(n_steps, L, setup.num_blocks)
    bound_wall = 0.0
    values, dual_wall = None, 0.0
    if any(getattr(p, "needs_values", False) for p in pols.values()):
        from jaxkv.sim import lp_bound  # imports this module

        w0 = time.perf_counter()
        values = lp_bound.trace_dual_values(
            trace,
            sparsity,
            geometry=geometry,
            profile=profile,
            capacity_blocks=setup.capacity,
            steps=n_steps,
            demote_cost=demote_cost,
            keep_fetched=keep_fetched,
            progress=progress,
        )
        dual_wall = time.perf_counter() - w0
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
        u, cb = _bounds(setup, reads[:c], jnp.int32(t0))
        unl_l += np.asarray(u, np.float64)
        cap_l += np.asarray(cb, np.float64)
        if packed is not None:
            w0 = time.perf_counter()
            packed.put(t0, _pack(reads[:c]))
            bound_wall += time.perf_counter() - w0
        for n in names:
            w0 = time.perf_counter()
            vals = None
            if getattr(pols[n], "needs_values", False):
                vals = np.zeros((c + horizon, *values.shape[1:]), np.float32)
                got = values[t0 : t0 + c + horizon]
                vals[: got.shape[0]] = got
                vals = jnp.asarray(vals)
            st = run_chunk(setup, c, states[n], reads, mass, jnp.int32(t0), vals)
            a = acc[n]
            a["latency"] += float(st.latency)
            a["hbm"] += float(st.hbm_reads)
            a["reads"] += float(st.reads)
            a["migrated"] += float(st.migrated)
            a["plans"] += int(st.plans)
            a["wall"] += time.perf_counter() - w0
            states[n] = st
    unl, capb = float(unl_l.sum()), float(cap_l.sum())
    bounds = {"unlimited_s": unl, "capacity_s": capb, "cache_s": None, "best_s": None}
    w0 = time.perf_counter()
    if packed is None:
        bounds["cache_note"] = (
            f"skipped: the packed reads would take {pack_bytes / 1e9:.2f} GB "
            f"> {cache_bound_max_bytes / 1e9:.2f} GB"
        )
    else:
        f = bnd.min_link_crossings(
            packed,
            bnd.initial_hbm(setup.prompt_len, setup.block_size, setup.num_blocks, setup.capacity),
            bnd.new_blocks(setup.prompt_len, setup.block_size, n_steps, setup.num_blocks),
            setup.capacity,
        )
        del packed
        bl = (setup.block_bytes, profile.link_bandwidth)
        bounds["cache_s"] = float(bnd.cache_bound_seconds(f, unl_l, *bl).sum())
        bounds["best_s"] = float(bnd.cache_bound_seconds(f, np.maximum(cap_l, unl_l), *bl).sum())
        bounds["cache_crossings"] = [int(x) for x in f]
    bounds["cache_wall_s"] = bound_wall + time.perf_counter() - w0
    out = {}
    for n in names:
        a = acc[n]
        per_plan = 0.0
        if time_plans and a["plans"]:
            per_plan = _time_plan(pols[n], states[n], setup, reads, n_steps - 1)
        out[n] = dict(
            latency_s=a["latency"],
            hbm_hit_rate=a["hbm"] / max(a["reads"], 1.0),
            migrated_bytes=a["migrated"] * setup.block_bytes,
            plans=a["plans"],
            plan_seconds=per_plan * a["plans"],
            sim_seconds=a["wall"],
        )
        if getattr(pols[n], "follow", False):
            # the per-step rule, not charged in vs_unlimited_with_plan: it runs on the layer's
            # critical path in the decode loop, here timed once per step for all layers
            per_rule = (
                _time_rule(pols[n], states[n], setup, reads, n_steps - 1) if time_plans else 0.0
            )
            out[n]["rule_seconds"] = per_rule * n_steps
            out[n]["follow_admit"] = _admit(pols[n]).get("admit")
        if hasattr(pols[n], "ride"):
            out[n]["ride"] = float(pols[n].ride)
        if getattr(pols[n], "needs_values", False):
            out[n]["dual_seconds"] = dual_wall  # the LP dual over the whole run, before it
    sa = [n for n in names if n.startswith("paper-sa[") and n not in policies]
    if sa:
        best = min(sa, key=lambda n: out[n]["latency_s"])
        out["paper-sa"] = dict(out[best], tuned=best)
        for n in sa:
            out.pop(n)
    if "unlimited" in policies:
        out["unlimited"] = dict(
            latency_s=unl,
            hbm_hit_rate=profile.alpha_star,
            migrated_bytes=0.0,
            plans=0,
            plan_seconds=0.0,
            sim_seconds=0.0,
        )
    static = out.get("static", {}).get("latency_s")
    for v in out.values():
        v["tokens_per_s"] = n_steps / v["latency_s"]
        v["speedup_vs_static"] = static / v["latency_s"] if static else None
        v["vs_unlimited"] = v["latency_s"] / unl
        v["vs_unlimited_with_plan"] = (v["latency_s"] + v["plan_seconds"]) / unl
    order = [p for p in policies if p in out]
    return {
        "policies": {p: out[p] for p in order},
        "bounds": bounds,
        "setup": {
            "trace": trace.name,
            "steps": n_steps,
            "prompt_len": trace.prompt_len,
            "block_size": trace.block_size,
            "layers": trace.num_layers,
            "blocks": trace.num_blocks,
            "capacity_blocks": setup.capacity,
            "sparsity": sparsity,
            "profile": profile.name,
            "geometry": geometry.name,
            "demote_cost": demote_cost,
            "keep_fetched": keep_fetched,
            "device": jax.devices()[0].device_kind,
            "jax": jax.__version__,
        },
    }


__all__ = [
    "simulate",
    "read_mask",
    "run_chunk",
    "make_policy",
    "Setup",
    "SimState",
]

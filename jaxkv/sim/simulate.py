"""Trace-driven simulator: the policies of `jaxkv.placement.presets` judged by `jaxkv.cost`'s model.

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

Policy names: the presets of `jaxkv.placement.presets` (a base with modifiers), built by
`make_policy` in the simulator's cost model (a policy object, e.g. a composed `Anneal`, runs as it
is: `simulate`'s `policies`). `anneal` / `anneal-oracle` take `+aw` (adaptive window,
`jaxkv.placement.pricing.AdaptiveWindow`) and `+ec` (forecast-error compensation, `Compensate`),
e.g. `anneal+aw+ec`; `anneal` also takes `+reuse` (the re-read law learned online as its forecast,
`jaxkv.placement.forecasts.Reuse`, with the reads it cannot place charged to the link:
`jaxkv.placement.pricing.Unforeseen`), `+now` (the plan sees the read set of the step it plans for,
Page's one-step lookahead: `jaxkv.placement.forecasts.Now`, priced with `Ride` 1 and its later steps
at their expected time, `jaxkv.placement.pricing.Spread` k = `now_spread`) or `+follow`
(`jaxkv.placement.policies.Follow`, what the decode loop runs in place of `+now`, whose annealer
would sit on each layer's critical path: every `follow_window` steps the annealer plans a target for
all layers between steps and nothing moves then; at every step the vector rule
`jaxkv.placement.policies.follow_moves` promotes, per layer, host blocks the step reads (its admit
rule, `follow_admit`: "read" every one; "ranked"
one that outranks its victim, `Follow`'s default and so the decode loop's; "target" only those
the target marks for HBM), each charged one block of HBM write and no link transfer, the read
that carries it being a host read, and demotes, only to make room beyond the free slots,
resident blocks the step does not read, ranked by (in the target, expected reads) lowest first,
each charged `demote_cost` x block bytes on each side; priced like `+now`'s later steps, `Ride` 1
and `Spread` `NOW_SPREAD`; `rule_seconds` is the rule's measured time over the run, not charged
in `vs_unlimited_with_plan`); `anneal-oracle` takes `+visits` (a diagnostic: the oracle told
only how long each visit in progress lasts, not when one starts, `jaxkv.sim.oracles.Visits`: how
much of the online planners' gap no forecast of visit lengths can close) and `+dual` (the value
of a block after the oracle's window from the LP relaxation's dual prices over the whole run,
`jaxkv.sim.lp.dual.trace_dual_values`, in place of Belady's next read: `jaxkv.sim.oracles.Dual`;
solved once before the run). `paper-sa` runs every (lookahead, fraction) pair of `PAPER_SA_GRID`
and reports the best (the oracle tuning of its two knobs). `unlimited` is the bound of
`jaxkv.cost.unlimited_step_time`.

Lower bounds (result["bounds"]): Unlimited; the capacity bound (`cost.capacity_bound_step_time`,
free re-placement before every step); and the cache bound (`jaxkv.sim.bounds`): a block not in HBM
must cross the link before HBM can serve it, Belady's rule with bypass gives the fewest crossings
F_l any placement needs per layer, and a layer's latency is at least max(Unlimited, F_l x block
bytes / B_link) (best_s: the capacity bound in place of Unlimited). On traces whose read set
churns this crossing traffic, not the capacity, is what limits every policy.

Planning is not part of `latency_s` (the model's decode time); `plan_seconds` is the compiled
plan time measured on the present device times the number of plans, and
`vs_unlimited_with_plan` charges it serially (planning on the critical path, no overlap).

`simulate` runs its steps in order: the argument checks (`jaxkv.sim.checks`, and `check_memory`
here), the geometry, batch and HBM pool (`jaxkv.sim.sizing`), the policies (`make_policy`), the
LP dual's pre-pass for the policies that need its values (`_dual_pass`), the chunked replay with
the per-chunk Unlimited and capacity bounds (`jaxkv.sim.replay`), the cache bound
(`_cache_bound`), the plan timing (`jaxkv.sim.timing`) and the result table (`_table`). The
command line (`jaxkv simulate`) is in `jaxkv.sim.cli`.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from jaxkv import cost
from jaxkv.cache.quant import FP8_MODES, fp8_block_bytes
from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.placement import presets
from jaxkv.placement.policies import Anneal
from jaxkv.placement.presets import NOW_SPREAD, NOW_WINDOW
from jaxkv.placement.pricing import Ride
from jaxkv.sim import bounds as bnd
from jaxkv.sim import sizing
from jaxkv.sim.checks import (
    ARG_BOUNDS,
    check_args,
    check_follow_admit,
    check_policies,
    check_policy_kwargs,
)
from jaxkv.sim.replay import Replay, Setup, SimState, init_state, replay, run_chunk
from jaxkv.sim.timing import plan_timing
from jaxkv.sim.trace import read_mask

PAPER_SA_GRID = ((2, 10, 50), (0.5, 1.0))  # lookahead W values, fraction R values
DUAL_WINDOW = 2  # W of `anneal-oracle+dual` (measured against 1 and 3: bench/RESULTS.md)
# W of the `+follow` policies: the steps between their plans and their lookahead (measured
# against 8 and 16, with and without the plan time charged: bench/notebook/2026-12-01-follow.md)
FOLLOW_WINDOW = 4
# the simulate() arguments that are `jaxkv.placement.presets.Settings` fields of the same name
_SETTINGS = (
    "window",
    "interval",
    "discount",
    "now_window",
    "now_spread",
    "follow_window",
    "oracle_window",
    "oracle_discount",
    "oracle_tail",
    "dual_window",
    "ride",
    "seed",
)


def make_policy(name: str, setup: Setup, settings=None, *, anneal_config=None, **overrides):
    """The policy `name` (`jaxkv.placement.presets`) for the simulator's cost model (`Setup.env`),
    under `settings` (`jaxkv.placement.presets.Settings`; default Settings()) with knob `overrides`
    (`jaxkv.placement.presets.KNOBS`; `anneal_config` is the `config` knob)."""
    if anneal_config is not None:
        overrides["config"] = anneal_config
    return presets.resolve(name, setup.env, settings or presets.Settings(), **overrides)


def _expand(entries: dict, grid) -> dict:
    """The policies to replay, {label: name or policy}: `paper-sa` as every pair of `grid`,
    without `unlimited`."""
    out = {}
    for label, spec in entries.items():
        if spec == "paper-sa":
            for w in grid[0]:
                for r in grid[1]:
                    out.setdefault(f"paper-sa[{w},{r}]", f"paper-sa[{w},{r}]")
        elif spec != "unlimited" and label not in out:
            out[label] = spec
    return out


def _ride(policy) -> float | None:
    """The Ride share of an anneal policy (0 without the term); None for other policies."""
    terms = getattr(policy, "terms", None)
    if terms is None:
        return None
    return next((t.share for t in terms if isinstance(t, Ride)), 0.0)


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
    sparsity: float,
    geometry: cost.Geometry | str | None = None,
    batch: int = 1,
    hbm_budget: float = cost.PAPER_HBM_BUDGET,
    capacity_blocks: int | None = None,
    hbm_fraction: float | None = None,
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
    fp8: str = "off",
) -> dict:
    """Runs every policy over the trace and returns the table.

    Args:
      trace: a FileTrace or SyntheticTrace (`jaxkv.sim.trace`).
      policies: a list of preset names (see the module docstring) and policy objects
        (`jaxkv.placement.policies.Policy`, e.g. a composed `policies.Anneal`, reported under its
        `name`), or a dict {label: name or policy}, e.g. {"w8": "anneal", "w16": "anneal"}
        with policy_kwargs per label: two variants of one preset in one run. A policy
        object is run as it is: the settings below (window, ...) shape the named presets only.
      profile: the tiers' bandwidths.
      sparsity: s in [0, 1).
      geometry: the model the trace is costed as (`jaxkv.sim.sizing.resolve_geometry`): None
        (default) the trace's own when it carries one (a recorded version-2 file), else the
        paper's; "trace" the trace's own; a preset name or a `jaxkv.cost.Geometry`. A geometry
        of other depth than the trace is costed with the trace's layers.
      batch: B sequences decoding together, each reading the trace's blocks (a modeled batch of
        identical sequences, placed alike): per step the KV bytes (HBM and link reads, writes,
        migrations) scale by B, the weights are read once (`jaxkv.cost.batched`); the budget
        holds B pools (capacity_blocks and hbm_fraction are per sequence); tokens_per_s counts
        the batch's tokens. batch=1 is the unbatched simulator, figure for figure.
      hbm_budget: HBM bytes in all; the KV pool gets (budget - params) / layers per layer.
      capacity_blocks: overrides the HBM pool blocks per layer.
      hbm_fraction: the pool holds this fraction of the trace's blocks per layer (in (0, 1],
        at least one block); not with capacity_blocks (`jaxkv.sim.sizing.pool_blocks`).
      chunk: steps per compiled chunk.
      demote_cost: bytes per side of a demotion, as a fraction of a block (0: inclusive host).
      keep_fetched: a block read from host at the previous step is promoted for the HBM write
        alone (a decode loop that keeps fetched copies for the next plan; the paper's rule and
        jaxkv's decode loop re-read it: False).
      window, interval, discount: the anneal policies' lookahead W, steps between plans
        (receding horizon) and per-step discount.
      now_window: W of the `+now` policies (they know the step they plan for and price later
        steps as re-plans, so a short lookahead; default `NOW_WINDOW`, measured:
        bench/RESULTS.md).
      now_spread: the `+now` policies' `jaxkv.placement.pricing.Spread` k (the later steps priced at
        their expected time under the forecast's uncertainty; 0 = the max of the expected
        loads).
      oracle_window, oracle_discount: W and discount of anneal-oracle (with the true future a
        short lookahead wins: a plan is one placement for its whole lookahead, so its later
        steps charge the link with every block first read there, which the re-plan at that
        step can promote instead; weighting them 0.4, 0.16 keeps the plan from promoting now
        for them; measured: bench/RESULTS.md).
      oracle_tail: anneal-oracle's steps after its window whose reads give a resident block a
        terminal value, so a full pool evicts the blocks needed latest, and, where a step reads
        more blocks than the pool holds, give every block it reads the value of all its reads
        there (`jaxkv.sim.oracles.BeladyTail`, `Overflow`; 0 = off).
      dual_window: W of `anneal-oracle+dual` (its discount is oracle_discount).
      follow_window: W of the `+follow` policies: they plan a target every W steps (interval 0)
        over a W-step window and follow it at every step (`jaxkv.placement.policies.follow_moves`).
      follow_admit: the `+follow` policies' admit rule (`jaxkv.placement.policies.follow_moves`:
        "read", "ranked" or "target"); None = `jaxkv.placement.policies.Follow`'s default
        ("ranked").
      ride: the anneal policies' receding-horizon pricing (`jaxkv.placement.pricing.Ride` share);
        None = each preset's own (0 for `anneal`, 1 for `+now` / `+follow`), 0.0 a real value.
      anneal_config: schedule of the anneal policies.
      paper_sa_grid: (lookaheads, fractions) searched for paper-sa.
      steps: simulate the first `steps` steps only.
      progress: tqdm bar over chunks.
      seed: anneal seed.
      time_plans: measure one compiled plan per policy (plan_seconds; 0 when False).
      cache_bound_max_bytes: the cache bound keeps every step's reads bit-packed (steps x
        layers x N / 8 bytes); above this it is skipped (cache_s and best_s None).
      policy_kwargs: {label: {knob: value}}, knobs of an anneal preset
        (`jaxkv.placement.presets.KNOBS`, e.g. budget, error_threshold, min_window) set for that
        label after everything above (a sweep over one policy's knobs); only for labels of
        anneal preset names.
    Returns:
      {"policies": {name: {latency_s, tokens_per_s, speedup_vs_static, vs_unlimited,
        hbm_hit_rate, migrated_bytes, plan_seconds, ...}}, "bounds": {...}, "setup": {...,
        geometry, geometry_source ("trace", "given" or "default": `jaxkv.sim.sizing`), batch,
        capacity_blocks, pool_from ("capacity_blocks", "hbm_fraction" or "hbm_budget")}}.
      Bounds (lower bounds on every policy's latency_s, seconds summed over layers):
      unlimited_s (`cost.unlimited_step_time`), capacity_s (`cost.capacity_bound_step_time`),
      cache_s (Unlimited or the fewest link crossings x block bytes / B_link, whichever is
      larger, per layer: `jaxkv.sim.bounds`), best_s (the same with the capacity bound in place of
      Unlimited, >= both), cache_crossings (the fewest crossings, per layer), cache_note (why
      cache_s is None, else absent) and cache_wall_s (seconds spent on the cache bound: packing
      the reads and Belady).
    Raises:
      ValueError, before any work: an argument outside ARG_BOUNDS, a bad policy name
      (`check_policies`; TypeError for an object that is not a policy), or arrays that cannot
      fit in the device's memory (`check_memory`).
    """
    numbers = dict(
        sparsity=sparsity,
        batch=batch,
        hbm_budget=hbm_budget,
        capacity_blocks=capacity_blocks,
        hbm_fraction=hbm_fraction,
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
    entries = _check_arguments(numbers, policies, policy_kwargs, follow_admit)
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8={fp8!r}: expected one of {FP8_MODES}")
    geometry, source = sizing.resolve_geometry(trace, geometry)
    pool = dict(hbm_budget=hbm_budget, capacity_blocks=capacity_blocks, hbm_fraction=hbm_fraction)
    geometry, setup, sized_by = _setup(
        trace, profile, cost.batched(geometry, batch), pool, demote_cost, keep_fetched, fp8
    )
    settings = presets.Settings(
        **{k: numbers[k] for k in _SETTINGS}, follow_admit=follow_admit, config=anneal_config
    )
    pols = _policies(_expand(entries, paper_sa_grid), setup, settings, policy_kwargs)
    n_steps = min(steps or trace.steps, trace.steps)
    horizon = max([p.horizon for p in pols.values()] + [1])
    check_memory(setup, min(chunk, n_steps), horizon, len(pols))
    states = {n: init_state(p, setup) for n, p in pols.items()}
    packed, cache_note = _packed_reads(setup, n_steps, cache_bound_max_bytes)
    values, dual_wall = None, 0.0
    if any(p.needs_values for p in pols.values()):
        rules = dict(demote_cost=demote_cost, keep_fetched=keep_fetched)
        values, dual_wall = _dual_pass(trace, sparsity, setup, geometry, n_steps, rules, progress)
    rep = replay(
        trace,
        setup,
        pols,
        states,
        sparsity=sparsity,
        n_steps=n_steps,
        chunk=chunk,
        horizon=horizon,
        values=values,
        packed=packed,
        progress=progress,
    )
    bounds = _cache_bound(setup, packed, cache_note, n_steps, rep)
    del packed
    plans = {n: a["plans"] for n, a in rep.acc.items()}
    timings = plan_timing(pols, rep.states, setup, rep.reads, n_steps, plans, time_plans)
    rows = _rows(pols, rep, setup, timings, dual_wall, n_steps)
    meta = _setup_row(trace, setup, n_steps, sparsity, geometry, demote_cost, keep_fetched)
    meta.update(geometry_source=source, pool_from=sized_by, hbm_budget=hbm_budget)
    return _table(rows, list(entries), bounds, n_steps * batch, setup.link_profile, meta)


def _check_arguments(numbers: dict, policies, policy_kwargs, follow_admit) -> dict:
    """simulate()'s checks before any work: the numbers (`numbers`, name -> value, by
    ARG_BOUNDS), the policies, the per-policy knobs and the follow admit rule. Returns the
    policies as {label: name or policy} (`check_policies`)."""
    sparsity = numbers["sparsity"]
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    check_args(numbers)
    entries = check_policies(policies)
    check_policy_kwargs(policy_kwargs, entries)
    check_follow_admit(follow_admit)
    return entries


def _setup(trace, profile, geometry, pool: dict, demote_cost, keep_fetched, fp8="off"):
    """(geometry, Setup, the option that sized the pool): the HBM pool per layer from `pool`
    (hbm_budget, capacity_blocks, hbm_fraction: `jaxkv.sim.sizing.pool_blocks`, the geometry it
    sizes), at most the trace's blocks; the bytes of the geometry's batch (`Geometry.batch`);
    under fp8="host" host blocks move at `jaxkv.cache.quant.fp8_block_bytes`, under fp8="age" every
    placed block is priced so in both tiers (modeled: the decode loop's full-precision ring of
    recent blocks, `fp8_age`, is not simulated; its blocks are priced as FP8 too)."""
    geometry, capacity_blocks, sized_by = sizing.pool_blocks(trace, geometry, **pool)
    host_bytes = hbm_bytes = None
    if fp8 in ("host", "age"):
        fp8_bytes = fp8_block_bytes(trace.block_size, geometry.kv_heads, geometry.head_dim)
        host_bytes = float(fp8_bytes * geometry.batch)
    if fp8 == "age":
        hbm_bytes = host_bytes
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
        host_bytes,
        hbm_bytes,
    )
    return geometry, setup, sized_by


def _policies(entries: dict, setup: Setup, settings, policy_kwargs) -> dict:
    """{label: policy}: a name resolved under `settings` with its label's `policy_kwargs`
    knobs (an anneal preset under another label takes the label as its name), a policy object
    as it is."""
    kw = policy_kwargs or {}
    out = {}
    for label, spec in entries.items():
        if not isinstance(spec, str):
            out[label] = spec
            continue
        policy = make_policy(spec, setup, settings, **kw.get(label, {}))
        if label != spec and isinstance(policy, Anneal):
            policy = dataclasses.replace(policy, name=label)
        out[label] = policy
    return out


def _packed_reads(setup: Setup, n_steps: int, max_bytes: float):
    """(PackedReads, None) for the cache bound, or (None, why) when it would exceed max_bytes."""
    pack_bytes = bnd.PackedReads.nbytes(n_steps, setup.num_layers, setup.num_blocks)
    if pack_bytes <= max_bytes:
        return bnd.PackedReads(n_steps, setup.num_layers, setup.num_blocks), None
    note = (
        f"skipped: the packed reads would take {pack_bytes / 1e9:.2f} GB > {max_bytes / 1e9:.2f} GB"
    )
    return None, note


def _dual_pass(trace, sparsity, setup: Setup, geometry, n_steps, rules: dict, progress):
    """(values [steps, L, N] float32 seconds, wall seconds): the LP dual's value-to-go over the
    whole run (`jaxkv.sim.lp.dual.trace_dual_values`), for the policies with `needs_values`;
    `rules` the simulator's demote_cost and keep_fetched."""
    from jaxkv.sim import lp as lp_bound

    w0 = time.perf_counter()
    values = lp_bound.trace_dual_values(
        trace,
        sparsity,
        geometry=geometry,
        profile=setup.link_profile,
        capacity_blocks=setup.capacity,
        steps=n_steps,
        **rules,
        progress=progress,
    )
    return values, time.perf_counter() - w0


def _cache_bound(setup: Setup, packed, note, n_steps: int, rep: Replay) -> dict:
    """result["bounds"]: the Unlimited and capacity sums of the replay and the cache bound from
    the packed reads (Belady's fewest link crossings, `jaxkv.sim.bounds`), or `note` why not."""
    unl_l, cap_l = rep.unlimited, rep.capacity_bound
    unl, capb = float(unl_l.sum()), float(cap_l.sum())
    bounds = {"unlimited_s": unl, "capacity_s": capb, "cache_s": None, "best_s": None}
    w0 = time.perf_counter()
    if packed is None:
        bounds["cache_note"] = note
    else:
        s = setup
        f = bnd.min_link_crossings(
            packed,
            bnd.initial_hbm(s.prompt_len, s.block_size, s.num_blocks, s.capacity),
            bnd.new_blocks(s.prompt_len, s.block_size, n_steps, s.num_blocks),
            s.capacity,
        )
        bl = (s.block_bytes, s.link_profile.link_bandwidth)
        bounds["cache_s"] = float(bnd.cache_bound_seconds(f, unl_l, *bl).sum())
        bounds["best_s"] = float(bnd.cache_bound_seconds(f, np.maximum(cap_l, unl_l), *bl).sum())
        bounds["cache_crossings"] = [int(x) for x in f]
    bounds["cache_wall_s"] = rep.pack_wall + time.perf_counter() - w0
    return bounds


def _rows(pols: dict, rep: Replay, setup: Setup, timings: dict, dual_wall, n_steps) -> dict:
    """{name: row} of every replayed policy: its sums, plan and rule times and settings."""
    out = {}
    for n, p in pols.items():
        a = rep.acc[n]
        per_plan, per_rule = timings[n]
        out[n] = dict(
            latency_s=a["latency"],
            hbm_hit_rate=a["hbm"] / max(a["reads"], 1.0),
            migrated_bytes=a["migrated"] * setup.block_bytes,
            plans=a["plans"],
            plan_seconds=per_plan * a["plans"],
            sim_seconds=a["wall"],
        )
        if p.rule is not None:
            # the in-step rule, not charged in vs_unlimited_with_plan: it runs on the layer's
            # critical path in the decode loop, here timed once per step for all layers
            out[n]["rule_seconds"] = per_rule * n_steps
            if hasattr(p.rule, "admit"):  # a Follow rule
                out[n]["follow_admit"] = p.rule.admit
        if _ride(p) is not None:
            out[n]["ride"] = float(_ride(p))
        if p.needs_values:
            out[n]["dual_seconds"] = dual_wall  # the LP dual over the whole run, before it
    return out


def _table(out: dict, policies, bounds: dict, tokens: int, profile, meta: dict) -> dict:
    """simulate()'s result: the rows in `policies`' order (paper-sa as its best pair, the
    Unlimited bound as a row), each with its ratios (tokens_per_s: `tokens`, the run's steps x
    its batch, over the latency), then the bounds and the setup."""
    sa = [n for n in out if n.startswith("paper-sa[") and n not in policies]
    if sa:
        best = min(sa, key=lambda n: out[n]["latency_s"])
        out["paper-sa"] = dict(out[best], tuned=best)
        for n in sa:
            out.pop(n)
    unl = bounds["unlimited_s"]
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
        v["tokens_per_s"] = tokens / v["latency_s"]
        v["speedup_vs_static"] = static / v["latency_s"] if static else None
        v["vs_unlimited"] = v["latency_s"] / unl
        v["vs_unlimited_with_plan"] = (v["latency_s"] + v["plan_seconds"]) / unl
    order = [p for p in policies if p in out]
    return {"policies": {p: out[p] for p in order}, "bounds": bounds, "setup": meta}


def _setup_row(trace, setup: Setup, n_steps, sparsity, geometry, demote_cost, keep_fetched):
    """result["setup"]: the trace, the pool, the cost model and the device (block_bytes the
    batch's, token_bytes one sequence's; `simulate` adds geometry_source, pool_from and
    hbm_budget)."""
    return {
        "trace": trace.name,
        "steps": n_steps,
        "prompt_len": trace.prompt_len,
        "block_size": trace.block_size,
        "layers": trace.num_layers,
        "blocks": trace.num_blocks,
        "capacity_blocks": setup.capacity,
        "sparsity": sparsity,
        "profile": setup.profile.name,
        "host_block_bytes": setup.link_block_bytes,
        "block_bytes": setup.block_bytes,
        "geometry": geometry.name,
        "batch": geometry.batch,
        "token_bytes": geometry.token_bytes // geometry.batch,
        "param_bytes": geometry.param_bytes,
        "demote_cost": demote_cost,
        "keep_fetched": keep_fetched,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
    }


__all__ = [
    "ARG_BOUNDS",
    "DUAL_WINDOW",
    "FOLLOW_WINDOW",
    "NOW_SPREAD",
    "NOW_WINDOW",
    "PAPER_SA_GRID",
    "Setup",
    "SimState",
    "available_memory",
    "check_args",
    "check_memory",
    "check_policies",
    "init_state",
    "make_policy",
    "read_mask",
    "run_chunk",
    "simulate",
]

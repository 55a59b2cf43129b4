"""The simulator in the decode loop's own accounting: a decode's reads, replayed on placement
masks with the loop's cache, rules and costs.

The trace simulator (`jaxkv.sim.replay`) models the paper's system: a plan at the start of a
step, charged to that step, whose promotions of blocks the step reads ride on the read; a
partial tail block; planning priced with its own `Setup.env`. The decode loop
(`jaxkv.Decoder`) differs in when and what it charges: it plans at the end of a step,
after the step's reads, the in-step rule's moves, the sealing of a full tail and the
statistics' update, and charges that plan's migration (read over the link, never riding) to
that step; the tail is read as a whole block; an in-step rule runs with the loop's migration
budget. This module is that second model, built from the decode loop's own functions (the
placement core, `jaxkv.placement`), so that the two cannot drift apart:

  reads and their bytes   `jaxkv.placement.charging.read_bytes` (the tail and the FP8 ring in
                          HBM)
  the in-step rule        `jaxkv.placement.admission.admit`, the decoder's own call, every layer
                          at once (budget `rule_budget`: the policy's or max_moves)
  a sealed block          `jaxkv.cache.slots.seal_keeps` (HBM while the pool has a free slot)
  the statistics          `jaxkv.placement.statistics.update_stats`
  the plan                `jaxkv.placement.observation.observe` -> `policy.plan` in the Decoder's
                          `env`; `jaxkv.cache.migration.plan_moves_masks`; the next W by
                          `jaxkv.decode.state.next_window`
  a step's cost           `jaxkv.placement.charging.step_latency` (write-through: a demotion is
                          free)

`record` runs a Decoder's steps one at a time and keeps each step's reads (`LoopRecord`). A
sparse selection depends on the logical blocks, not on where they live, so one placement's
reads are, but for rounding, every placement's: the attention merges its HBM and host partials
in a grouping that follows the placement, and the last bits of a layer's output can flip a
near-tie in the selection of a layer above (2 of 28,896 reads at bench_decode's 8k case).
`replay` runs them through the model above for the Decoder's policy (or another,
`LoopSetup.of(decoder, policy=...)`; an oracle, which the decode loop refuses, sees the
recorded reads of the steps after each plan, or, an offline rule (Belady), every block's next
read: the limit a perfect forecast reaches) and returns per-step figures (`LoopReplay`) that
equal the decode loop's own metrics on its own record: the same hit counts and migrations, the
same modeled latency (tests/test_sim_loop.py, for static, lru-plan, the field's rules and the
live policy under both host tiers). Out of scope: sequences that finish during the recorded
steps (EOS, a full cache), a sharded cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cost
from jaxkv._pytree import pytree_dataclass, replace, static_field
from jaxkv.cache.layout import ring_window
from jaxkv.cache.migration import plan_moves_masks
from jaxkv.cache.slots import seal_keeps
from jaxkv.config import CacheConfig, HardwareProfile, PlacementConfig
from jaxkv.cost import CostModel
from jaxkv.decode.state import PlacementState, new_window, next_window
from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import (
    NEVER_READ,
    StepView,
    admit,
    moves_mask,
    needs_next_use,
    rule_budget,
    rule_state,
)
from jaxkv.placement.charging import (
    copied_demotions,
    loop_free_promotions,
    read_bytes,
    step_latency,
    token_write_bytes,
)
from jaxkv.placement.observation import layer_windows, observe, placeable_blocks
from jaxkv.placement.policies import looks_ahead
from jaxkv.sim.bounds import cache_bound_seconds, min_link_crossings


@dataclasses.dataclass(frozen=True)
class LoopSetup:
    """Everything static about a replay: the Decoder's cache, placement, policy and costs."""

    cache_config: CacheConfig
    model_config: Any  # only its sliding windows are read (`layer_windows`)
    placement: PlacementConfig
    policy: Any
    env: CostModel  # what plans are priced in (`jaxkv.decode.setup.plan_env`)
    profile: HardwareProfile
    weight_bytes: float  # HBM bytes of one layer's weights per step

    @property
    def budget(self) -> int:
        """Admissions per layer a step's rule may make (`rule_budget`, as the decoder's)."""
        return rule_budget(self.policy, self.placement.max_moves)

    @classmethod
    def of(cls, decoder, *, policy=None) -> LoopSetup:
        """The setup of `decoder` (a `jaxkv.Decoder`), with `policy` in place of its own
        if given (a policy object built for the same env, e.g. another Decoder's `.policy`)."""
        return cls(
            cache_config=decoder.cache_config,
            model_config=decoder.model_config,
            placement=decoder.placement,
            policy=decoder.policy if policy is None else policy,
            env=decoder.env,
            profile=decoder.profile,
            weight_bytes=float(decoder.weight_bytes_per_layer),
        )


@pytree_dataclass
class LoopStart:
    """The placement side of a DecodeState, where a replay starts."""

    in_hbm: jax.Array  # [layers, batch, max_blocks] bool: sealed blocks resident in HBM
    lengths: jax.Array  # [batch] int32: tokens in each sequence's cache
    stats: imp.Stats  # the read statistics, [layers, batch * max_blocks]
    placement: PlacementState  # window bookkeeping and the policy's state
    step: jax.Array  # [] int32: decode steps taken


@pytree_dataclass
class LoopMetrics:
    """Per-step figures of a decode, [steps] each, as the decode loop's `Metrics` has them."""

    latency: jax.Array  # f32 modeled seconds
    hbm_bytes: jax.Array  # f32 KV bytes read from HBM (all layers)
    host_bytes: jax.Array  # f32 KV bytes read over the link
    moved: jax.Array  # int32 blocks copied between the tiers
    hbm_reads: jax.Array  # f32 block reads served from HBM (the tail included)
    reads: jax.Array  # f32 block reads


@pytree_dataclass
class LoopRecord:
    """What `record` kept of a decode: its start, each step's reads and the loop's figures."""

    start: LoopStart
    reads: jax.Array  # [steps, layers, batch, max_blocks] bool: blocks read (tail included)
    mass: jax.Array  # [steps, layers, batch, max_blocks] f32: attention mass (0 unread)
    decoded: LoopMetrics  # the decode loop's own figures for these steps
    # [steps, batch, max_blocks] bool: layer 0's next reads as the loop's lookahead knew them
    # at the end of each step (`Lrfu.lookahead`); None when the Decoder ran without
    ahead: Any = None
    policy: Any = static_field(default=None)  # the recorded Decoder's policy


@dataclasses.dataclass
class LoopReplay:
    """What `replay` gives: the per-step figures and the placement after the last step."""

    metrics: LoopMetrics
    in_hbm: np.ndarray  # [layers, batch, max_blocks] bool
    plans: int

    def summary(self) -> dict:
        """Totals, as `jaxkv.summarize` names them (batch from `in_hbm`)."""
        return summarize_metrics(self.metrics, self.in_hbm.shape[1])


def summarize_metrics(m: LoopMetrics, batch: int) -> dict:
    """Totals of per-step figures: hit rate, blocks migrated, modeled seconds and tokens/s."""
    m = jax.device_get(m)
    lat = float(np.sum(m.latency, dtype=np.float64))
    steps = int(m.latency.shape[0])
    return {
        "steps": steps,
        "hbm_hit_rate": float(np.sum(m.hbm_reads) / max(float(np.sum(m.reads)), 1.0)),
        "migrated_blocks": int(np.sum(m.moved)),
        "modeled_seconds": lat,
        "modeled_tokens_per_s": batch * steps / lat if lat > 0 else float("nan"),
    }


def start_of(state) -> LoopStart:
    """The placement side of a DecodeState (copied: a Decoder's steps donate the state)."""
    s = LoopStart(
        in_hbm=state.cache.in_hbm,
        lengths=state.cache.lengths,
        stats=state.statistics.blocks,
        placement=state.placement,
        step=state.sampling.step,
    )
    return jax.tree.map(jnp.copy, s)


def record(decoder, params, state, steps: int):
    """Runs `steps` decode steps of `decoder` from `state`, one at a time, keeping each
    step's reads: (LoopRecord, the state after). Every sequence must decode at every step (none
    finished, none reaching its cache's end or the token buffer's).

    A step's reads are the blocks whose `last_read` statistic became that step (its tail
    included); its mass is the statistics' `step_mass`; its lookahead `Statistics.ahead`."""
    if isinstance(steps, bool) or not isinstance(steps, int | np.integer) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected a positive int")
    if not decoder.collects_mass:
        raise ValueError(
            f"record: the decoder's attention impl {decoder.impl!r} is the Pallas kernel, which "
            "collects no attention mass (the record's mass would be zeros): expected impl='xla'"
        )
    c = decoder.cache_config
    s0 = int(state.sampling.step)
    room = decoder.max_new_tokens - 1 - s0
    longest = int(np.max(np.asarray(state.cache.lengths)))
    if steps > room or longest + steps > c.max_len or bool(np.any(np.asarray(state.done))):
        raise ValueError(
            f"record: {steps} steps from step {s0} (longest sequence {longest} tokens, "
            f"done={np.asarray(state.done).tolist()}): expected every sequence to decode at "
            f"every step, i.e. none done, steps <= {room} (max_new_tokens - 1 - step) and "
            f"<= {c.max_len - longest} (max_len - longest)"
        )
    start = start_of(state)
    shape = (c.num_layers, c.batch, c.max_blocks)
    reads, mass, hits, totals, ahead = [], [], [], [], []
    m = state.metrics
    prev = (float(m.hbm_reads), float(m.total_reads))
    for t in range(s0, s0 + steps):
        state = decoder.step(params, state)
        reads.append(np.asarray(state.statistics.blocks.last_read == t).reshape(shape))
        mass.append(np.asarray(state.statistics.step_mass).reshape(shape))
        if state.statistics.ahead is not None:
            ahead.append(np.asarray(state.statistics.ahead))
        now = (float(state.metrics.hbm_reads), float(state.metrics.total_reads))
        hits.append(now[0] - prev[0])
        totals.append(now[1] - prev[1])
        prev = now
    if bool(np.any(np.asarray(state.done))):
        raise ValueError("record: a sequence finished during the recorded steps (EOS)")
    m = jax.device_get(state.metrics)
    sl = slice(s0, s0 + steps)
    decoded = LoopMetrics(
        latency=np.asarray(m.latency[sl]),
        hbm_bytes=np.asarray(m.hbm_bytes[sl]),
        host_bytes=np.asarray(m.host_bytes[sl]),
        moved=np.asarray(m.moved_trace[sl]),
        hbm_reads=np.asarray(hits, np.float32),
        reads=np.asarray(totals, np.float32),
    )
    rec = LoopRecord(
        start=start,
        reads=np.stack(reads),
        mass=np.stack(mass),
        decoded=decoded,
        ahead=np.stack(ahead) if ahead else None,
        policy=decoder.policy,
    )
    return rec, state


def replay(setup: LoopSetup, rec: LoopRecord) -> LoopReplay:
    """The recorded steps of `rec` replayed under `setup`'s policy in the decode loop's
    accounting (the module docstring); one jit-compiled `lax.scan` over the steps."""
    c = setup.cache_config
    shape = (c.num_layers, c.batch, c.max_blocks)
    if tuple(rec.reads.shape[1:]) != shape or tuple(rec.start.in_hbm.shape) != shape:
        raise ValueError(
            f"the record's reads have shape {tuple(rec.reads.shape)} and its placement "
            f"{tuple(rec.start.in_hbm.shape)}: expected [steps, {', '.join(map(str, shape))}] "
            "and the same without steps (the setup's cache geometry)"
        )
    pl = rec.start.placement
    other = setup.policy != rec.policy
    if other or int(pl.window) != setup.placement.window:
        # another policy starts from its initial state, another W with a new window
        N = c.batch * c.max_blocks
        ps = setup.policy.init(c.num_layers, N) if other else pl.policy
        rs = rule_state(setup.policy, c.num_layers, N) if other else pl.rule
        pl = new_window(jnp.int32(setup.placement.window), pl.prev_hit, ps, rs)
        rec = replace(rec, start=replace(rec.start, placement=pl))
    run = jax.jit(lambda r: _scan(setup, r))
    metrics, in_hbm, plans = run(rec)
    return LoopReplay(jax.device_get(metrics), np.asarray(in_hbm), int(plans))


def _scan(setup: LoopSetup, rec: LoopRecord):
    st = rec.start
    carry = (st.in_hbm, st.lengths, st.stats, st.placement, st.step, jnp.int32(0))
    future = None
    if setup.policy.needs_forecast:  # an oracle: the recorded reads after each plan
        T, L, B, M = rec.reads.shape
        h = setup.policy.horizon
        pad = lambda x: jnp.concatenate(  # noqa: E731
            [x.reshape(T, L, B * M).astype(jnp.float32), jnp.zeros((h, L, B * M))]
        )
        future = (pad(rec.reads), pad(rec.mass))
    steps = jnp.arange(rec.reads.shape[0], dtype=jnp.int32)
    nxt = next_reads(rec.reads) if needs_next_use(setup.policy) else None
    xs = (rec.reads, rec.mass, steps, _ahead(rec), nxt)
    (in_hbm, _, _, _, _, plans), m = jax.lax.scan(
        lambda cr, x: _step(setup, cr, x, future), carry, xs
    )
    return m, in_hbm, plans


def next_reads(reads):
    """[steps, ...] int32 of `reads` [steps, ...] bool: for each step, the next step (index into
    `reads`) after it at which each block is read, `NEVER_READ` if none (a backward scan)."""
    reads = jnp.asarray(reads)
    t = jnp.arange(reads.shape[0], dtype=jnp.int32)

    def back(nxt, x):
        r, s = x
        return jnp.where(r, s, nxt), nxt  # the next read after step s, before folding s in

    init = jnp.full(reads.shape[1:], NEVER_READ, jnp.int32)
    _, out = jax.lax.scan(back, init, (reads, t), reverse=True)
    return out


def _ahead(rec: LoopRecord):
    """[steps, batch, max_blocks] bool: layer 0's next reads at each step, as the decode loop's
    lookahead knew them (`LoopRecord.ahead`) or, for a record made without, the next step's
    recorded reads (none after the last step): what a lookahead would have known, up to the
    rounding of `record`'s docstring."""
    if rec.ahead is not None:
        return jnp.asarray(rec.ahead)
    r0 = jnp.asarray(rec.reads)[:, 0]
    return jnp.concatenate([r0[1:], jnp.zeros_like(r0[:1])])


def _step(setup: LoopSetup, carry, xs, future=None):
    """One decode step on masks, in the decode loop's order: reads, the in-step rule, the
    sealing of full tails, the statistics, the plan if the window ends, the step's cost."""
    c, policy = setup.cache_config, setup.policy
    L, B, M, bs = c.num_layers, c.batch, c.max_blocks, c.block_size
    N = B * M
    in_hbm, lengths, stats, pl, step, plans = carry
    read, mass, i, ahead, next_use = xs
    j = jnp.arange(M)
    sealed = jnp.broadcast_to(j[None] < (lengths // bs)[:, None], (L, B, M))
    # the tail (unsealed) and, under fp8="age", the ring are read from HBM
    in_fast = in_hbm | ~sealed
    if c.ring_blocks:
        in_fast = in_fast | ring_window(c, lengths)[None]
    read_hbm, read_host = read & in_fast, read & ~in_fast
    hbm_b, host_b = read_bytes(c, read_hbm, read_host, lengths)
    # the cache's advance after the step: a full tail seals, in HBM while the pool has room
    ok = lengths < c.max_len
    new_len = lengths + ok.astype(jnp.int32)
    full = ok & (new_len % bs == 0)
    seal = full & (new_len // bs < M)
    at_end = full & ~seal
    sj = jnp.clip(new_len // bs - 1, 0, M - 1)
    b = jnp.arange(B)

    def n_free(in_hbm, lengths):  # [L] free HBM slots: the pool less resident blocks and tails
        tails = jnp.sum(lengths // bs < M)
        return (c.hbm_slots - tails - jnp.sum(in_hbm.reshape(L, N), -1)).astype(jnp.int32)

    promoted = demoted = jnp.zeros((L,), jnp.int32)
    rule = policy.rule
    shared = bool(getattr(rule, "shared", False))  # one pool for every layer (Belady's option)
    if rule is not None:
        flat = in_hbm.reshape(L, N)
        rows = (1, L * N) if shared else (L, N)  # shared: every layer's blocks in one row
        sealing = jnp.zeros((B, M), bool).at[b, sj].set(seal).reshape(1, N)
        room = n_free(in_hbm, lengths)
        view = StepView(
            in_hbm=flat.reshape(rows),
            valid=sealed.reshape(rows),
            reads=read.reshape(rows),
            room=jnp.sum(room)[None] if shared else room,  # shared: the layers' slots pooled
            step=step,
            stats=stats,
            pstate=pl.policy,
            ahead=ahead.reshape(N) if looks_ahead(policy) else None,
            sealing=jnp.broadcast_to(sealing, (L, N)).reshape(rows),
            next_use=None if next_use is None else next_use.reshape(rows),
            slack=None
            if shared
            else loop_free_promotions(c, setup.profile, setup.weight_bytes, hbm_b, host_b),
        )
        adm, rstate = admit(rule, pl.rule, view, min(setup.budget, rows[1]))
        after = adm.apply(flat.reshape(rows)).reshape(L, N)
        promoted = jnp.sum(after & ~flat, -1).astype(jnp.int32)
        demoted = jnp.sum(flat & ~after, -1).astype(jnp.int32)
        in_hbm = after.reshape(L, B, M)
        pl = replace(pl, rule=rstate)

    free = n_free(in_hbm, lengths)
    if shared:  # the sealing blocks take the pooled free slots, layer by layer
        order = jnp.cumsum(jnp.broadcast_to(seal[None], (L, B)).reshape(-1)).reshape(L, B) - 1
        keep = seal[None] & (order < jnp.sum(free))
    else:
        keep, _ = seal_keeps(seal, free)
    stays = (keep | at_end[None]) & full[None]  # [L, B]
    in_hbm = in_hbm.at[:, b, sj].set(in_hbm[:, b, sj] | stays)

    flat_read = read.reshape(L, N)
    stats = imp.update_stats(stats, flat_read, mass.reshape(L, N), step, sealed.reshape(L, N))
    n_hbm = jnp.sum(read_hbm).astype(jnp.float32)
    n_all = jnp.sum(read).astype(jnp.float32)
    pl = replace(
        pl, since_plan=pl.since_plan + 1, win_hbm=pl.win_hbm + n_hbm, win_total=pl.win_total + n_all
    )

    def plan(args):
        in_hbm, stats, pl = args
        sealed_now = jnp.broadcast_to(j[None] < (new_len // bs)[:, None], (L, B, M))
        obs = observe(in_hbm, sealed_now, new_len, stats, step + 1, c, setup.model_config)
        if future is not None:  # the reads of the steps after this one (zeros past the record)
            shape = (policy.horizon, L, N)
            fc, fm = (jax.lax.dynamic_slice(x, (i + 1, 0, 0), shape) for x in future)
            obs = replace(obs, forecast=fc, forecast_mass=fm)
        pstate, target = policy.plan(pl.policy, obs, setup.env)
        moved = jnp.zeros((L,), jnp.int32)
        if rule is None:
            flat, sflat = in_hbm.reshape(L, N), sealed_now.reshape(L, N)
            passed = None
            if layer_windows(setup.model_config) is not None:
                live = placeable_blocks(sealed_now, new_len, c, setup.model_config)
                passed = sflat & ~live
            mv = plan_moves_masks(
                flat,
                sflat,
                n_free(in_hbm, new_len),
                target.reshape(L, N),
                setup.placement.max_moves,
                demote_first=passed,
            )
            after = (flat & ~moves_mask(mv.demote, mv.num_demote, N)) | moves_mask(
                mv.promote, mv.num_promote, N
            )
            n_in = jnp.sum(after & ~flat, -1)
            n_out = jnp.sum(flat & ~after, -1)
            moved = (n_in if c.write_through else n_in + n_out).astype(jnp.int32)
            in_hbm = after.reshape(L, B, M)
        stats = replace(stats, window_reads=jnp.zeros_like(stats.window_reads))
        window, hit = next_window(policy, setup.placement, pl, pstate)
        pl = new_window(window.astype(jnp.int32), hit, pstate, pl.rule)
        return in_hbm, stats, pl, moved, 1

    def skip(args):
        in_hbm, stats, pl = args
        return in_hbm, stats, pl, jnp.zeros((L,), jnp.int32), 0

    in_hbm, stats, pl, moved, planned = jax.lax.cond(
        pl.since_plan >= pl.window, plan, skip, (in_hbm, stats, pl)
    )
    lat = step_latency(
        c, setup.profile, setup.weight_bytes, hbm_b, host_b, moved, promoted, demoted
    )
    n_moved = (moved + promoted + copied_demotions(c, demoted)).sum().astype(jnp.int32)
    out = LoopMetrics(
        latency=lat,
        hbm_bytes=hbm_b.sum(),
        host_bytes=host_b.sum(),
        moved=n_moved,
        hbm_reads=n_hbm,
        reads=n_all,
    )
    return (in_hbm, new_len, stats, pl, step + 1, plans + planned), out


def bounds(setup: LoopSetup, rec: LoopRecord) -> dict:
    """Lower bounds on the modeled seconds of the recorded steps under any placement, in the
    decode loop's accounting (`jaxkv.sim.bounds`' argument, per layer, summed over layers):

      unlimited  every read from HBM (`cost.unlimited_step_time` of the step's bytes: its
                 reads, the tail as a whole block, the layer's weights, the tokens' write)
      capacity   at most the pool's blocks and the tails in HBM, re-chosen for free before
                 each step (`cost.capacity_bound_step_time`)
      cache      max(unlimited, the fewest link crossings any placement needs x block bytes /
                 link bandwidth) (`min_link_crossings`: Belady with bypass from the best start,
                 a sealing block free in HBM; the prefill may place any sealed blocks in HBM,
                 as many as the recorded start holds (`jaxkv.decode.prompt`), and the best are
                 those read first, `best_start`)
      best       the same with the capacity bound in place of unlimited

    Returns {name: seconds} and "crossings" ([layers] ints). FP8 blocks are refused: the
    bound counts every block at one size."""
    c = setup.cache_config
    if c.fp8 != "off":
        raise ValueError(f"bounds: fp8={c.fp8!r}: expected fp8='off' (one block size)")
    reads = np.asarray(rec.reads, bool)
    T, L, B, M = reads.shape
    N, bs, bb = B * M, c.block_size, float(c.block_bytes)
    lengths, sealed, placed = _sealed_reads(c, rec)
    kw = dict(
        profile=setup.profile,
        weight_bytes=setup.weight_bytes,
        hbm_write_bytes=token_write_bytes(c),
    )
    rb = bb * reads.sum(axis=(2, 3))  # [T, L]
    tails = np.sum(lengths // bs < M, axis=1)[:, None]  # [T, 1]
    unl = np.asarray(cost.unlimited_step_time(rb, **kw), np.float64).sum(0)
    cap_bytes = bb * (c.hbm_pool_slots + tails)
    cap = np.asarray(cost.capacity_bound_step_time(rb, cap_bytes, **kw), np.float64).sum(0)
    fresh = np.zeros((T, N), bool)  # blocks that seal before each step, free in HBM there
    fresh[1:] = (sealed[1:] & ~sealed[:-1]).reshape(T - 1, N)
    init = best_start(placed, sealed[0].reshape(N), np.asarray(rec.start.in_hbm).reshape(L, N))
    f = min_link_crossings(placed, init, fresh, c.hbm_pool_slots)
    link = setup.profile.link_bandwidth
    return {
        "unlimited": float(unl.sum()),
        "capacity": float(cap.sum()),
        "cache": float(cache_bound_seconds(f, unl, bb, link).sum()),
        "best": float(cache_bound_seconds(f, cap, bb, link).sum()),
        "crossings": f.tolist(),
    }


def _sealed_reads(c, rec):
    """(lengths [T, B] before each step, sealed [T, B, M] bool, the reads of sealed blocks
    [T, layers, N] bool) of a record."""
    reads = np.asarray(rec.reads, bool)
    T, L, B, M = reads.shape
    lengths = np.asarray(rec.start.lengths)[None] + np.arange(T)[:, None]
    sealed = np.arange(M)[None, None] < (lengths // c.block_size)[:, :, None]
    return lengths, sealed, (reads & sealed[:, None]).reshape(T, L, B * M)


def limit(setup: LoopSetup, rec: LoopRecord, *, shared: bool = False) -> LoopReplay:
    """Belady's MIN with bypass (`jaxkv.sim.belady`) replayed on `rec` from the best prefill
    placement (`best_start`, as many blocks per layer as the recorded start holds: the prefill
    may choose them): the fewest host reads this pool can make, priced by the decode loop's
    cost model. `shared`: one pool for every layer. The attainable limit a policy in the step
    is measured against (`jaxkv.sim.belady`'s docstring: not a lower bound on the time)."""
    from jaxkv.sim.belady import Belady

    c = setup.cache_config
    L, N = c.num_layers, c.batch * c.max_blocks
    _, sealed, placed = _sealed_reads(c, rec)
    start = np.asarray(rec.start.in_hbm).reshape(L, N)
    init = best_start(placed, sealed[0].reshape(N), start).reshape(np.shape(rec.start.in_hbm))
    policy = Belady(shared=shared)
    rec = replace(rec, start=replace(rec.start, in_hbm=init), policy=None)
    return replay(dataclasses.replace(setup, policy=policy), rec)


def best_start(reads, sealed, start):
    """[layers, N] bool: the HBM content before step 0 that needs the fewest link crossings,
    given as many blocks per layer as `start` [layers, N] holds, chosen among the `sealed` [N]
    ones: those read first (`reads` [T, layers, N]), ties by index. (Belady's exchange argument:
    a block read earlier is worth at least as much in HBM as one read later, and a block never
    read is worth nothing.)"""
    T = reads.shape[0]
    first = np.where(reads.any(0), reads.argmax(0), T)  # [layers, N]; T: never read
    key = np.where(sealed[None], first, T + 1)
    order = np.argsort(key, axis=1, kind="stable")
    rank = np.argsort(order, axis=1, kind="stable")
    return (rank < start.sum(1, keepdims=True)) & (key < T)


def decode_bound(decoder, params, state, steps: int) -> dict:
    """{unlimited, capacity, cache, best: tokens/s}: the fastest any placement of `decoder`'s
    HBM size can read what `steps` decode steps from `state` read (`bounds`; `record` runs the
    steps). Under sparse attention the reads are those of any placement; under exact attention
    every block is read."""
    rec, _ = record(decoder, params, state, steps)
    b = bounds(LoopSetup.of(decoder), rec)
    n = steps * decoder.cache_config.batch
    return {k: n / b[k] for k in ("unlimited", "capacity", "cache", "best")}

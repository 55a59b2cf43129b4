"""In-step admission: after a step's reads, which host blocks the step read enter HBM and which
resident blocks leave to make room, per row (one layer, or every layer at once).

A promotion rides the read: the block crossed the link because the step read it from host, so
admitting it is one HBM write from the copy the read fetched, never a second link read. This is
what the field's hot buffers do (SGLang HiSparse, vLLM's offload with LRU or ARC eviction) and
what `jaxkv.cost`'s step model charges. Under a write-through host tier a demotion frees its
HBM slot and moves nothing.

A rule (`Rule`) sees a `StepView` of one step and returns an `Admission` (per row, the blocks
to promote and to demote, as index lists) and its new state. Its state lives with the caller:
`jaxkv.decode` keeps it in the decode state and runs the rule once per layer inside the layer
scan (rows = 1, `layer` traced); `jaxkv.sim.loop` and `jaxkv.sim.replay` run it for every layer
at once on placement masks (rows = layers, `layer` None). The same function serves all three:
`admit`.

Two executors back the rules:
  follow_moves    vectorized: the step's misses are ranked by a value (`Follow("value")`, the
                  live policy's read frequency; Belady's next use) or by a plan's target and
                  expected reads (`Follow("ranked")` ...) and paired with the resident blocks
                  ranked the other way; a candidate displaces a victim when it ranks higher.
  scan_misses     sequential: the field's cache algorithms written as their papers state them,
                  one access at a time (`SequentialRule`: LRU, ARC, SLRU, LFU with aging,
                  W-TinyLFU in `jaxkv.placement.policies`). A step's reads arrive as one
                  batch: the rule first sees the blocks that entered or left HBM since it last
                  ran (a sealed tail, a freed sequence), then every hit in block order (a hit
                  never evicts, so their order only sets recency), then each miss in block
                  order, at most `budget` of them (later misses bypass HBM); each miss is
                  admitted or bypassed by the rule, evicting at most one resident block.
The admissions a row makes are at most `budget` promotions and as many demotions.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.placement import statistics as imp


@pytree_dataclass
class StepView:
    """What an in-step rule sees of one step, per row: [rows, N] (N = batch x logical blocks);
    rows = 1 inside the decode loop's layer scan (`layer`: the traced layer), every layer in
    the simulators (`layer` None)."""

    in_hbm: jax.Array  # [rows, N] bool: sealed blocks resident in HBM before the admission
    valid: jax.Array  # [rows, N] bool: placeable (sealed) blocks
    reads: jax.Array  # [rows, N] bool: blocks this step read (a tail too: never valid)
    room: jax.Array  # [rows] int32: free HBM slots
    step: jax.Array  # [] int32: the step (the decode loop's step counter)
    stats: Any  # `jaxkv.placement.statistics.Stats` before this step, all layers
    pstate: Any = None  # the policy's state (a plan's target and expected reads), all layers
    layer: Any = None  # [] int32 traced layer of the one row, or None: rows are every layer
    ahead: jax.Array | None = None  # [N] bool: layer 0's next reads (row 0; `Lrfu.lookahead`)
    # [rows, N] bool: blocks that seal before the next step's reads and enter HBM if a slot is
    # free then (the simulators give it; an offline rule may keep a slot for them)
    sealing: jax.Array | None = None
    # [rows, N] int32: the next step at which each block is read after this one (NEVER_READ if
    # none): the future, which only the simulators know (oracle rules: `Belady`)
    next_use: jax.Array | None = None
    # [rows] int32: the promotions whose HBM writes this step's link time hides
    # (`jaxkv.placement.charging.free_promotions`; lrfu's `slack` caps its admissions at it)
    slack: jax.Array | None = None

    def rows(self, x):
        """Row(s) of an all-layers array `x` ([layers, ...]) that this view covers."""
        return x if self.layer is None else x[self.layer][None]


NEVER_READ = jnp.iinfo(jnp.int32).max  # `StepView.next_use` of a block never read again


@pytree_dataclass
class Admission:
    """A step's admissions, per row, as index lists into the row's N blocks; entries past a
    row's count are unused. K = min(budget, N)."""

    promote: jax.Array  # [rows, K] int32: host blocks (read at this step) that enter HBM
    num_promote: jax.Array  # [rows] int32
    demote: jax.Array  # [rows, K] int32: resident blocks that leave HBM
    num_demote: jax.Array  # [rows] int32

    def __iter__(self):
        """(promote, num_promote, demote, num_demote), for unpacking."""
        return iter((self.promote, self.num_promote, self.demote, self.num_demote))

    def masks(self, n: int):
        """([rows, n] bool promoted, [rows, n] bool demoted)."""
        return moves_mask(self.promote, self.num_promote, n), moves_mask(
            self.demote, self.num_demote, n
        )

    def apply(self, in_hbm):
        """The [rows, N] residency after the admission (`in_hbm` before it)."""
        pro, dem = self.masks(in_hbm.shape[-1])
        return (in_hbm & ~dem) | pro


class Rule(Protocol):
    """An in-step admission rule (a policy's `rule`).

    init(rows, num_blocks): its state, a pytree whose every leaf has a leading [rows] axis
      (() when it keeps none).
    step(state, view, budget): (Admission, new state) for the rows of `view`, at most
      `budget` promotions per row (static).
    stateful: whether `init` returns any state (the decode loop carries it per layer).
    """

    stateful: bool

    def init(self, rows: int, num_blocks: int) -> Any: ...

    def step(self, state, view: StepView, budget: int) -> tuple[Admission, Any]: ...


def admit(rule, state, view: StepView, budget: int) -> tuple[Admission, Any]:
    """The one entry point of every caller (the decode loop, `jaxkv.sim.loop`,
    `jaxkv.sim.replay`): `rule.step` with `state`'s rows of `view` (all of them, or the row
    of `view.layer`), and `state` with those rows updated."""
    if view.layer is None or not rule.stateful:
        adm, new = rule.step(state, view, budget)
        return adm, (new if view.layer is None else state)
    layer = view.layer
    rows = jax.tree.map(lambda x: x[layer][None], state)
    adm, new = rule.step(rows, view, budget)
    return adm, jax.tree.map(lambda x, y: x.at[layer].set(y[0]), state, new)


def rule_state(policy, rows: int, num_blocks: int):
    """The initial state of `policy`'s in-step rule for `rows` rows of `num_blocks` blocks (()
    without a rule, or for one that keeps none)."""
    rule = getattr(policy, "rule", None)
    return () if rule is None else rule.init(rows, num_blocks)


def needs_next_use(policy) -> bool:
    """`policy`'s rule reads every block's next read (`StepView.next_use`: an offline rule,
    which only `jaxkv.sim.loop` can run)."""
    return bool(getattr(getattr(policy, "rule", None), "needs_next_use", False))


def rule_budget(policy, max_moves: int) -> int:
    """A step's admissions per row for `policy`'s rule: its own `budget` when it sets one, else
    the caller's `max_moves` (`PlacementConfig.max_moves`)."""
    b = getattr(policy, "budget", None)
    return int(max_moves if b is None else b)


# ---- the vectorized executor ------------------------------------------------------------------

FOLLOW_ADMITS = ("read", "ranked", "target", "value")


def follow_moves(
    in_hbm,
    valid,
    reads,
    target,
    priority,
    room,
    budget: int,
    admit: str = "read",
    value=None,
):
    """The vectorized executor, over rows.

    Candidates are blocks this step reads from host. Under "read", "ranked" and "target" the
    victims are resident blocks this step does not read, and both are ranked by (in the
    window's target, `priority`): candidates best first, victims worst first (blocks outside
    the target go first, the least expected first). Under "value" both are ranked by `value`
    alone (the live policy's read frequency after this step, `follow_value`; an oracle's next
    use) and every resident block is a victim, read at this step or not. The i-th candidate
    is promoted into a free slot while `room` lasts, beyond it by displacing the next victim,
    at most `budget` per row; the promoted blocks are a leading run of the candidates. `admit`
    says which candidates may be promoted:
      "read": every candidate (promote on read; the plan chooses the victims);
      "ranked": a candidate displaces a victim only when it ranks higher (its read counts as
        one expected read more);
      "target": only target blocks, and only over victims outside the target (the window's
        target followed literally);
      "value": a candidate displaces a victim only when its value is strictly higher; with
        free room a candidate is admitted unless its value is -inf (never worth HBM). Under
        "value" the kept set is the (resident + room) highest-valued blocks of the residents
        and the candidates (the budget aside).

    Args:
      in_hbm, valid, reads, target: [rows, N] bool: resident (sealed, in HBM), placeable, read
        at this step, in the window's target.
      priority: [rows, N] float32: expected reads over the window (`AnnealPolicyState.priority`).
      room: [rows] int: free HBM slots.
      budget: static bound on the promotions (and so demotions) per row.
      admit: "read" | "ranked" | "target" | "value".
      value: [rows, N] float32, each block's value; "value" only.
    Returns:
      `Admission` (K = min(budget, N)); num_demote = max(num_promote - room, 0).
    """
    if admit not in FOLLOW_ADMITS:
        raise ValueError(f"follow_moves admit must be one of {FOLLOW_ADMITS}, got {admit!r}")
    if (admit == "value") != (value is not None):
        raise ValueError(
            f"follow_moves admit={admit!r} with value {'None' if value is None else 'given'}: "
            'expected a value array exactly when admit="value"'
        )
    rows, n = in_hbm.shape
    k = max(0, min(int(budget), n))
    i32 = jnp.int32
    if k == 0:
        return _no_admission(rows)
    cand = reads & valid & ~in_hbm
    victim = in_hbm & valid
    if admit == "value":
        rank = c_rank_of = value.astype(jnp.float32)
    else:
        big = 1e6  # target membership outranks any priority (expected reads <= window steps)
        rank = jnp.where(target, big, 0.0) + priority.astype(jnp.float32)
        c_rank_of = rank + 1.0
        victim &= ~reads
    if admit == "target":
        cand &= target
        victim &= ~target
    c_rank, pro = jax.lax.top_k(jnp.where(cand, c_rank_of, -jnp.inf), k)  # best first
    v_neg, dem = jax.lax.top_k(jnp.where(victim, -rank, -jnp.inf), k)  # worst first
    room = jnp.maximum(jnp.asarray(room, i32), 0)
    j = jnp.arange(k)[None] - room[:, None]  # the victim the i-th candidate would displace
    v_rank = -jnp.take_along_axis(v_neg, jnp.clip(j, 0, k - 1), axis=1)
    has_victim = (j < k) & jnp.isfinite(v_rank)
    better = (c_rank > v_rank) if admit in ("ranked", "value") else True
    ok = jnp.isfinite(c_rank) & ((j < 0) | (has_victim & better))
    n_p = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)  # the leading run that qualifies
    n_d = jnp.maximum(n_p - room, 0)
    return Admission(pro.astype(i32), n_p.astype(i32), dem.astype(i32), n_d.astype(i32))


def follow_value(read_ema, reads, decay: float = imp.READ_DECAY):
    """[rows, N] float32: each block's value to the `admit="value"` rule, its decayed read
    frequency with this step's reads folded in: `Stats.read_ema` one step on, decay x read_ema
    + (1 - decay) x read (the order of LRFU's combined recency and frequency, 2^-lambda =
    decay). Mixing in the window plan's expected reads was measured and gains nothing
    (bench/notebook/2026-12-06-lrfu.md)."""
    return imp.ema_after(read_ema, reads, decay)


def moves_mask(idx, count, n: int):
    """[rows, n] bool of the first `count` [rows] entries of the index lists `idx` [rows, K]."""
    rows, k = idx.shape
    ok = jnp.arange(k)[None] < count[:, None]
    r = jnp.arange(rows)[:, None]
    return jnp.zeros((rows, n), bool).at[r, jnp.where(ok, idx, n)].set(True, mode="drop")


def first_k(mask, k: int):
    """The first `k` set entries of each row of `mask` [rows, N] in index order:
    ([rows, k'] int32 indices, [rows] int32 counts <= k'), k' = min(k, N); vectorized (top_k)."""
    rows, n = mask.shape
    k = max(0, min(k, n))
    if k == 0:
        return jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows,), jnp.int32)
    _, idx = jax.lax.top_k(jnp.where(mask, -jnp.arange(n)[None], -n - 1), k)
    return idx.astype(jnp.int32), jnp.minimum(jnp.sum(mask, axis=1), k).astype(jnp.int32)


def _no_admission(rows: int) -> Admission:
    z, zn = jnp.zeros((rows, 0), jnp.int32), jnp.zeros((rows,), jnp.int32)
    return Admission(z, zn, z, zn)


# ---- the sequential executor ------------------------------------------------------------------


class SequentialRule:
    """Base of the field's cache algorithms, run one access at a time (`scan_misses`).

    A subclass writes its hooks for ONE row (state leaves [N] per block or [] per row; the
    executor vmaps them over rows) and states its algorithm as its paper does:
      init_row(n)                      the state of an empty cache of n blocks;
      sync(st, resident, valid, step, cap)
                                       before the step's accesses: blocks that entered HBM
                                       outside the rule (a sealed tail, the prefill's
                                       placement) join it, blocks that left it (a freed
                                       sequence) leave it, and any per-step upkeep (aging);
      touch(st, hits, reads, cap)      the step's hits, all at once in block order ([N] bool),
                                       and its reads (frequency counts);
      miss(st, b, cap)                 one miss: block b ([] int32) is admitted (evicting at
                                       most one resident block) or bypassed;
      resident(st)                     [N] bool: the blocks the rule holds in HBM.
    `cap` ([] int32) is the blocks the row may hold at this step: its residents plus its free
    slots. A rule keeps at most `cap` blocks resident.
    """

    stateful = True

    def init(self, rows: int, num_blocks: int):
        one = self.init_row(num_blocks)
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (rows, *x.shape)), one)

    def step(self, state, view: StepView, budget: int) -> tuple[Admission, Any]:
        return scan_misses(self, state, view, budget)


def scan_misses(rule: SequentialRule, state, view: StepView, budget: int):
    """The sequential executor (the module docstring): per row, `rule.sync`, `rule.touch` with
    the step's hits and reads, then `rule.miss` for each of the first min(budget, N) misses in
    block order (a `lax.scan` of static length, vmapped over rows). Returns (Admission: the
    blocks resident after and not before, and the other way round, K = min(budget, N) each;
    the new state)."""
    rows, n = view.in_hbm.shape
    k = max(0, min(int(budget), n))
    in0 = view.in_hbm & view.valid
    cap = (jnp.sum(in0, axis=-1) + jnp.maximum(view.room, 0)).astype(jnp.int32)
    miss = view.reads & view.valid & ~in0
    idx, count = first_k(miss, k)

    def row(st, in0, valid, reads, cap, idx, count):
        st = rule.sync(st, in0, valid, view.step, cap)
        st = rule.touch(st, reads & in0, reads & valid, cap)

        def body(s, i):
            new = rule.miss(s, idx[i], cap)
            return jax.tree.map(lambda a, b: jnp.where(i < count, a, b), new, s), None

        if k:
            st, _ = jax.lax.scan(body, st, jnp.arange(k))
        return st, rule.resident(st)

    state, after = jax.vmap(row)(state, in0, view.valid, view.reads, cap, idx, count)
    pro, n_p = first_k(after & ~in0, k)
    dem, n_d = first_k(in0 & ~after, k)
    return Admission(pro, n_p, dem, n_d), state

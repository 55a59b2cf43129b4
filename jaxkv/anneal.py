"""Simulated annealing over block -> tier assignments, chains and layers vmapped, inside jit.

Where things are: the problem and its energy (`AnnealProblem`, `loads`, `energy`) in
`jaxkv.anneal_energy`, the exact-scan starting point (`greedy_init`) in `jaxkv.anneal_init`,
the chains, their schedule and `run` here; all of them can be imported from this module.

The state keeps per-step loads so the energy change of a proposal costs O(W).

Proposals: swap one HBM block with one host block (capacity kept), or, with probability
`move_prob`, a single promotion (while there is slack) or demotion. Blocks are kept in a
permutation `perm` whose first `count` entries are the HBM blocks and the next ones the host
blocks, so sampling a block of either tier is O(1). Acceptance is Metropolis, applied with
`jnp.where` on the touched entries only.

Init (`greedy_init`): the best prefix of the blocks under four orderings (forecast mass, next
step first, residents first, link time saved in HBM; each an exact scan over all prefix sizes,
migration and budget included), x0 plus its best m swaps (an exact scan over m), or x0,
whichever has the lowest energy; every chain starts there. After the chains, `settle` undoes
the moves that change no load of the window.
Schedule (AnnealConfig; defaults 32 chains, T0 = 0.2 x the init energy, x 0.85 every 100
iterations, patience 30 at 1e-3, at most 4000 iterations): T0 = t0_fraction x the init energy,
multiplied by `cooling` every `cooling_every` iterations; a (layer, chain) stalls after `patience`
consecutive iterations that improve its best energy by less than `min_improvement` (relative);
the loop stops when all have stalled or after `max_iters`. One iteration = one proposal per chain
per layer. The best chain per layer wins.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass

# AnnealProblem, loads, energy and greedy_init are also used as `jaxkv.anneal.X` by callers
from jaxkv.anneal_energy import (  # noqa: F401
    AnnealProblem,
    energy,
    energy_of_loads,
    host_hbm_of,
    host_link_of,
    loads,
    miss_of,
    spread_of,
    value_of,
)
from jaxkv.anneal_init import best_prefix, best_swaps, greedy_init  # noqa: F401
from jaxkv.config import AnnealConfig

# the names these had when they were defined here (tests/test_anneal.py calls them)
_energy_of_loads, _best_prefix, _best_swaps = energy_of_loads, best_prefix, best_swaps


@pytree_dataclass
class AnnealState:
    """Chains of every layer. C = chains."""

    x: jax.Array  # [layers, C, N] bool
    perm: jax.Array  # [layers, C, N] int32: HBM blocks, then host blocks, then invalid ones
    count: jax.Array  # [layers, C] int32: blocks in HBM
    nvalid: jax.Array  # [layers, C] int32: valid blocks
    moved: jax.Array  # [layers, C] int32: blocks differing from x0
    hbm: jax.Array  # [layers, C, W] float32: HBM-side load bytes per step (without `fixed`)
    link: jax.Array  # [layers, C, W] float32: link-side load bytes per step
    miss: jax.Array  # [layers, C] float32 seconds: terminal value of the blocks out of HBM
    energy: jax.Array  # [layers, C] float32 seconds (load energy + miss)
    best_x: jax.Array  # [layers, C, N] bool
    best_energy: jax.Array  # [layers, C] float32
    ref_energy: jax.Array  # [layers, C] float32: best energy at the last significant improvement
    stall: jax.Array  # [layers, C] int32: iterations since that improvement
    temperature: jax.Array  # [layers, C] float32
    key: jax.Array  # [layers, C, 2] uint32: one PRNG key per chain
    it: jax.Array  # [] int32


def _perm_of(x, valid):
    """HBM blocks first, then host, then invalid: [..., N] int32."""
    key = jnp.where(valid, jnp.where(x, 0, 1), 2)
    return jnp.argsort(key, axis=-1, stable=True).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config",))
def init(
    problem: AnnealProblem, key: jax.Array, config: AnnealConfig = AnnealConfig()
) -> AnnealState:
    """Builds the chains (all starting from `greedy_init`) with one PRNG key per (layer, chain).

    Args:
      problem: the window's problem.
      key: PRNG key.
      config: schedule; `config.chains` chains per layer.
    Returns:
      AnnealState.
    """
    layers, n = problem.x0.shape
    c = config.chains
    x = jnp.broadcast_to(greedy_init(problem)[:, None, :], (layers, c, n))
    valid = jnp.broadcast_to(problem.valid[:, None, :], (layers, c, n))
    hbm, link = loads(problem, x)
    miss = miss_of(problem, x)
    sp = spread_of(problem, hbm.ndim)
    e = energy_of_loads(hbm, link, problem.fixed, problem.weight, problem.profile, sp) + miss
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    keys = jax.random.key_data(jax.random.split(key, (layers, c)))  # [layers, C, 2]
    return AnnealState(
        x=x,
        perm=_perm_of(x, valid),
        count=jnp.sum(x, -1).astype(jnp.int32),
        nvalid=jnp.sum(valid, -1).astype(jnp.int32),
        moved=jnp.sum(x != problem.x0[:, None, :], -1).astype(jnp.int32),
        hbm=hbm,
        link=link,
        miss=miss,
        energy=e,
        best_x=x,
        best_energy=e,
        ref_energy=e,
        stall=jnp.zeros((layers, c), jnp.int32),
        temperature=config.t0_fraction * e,
        key=keys.astype(jnp.uint32),
        it=jnp.zeros((), jnp.int32),
    )


def _chain_step(
    a,
    hh,
    hl,
    x0,
    ph,
    pl,
    val,
    fixed,
    weight,
    spread,
    x,
    perm,
    count,
    nvalid,
    moved,
    hbm,
    link,
    miss,
    e,
    key,
    temp,
    *,
    profile,
    b,
    cap,
    budget,
    move_prob,
    d,
    has_hh,
    has_spread,
):
    """One proposal for one chain. a, hh, hl: [W, N] (forecast, host-side HBM and link loads;
    hh unused unless has_hh); x0, ph, pl, val, x, perm: [N]; hbm, link: [W]; miss, e: []
    (terminal value out of HBM, energy = load energy + miss)."""
    k_kind, k_p, k_q, k_dir, k_acc, k_next = jax.random.split(jax.random.wrap_key_data(key), 6)
    p, q, promote, demote, swap, feasible = _propose(
        (k_kind, k_p, k_q, k_dir), count, nvalid, cap, move_prob
    )
    has_i = ~promote  # a block leaves HBM
    has_j = ~demote  # a block enters HBM
    i = perm[p]
    j = perm[q]
    blocks = (a, hh, hl, x0, ph, pl, val)
    new_hbm, new_link, new_miss, dmoved = _loads_after(
        blocks, (i, has_i), (j, has_j), (hbm, link, miss), b=b, d=d, has_hh=has_hh
    )
    sp = spread if has_spread else None
    new_e = energy_of_loads(new_hbm, new_link, fixed, weight, profile, sp) + new_miss
    de = new_e - e
    metropolis = jax.random.uniform(k_acc) < jnp.exp(
        -jnp.maximum(de, 0.0) / jnp.maximum(temp, 1e-30)
    )
    accept = feasible & (moved + dmoved <= budget) & ((de <= 0) | metropolis)
    perm, x, count = _commit(accept, perm, x, count, (p, q, i, j), (has_i, has_j, promote, swap))
    moved = moved + jnp.where(accept, dmoved, 0)
    hbm = jnp.where(accept, new_hbm, hbm)
    link = jnp.where(accept, new_link, link)
    miss = jnp.where(accept, new_miss, miss)
    e = jnp.where(accept, new_e, e)
    return x, perm, count, moved, hbm, link, miss, e, jax.random.key_data(k_next)


def _propose(keys, count, nvalid, cap, move_prob):
    """A random proposal: perm positions p (an HBM block) and q (a host block), its kind
    (promote, demote, swap: one is True) and whether the tiers allow it."""
    k_kind, k_p, k_q, k_dir = keys
    u = jax.random.uniform(k_kind)
    p = jnp.minimum((jax.random.uniform(k_p) * count).astype(jnp.int32), jnp.maximum(count - 1, 0))
    nhost = nvalid - count
    q = count + jnp.minimum(
        (jax.random.uniform(k_q) * nhost).astype(jnp.int32), jnp.maximum(nhost - 1, 0)
    )
    is_move = u < move_prob
    promote = is_move & (jax.random.uniform(k_dir) < 0.5)
    demote = is_move & ~promote
    swap = ~is_move
    feasible = jnp.where(
        swap,
        (count > 0) & (nhost > 0),
        jnp.where(promote, (nhost > 0) & (count < cap), count > 0),
    )
    return p, q, promote, demote, swap, feasible


def _loads_after(blocks, leaves, enters, state, *, b, d, has_hh):
    """The loads [W], terminal value [] and moves count change after block i leaves HBM (when
    has_i) and block j enters it (when has_j): (hbm, link, miss, moved delta)."""
    a, hh, hl, x0, ph, pl, val = blocks
    (i, has_i), (j, has_j) = leaves, enters
    hbm, link, miss = state
    # HBM-side and link-side load columns a block adds in HBM rather than on host
    col_i = a[:, i] - hh[:, i] if has_hh else a[:, i]
    col_j = a[:, j] - hh[:, j] if has_hh else a[:, j]
    ai = jnp.where(has_i, col_i, 0.0)  # [W]
    aj = jnp.where(has_j, col_j, 0.0)
    li = jnp.where(has_i, hl[:, i], 0.0)
    lj = jnp.where(has_j, hl[:, j], 0.0)
    # i leaves HBM: a demotion (x0[i]) or an undone promotion; j enters: the reverse.
    dmig_i = jnp.where(has_i, jnp.where(x0[i], 1, -1), 0)
    dmig_j = jnp.where(has_j, jnp.where(x0[j], -1, 1), 0)
    dmoved = dmig_i + dmig_j
    dm_h = jnp.where(has_i, jnp.where(x0[i], d, -ph[i]), 0.0) + jnp.where(
        has_j, jnp.where(x0[j], -d, ph[j]), 0.0
    )
    dm_l = jnp.where(has_i, jnp.where(x0[i], d, -pl[i]), 0.0) + jnp.where(
        has_j, jnp.where(x0[j], -d, pl[j]), 0.0
    )
    dh = b * (aj - ai)
    first = (jnp.arange(a.shape[0]) == 0).astype(jnp.float32)
    new_hbm, new_link = hbm + dh + b * dm_h * first, link + b * (li - lj) + b * dm_l * first
    # i leaves HBM (its terminal value now counts), j enters (its value no longer does)
    new_miss = miss + jnp.where(has_i, val[i], 0.0) - jnp.where(has_j, val[j], 0.0)
    return new_hbm, new_link, new_miss, dmoved


def _commit(accept, perm, x, count, where, kind):
    """perm, x and count after the proposal when `accept` (as they were otherwise)."""
    p, q, i, j = where
    has_i, has_j, promote, swap = kind
    # Exchange two positions of perm: swap (p, q); promotion (q, count); demotion (p, count - 1).
    pa = jnp.where(promote, q, p)
    pb = jnp.where(swap, q, jnp.where(promote, count, count - 1))
    va, vb = perm[pa], perm[pb]
    perm = perm.at[pa].set(jnp.where(accept, vb, va)).at[pb].set(jnp.where(accept, va, vb))
    x = x.at[i].set(jnp.where(accept & has_i, False, x[i]))
    x = x.at[j].set(jnp.where(accept & has_j, True, x[j]))
    dcount = jnp.where(swap, 0, jnp.where(promote, 1, -1))
    return perm, x, count + jnp.where(accept, dcount, 0)


@functools.partial(jax.jit, static_argnames=("config",))
def step(problem: AnnealProblem, state: AnnealState, config: AnnealConfig = AnnealConfig()):
    """One iteration: one proposal per chain per layer, then best / stall / temperature updates."""
    chain = functools.partial(
        _chain_step,
        profile=problem.profile,
        b=problem.block_bytes,
        cap=problem.capacity,
        budget=problem.budget,
        move_prob=config.move_prob,
        d=problem.demote_cost,
        has_hh=problem.host_hbm is not None,
        has_spread=problem.spread is not None,
    )
    over_chains = jax.vmap(chain, in_axes=(None,) * 10 + (0,) * 11)
    over_layers = jax.vmap(over_chains, in_axes=(0,) * 7 + (None, None, 0) + (0,) * 11)
    chains = (state.x, state.perm, state.count, state.nvalid, state.moved, state.hbm, state.link)
    chains += (state.miss, state.energy, state.key, state.temperature)
    out = over_layers(*_step_inputs(problem), *chains)
    return _after_step(state, config, *out)


def _step_inputs(problem: AnnealProblem):
    """The problem's arrays as `_chain_step` takes them (its first 10 arguments, per layer)."""
    a = problem.forecast
    return (
        a,
        a if problem.host_hbm is None else problem.host_hbm,
        a if problem.host_link is None else problem.host_link,
        problem.x0,
        problem.promote_hbm,
        problem.promote_link,
        value_of(problem),
        problem.fixed,
        problem.weight,
        jnp.zeros(problem.x0.shape[:1] + problem.weight.shape, jnp.float32)
        if problem.spread is None
        else problem.spread.astype(jnp.float32),
    )


def _after_step(
    state: AnnealState, config: AnnealConfig, x, perm, count, moved, hbm, link, miss, e, key
):
    """The state after an iteration whose chains ended at (x, ..., key): best, stall and
    temperature updated by the schedule."""
    better = e < state.best_energy * (1.0 - 1e-6)  # float noise is not an improvement
    best_x = jnp.where(better[..., None], x, state.best_x)
    best_e = jnp.minimum(e, state.best_energy)
    significant = best_e < state.ref_energy * (1.0 - config.min_improvement)
    it = state.it + 1
    cool = (it % config.cooling_every) == 0
    return AnnealState(
        x=x,
        perm=perm,
        count=count,
        nvalid=state.nvalid,
        moved=moved,
        hbm=hbm,
        link=link,
        miss=miss,
        energy=e,
        best_x=best_x,
        best_energy=best_e,
        ref_energy=jnp.where(significant, best_e, state.ref_energy),
        stall=jnp.where(significant, 0, state.stall + 1),
        temperature=jnp.where(cool, state.temperature * config.cooling, state.temperature),
        key=key,
        it=it,
    )


@functools.partial(jax.jit, static_argnames=("config",))
def run(problem: AnnealProblem, key: jax.Array, config: AnnealConfig = AnnealConfig()):
    """Anneals until every chain stalls or `max_iters`; returns the best chain per layer.

    Args:
      problem: the window's problem.
      key: PRNG key (the same key gives the same answer).
      config: schedule.
    Returns:
      (x [layers, N] bool, energy [layers] float32, final AnnealState).
    """
    state = init(problem, key, config)

    def cond(s):
        return (s.it < config.max_iters) & jnp.any(s.stall < config.patience)

    state = jax.lax.while_loop(cond, lambda s: step(problem, s, config), state)
    best = jnp.argmin(state.best_energy, axis=1)  # [layers]
    x = jnp.take_along_axis(state.best_x, best[:, None, None], axis=1)[:, 0]
    x = settle(problem, x)
    return x, energy(problem, x), state


def settle(problem: AnnealProblem, x):
    """Undoes the moves of `x` [layers, N] that change no load of the window: [layers, N] bool.

    A block the window never touches (no forecast read, no host-side load at any weighted step)
    adds nothing to the energy wherever it lives, so the chains' random walk moves it at no cost
    (at the schedule's temperatures every such move is accepted), and a prefix init cuts resident
    idle blocks off with the busy ones it demotes. Moving it is not free after the window: a
    demoted block read later must be promoted again (an HBM write and a link crossing). So:
    promotions of idle blocks without terminal value are dropped, then idle resident blocks that
    `x` demotes are kept in the free slots, highest terminal value first (Belady's rule when the
    value comes from the next read), then lowest index (write order). Neither step raises the
    energy (no load moves, migration and terminal costs only fall), exceeds the capacity or
    adds a move against the budget.
    """
    w = (problem.weight > 0)[None, :, None]  # [1, W, 1]
    hh, hl = host_hbm_of(problem), host_link_of(problem)
    busy = jnp.any(w & ((problem.forecast != 0) | (hh != 0) | (hl != 0)), axis=1)  # [L, N]
    idle = problem.valid & ~busy
    x0 = problem.x0 & problem.valid
    v = value_of(problem)
    x = x & ~(~x0 & idle & (v <= 0))
    cand = x0 & ~x & idle
    free = problem.capacity - jnp.sum(x, axis=-1, keepdims=True)  # [L, 1]
    order = jnp.argsort(jnp.where(cand, -v, jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # position of each block among the candidates
    return x | (cand & (rank < free))

"""Simulated annealing over block -> tier assignments, chains and layers vmapped, inside jit.

Where things are: the problem and its energy (`AnnealProblem`, `loads`, `energy`) in
`jaxkv.placement.anneal.problem`, the exact-scan starting point (`greedy_init`) in
`jaxkv.placement.anneal.greedy`, the moves, their exact prices and the start's certificate
(`neighbourhood`, `certify`) in `jaxkv.placement.anneal.moves`, the chains, their schedule and `run`
here; the package `jaxkv.placement.anneal` exports their public names.

The state keeps per-step loads so the energy change of a move costs O(W); rating every block's
move costs O(N W) per chain and iteration.

Init (`greedy_init`): the best prefix of the blocks under four orderings (forecast mass, next
step first, residents first, link time saved in HBM; each an exact scan over all prefix sizes,
migration and budget included), x0 plus its best m swaps (an exact scan over m), or x0,
whichever has the lowest energy; every chain starts there. After the chains, `settle` undoes
the moves that change no load of the window.

Moves: each iteration a chain rates every block's move by the energy's slopes at its loads (one
dot product per block), takes the `candidates` k best of each tier, prices their k x k swaps, k
promotions and k demotions exactly (capacity and budget kept), and picks one of them or none
with probability proportional to exp(-(dE + tol) / T) against 1 for staying (a heat-bath choice:
at T -> 0 the best move that gains more than tol, else none).
Schedule (AnnealConfig; defaults 4 chains, at most 200 iterations, k = 8, T0 at the 0.1
quantile, t_final 1e-3, tolerance 0.05, patience 10): everything is scaled to the energy
change of one move, per layer, from the start's own candidate moves: T0 is the `t0_quantile`
quantile of their energy rises, and the tolerance tol is `tolerance` x their median |dE| (an
absolute energy). T cools geometrically to `t_final` x T0 at `max_iters`. A layer whose start is
certified locally optimal (`certify`: no single promotion, demotion or swap gains more than tol)
runs no chain. A (layer, chain) stops after `patience` consecutive iterations that improve its
best energy by at most tol; the loop stops when all have stopped or after `max_iters` (on a
CPU it exits then; compiled for a GPU it runs `max_iters` iterations that keep the state once
all have stopped, so that no iteration waits on the host: `run`'s `loop`). One
iteration = one move (or none) per chain per layer. The best chain per layer wins; the result
never has a higher energy than the start.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.config import AnnealConfig
from jaxkv.placement.anneal.greedy import greedy_init
from jaxkv.placement.anneal.moves import (
    BlockDeltas,
    block_deltas,
    certify,
    move_feasible,
    neighbourhood,
)

# AnnealProblem, loads, energy and greedy_init are also used as `jaxkv.anneal.X` by callers
from jaxkv.placement.anneal.problem import (
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


@pytree_dataclass
class AnnealState:
    """Chains of every layer. C = chains."""

    x: jax.Array  # [layers, C, N] bool
    count: jax.Array  # [layers, C] int32: blocks in HBM
    moved: jax.Array  # [layers, C] int32: blocks differing from x0
    hbm: jax.Array  # [layers, C, W] float32: HBM-side load bytes per step (without `fixed`)
    link: jax.Array  # [layers, C, W] float32: link-side load bytes per step
    miss: jax.Array  # [layers, C] float32 seconds: terminal value of the blocks out of HBM
    energy: jax.Array  # [layers, C] float32 seconds (load energy + miss)
    best_x: jax.Array  # [layers, C, N] bool
    best_energy: jax.Array  # [layers, C] float32
    ref_energy: jax.Array  # [layers, C] float32: best energy at the last gain above tol
    stall: jax.Array  # [layers, C] int32: iterations since that gain
    accepted: jax.Array  # [layers, C] int32: moves made
    t0: jax.Array  # [layers] float32 seconds: initial temperature
    tol: jax.Array  # [layers] float32 seconds: the stop tolerance
    start_energy: jax.Array  # [layers] float32 seconds: the greedy start's energy
    certified: jax.Array  # [layers] bool: the start is locally optimal (no chain runs)
    key: jax.Array  # [layers, C, 2] uint32: one PRNG key per chain
    it: jax.Array  # [] int32


@pytree_dataclass
class AnnealMetrics:
    """What one plan's annealing did, per layer."""

    start_energy: jax.Array  # [layers] float32 seconds: the greedy start's energy
    energy: jax.Array  # [layers] float32 seconds: the result's energy (<= start_energy)
    accepted: jax.Array  # [layers] int32: moves the layer's chains made, summed
    certified: jax.Array  # [layers] bool: the start was certified optimal; no chain ran
    iterations: jax.Array  # [] int32: iterations of the loop (all layers together)

    @staticmethod
    def empty(layers: int) -> AnnealMetrics:
        """The metrics before any plan (zeros)."""
        z = jnp.zeros((layers,), jnp.float32)
        return AnnealMetrics(z, z, jnp.zeros((layers,), jnp.int32), z > 0, jnp.int32(0))


@pytree_dataclass
class AnnealResult:
    """`run`'s answer: the placement, its metrics and the chains' final state."""

    x: jax.Array  # [layers, N] bool: the best chain's assignment per layer, settled
    metrics: AnnealMetrics
    state: AnnealState

    @property
    def energy(self) -> jax.Array:
        """[layers] float32 seconds: the energy of x."""
        return self.metrics.energy


@pytree_dataclass
class LayerProblem:
    """One layer's window as its chains see it (`_chain_step`, `_scale`): the per-block deltas
    of a move and the per-step figures. Under the vmap over layers every field but `fixed` and
    `weight` (the same for every layer) carries the layer axis (`_layer_axes`)."""

    dh: jax.Array  # [W, N] float32: HBM-side load change per step of promoting each block
    dl: jax.Array  # [W, N] float32: link-side load change
    dv: jax.Array  # [N] float32: terminal-value change
    dm: jax.Array  # [N] int32: change of the move count against x0
    valid: jax.Array  # [N] bool: placeable blocks
    fixed: jax.Array  # [W] float32: the HBM bytes of each step besides the KV (shared)
    weight: jax.Array  # [W] float32: each step's weight in the energy (shared)
    spread: jax.Array | None  # [W] float32 seconds, or None


@pytree_dataclass
class Chain:
    """One chain's assignment and its running loads (`AnnealState` without the layer and chain
    axes, less the bookkeeping `_step` keeps around it)."""

    x: jax.Array  # [N] bool
    count: jax.Array  # [] int32: blocks in HBM
    moved: jax.Array  # [] int32: blocks differing from x0
    hbm: jax.Array  # [W] float32
    link: jax.Array  # [W] float32
    miss: jax.Array  # [] float32 seconds
    key: jax.Array  # [2] uint32


def _layer_axes(spread) -> LayerProblem:
    """`LayerProblem`'s vmap axes over layers: 0 for every field but the shared ones."""
    sp = None if spread is None else 0
    return LayerProblem(dh=0, dl=0, dv=0, dm=0, valid=0, fixed=None, weight=None, spread=sp)


def _layer_problem(problem: AnnealProblem, deltas: BlockDeltas) -> LayerProblem:
    """Every layer's `LayerProblem`, stacked ([layers, ...] but fixed and weight)."""
    return LayerProblem(
        dh=deltas.dh,
        dl=deltas.dl,
        dv=deltas.dv,
        dm=deltas.dm,
        valid=problem.valid,
        fixed=problem.fixed,
        weight=problem.weight,
        spread=spread_of(problem, 2),
    )


def _hood(lp: LayerProblem, x, hbm, link, *, profile, k, split):
    """`neighbourhood` of assignment x [N] with loads hbm, link [W] in one layer."""
    return neighbourhood(
        lp.dh, lp.dl, lp.dv, lp.dm, lp.valid & ~x, x, hbm, link, lp.fixed, lp.weight, lp.spread,
        k=k, profile=profile, split=split,
    )  # fmt: skip


def temperature(state: AnnealState, config: AnnealConfig) -> jax.Array:
    """[layers] float32: T0 cooled geometrically to t_final x T0 at max_iters."""
    frac = state.it.astype(jnp.float32) / config.max_iters
    return state.t0 * jnp.asarray(config.t_final, jnp.float32) ** frac


def active(state: AnnealState, config: AnnealConfig) -> jax.Array:
    """[layers, C] bool: the chains still running (not certified, not stalled)."""
    return ~state.certified[:, None] & (state.stall < config.patience)


@functools.partial(jax.jit, static_argnames=("config",))
def init(
    problem: AnnealProblem, key: jax.Array, config: AnnealConfig = AnnealConfig()
) -> AnnealState:
    """Builds the chains (all starting from `greedy_init`) with one PRNG key per (layer, chain),
    the schedule's scale (T0 and the tolerance, from the start's candidate moves) and the
    start's certificate.

    Args:
      problem: the window's problem.
      key: PRNG key.
      config: schedule; `config.chains` chains per layer.
    Returns:
      AnnealState.
    """
    return _init(problem, block_deltas(problem), key, config)


def _init(problem: AnnealProblem, deltas: BlockDeltas, key: jax.Array, config: AnnealConfig):
    """`init` with the problem's per-block deltas given (`run` computes them once for both)."""
    layers, n = problem.x0.shape
    c = config.chains
    x = greedy_init(problem)  # [L, N]
    hbm, link = loads(problem, x)  # [L, W]
    miss = miss_of(problem, x)
    sp = spread_of(problem, hbm.ndim)
    e = energy_of_loads(hbm, link, problem.fixed, problem.weight, problem.profile, sp) + miss
    moved = jnp.sum(x != problem.x0, -1).astype(jnp.int32)
    t0, tol = _scale(problem, deltas, x, hbm, link, moved, e, config)
    certified = certify(problem, deltas, x, hbm, link, moved, tol)
    if not jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    keys = jax.random.key_data(jax.random.split(key, (layers, c)))  # [layers, C, 2]

    def chains(v):  # [L, ...] -> [L, C, ...]
        return jnp.broadcast_to(v[:, None], v.shape[:1] + (c,) + v.shape[1:])

    return AnnealState(
        x=chains(x),
        count=chains(jnp.sum(x, -1).astype(jnp.int32)),
        moved=chains(moved),
        hbm=chains(hbm),
        link=chains(link),
        miss=chains(miss),
        energy=chains(e),
        best_x=chains(x),
        best_energy=chains(e),
        ref_energy=chains(e),
        stall=jnp.where(certified[:, None], config.patience, jnp.zeros((layers, c), jnp.int32)),
        accepted=jnp.zeros((layers, c), jnp.int32),
        t0=t0,
        tol=tol,
        start_energy=e,
        certified=certified,
        key=keys.astype(jnp.uint32),
        it=jnp.zeros((), jnp.int32),
    )


def _scale(problem, deltas: BlockDeltas, x, hbm, link, moved, e, config: AnnealConfig):
    """(T0, tol) [layers] seconds from the start's candidate moves (`neighbourhood`, capacity
    and budget kept): T0 the `t0_quantile` quantile of their energy rises, tol `tolerance` x
    their median |dE|. Changes below float32's resolution of the energy (1e-6 x |E|) count as
    none; without any move above it both fall back to that resolution."""
    lp = _layer_problem(problem, deltas)
    hood = jax.vmap(
        functools.partial(_hood, profile=problem.profile, **_hood_size(problem, config)),
        in_axes=(_layer_axes(lp.spread), 0, 0, 0),
    )
    de, enter, leave, ok = hood(lp, x, hbm, link)
    feasible = functools.partial(move_feasible, cap=problem.capacity, budget=problem.budget)
    fits = jax.vmap(feasible)(enter, leave, deltas.dm, jnp.sum(x, -1), moved)
    floor = 1e-6 * jnp.abs(e)  # [L]
    real = ok & fits & (jnp.abs(de) > floor[:, None])
    scale = jnp.nanmedian(jnp.where(real, jnp.abs(de), jnp.nan), axis=-1)
    rise = jnp.nanquantile(jnp.where(real & (de > 0), de, jnp.nan), config.t0_quantile, axis=-1)
    scale = jnp.where(jnp.isnan(scale), floor, scale)
    t0 = jnp.where(jnp.isnan(rise), scale, rise)
    return t0.astype(jnp.float32), (config.tolerance * scale).astype(jnp.float32)


def _hood_size(problem: AnnealProblem, config: AnnealConfig) -> dict:
    """`neighbourhood`'s static k (at most N) and split (a budget below N can bind)."""
    n = problem.x0.shape[-1]
    return dict(k=min(config.candidates, n), split=problem.budget < n)


def _chain_step(
    lp: LayerProblem, ch: Chain, temp, tol, run, *, profile, cap, budget, k, split
) -> tuple[Chain, jax.Array, jax.Array]:
    """One move (or none) of one chain of one layer: (the chain after, its energy [], whether
    it moved [] bool). temp, tol: [] the layer's temperature and stop tolerance; run: [] bool
    (False: the chain has stopped and stays)."""
    k_pick, k_next = jax.random.split(jax.random.wrap_key_data(ch.key))
    de, enter, leave, ok = _hood(lp, ch.x, ch.hbm, ch.link, profile=profile, k=k, split=split)
    dm = lp.dm
    ok = ok & move_feasible(enter, leave, dm, ch.count, ch.moved, cap=cap, budget=budget)
    # staying costs 0, a move its energy change plus tol (a gain below tol is no gain)
    cost = jnp.concatenate([jnp.zeros((1,), de.dtype), jnp.where(ok, de + tol, jnp.inf)])
    logits = -cost / jnp.maximum(temp, 1e-30) + jax.random.gumbel(k_pick, cost.shape)
    pick = jnp.where(run, jnp.argmax(logits), 0)
    m = jnp.maximum(pick - 1, 0)
    moving = pick > 0
    j, i = enter[m], leave[m]
    has_j, has_i = moving & (j >= 0), moving & (i >= 0)
    j, i = jnp.maximum(j, 0), jnp.maximum(i, 0)
    x = ch.x.at[i].set(jnp.where(has_i, False, ch.x[i]))
    x = x.at[j].set(jnp.where(has_j, True, x[j]))
    sj, si = has_j.astype(jnp.float32), has_i.astype(jnp.float32)
    hbm = ch.hbm + sj * lp.dh[:, j] - si * lp.dh[:, i]
    link = ch.link + sj * lp.dl[:, j] - si * lp.dl[:, i]
    miss = ch.miss + sj * lp.dv[j] - si * lp.dv[i]
    count = ch.count + has_j.astype(jnp.int32) - has_i.astype(jnp.int32)
    moved = ch.moved + jnp.where(has_j, dm[j], 0) - jnp.where(has_i, dm[i], 0)
    e = energy_of_loads(hbm, link, lp.fixed, lp.weight, profile, lp.spread) + miss
    key = jax.random.key_data(k_next)
    return Chain(x, count, moved, hbm, link, miss, key), e, moving


@functools.partial(jax.jit, static_argnames=("config",))
def step(problem: AnnealProblem, state: AnnealState, config: AnnealConfig = AnnealConfig()):
    """One iteration: one move (or none) per running chain per layer, then best and stall."""
    return _step(problem, block_deltas(problem), state, config)


def _step(problem: AnnealProblem, deltas: BlockDeltas, state: AnnealState, config):
    chain = functools.partial(
        _chain_step,
        profile=problem.profile,
        cap=problem.capacity,
        budget=problem.budget,
        **_hood_size(problem, config),
    )
    lp = _layer_problem(problem, deltas)
    # (problem, chain, temp, tol, run): one vmap over a layer's chains, one over the layers
    over_chains = jax.vmap(chain, in_axes=(None, 0, None, None, 0))
    over_layers = jax.vmap(over_chains, in_axes=(_layer_axes(lp.spread), 0, 0, 0, 0))
    run = active(state, config)
    chains = Chain(
        x=state.x,
        count=state.count,
        moved=state.moved,
        hbm=state.hbm,
        link=state.link,
        miss=state.miss,
        key=state.key,
    )
    ch, e, moving = over_layers(lp, chains, temperature(state, config), state.tol, run)
    better = e < state.best_energy
    best_e = jnp.minimum(e, state.best_energy)
    gain = best_e < state.ref_energy - state.tol[:, None]
    return AnnealState(
        x=ch.x,
        count=ch.count,
        moved=ch.moved,
        hbm=ch.hbm,
        link=ch.link,
        miss=ch.miss,
        energy=e,
        best_x=jnp.where(better[..., None], ch.x, state.best_x),
        best_energy=best_e,
        ref_energy=jnp.where(gain, best_e, state.ref_energy),
        stall=jnp.where(run, jnp.where(gain, 0, state.stall + 1), state.stall),
        accepted=state.accepted + moving.astype(jnp.int32),
        t0=state.t0,
        tol=state.tol,
        start_energy=state.start_energy,
        certified=state.certified,
        key=ch.key,
        it=state.it + 1,
    )


LOOPS = ("auto", "converge", "fixed")


@functools.partial(jax.jit, static_argnames=("config", "loop"))
def run(
    problem: AnnealProblem,
    key: jax.Array,
    config: AnnealConfig = AnnealConfig(),
    loop: str = "auto",
) -> AnnealResult:
    """Anneals until every chain stops (certified start, or stalled) or `max_iters`; returns
    the best chain per layer, settled.

    Args:
      problem: the window's problem.
      key: PRNG key (the same key gives the same answer).
      config: schedule.
      loop: how the iterations run; every choice gives the same result, metrics included.
        "converge": a while loop that exits when every chain has stopped. On a GPU its
        condition is a device value the host reads after every iteration (XLA's WhileThunk
        copies the predicate back: a host sync per iteration, and a loop of unknown trip
        count). "fixed": `max_iters` iterations, those after the stop keeping the state as
        it is: a loop of known trip count that never waits on the host. "auto" (the default):
        "converge" where the program is lowered for a CPU (the host is the device; it stops
        early), "fixed" elsewhere (`jax.lax.platform_dependent`, resolved at lowering, so a
        program compiled for a GPU holds no branch either).
    Returns:
      AnnealResult: x [layers, N] bool, metrics (start and result energies, moves made,
      certified layers, iterations) and the final AnnealState.
    """
    if loop not in LOOPS:
        raise ValueError(f"anneal.run loop={loop!r}: expected one of {LOOPS}")
    deltas = block_deltas(problem)
    state = _init(problem, deltas, key, config)

    def cond(s):
        return (s.it < config.max_iters) & jnp.any(active(s, config))

    def body(s):
        return _step(problem, deltas, s, config)

    def converge(s):
        return jax.lax.while_loop(cond, body, s)

    def fixed(s):
        def kept(_, s):
            go = cond(s)
            return jax.tree.map(lambda new, old: jnp.where(go, new, old), body(s), s)

        return jax.lax.fori_loop(0, config.max_iters, kept, s)

    if loop == "auto":
        state = jax.lax.platform_dependent(state, cpu=converge, default=fixed)
    else:
        state = (converge if loop == "converge" else fixed)(state)
    best = jnp.argmin(state.best_energy, axis=1)  # [layers]
    x = jnp.take_along_axis(state.best_x, best[:, None, None], axis=1)[:, 0]
    x = settle(problem, x)
    metrics = AnnealMetrics(
        start_energy=state.start_energy,
        energy=energy(problem, x),
        accepted=jnp.sum(state.accepted, axis=1),
        certified=state.certified,
        iterations=state.it,
    )
    return AnnealResult(x=x, metrics=metrics, state=state)


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

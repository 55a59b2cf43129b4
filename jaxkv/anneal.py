"""Simulated annealing over block -> tier assignments, chains and layers vmapped, inside jit.

Problem (per layer): choose x in {0, 1}^N (1 = HBM) with x <= valid, sum x <= capacity and at most
`budget` blocks differing from the current assignment x0, minimizing the window energy

  E(x) = sum_t w_t max((fixed_t + hbm_t(x)) / B_hbm, link_t(x) / B_link) + sum_i v_i (1 - x_i)
  hbm_t(x)  = b * sum_i (A[t, i] x_i + H[t, i] (1 - x_i)) + [t = 0] b * (sum_{i in P} h_i + d |D|)
  link_t(x) = b * sum_i G[t, i] (1 - x_i)                 + [t = 0] b * (sum_{i in P} l_i + d |D|)
              + u_t

with w_t a per-step weight (1, or a discount for receding-horizon planning; 0 on padding), u_t an
optional link load no assignment changes (`fixed_link`: e.g. the reads a forecast cannot place),
A[t, i] the forecast (probability or 0/1) that block i is read at step t, H and G the HBM-side
and link-side loads of block i at step t when the plan leaves it on host (`host_hbm`, default
0, and `host_link`, default A: the placement held for the whole window), b the block bytes,
P = x & ~x0 the promotions (h_i = promote_hbm, l_i = promote_link: per block, so the caller can
price a block that crosses the link anyway, see `jaxkv.policies.Anneal`) and D = x0 & ~x the
demotions (d = 0 when host memory keeps a copy of every block, as in the paper; 1 for an exclusive
cache), all charged to the window's first step
(see `jaxkv.cost`), and v_i >= 0 an optional terminal value (seconds): what leaving block i on host
costs after the window (e.g. the link transfer of a read beyond it), so that among placements
the window alone cannot tell apart the planner keeps the blocks needed soonest (Belady's rule).
With an optional spread s_t > 0 (`spread`: the loads are forecasts, uncertain), a step costs its
expected time, E max(T_hbm, T_link + s_t Z) with Z standard normal, in place of the max of the
loads; it keeps the plan's link time below the HBM time by a margin that grows with s_t.
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
Schedule (AnnealConfig, defaults from the seed article): T0 = t0_fraction x the init energy,
multiplied by `cooling` every `cooling_every` iterations; a (layer, chain) stalls after `patience`
consecutive iterations that improve its best energy by less than `min_improvement` (relative);
the loop stops when all have stalled or after `max_iters`. One iteration = one proposal per chain
per layer. The best chain per layer wins.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass, static_field
from jaxkv.config import AnnealConfig, HardwareProfile


@pytree_dataclass
class AnnealProblem:
    """One window's placement problem for every layer."""

    forecast: jax.Array  # [layers, W, N] float32: A[t, i], expected reads of block i at step t
    x0: jax.Array  # [layers, N] bool: current assignment (True = HBM)
    valid: jax.Array  # [layers, N] bool: placeable blocks
    fixed: jax.Array  # [W] float32: HBM bytes every step reads anyway (weights + write)
    weight: jax.Array  # [W] float32: weight of each step in the energy (discount; 0 = padding)
    promote_hbm: jax.Array  # [layers, N] float32: HBM-side bytes of promoting a block, x b
    promote_link: jax.Array  # [layers, N] float32: link-side bytes of promoting a block, x b
    profile: HardwareProfile = static_field()
    block_bytes: float = static_field(default=1.0)
    capacity: int = static_field(default=0)  # HBM pool blocks per layer
    budget: int = static_field(default=1 << 30)  # max blocks moved per layer per window
    demote_cost: float = static_field(default=0.0)  # d: demotion bytes per side, x block bytes
    # [layers, N] float32 seconds, or None (zeros): what leaving block i out of HBM at the
    # window's end costs later (a terminal value for reads beyond the window; see `energy`)
    value: jax.Array | None = None
    # [layers, W] float32 bytes, or None (zeros): link load every assignment has at each step,
    # e.g. the expected reads the forecast cannot place (blocks entering the read set unforeseen)
    fixed_link: jax.Array | None = None
    # [layers, W, N] float32, or None: the loads (x block bytes) block i puts on the HBM side
    # (host_hbm; None = 0) and on the link (host_link; None = forecast) at step t when the plan
    # leaves it on host. The defaults price a plan as one placement held for the whole window;
    # a receding-horizon plan can price the later re-plans instead, e.g. a host block promoted
    # at its first read (the read carries it to HBM, later reads hit): see `jaxkv.policies`.
    host_hbm: jax.Array | None = None
    host_link: jax.Array | None = None
    # [layers, W] float32 seconds, or None (zeros): the deviation of each step's link time minus
    # its HBM time around the loads' values (the loads are forecasts); a step then costs its
    # expected time, not the max of its expected loads (see `_energy_of_loads`)
    spread: jax.Array | None = None


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


def _energy_of_loads(hbm, link, fixed, weight, profile: HardwareProfile, spread=None):
    """hbm, link: [..., W] bytes; fixed, weight: [W]; spread: None or broadcastable to [..., W]
    seconds -> [...] seconds.

    Each step costs max(HBM time, link time), or with a spread s > 0 its expectation when the
    link time minus the HBM time is Gaussian around the loads' difference d with deviation s:
    HBM time + s phi(d / s) + d Phi(d / s) (>= the max of the means; equal at s = 0).
    """
    th = (hbm + fixed) / profile.hbm_bandwidth
    tl = link / profile.link_bandwidth
    t = jnp.maximum(th, tl)
    if spread is not None:
        s = jnp.broadcast_to(spread, t.shape)
        safe = jnp.maximum(s, 1e-30)
        z = (tl - th) / safe
        smooth = th + safe * jax.scipy.stats.norm.pdf(z) + (tl - th) * jax.scipy.special.ndtr(z)
        t = jnp.where(s > 0, jnp.maximum(smooth, t), t)
    return jnp.sum(t * weight, axis=-1)


def _spread(problem: AnnealProblem, ndim: int):
    """problem.spread [layers, W] reshaped to broadcast with [layers, ..., W] (ndim axes)."""
    if problem.spread is None:
        return None
    sp = problem.spread.astype(jnp.float32)
    return sp.reshape(sp.shape[:1] + (1,) * (ndim - 2) + sp.shape[1:])


def loads(problem: AnnealProblem, x):
    """Per-step loads of assignments x: [layers, ..., N] bool -> (hbm, link) [layers, ..., W].

    A full recomputation (used by init and by tests to check the O(W) deltas).
    """
    b, d = problem.block_bytes, problem.demote_cost
    a = problem.forecast  # [L, W, N]
    lead = x.shape[:-1]
    xb = x.reshape(x.shape[0], -1, x.shape[-1])  # [L, M, N]
    xf = xb.astype(jnp.float32)
    hh, hl = _host_hbm(problem), _host_link(problem)
    hbm = b * jnp.einsum("ltn,lmn->lmt", a - hh, xf) + b * jnp.sum(hh, -1)[:, None, :]
    link = b * (jnp.sum(hl, -1)[:, None, :] - jnp.einsum("ltn,lmn->lmt", hl, xf))  # [L, M, W]
    x0 = problem.x0[:, None, :]
    pro = (xb & ~x0).astype(jnp.float32)  # [L, M, N]
    dem = jnp.sum(x0 & ~xb, axis=-1).astype(jnp.float32)  # [L, M]
    mig_h = b * (jnp.sum(pro * problem.promote_hbm[:, None, :], -1) + d * dem)
    mig_l = b * (jnp.sum(pro * problem.promote_link[:, None, :], -1) + d * dem)
    first = (jnp.arange(a.shape[1]) == 0).astype(jnp.float32)  # [W]
    shape = lead + (a.shape[1],)
    return (
        (hbm + mig_h[..., None] * first).reshape(shape),
        (link + mig_l[..., None] * first + _fixed_link(problem)[:, None]).reshape(shape),
    )


def _host_hbm(problem: AnnealProblem):
    """[layers, W, N]: HBM-side load of a block left on host (zeros when None)."""
    if problem.host_hbm is None:
        return jnp.zeros_like(problem.forecast)
    return problem.host_hbm.astype(jnp.float32)


def _host_link(problem: AnnealProblem):
    """[layers, W, N]: link-side load of a block left on host (the forecast when None)."""
    if problem.host_link is None:
        return problem.forecast
    return problem.host_link.astype(jnp.float32)


def _fixed_link(problem: AnnealProblem):
    """[layers, W] float32 bytes: the assignment-independent link load (zeros when none)."""
    shape = problem.forecast.shape[:2]
    if problem.fixed_link is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(problem.fixed_link.astype(jnp.float32), shape)


def _value(problem: AnnealProblem):
    """[layers, N] float32: the terminal value (zeros when the problem has none)."""
    if problem.value is None:
        return jnp.zeros(problem.x0.shape, jnp.float32)
    return problem.value.astype(jnp.float32)


def _miss(problem: AnnealProblem, x):
    """Terminal value of the blocks out of HBM: [layers, ..., N] bool -> [layers, ...] seconds."""
    v = _value(problem)
    xb = x.reshape(x.shape[0], -1, x.shape[-1])
    miss = jnp.einsum("ln,lmn->lm", v, 1.0 - xb.astype(jnp.float32))
    return miss.reshape(x.shape[:-1])


def energy(problem: AnnealProblem, x):
    """Window energy of assignments x: [layers, ..., N] bool -> [layers, ...] seconds.

    The window's step times plus the terminal value of every block left out of HBM.
    """
    hbm, link = loads(problem, x)
    sp = _spread(problem, hbm.ndim)
    e = _energy_of_loads(hbm, link, problem.fixed, problem.weight, problem.profile, sp)
    return e + _miss(problem, x)


def _ordered_sums(v, order):
    """Sums of v over the first k blocks of `order` [L, N], k = 0..N: [L, ..., N] -> [L, ...,
    N + 1] (v per block [L, N], or per step and block [L, W, N])."""
    idx = order.reshape(order.shape[:1] + (1,) * (v.ndim - 2) + order.shape[1:])
    vs = jnp.take_along_axis(v, jnp.broadcast_to(idx, v.shape), axis=-1)
    zero = jnp.zeros(vs.shape[:-1] + (1,), vs.dtype)
    return jnp.concatenate([zero, jnp.cumsum(vs, axis=-1)], axis=-1)


def _best_prefix(problem: AnnealProblem, score):
    """Best prefix of the valid blocks ordered by `score` [L, N]: (x [L, N] bool, energy [L])."""
    b, cap, d = problem.block_bytes, problem.capacity, problem.demote_cost
    a, valid = problem.forecast, problem.valid
    x0 = problem.x0 & valid
    n = a.shape[-1]
    order = jnp.argsort(jnp.where(valid, -score, jnp.inf), axis=-1, stable=True)  # [L, N]
    hh, hl = _host_hbm(problem), _host_link(problem)
    sums = functools.partial(_ordered_sums, order=order)  # over the first k blocks, k = 0..N
    hbm = b * (sums(a - hh) + jnp.sum(hh, -1, keepdims=True))  # [L, W, N+1]
    cl = sums(hl)
    link = b * (cl[..., -1:] - cl) + _fixed_link(problem)[..., None]

    kept = sums(x0.astype(jnp.float32))
    k = jnp.arange(n + 1, dtype=jnp.float32)
    pro = k - kept
    pro_hbm = sums((~x0) * problem.promote_hbm)
    pro_link = sums((~x0) * problem.promote_link)
    dem = jnp.sum(x0, -1, keepdims=True) - kept
    first = (jnp.arange(a.shape[1]) == 0)[None, :, None]
    mig_h = (b * (pro_hbm + d * dem))[:, None, :] * first  # [L, W, N+1]
    mig_l = (b * (pro_link + d * dem))[:, None, :] * first
    v = _value(problem) * valid
    e = _energy_of_loads(
        jnp.swapaxes(hbm + mig_h, 1, 2),
        jnp.swapaxes(link + mig_l, 1, 2),
        problem.fixed,
        problem.weight,
        problem.profile,
        _spread(problem, 3),
    ) + (jnp.sum(v, -1, keepdims=True) - sums(v))  # [L, N+1]
    nvalid = jnp.sum(valid, axis=-1, keepdims=True)
    ok = (k <= cap) & (k <= nvalid) & (pro + dem <= problem.budget)
    e = jnp.where(ok, e, jnp.inf)
    # Among (near-)ties keep the most blocks: a block unread within the window is free to keep,
    # and dropping it would cost a promotion if it is read after the window.
    best = jnp.min(e, axis=-1)
    near = e <= best[:, None] * (1.0 + 1e-6)
    best_k = n - jnp.argmax(near[:, ::-1], axis=-1)  # [L]: the largest near-optimal k
    rank = jnp.argsort(order, axis=-1)  # [L, N]: position of each block in the order
    return (rank < best_k[:, None]) & valid, best


def greedy_init(problem: AnnealProblem):
    """The best of x0, the best prefixes of four orderings and x0's best swaps: [layers, N] bool.

    Orderings: by weighted forecast mass over the window; next-step reads first (then mass);
    resident blocks first (then mass: the fewest moves); by the link time a block saves in HBM
    (its weighted host-side link load, less its promotion's link transfer if it is not resident,
    plus its terminal value; ties: resident first). Each is scanned exactly over all prefix
    sizes (migration, capacity and budget included). The last is the only one that ranks a
    resident block with terminal value but no read in the window above a promotion that saves
    nothing (a host block read only at the first step, whose promotion rides on that read), and
    below one that saves a read: without it, a pool full of such residents keeps x0 whatever the
    window reads (measured: 35 swaps 10% better than x0 were missed, recency-high s = 0.8).
    A prefix still moves every block on the wrong side of its cut: it promotes all the host
    blocks it ranks above a resident or none, and no prefix fits a migration budget once the
    pool is full. `_best_swaps` (x0 plus its best m promotions by the same saved-link score, each
    for the least valuable resident once the free slots are used) covers the partial trades: on
    recency-low s = 0.6 the prefixes' all-or-nothing plans promoted about 100 blocks every third
    step and the plans between demoted blocks read that very step to use the idle link; the best
    swaps found plans 3% lower in energy with half the moves, and a steady 25-45 promotions.
    """
    a, w = problem.forecast, problem.weight
    x0 = problem.x0 & problem.valid
    mass = jnp.einsum("ltn,t->ln", a, w)
    mass = mass / jnp.maximum(jnp.max(mass, axis=-1, keepdims=True), 1e-30)
    val = _value(problem)
    v = val / jnp.maximum(jnp.max(val, axis=-1, keepdims=True), 1e-30)
    unit = problem.block_bytes / problem.profile.link_bandwidth  # seconds of one block's read
    saved = jnp.einsum("ltn,t->ln", _host_link(problem), w) - (~x0) * problem.promote_link
    saved = saved + val / unit
    scores = (
        mass * (1.0 + 1e-3 * x0) + 1e-3 * v + 1e-9 * x0,  # ties: the terminal value, then stay
        a[:, 0] + 1e-3 * mass + 1e-6 * v + 1e-9 * x0,
        x0 + 1e-3 * mass + 1e-6 * v,
        saved + 1e-6 * x0,
    )
    best_x, best_e = (
        x0,
        jnp.where(jnp.sum(x0, -1) <= problem.capacity, energy(problem, x0), jnp.inf),
    )
    cands = [_best_prefix(problem, score) for score in scores]
    cands.append(_best_swaps(problem, saved))
    for x, e in cands:
        better = e < best_e
        best_x = jnp.where(better[:, None], x, best_x)
        best_e = jnp.where(better, e, best_e)
    return best_x


def _best_swaps(problem: AnnealProblem, score):
    """x0 plus its best m promotions by `score` [L, N] (highest first), each demoting the
    lowest-scored resident once the free slots are used, scanned exactly over every m whose
    moves fit the budget: (x [L, N] bool, energy [L])."""
    b, d, cap = problem.block_bytes, problem.demote_cost, problem.capacity
    a, valid = problem.forecast, problem.valid
    x0 = problem.x0 & valid
    n = a.shape[-1]
    hh, hl = _host_hbm(problem), _host_link(problem)
    host = valid & ~x0
    up = jnp.argsort(jnp.where(host, -score, jnp.inf), axis=-1, stable=True)  # promote first
    down = jnp.argsort(jnp.where(x0, score, jnp.inf), axis=-1, stable=True)  # demote first
    s = _ordered_sums
    m = jnp.arange(n + 1)
    free = jnp.maximum(cap - jnp.sum(x0, -1, keepdims=True), 0)  # [L, 1]
    k = jnp.maximum(m[None] - free, 0)  # [L, N + 1]: demotions after m promotions
    nhost = jnp.sum(host, -1, keepdims=True)
    nres = jnp.sum(x0, -1, keepdims=True)

    def demoted(v):  # sums of v over the first k blocks of `down`, for every m
        c = s(v, down)
        idx = jnp.minimum(k, n).reshape(k.shape[:1] + (1,) * (c.ndim - 2) + k.shape[1:])
        return jnp.take_along_axis(c, jnp.broadcast_to(idx, c.shape), axis=-1)

    hbm0, link0 = loads(problem, x0)  # [L, W]
    hbm = hbm0[..., None] + b * (s(a - hh, up) - demoted(a - hh))  # [L, W, N + 1]
    link = link0[..., None] - b * (s(hl, up) - demoted(hl))
    first = (jnp.arange(a.shape[1]) == 0)[None, :, None]
    mig_h = b * (s(problem.promote_hbm * host, up) + d * k)[:, None, :] * first
    mig_l = b * (s(problem.promote_link * host, up) + d * k)[:, None, :] * first
    v = _value(problem) * valid
    miss = _miss(problem, x0)[:, None] - s(v * host, up) + demoted(v * x0)
    e = (
        _energy_of_loads(
            jnp.swapaxes(hbm + mig_h, 1, 2),
            jnp.swapaxes(link + mig_l, 1, 2),
            problem.fixed,
            problem.weight,
            problem.profile,
            _spread(problem, 3),
        )
        + miss
    )  # [L, N + 1]
    ok = (m[None] <= nhost) & (k <= nres) & (m[None] + k <= problem.budget)
    e = jnp.where(ok, e, jnp.inf)
    best_m = jnp.argmin(e, axis=-1)  # [L]
    best_k = jnp.take_along_axis(k, best_m[:, None], -1)  # [L, 1]
    r_up = jnp.argsort(up, axis=-1)  # position of each block in the promotion order
    r_down = jnp.argsort(down, axis=-1)
    x = (x0 & ~(r_down < best_k)) | (host & (r_up < best_m[:, None]))
    return x, jnp.min(e, axis=-1)


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
    miss = _miss(problem, x)
    sp = _spread(problem, hbm.ndim)
    e = _energy_of_loads(hbm, link, problem.fixed, problem.weight, problem.profile, sp) + miss
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
    has_i = ~promote  # a block leaves HBM
    has_j = ~demote  # a block enters HBM
    i = perm[p]
    j = perm[q]
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
    sp = spread if has_spread else None
    new_e = _energy_of_loads(new_hbm, new_link, fixed, weight, profile, sp) + new_miss
    de = new_e - e
    metropolis = jax.random.uniform(k_acc) < jnp.exp(
        -jnp.maximum(de, 0.0) / jnp.maximum(temp, 1e-30)
    )
    accept = feasible & (moved + dmoved <= budget) & ((de <= 0) | metropolis)
    # Exchange two positions of perm: swap (p, q); promotion (q, count); demotion (p, count - 1).
    pa = jnp.where(promote, q, p)
    pb = jnp.where(swap, q, jnp.where(promote, count, count - 1))
    va, vb = perm[pa], perm[pb]
    perm = perm.at[pa].set(jnp.where(accept, vb, va)).at[pb].set(jnp.where(accept, va, vb))
    x = x.at[i].set(jnp.where(accept & has_i, False, x[i]))
    x = x.at[j].set(jnp.where(accept & has_j, True, x[j]))
    dcount = jnp.where(swap, 0, jnp.where(promote, 1, -1))
    count = count + jnp.where(accept, dcount, 0)
    moved = moved + jnp.where(accept, dmoved, 0)
    hbm = jnp.where(accept, new_hbm, hbm)
    link = jnp.where(accept, new_link, link)
    miss = jnp.where(accept, new_miss, miss)
    e = jnp.where(accept, new_e, e)
    return x, perm, count, moved, hbm, link, miss, e, jax.random.key_data(k_next)


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
    a = problem.forecast
    x, perm, count, moved, hbm, link, miss, e, key = over_layers(
        a,
        a if problem.host_hbm is None else problem.host_hbm,
        a if problem.host_link is None else problem.host_link,
        problem.x0,
        problem.promote_hbm,
        problem.promote_link,
        _value(problem),
        problem.fixed,
        problem.weight,
        jnp.zeros(problem.x0.shape[:1] + problem.weight.shape, jnp.float32)
        if problem.spread is None
        else problem.spread.astype(jnp.float32),
        state.x,
        state.perm,
        state.count,
        state.nvalid,
        state.moved,
        state.hbm,
        state.link,
        state.miss,
        state.energy,
        state.key,
        state.temperature,
    )
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
    hh, hl = _host_hbm(problem), _host_link(problem)
    busy = jnp.any(w & ((problem.forecast != 0) | (hh != 0) | (hl != 0)), axis=1)  # [L, N]
    idle = problem.valid & ~busy
    x0 = problem.x0 & problem.valid
    v = _value(problem)
    x = x & ~(~x0 & idle & (v <= 0))
    cand = x0 & ~x & idle
    free = problem.capacity - jnp.sum(x, axis=-1, keepdims=True)  # [L, 1]
    order = jnp.argsort(jnp.where(cand, -v, jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # position of each block among the candidates
    return x | (cand & (rank < free))

"""The annealer's starting point, `greedy_init`: the lowest-energy of x0, the best prefixes of
four block orderings and x0 plus its best swaps, each scanned exactly over every size (migration,
capacity and budget included) rather than sampled.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxkv.placement.anneal.problem import (
    AnnealProblem,
    energy,
    energy_of_loads,
    fixed_link_of,
    host_hbm_of,
    host_link_of,
    loads,
    miss_of,
    spread_of,
    value_of,
)


def _ordered_sums(v, order):
    """Sums of v over the first k blocks of `order` [L, N], k = 0..N: [L, ..., N] -> [L, ...,
    N + 1] (v per block [L, N], or per step and block [L, W, N])."""
    idx = order.reshape(order.shape[:1] + (1,) * (v.ndim - 2) + order.shape[1:])
    vs = jnp.take_along_axis(v, jnp.broadcast_to(idx, v.shape), axis=-1)
    zero = jnp.zeros(vs.shape[:-1] + (1,), vs.dtype)
    return jnp.concatenate([zero, jnp.cumsum(vs, axis=-1)], axis=-1)


def best_prefix(problem: AnnealProblem, score):
    """Best prefix of the valid blocks ordered by `score` [L, N]: (x [L, N] bool, energy [L])."""
    b, cap, d = problem.block_bytes, problem.capacity, problem.demote_cost
    a, valid = problem.forecast, problem.valid
    x0 = problem.x0 & valid
    n = a.shape[-1]
    order = jnp.argsort(jnp.where(valid, -score, jnp.inf), axis=-1, stable=True)  # [L, N]
    hh, hl = host_hbm_of(problem), host_link_of(problem)
    sums = functools.partial(_ordered_sums, order=order)  # over the first k blocks, k = 0..N
    hbm = b * (sums(a - hh) + jnp.sum(hh, -1, keepdims=True))  # [L, W, N+1]
    cl = sums(hl)
    link = b * (cl[..., -1:] - cl) + fixed_link_of(problem)[..., None]

    kept = sums(x0.astype(jnp.float32))
    k = jnp.arange(n + 1, dtype=jnp.float32)
    pro = k - kept
    pro_hbm = sums((~x0) * problem.promote_hbm)
    pro_link = sums((~x0) * problem.promote_link)
    dem = jnp.sum(x0, -1, keepdims=True) - kept
    first = (jnp.arange(a.shape[1]) == 0)[None, :, None]
    mig_h = (b * (pro_hbm + d * dem))[:, None, :] * first  # [L, W, N+1]
    mig_l = (b * (pro_link + d * dem))[:, None, :] * first
    v = value_of(problem) * valid
    e = energy_of_loads(
        jnp.swapaxes(hbm + mig_h, 1, 2),
        jnp.swapaxes(link + mig_l, 1, 2),
        problem.fixed,
        problem.weight,
        problem.profile,
        spread_of(problem, 3),
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
    pool is full. `best_swaps` (x0 plus its best m promotions by the same saved-link score, each
    for the least valuable resident once the free slots are used) covers the partial trades: on
    recency-low s = 0.6 the prefixes' all-or-nothing plans promoted about 100 blocks every third
    step and the plans between demoted blocks read that very step to use the idle link; the best
    swaps found plans 3% lower in energy with half the moves, and a steady 25-45 promotions.
    """
    a, w = problem.forecast, problem.weight
    x0 = problem.x0 & problem.valid
    mass = jnp.einsum("ltn,t->ln", a, w)
    mass = mass / jnp.maximum(jnp.max(mass, axis=-1, keepdims=True), 1e-30)
    val = value_of(problem)
    v = val / jnp.maximum(jnp.max(val, axis=-1, keepdims=True), 1e-30)
    unit = problem.block_bytes / problem.profile.link_bandwidth  # seconds of one block's read
    saved = jnp.einsum("ltn,t->ln", host_link_of(problem), w) - (~x0) * problem.promote_link
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
    cands = [best_prefix(problem, score) for score in scores]
    cands.append(best_swaps(problem, saved))
    for x, e in cands:
        better = e < best_e
        best_x = jnp.where(better[:, None], x, best_x)
        best_e = jnp.where(better, e, best_e)
    return best_x


def best_swaps(problem: AnnealProblem, score):
    """x0 plus its best m promotions by `score` [L, N] (highest first), each demoting the
    lowest-scored resident once the free slots are used, scanned exactly over every m whose
    moves fit the budget: (x [L, N] bool, energy [L])."""
    b, d, cap = problem.block_bytes, problem.demote_cost, problem.capacity
    a, valid = problem.forecast, problem.valid
    x0 = problem.x0 & valid
    n = a.shape[-1]
    hh, hl = host_hbm_of(problem), host_link_of(problem)
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
    v = value_of(problem) * valid
    miss = miss_of(problem, x0)[:, None] - s(v * host, up) + demoted(v * x0)
    e = (
        energy_of_loads(
            jnp.swapaxes(hbm + mig_h, 1, 2),
            jnp.swapaxes(link + mig_l, 1, 2),
            problem.fixed,
            problem.weight,
            problem.profile,
            spread_of(problem, 3),
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

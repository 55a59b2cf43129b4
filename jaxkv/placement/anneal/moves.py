"""The annealer's moves: what one block's move does to the loads (`block_deltas`), a chain's
neighbourhood of candidate moves priced exactly (`neighbourhood`), and the start's certificate
of local optimality (`certify`), used by `jaxkv.placement.anneal`.

A move is a promotion (a host block enters HBM), a demotion (an HBM block leaves) or a swap (one
of each). Entering HBM changes block j's loads by a fixed column, whatever else is placed:
dh[:, j] HBM bytes and dl[:, j] link bytes per step (its reads move from the link to HBM, and
the first step gains its promotion or loses its demotion), its terminal value by dv[j] and the
moves counted against the budget by dm[j]; leaving HBM changes them by the negatives. So a
move's energy change is O(W) from the current loads, and its first-order estimate from the
energy's slopes (`jaxkv.placement.anneal.problem.step_slopes`) is one dot product per block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv._pytree import pytree_dataclass
from jaxkv.placement.anneal.problem import (
    AnnealProblem,
    host_hbm_of,
    host_link_of,
    spread_of,
    step_slopes,
    step_times,
    value_of,
)


@pytree_dataclass
class BlockDeltas:
    """What block j entering HBM changes (leaving: the negatives)."""

    dh: jax.Array  # [layers, W, N] float32 bytes: HBM-side load per step
    dl: jax.Array  # [layers, W, N] float32 bytes: link-side load per step
    dv: jax.Array  # [layers, N] float32 seconds: terminal value (-v: it no longer counts)
    dm: jax.Array  # [layers, N] int32: blocks moved from x0 (+1 a promotion, -1 an undone demotion)


def block_deltas(problem: AnnealProblem) -> BlockDeltas:
    """The per-block columns of `BlockDeltas` (see the module docstring and `loads`)."""
    b, d = problem.block_bytes, problem.demote_cost
    a = problem.forecast
    x0 = problem.x0 & problem.valid
    first = (jnp.arange(a.shape[1]) == 0)[None, :, None]  # [1, W, 1]
    mig_h = jnp.where(x0, -d, problem.promote_hbm)[:, None, :]  # [L, 1, N]
    mig_l = jnp.where(x0, -d, problem.promote_link)[:, None, :]
    return BlockDeltas(
        dh=b * (a - host_hbm_of(problem)) + b * first * mig_h,
        dl=-b * host_link_of(problem) + b * first * mig_l,
        dv=-value_of(problem),
        dm=jnp.where(x0, -1, 1).astype(jnp.int32),
    )


def neighbourhood(
    dh, dl, dv, dm, ok_in, ok_out, hbm, link, fixed, weight, spread, *, k, profile, split=False
):
    """A chain's candidate moves, priced exactly. One chain of one layer: dh, dl [W, N];
    dv, dm [N]; ok_in, ok_out [N] bool (blocks that may enter / leave HBM); hbm, link [W] (the
    chain's loads); fixed, weight [W]; spread None or [W].

    Candidates: the k blocks of each side whose move the slopes rate best (enter: lowest
    slopes . column + dv; leave: the highest), with `split` (a migration budget that can bind)
    k of each side's new moves and k of its undoing ones (dm), so that a chain at its budget
    still sees moves that undo earlier ones; their swaps, promotions and demotions. Returns
    (dE [M] seconds, exact; entering [M] and leaving [M] block indices, -1 for none; ok [M]
    bool: both blocks are candidates), M = K * K + 2 K with K = k (2 k with split), moves
    ordered swaps (leave-major), promotions, demotions.
    """
    g_h, g_l = step_slopes(hbm, link, fixed, weight, profile, spread)  # [W]
    lin = g_h @ dh + g_l @ dl + dv  # [N]: first-order energy change of entering

    def best(score, ok):  # the k highest scores among ok, per class with split: [K] each
        classes = (dm < 0, dm > 0) if split else (True,)
        tops = [jax.lax.top_k(jnp.where(ok & c, score, -jnp.inf), k) for c in classes]
        return jnp.concatenate([t[0] for t in tops]), jnp.concatenate([t[1] for t in tops])

    s_in, j = best(-lin, ok_in)
    s_out, i = best(lin, ok_out)
    has_j, has_i = jnp.isfinite(s_in), jnp.isfinite(s_out)  # fewer than k eligible
    base = step_times(hbm, link, fixed, profile, spread)  # [W]
    h_j, l_j = dh[:, j].T, dl[:, j].T  # [K, W]
    h_i, l_i = dh[:, i].T, dl[:, i].T

    def change(dhb, dlb):  # [..., W] load changes -> [...] energy changes (time part)
        t = step_times(hbm + dhb, link + dlb, fixed, profile, spread)
        return jnp.sum((t - base) * weight, axis=-1)

    swap = change(h_j[None] - h_i[:, None], l_j[None] - l_i[:, None])  # [K (leave), K (enter)]
    swap = swap + dv[j][None] - dv[i][:, None]
    pro = change(h_j, l_j) + dv[j]
    dem = change(-h_i, -l_i) - dv[i]
    n = j.shape[0]
    none = jnp.full((n,), -1, jnp.int32)
    de = jnp.concatenate([swap.reshape(-1), pro, dem])
    enter = jnp.concatenate([jnp.tile(j, n), j, none]).astype(jnp.int32)
    leave = jnp.concatenate([jnp.repeat(i, n), none, i]).astype(jnp.int32)
    ok = jnp.concatenate([(has_i[:, None] & has_j[None]).reshape(-1), has_j, has_i])
    return de, enter, leave, ok


def move_feasible(enter, leave, dm, count, moved, *, cap, budget):
    """[M] bool: the moves (enter, leave: [M] block indices, -1 for none) keep count <= cap and
    the blocks moved from x0 (moved + the change) <= budget. dm [N], count and moved []."""
    dcount = (enter >= 0).astype(jnp.int32) - (leave >= 0).astype(jnp.int32)
    dmoved = jnp.where(enter >= 0, dm[jnp.maximum(enter, 0)], 0)
    dmoved = dmoved - jnp.where(leave >= 0, dm[jnp.maximum(leave, 0)], 0)
    return (count + dcount <= cap) & (moved + dmoved <= budget)


def certify(problem: AnnealProblem, deltas: BlockDeltas, x, hbm, link, moved, tol):
    """Whether no single promotion, demotion or swap lowers the energy of x by more than tol:
    [layers] bool (True: x is a local optimum; chains cannot improve on it by one move).

    x [layers, N] bool with loads hbm, link [layers, W] and moved [layers] blocks moved from x0;
    tol [layers] seconds. Promotions and demotions are priced exactly, every block at once
    (O(N W)). A swap's change is bounded below, every pair at once, by its first-order change
    at x's slopes (the energy is convex in the loads) on every step but one, and exactly on
    that one: the step closest to balance, where a swap can flip the binding side (without a
    spread; with one, first order on every step). A swap then improves by more than tol only
    if both of its sides' bounds do, a dominance query over the blocks sorted by one of them
    (O(N log N)). So the certificate is sound: when it holds, no move of the chains'
    neighbourhoods improves by more than tol. Moves the capacity or the migration budget
    forbids are left out, as the chains never make them.
    """
    sp = spread_of(problem, 2)
    prof, w = problem.profile, problem.weight
    g_h, g_l = step_slopes(hbm, link, problem.fixed, w, prof, sp)  # [L, W]
    dh, dl, dv, dm = deltas.dh, deltas.dl, deltas.dv, deltas.dm
    lin = jnp.einsum("lw,lwn->ln", g_h, dh) + jnp.einsum("lw,lwn->ln", g_l, dl) + dv  # [L, N]
    sp3 = None if sp is None else sp[..., None]
    base = step_times(hbm, link, problem.fixed, prof, sp)[..., None]  # [L, W, 1]
    f = problem.fixed[None, :, None]

    def change(sign):  # [L, N]: the exact energy change of every block entering (+) / leaving
        t = step_times(hbm[..., None] + sign * dh, link[..., None] + sign * dl, f, prof, sp3)
        return jnp.sum((t - base) * w[None, :, None], axis=1) + sign * dv

    count = jnp.sum(x, -1, keepdims=True)
    mv = moved[:, None]
    budget, cap = problem.budget, problem.capacity
    can_in = problem.valid & ~x
    can_out = x
    pro = jnp.where(can_in & (count + 1 <= cap) & (mv + dm <= budget), change(1.0), jnp.inf)
    dem = jnp.where(can_out & (mv - dm <= budget), change(-1.0), jnp.inf)
    # swaps (j enters, i leaves): change >= max(p_j - p_i + ca, q_j - q_i + cb), the step
    # closest to balance t* taken exactly (its HBM side binding: p, its link side: q)
    th = (hbm + problem.fixed) / prof.hbm_bandwidth
    tl = link / prof.link_bandwidth
    p = q = lin
    ca = cb = jnp.zeros(lin.shape[:1], lin.dtype)
    if sp is None:
        star = jnp.argmin(jnp.where(w > 0, jnp.abs(th - tl), jnp.inf), axis=-1)  # [L]
        pick = jax.nn.one_hot(star, w.shape[0], dtype=lin.dtype)  # [L, W]
        al = jnp.einsum("lw,lwn->ln", pick * w / prof.hbm_bandwidth, dh)  # t*'s HBM part
        be = jnp.einsum("lw,lwn->ln", pick * w / prof.link_bandwidth, dl)
        rest = (
            lin
            - jnp.einsum("lw,lwn->ln", pick * g_h, dh)
            - jnp.einsum("lw,lwn->ln", pick * g_l, dl)
        )
        p, q = rest + al, rest + be
        a, b = jnp.sum(pick * th, -1), jnp.sum(pick * tl, -1)
        top = jnp.maximum(a, b)
        w_star = jnp.sum(pick * w, -1)
        ca, cb = w_star * (a - top), w_star * (b - top)
    classes = ((None, None),) if budget >= x.shape[-1] else ((-1, -1), (-1, 1), (1, -1), (1, 1))
    swap_ok = jnp.ones(lin.shape[:1], bool)
    for a_in, c_out in classes:
        ins = can_in if a_in is None else can_in & (dm == a_in)
        outs = can_out if c_out is None else can_out & (dm == c_out)
        fits = True if a_in is None else moved + a_in - c_out <= budget
        gains = _dominated(p, q, ins, outs, ca, cb, tol)
        swap_ok = swap_ok & ~(fits & gains)
    low = jnp.minimum(jnp.min(pro, -1), jnp.min(dem, -1))
    return (low >= -tol) & swap_ok


def _dominated(p, q, ins, outs, ca, cb, tol):
    """[L] bool: some pair (j in ins, i in outs) has p_j - p_i + ca < -tol and
    q_j - q_i + cb < -tol. p, q [L, N]; ins, outs [L, N] bool; ca, cb, tol [L]."""
    p_in = jnp.where(ins, p, jnp.inf)
    order = jnp.argsort(p_in, axis=-1)
    ps = jnp.take_along_axis(p_in, order, -1)
    qs = jax.lax.cummin(jnp.take_along_axis(jnp.where(ins, q, jnp.inf), order, -1), axis=1)
    # per leaving block i: the lowest q_j among the j with p_j < p_i - ca - tol
    bound = p - (ca + tol)[:, None]
    # method="sort": one sort, no loop (the default "scan" is a loop of log2(N) trips, which
    # grows with the context in a step compiled for a GPU: `make test-gpu-compile`)
    n_below = jax.vmap(lambda s, v: jnp.searchsorted(s, v, side="left", method="sort"))(ps, bound)
    best_q = jnp.take_along_axis(qs, jnp.maximum(n_below - 1, 0), -1)
    best_q = jnp.where(n_below > 0, best_q, jnp.inf)
    return jnp.any(outs & (best_q < q - (cb + tol)[:, None]), axis=-1)

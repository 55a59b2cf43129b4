"""The "lagrangian" solver of `jaxkv.sim.lp.bound`: a lower bound on the window LP's optimum from
its partial Lagrangian dual, without building the LP.

The rows that couple blocks (capacity (1), sealing (3), the step-time rows (5) of
docs/lp_bound.md) are priced; each block's chain of the window is then solved exactly by dynamic
programming (`window_blocks` holds the chains, `chain_costs` their priced costs), and the dual is
ascended by L-BFGS-B on a smoothed version (`ascend`: soft minimum at decreasing temperatures,
jax gradients in float64, DEFAULT_ITERS = 200 iterations per temperature in
`lagrangian_bound`). The bound is the exact dual value at the best prices.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from jaxkv.sim.lp.model import WindowSpec

DEFAULT_ITERS = 200  # L-BFGS-B iterations per temperature of `lagrangian_bound`
_BIG = 1e9  # cost of a forbidden state (a block outside its valid, read-bounded range)


def _sealing(vf, T: int, K: int) -> dict:
    """The steps t > 0 at which a block is sealed, and which: seal [T], new_k [T] (-1: none),
    is_new [T, K]."""
    seal = np.zeros(T, bool)
    new_k = np.full(T, -1, np.int64)
    s_k = np.flatnonzero((vf > 0) & (vf < T))
    seal[vf[s_k]] = True
    new_k[vf[s_k]] = s_k
    is_new = (np.arange(K)[None] == new_k[:, None]) & seal[:, None]
    return dict(seal=seal, new_k=new_k, is_new=is_new)


def window_blocks(spec: WindowSpec) -> dict:
    """The window LP of `spec` (`jaxkv.sim.lp.model.build_window_lp`'s) as per-block chains for
    the dual ([T, K] arrays over the K blocks read in the window)."""
    valid_from, init, prev_read = spec.valid_from, spec.init, spec.prev_read
    keep_fetched, demote_cost, promote_write = (
        spec.keep_fetched,
        spec.demote_cost,
        spec.promote_write,
    )
    fixed, capacity, rho = spec.fixed, spec.capacity, spec.rho
    R = np.asarray(spec.reads, bool)
    T, _ = R.shape
    act = np.flatnonzero(R.any(0))
    R = R[:, act]
    K = act.size
    vf = np.zeros(K, np.int64) if valid_from is None else np.asarray(valid_from)[act]
    prev = np.zeros(K, bool) if prev_read is None else np.asarray(prev_read, bool)[act]
    last = T - 1 - np.argmax(R[::-1], axis=0) if K else np.zeros(0, np.int64)
    t = np.arange(T)[:, None]
    pres = (t >= vf[None]) & (t <= last[None])
    kept = keep_fetched & np.concatenate([prev[None], R[:-1]], 0)
    init_k = np.zeros(K, bool) if init is None else np.asarray(init, bool)[act]
    # the previous state of each chain: HBM content before step 0 (first window) or nothing
    in_hbm = init_k & (vf == 0)
    seal = _sealing(vf, T, K)
    Rf = R.astype(np.float64)
    return dict(
        R=Rf,
        pres=pres,
        after=t > last[None],
        free_in=(t == vf[None]) & ((vf[None] > 0) | (init is None)),  # no promotion row there
        hp=np.where(kept, promote_write, promote_write - Rf),
        lp=np.where(kept, 0.0, 1.0),
        v0=np.where(in_hbm, _BIG, 0.0),
        v1=np.where(in_hbm, 0.0, _BIG),
        **seal,
        next_seal=pres & np.r_[seal["seal"][1:], False][:, None],  # y[t] in step t + 1's (3)
        fixed=np.asarray(fixed, np.float64),
        sum_r=Rf.sum(1),
        capacity=float(capacity),
        rho=float(rho),
        demote_cost=float(demote_cost),
    )


def chain_costs(theta, nu, sigma, blk: dict, xp):
    """Each block chain's priced costs under multipliers (theta, nu, sigma), [T, K] each: a (the
    step in HBM rather than on host; _BIG where the block must be out), c (a promotion at the
    step, >= 0), e (a demotion at the step), and c_all, chain (the raw promotion price and where
    the chain has a promotion row)."""
    th = theta[:, None]
    R, rho, dc = blk["R"], blk["rho"], blk["demote_cost"]
    sig_next = xp.concatenate([sigma[1:], xp.zeros(1, sigma.dtype)])[:, None]
    a = th * R - (1.0 - th) * rho * R + nu[:, None]
    a = a + sig_next * blk["next_seal"] + sigma[:, None] * blk["is_new"]
    a = xp.where(blk["pres"], a, _BIG)
    c_all = th * blk["hp"] + (1.0 - th) * rho * blk["lp"]
    # a promotion share costs c p with p >= (y_t - y_{t-1})^+, p <= 1: c (y_t - y_{t-1})^+ for
    # c >= 0, else c (p = 1) whatever y does (only with promote_write < 1)
    chain = blk["pres"] & ~blk["free_in"]
    c = xp.where(chain, xp.maximum(c_all, 0.0), 0.0)
    e = xp.where(blk["after"], 0.0, (th + (1.0 - th) * rho) * dc + 0.0 * R)
    return a, c, e, c_all, chain


def _chains_least(a, c, e, blk: dict, xp, softmin):
    """[K] each chain's least cost over the window, by dynamic programming forward over
    y in {0, 1} (v0, v1: the least cost so far ending out of / in HBM)."""
    if xp is np:
        v0, v1 = blk["v0"].copy(), blk["v1"].copy()
        for t in range(a.shape[0]):
            v0, v1 = softmin(v0, v1 + e[t]), a[t] + softmin(v1, v0 + c[t])
        return softmin(v0, v1)

    def step(carry, x):
        v0, v1 = carry
        at, ct, et = x
        return (softmin(v0, v1 + et), at + softmin(v1, v0 + ct)), None

    (v0, v1), _ = jax.lax.scan(step, (xp.asarray(blk["v0"]), xp.asarray(blk["v1"])), (a, c, e))
    return softmin(v0, v1)


def _dual_value(theta, nu, sigma, blk: dict, xp, softmin):
    """The partial Lagrangian dual g(theta, nu, sigma) of a window LP (see `lagrangian_bound`).

    Rows (1), (3) and (5) are priced (HBM row theta, link row 1 - theta, capacity nu, sealing
    sigma); each block's chain (rows (2), (4), its box) is solved exactly by dynamic programming
    over y in {0, 1} (`softmin` = min) or smoothed (`softmin` = a soft minimum). `xp`: numpy or
    jax.numpy.
    """
    rho = blk["rho"]
    a, c, e, c_all, chain = chain_costs(theta, nu, sigma, blk, xp)
    c_neg = xp.sum(xp.where(chain, xp.minimum(c_all, 0.0), 0.0))
    # the sealed block's promotion share at its sealing step: only in rows (3) and (5)
    c_new = xp.sum(xp.where(blk["is_new"], c_all, 0.0), axis=1)
    p_new = xp.sum(xp.where(blk["seal"], softmin(xp.zeros_like(c_new), c_new - sigma), 0.0))
    const = xp.sum(theta * blk["fixed"] + (1.0 - theta) * rho * blk["sum_r"])
    const = const - blk["capacity"] * (xp.sum(nu) + xp.sum(sigma))
    return const + p_new + c_neg + xp.sum(_chains_least(a, c, e, blk, xp, softmin))


_SMOOTH_KEYS = (
    "R",
    "pres",
    "after",
    "free_in",
    "hp",
    "lp",
    "v0",
    "v1",
    "seal",
    "is_new",
    "next_seal",
    "fixed",
    "sum_r",
    "capacity",
    "rho",
    "demote_cost",
)


@jax.jit
@jax.value_and_grad
def _smooth_value_and_grad(z, mu, blk):
    """The smoothed dual (soft minimum at temperature mu) and its gradient; z = theta|nu|sigma."""
    T = blk["R"].shape[0]

    def soft(x, y):
        return -mu * jnp.logaddexp(-x / mu, -y / mu)

    return _dual_value(z[:T], z[T : 2 * T], z[2 * T :], blk, jnp, soft)


def lagrangian_bound(
    spec: WindowSpec,
    *,
    temperatures=(0.3, 0.1, 0.03, 0.01, 0.003),
    iters: int = DEFAULT_ITERS,
) -> dict:
    """A lower bound on the window LP's optimum from its partial Lagrangian dual.

    Dualizing the rows that couple blocks (capacity (1), sealing (3), the step-time rows (5))
    leaves one chain per block, whose LP is integral (by the coarea formula its objective, linear
    in y plus c (y_t - y_{t-1})^+ + e (y_{t-1} - y_t)^+ with c, e >= 0, is an average of its
    values at the thresholded 0/1 paths), so dynamic programming over y in {0, 1} solves it
    exactly and g(theta, nu, sigma) <= the LP optimum for every theta in [0, 1], nu, sigma >= 0
    (weak duality; the multipliers of the two rows (5) of a step sum to 1, or tau_t's term is
    unbounded below; a negative promotion price, possible only with promote_write < 1, sets
    p = 1). The dual is maximized by L-BFGS-B on a smoothed g (soft minimum at
    decreasing temperatures, jax gradients in float64); every stage's multipliers are then scored
    with the exact g in float64, and the best is the bound. At its maximum g equals the LP
    optimum (LP duality), so the bound approaches the LP from below as the ascent converges.

    Args:
      spec: the window (`jaxkv.sim.lp.model.WindowSpec`).
      temperatures: soft-minimum temperatures (block units), one L-BFGS-B stage each.
      iters: L-BFGS-B iterations per stage.
    Returns:
      {"bound": the best exact g (units of block bytes / B_hbm), "stages": the exact g after each
       stage, "evals": smoothed evaluations, "multipliers": theta | nu | sigma [3T] at the best
       g (`jaxkv.sim.lp.dual.dual_values` prices the blocks' futures with them), "wall_s"}.
    """
    w0 = time.perf_counter()
    blk = window_blocks(spec)
    best, z, stages, evals = ascend(blk, temperatures, iters)
    return dict(
        bound=best, stages=stages, evals=evals, multipliers=z, wall_s=time.perf_counter() - w0
    )


def _jax_blocks(blk: dict) -> dict:
    """The chains' arrays the smoothed dual reads, as jax arrays (bool or float64)."""
    jblk = {k: v for k, v in blk.items() if k in _SMOOTH_KEYS}
    return jax.tree.map(
        lambda v: jnp.asarray(v, bool if v.dtype == bool else jnp.float64),
        {k: np.asarray(v) for k, v in jblk.items()},
    )


def _lbfgs_stage(z, mu, jblk: dict, lo, hi, iters: int):
    """One L-BFGS-B ascent of the dual smoothed at temperature mu, from z."""

    def fun(zz):
        v, g = _smooth_value_and_grad(jnp.asarray(zz), jnp.float64(mu), jblk)
        return -float(v), -np.asarray(g, np.float64)

    return scipy.optimize.minimize(
        fun,
        z,
        jac=True,
        method="L-BFGS-B",
        bounds=list(zip(lo, hi, strict=True)),
        options=dict(maxiter=iters),
    )


def ascend(blk: dict, temperatures, iters: int):
    """Maximizes the window's partial dual (`_dual_value`) by L-BFGS-B on its smoothed version,
    one stage per temperature; returns (best exact g, its multipliers theta|nu|sigma [3T],
    the exact g after each stage, smoothed evaluations)."""
    T = blk["R"].shape[0]
    exact = functools.partial(_dual_value, blk=blk, xp=np, softmin=np.minimum)
    z = np.concatenate([np.full(T, blk["rho"] / (blk["rho"] + 1.0)), np.zeros(T), np.zeros(T)])
    lo = np.zeros(3 * T)
    hi = np.concatenate([np.ones(T), np.full(T, np.inf), np.where(blk["seal"], np.inf, 0.0)])
    best = exact(z[:T], z[T : 2 * T], z[2 * T :])
    best_z = z
    stages, evals = [], 0
    with jax.enable_x64(True):  # float64: the line searches need a smooth, exact gradient
        jblk = _jax_blocks(blk)
        for mu in temperatures:
            res = _lbfgs_stage(z, mu, jblk, lo, hi, iters)
            evals += int(res.nfev)
            z = np.clip(res.x, lo, hi)
            val = exact(z[:T], z[T : 2 * T], z[2 * T :])
            stages.append(val)
            if val > best:
                best, best_z = val, z
    return float(best), best_z, stages, evals


__all__ = ["DEFAULT_ITERS", "ascend", "chain_costs", "lagrangian_bound", "window_blocks"]

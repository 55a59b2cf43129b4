"""A linear-programming lower bound on `jaxkv.sim.simulate`'s latency that counts promotion writes.

The bounds of `jaxkv.sim.bounds` ignore the HBM write every promotion costs, so on traces whose read
set churns they sit at the Unlimited bound while every policy pays for its promotions. Here the
placement problem, exactly as the simulator charges it, is relaxed to a linear program per layer,
whose optimum is at most every policy's latency; the LP is solved with HiGHS
(`scipy.optimize.linprog`) or, at full scale, bounded from below through its Lagrangian dual.

Model, per layer (b = block bytes, C = HBM pool blocks, the always-HBM tail block extra; steps
t = 0..T-1; R[t, i] = 1 when step t reads block i, from the trace's read mask at sparsity s):
  y[t, i] in [0, 1]  share of block i in HBM during step t (the simulator's `in_hbm` after the
                     step's plan: the set its reads see);
  p[t, i] in [0, 1]  share promoted at step t;  d[t, i] in [0, 1] share demoted (demote_cost > 0);
  tau_t              the step's time, in units of one block's HBM time b / B_hbm.
The simulator charges, per block and step (integral y; w = 1 is the promotion's HBM write):
  kept, not moved, read: HBM b;  host, read: link b;  promoted: HBM b (the write) and, unless
  the step reads it from host anyway (the "ride": then that read is the link transfer and a host
  read), one link b;  with keep_fetched a block read at step t - 1 is promoted for its HBM write
  alone and read from HBM;  demoted: demote_cost x b on each side.
In (y, p, d) these are linear and exact at integral points:
  HBM_t  = F_t + sum_i [R y + (w - R) p]  (kept: R y + w p)  + demote_cost sum_i d,
  link_t = sum_i [R (1 - y) + p]           (kept: R (1 - y))   + demote_cost sum_i d,
with F_t = (weights + the new token's write + the tail block's read) / b, the bytes the step
reads or writes in HBM besides the placed blocks. Constraints:
  (1) capacity: sum_i y[t, i] <= C;
  (2) promotion: p[t, i] >= y[t, i] - y[t - 1, i], y[-1] = the simulator's initial placement
      (write order after prefill: blocks < min(prompt_len // block_size, C));
  (3) sealing: the block i sealed at step t > 0 enters HBM for free when the pool had a free
      slot after step t - 1, else it is left on host and promoting it is a promotion:
      p[t, i] >= y[t, i] - (C - sum_j y[t - 1, j]); before step t, y[., i] = 0 (not valid);
  (4) demotion (demote_cost > 0 only): d[t, i] >= y[t - 1, i] - y[t, i];
  (5) tau_t >= HBM_t, tau_t >= link_t x B_hbm / B_link.
Minimize sum_t tau_t; the bound is sum_t tau_t x b / B_hbm seconds, summed over layers.

Why no policy beats it: take any policy's run of `jaxkv.sim.simulate` and one layer. Let y[t] be its
HBM set during step t, p[t] = y[t] minus the set before the step's plan (`pro`), d[t] = the set
before the plan minus y[t] (`dem`). (1) holds: a plan's target has at most C blocks
(`policies.Policy`, `top_capacity`, the annealer) and a sealed block is inserted only into a free
slot. (2) holds: between plans HBM changes only by sealing, and every other block entering HBM
is in `pro`. (3): if the pool was full after step t - 1 the sealed block is not inserted, so
having it during step t is a promotion (p = 1 = y); otherwise the right side is <= 0. (4): every
block leaving HBM is in `dem`. The step's HBM and link bytes are the simulator's own (weights,
write, tail and migration on the HBM side; host reads and link migration on the link side, the
ride rule included), so tau_t = max(T_hbm, T_link) is its step time and the run is a feasible
integral point of the LP with objective = its latency. The LP optimum is therefore <= every
policy's latency, and >= the Unlimited bound (HBM_t >= F_t + sum_i R y, link_t >= sum_i R (1 -
y), so tau_t >= both `cost.unlimited_step_time` terms). What the LP leaves out only lowers it:
plans every step (policies plan every W), fractional shares, no demotion charged for a sealed
block the plan drops at once or for the reductions below.

Reductions, each a relaxation (a policy's point maps to a feasible point of the reduced LP with
no larger cost, so the reduced optimum is still a lower bound), the first two exact when
demote_cost = 0:
  * blocks never read in the window are left out (y = p = d = 0): zeroing them only frees
    capacity, loosens (3) and drops nonnegative cost terms;
  * after a block's last read in the window y = 0: zeroing y there needs no promotion (p = 0
    is feasible), frees capacity, and the demotion it implies is not charged;
  * sub-horizons (`window`): the steps are split into disjoint windows, each an LP whose first
    step has a free initial placement (no (2)-(4) rows at its first step; the first window
    keeps the simulator's initial placement). A global point restricted to a window is feasible
    there and the objective is a sum over steps, so the sum of the windows' optima is at most
    the whole-horizon optimum. It loses what a free placement at each window's start saves
    (measured on real-like, s = 0.5, 256 steps: 128-step windows 0.16% below the whole-horizon
    LP, 64-step 0.46%, 32-step 1.2%) and keeps the LPs small (HiGHS' interior-point time grows
    faster than linearly with the steps).

Two solvers; each reports a certified lower bound on the LP optimum, hence on every policy:
  * "highs": the LP itself with HiGHS' interior point (`build_window_lp`, `solve_lp`). The
    bound is the Lagrangian dual value at the solver's row duals lambda (clipped to >= 0) with
    every variable boxed: y, p, d in [0, 1] (p <= 1 and d <= 1 cut no feasible point: y in
    [0, 1], and in (3) sum_j y[t - 1, j] <= C), tau_t in [0, U_t] with U_t >= max(HBM_t, link_t
    x B_hbm / B_link) at every feasible point, so the box keeps the optimum. By weak duality
    that value is <= the LP optimum for every lambda >= 0: it holds whatever the solver's
    tolerances (no crossover needed) and equals the optimum to within them (`lp_s` is the
    primal objective). A window without duals (time limit) falls back to sum_t max(F_t, (F_t +
    reads_t) B_hbm / (B_hbm + B_link)), which every feasible tau meets.
  * "lagrangian" (the default; `lagrangian_bound`): rows (1), (3), (5) priced, each block's
    chain solved exactly by dynamic programming, the dual maximized by L-BFGS-B on a smoothed
    version; the bound is the exact dual value at the final prices, <= the LP optimum by weak
    duality, and equal to it at the dual optimum.

Scale (CPU, one layer of 1,990 blocks, prompt 31,299, block 16, real-like trace): HiGHS' time
grows faster than the steps and with the trace's difficulty (s = 0.5: 64 / 128 / 256 / 512
steps in one LP, 12 / 30 / 110 / 890 s, the last with 1M y, 1M p and 7M nonzeros; s = 0.6:
47 s for 64 steps, 350 s for 128). The Lagrangian takes about 75 ms per dual evaluation at 512
steps, 1 min for the whole horizon at the default iterations, and lands 0.03-0.1% below the LP
optimum (s = 0.5, 512 steps: 1.2329 x Unlimited against the LP's 1.2339; s = 0.6, 128 steps:
0.0003% below).

Values for a planner (`dual_values`, `trace_dual_values`): at the dual's prices each block's
chain is solved exactly, so running its dynamic programme backwards gives, per block and step,
what ending the step on host rather than in HBM costs over the steps after it (`value_to_go`):
later reads weighed by how far the LP finds their steps HBM- or link-bound, slot time charged
the capacity price. `anneal-oracle+dual` takes it as the terminal value of its short window.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize
import scipy.sparse as sp

from jaxkv.sim import bounds as bnd
from jaxkv import cost
from jaxkv.config import HardwareProfile
from jaxkv.sim.trace import read_mask

DEFAULT_ITERS = 200  # L-BFGS-B iterations per temperature of `lagrangian_bound`
# `dual_values`' ascent: prices for values need not be converged as a bound's multipliers do.
# One stage of 50 iterations at 0.03 valued recency-high 0.8 / recency-low 0.6 (4 layers, 300
# steps) as well as the bound's five stages of 200 (anneal-oracle+dual 1.046 / 1.024 against
# 1.047 / 1.024) in a tenth of the time (bench/RESULTS.md)
DUAL_TEMPERATURES = (0.03,)
DUAL_ITERS = 50


@dataclasses.dataclass
class _LP:
    """min c x s.t. A x <= b, lb <= x <= ub; tau are the last T variables."""

    c: np.ndarray
    A: sp.csr_matrix
    b: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    size: dict


def build_window_lp(
    reads,
    fixed,
    capacity: int,
    rho: float,
    *,
    valid_from=None,
    init=None,
    prev_read=None,
    keep_fetched: bool = False,
    demote_cost: float = 0.0,
    promote_write: float = 1.0,
) -> _LP:
    """The LP of one layer over one window of steps, in block units (see the module docstring).

    Args:
      reads: [T, N] bool, the blocks each step of the window reads (the tail block excluded).
      fixed: [T] float, HBM bytes of each step besides the placed blocks / block bytes.
      capacity: C, HBM pool blocks.
      rho: B_hbm / B_link.
      valid_from: [N] int, the window step at which each block is sealed (0: valid from the
        window's start; > 0: sealed there, constraint (3); >= T: never valid). None: all 0.
      init: [N] bool, HBM content before the window's first step; None: a free initial
        placement (a later window).
      prev_read: [N] bool, the reads of the step before the window (keep_fetched); None: none.
      keep_fetched: the simulator's keep_fetched rule.
      demote_cost: the simulator's demote_cost (fraction of a block on each side).
      promote_write: HBM write per promoted block (1 as in the simulator; tests set other values
        to check that the tests can fail).
    Returns:
      an _LP whose optimum (in units of b / B_hbm) is the window's bound.
    """
    R = np.asarray(reads, bool)
    if R.ndim != 2:
        raise ValueError(f"reads must be [steps, blocks], got shape {R.shape}")
    T, N = R.shape
    fixed = np.asarray(fixed, np.float64)
    if fixed.shape != (T,):
        raise ValueError(f"fixed must have shape ({T},), got {fixed.shape}")
    act = np.flatnonzero(R.any(0))  # blocks read in the window; the others stay out (y = 0)
    R = R[:, act]
    K = act.size
    vf = np.zeros(K, np.int64) if valid_from is None else np.asarray(valid_from)[act]
    if np.any(R & (np.arange(T)[:, None] < vf[None])):
        raise ValueError("reads must not read a block before its valid_from step")
    prev = np.zeros(K, bool) if prev_read is None else np.asarray(prev_read, bool)[act]
    last = T - 1 - np.argmax(R[::-1], axis=0) if K else np.zeros(0, np.int64)
    steps = np.arange(T)[:, None]
    pres = (steps >= vf[None]) & (steps <= last[None])  # [T, K] y variables
    tt, kk = np.nonzero(pres)  # row-major: sorted by step
    ny = tt.size
    yid = np.full((T, K), -1, np.int64)
    yid[tt, kk] = np.arange(ny)
    inner = tt > vf[kk]  # (2) against the previous step
    seal = (tt == vf[kk]) & (tt > 0)  # (3)
    start = (tt == 0) & (init is not None)  # (2) against the initial placement
    hasp = inner | seal | start
    n_p = int(hasp.sum())
    pid = np.full((T, K), -1, np.int64)
    pid[tt[hasp], kk[hasp]] = ny + np.arange(n_p)
    init_k = np.zeros(K) if init is None else np.asarray(init, bool)[act].astype(np.float64)
    rows, cols, vals, rhs = [], [], [], []
    r0 = 0

    def add(r, c, v):
        rows.append(np.asarray(r, np.int64))
        cols.append(np.asarray(c, np.int64))
        vals.append(np.broadcast_to(np.asarray(v, np.float64), np.shape(r)))

    # (2) y[t] - y[t - 1] - p[t] <= 0, and y[0] - p[0] <= init
    ti, ki = tt[inner], kk[inner]
    rr = r0 + np.arange(ti.size)
    add(rr, yid[ti, ki], 1.0)
    add(rr, yid[ti - 1, ki], -1.0)
    add(rr, pid[ti, ki], -1.0)
    rhs.append(np.zeros(ti.size))
    r0 += ti.size
    ts, ks = tt[start], kk[start]
    rr = r0 + np.arange(ts.size)
    add(rr, yid[ts, ks], 1.0)
    add(rr, pid[ts, ks], -1.0)
    rhs.append(init_k[ks])
    r0 += ts.size
    # (3) y[t, k] + sum_j y[t - 1, j] - p[t, k] <= C
    for t, k in zip(tt[seal], kk[seal], strict=True):
        before = yid[t - 1][yid[t - 1] >= 0]
        add(
            np.full(before.size + 2, r0),
            np.r_[yid[t, k], pid[t, k], before],
            np.r_[1.0, -1.0, np.ones(before.size)],
        )
        rhs.append(np.array([float(capacity)]))
        r0 += 1
    # (4) y[t - 1] - y[t] - d[t] <= 0 (and 1 - y[0] - d[0] <= 0 for blocks initially in HBM)
    dt = np.zeros(0, np.int64)
    n_d = 0
    if demote_cost > 0:
        s0 = start & (init_k[kk] > 0)
        dt = np.concatenate([ti, tt[s0]])
        n_d = dt.size
        did = ny + n_p + np.arange(n_d)
        rr = r0 + np.arange(ti.size)
        add(rr, yid[ti - 1, ki], 1.0)
        add(rr, yid[ti, ki], -1.0)
        add(rr, did[: ti.size], -1.0)
        rhs.append(np.zeros(ti.size))
        r0 += ti.size
        rr = r0 + np.arange(int(s0.sum()))
        add(rr, yid[tt[s0], kk[s0]], -1.0)
        add(rr, did[ti.size :], -1.0)
        rhs.append(-np.ones(rr.size))
        r0 += rr.size
    n_tau = ny + n_p + n_d
    tau = n_tau + np.arange(T)
    # (1) capacity
    add(r0 + tt, yid[tt, kk], 1.0)
    rhs.append(np.full(T, float(capacity)))
    r0 += T
    # (5) HBM: sum R y + hp p + dc d - tau <= -F
    rd = R[tt, kk]
    tp, kp = tt[hasp], kk[hasp]
    kept = keep_fetched & np.where(tp > 0, R[np.maximum(tp - 1, 0), kp], prev[kp])
    hp = np.where(kept, promote_write, promote_write - R[tp, kp])
    lp = np.where(kept, 0.0, 1.0)
    add(r0 + tt[rd], yid[tt[rd], kk[rd]], 1.0)
    add(r0 + tp, pid[tp, kp], hp)
    add(r0 + dt, ny + n_p + np.arange(n_d), demote_cost)
    add(r0 + np.arange(T), tau, -1.0)
    rhs.append(-fixed)
    r0 += T
    # (5) link x rho: rho (-sum R y + lp p + dc d) - tau <= -rho sum R
    add(r0 + tt[rd], yid[tt[rd], kk[rd]], -rho)
    add(r0 + tp, pid[tp, kp], rho * lp)
    add(r0 + dt, ny + n_p + np.arange(n_d), rho * demote_cost)
    add(r0 + np.arange(T), tau, -1.0)
    rhs.append(-rho * R.sum(1).astype(np.float64))
    r0 += T
    nv = n_tau + T
    A = sp.csr_matrix(
        (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r0, nv)
    )
    c = np.zeros(nv)
    c[tau] = 1.0
    lb = np.zeros(nv)
    ub = np.ones(nv)
    per_step = (2.0 + promote_write + 2.0 * demote_cost) * pres.sum(1) + 1.0  # >= block terms
    ub[tau] = np.maximum(fixed + per_step, rho * per_step)
    size = dict(steps=T, blocks=K, y=ny, p=n_p, d=n_d, rows=r0, nonzeros=int(A.nnz))
    return _LP(c, A, np.concatenate(rhs), lb, ub, size)


def dual_bound(lp: _LP, lam) -> float:
    """Weak-duality bound min over the box of c x + lam (A x - b), lam clipped to >= 0."""
    lam = np.maximum(np.asarray(lam, np.float64), 0.0)
    r = lp.c + lp.A.T @ lam
    return float(-lam @ lp.b + np.sum(np.minimum(r * lp.lb, r * lp.ub)))


def solve_lp(
    lp: _LP, *, time_limit: float | None = None, method: str = "highs-ipm", tol: float = 1e-7
) -> dict:
    """Solves an _LP with HiGHS; returns {bound, primal, status, message, wall_s}.

    Args:
      lp: from `build_window_lp`.
      time_limit: seconds (None: no limit).
      method: scipy.optimize.linprog HiGHS method; "highs-ipm" runs no crossover (the bound
        comes from the duals, which need no vertex) unless the interior point ends imprecise.
      tol: the interior point's optimality tolerance (relative duality gap).
    Returns:
      `bound`: `dual_bound` at the solver's duals (None when it returned none); `primal`: the
      solver's objective (None unless optimal); `status`, `message`: scipy's; `wall_s`.
    """
    opts = {"presolve": True}
    if method == "highs-ipm":
        opts.update(ipm_optimality_tolerance=tol, run_crossover="off")
    if time_limit is not None:
        opts["time_limit"] = float(time_limit)
    w0 = time.perf_counter()
    while True:
        with warnings.catch_warnings():  # run_crossover goes to HiGHS verbatim, as intended
            warnings.filterwarnings(
                "ignore", "Unrecognized options", scipy.optimize.OptimizeWarning
            )
            res = scipy.optimize.linprog(
                lp.c,
                A_ub=lp.A,
                b_ub=lp.b,
                bounds=np.stack([lp.lb, lp.ub], 1),
                method=method,
                options=opts,
            )
        # IPX without crossover can end "unknown" (imprecise) on small degenerate LPs: rerun
        # with crossover, which certifies the optimum (not after a time or iteration limit)
        if res.status in (0, 1) or opts.get("run_crossover") != "off":
            break
        opts["run_crossover"] = "on"
    wall = time.perf_counter() - w0
    marg = getattr(res.get("ineqlin"), "marginals", None)
    bound = None
    if marg is not None and np.all(np.isfinite(marg)):
        bound = dual_bound(lp, -np.asarray(marg))
    return dict(
        bound=bound,
        primal=float(res.fun) if res.status == 0 else None,
        status=int(res.status),
        message=str(res.message),
        wall_s=wall,
    )


_BIG = 1e9  # cost of a forbidden state (a block outside its valid, read-bounded range)


def _window_blocks(
    reads,
    fixed,
    capacity: int,
    rho: float,
    *,
    valid_from=None,
    init=None,
    prev_read=None,
    keep_fetched: bool = False,
    demote_cost: float = 0.0,
    promote_write: float = 1.0,
) -> dict:
    """The window LP of `build_window_lp` as per-block chains for `_dual_value` ([T, K] arrays
    over the K blocks read in the window)."""
    R = np.asarray(reads, bool)
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
    v1 = np.where(init_k & (vf == 0), 0.0, _BIG)
    v0 = np.where(init_k & (vf == 0), _BIG, 0.0)
    free_in = (t == vf[None]) & ((vf[None] > 0) | (init is None))  # no promotion row there
    seal = np.zeros(T, bool)
    new_k = np.full(T, -1, np.int64)
    s_k = np.flatnonzero((vf > 0) & (vf < T))
    seal[vf[s_k]] = True
    new_k[vf[s_k]] = s_k
    next_seal = pres & np.r_[seal[1:], False][:, None]  # y[t] in the sealing row of step t + 1
    Rf = R.astype(np.float64)
    return dict(
        R=Rf,
        pres=pres,
        after=t > last[None],
        free_in=free_in,
        hp=np.where(kept, promote_write, promote_write - Rf),
        lp=np.where(kept, 0.0, 1.0),
        v0=v0,
        v1=v1,
        seal=seal,
        new_k=new_k,
        is_new=(np.arange(K)[None] == new_k[:, None]) & seal[:, None],
        next_seal=next_seal,
        fixed=np.asarray(fixed, np.float64),
        sum_r=Rf.sum(1),
        capacity=float(capacity),
        rho=float(rho),
        demote_cost=float(demote_cost),
    )


def _chain_costs(theta, nu, sigma, blk: dict, xp):
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


def _dual_value(theta, nu, sigma, blk: dict, xp, softmin):
    """The partial Lagrangian dual g(theta, nu, sigma) of a window LP (see `lagrangian_bound`).

    Rows (1), (3) and (5) are priced (HBM row theta, link row 1 - theta, capacity nu, sealing
    sigma); each block's chain (rows (2), (4), its box) is solved exactly by dynamic programming
    over y in {0, 1} (`softmin` = min) or smoothed (`softmin` = a soft minimum). `xp`: numpy or
    jax.numpy.
    """
    R, rho = blk["R"], blk["rho"]
    a, c, e, c_all, chain = _chain_costs(theta, nu, sigma, blk, xp)
    c_neg = xp.sum(xp.where(chain, xp.minimum(c_all, 0.0), 0.0))
    # the sealed block's promotion share at its sealing step: only in rows (3) and (5)
    c_new = xp.sum(xp.where(blk["is_new"], c_all, 0.0), axis=1)
    p_new = xp.sum(xp.where(blk["seal"], softmin(xp.zeros_like(c_new), c_new - sigma), 0.0))
    const = xp.sum(theta * blk["fixed"] + (1.0 - theta) * rho * blk["sum_r"])
    const = const - blk["capacity"] * (xp.sum(nu) + xp.sum(sigma))
    if xp is np:
        v0, v1 = blk["v0"].copy(), blk["v1"].copy()
        for t in range(R.shape[0]):
            v0, v1 = softmin(v0, v1 + e[t]), a[t] + softmin(v1, v0 + c[t])
    else:

        def step(carry, x):
            v0, v1 = carry
            at, ct, et = x
            return (softmin(v0, v1 + et), at + softmin(v1, v0 + ct)), None

        (v0, v1), _ = jax.lax.scan(step, (xp.asarray(blk["v0"]), xp.asarray(blk["v1"])), (a, c, e))
    return const + p_new + c_neg + xp.sum(softmin(v0, v1))


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
    reads,
    fixed,
    capacity: int,
    rho: float,
    *,
    valid_from=None,
    init=None,
    prev_read=None,
    keep_fetched: bool = False,
    demote_cost: float = 0.0,
    promote_write: float = 1.0,
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
      reads, fixed, capacity, rho, valid_from, init, prev_read, keep_fetched, demote_cost,
        promote_write: as in `build_window_lp`.
      temperatures: soft-minimum temperatures (block units), one L-BFGS-B stage each.
      iters: L-BFGS-B iterations per stage.
    Returns:
      {"bound": the best exact g (units of block bytes / B_hbm), "stages": the exact g after each
       stage, "evals": smoothed evaluations, "multipliers": theta | nu | sigma [3T] at the best
       g (`dual_values` prices the blocks' futures with them), "wall_s"}.
    """
    w0 = time.perf_counter()
    blk = _window_blocks(
        reads,
        fixed,
        capacity,
        rho,
        valid_from=valid_from,
        init=init,
        prev_read=prev_read,
        keep_fetched=keep_fetched,
        demote_cost=demote_cost,
        promote_write=promote_write,
    )
    best, z, stages, evals = _ascend(blk, temperatures, iters)
    return dict(
        bound=best, stages=stages, evals=evals, multipliers=z, wall_s=time.perf_counter() - w0
    )


def _ascend(blk: dict, temperatures, iters: int):
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
        jblk = {k: v for k, v in blk.items() if k in _SMOOTH_KEYS}
        jblk = jax.tree.map(
            lambda v: jnp.asarray(v, bool if v.dtype == bool else jnp.float64),
            {k: np.asarray(v) for k, v in jblk.items()},
        )
        for mu in temperatures:

            def fun(zz, mu=mu):
                v, g = _smooth_value_and_grad(jnp.asarray(zz), jnp.float64(mu), jblk)
                return -float(v), -np.asarray(g, np.float64)

            res = scipy.optimize.minimize(
                fun,
                z,
                jac=True,
                method="L-BFGS-B",
                bounds=list(zip(lo, hi, strict=True)),
                options=dict(maxiter=iters),
            )
            evals += int(res.nfev)
            z = np.clip(res.x, lo, hi)
            val = exact(z[:T], z[T : 2 * T], z[2 * T :])
            stages.append(val)
            if val > best:
                best, best_z = val, z
    return float(best), best_z, stages, evals


def value_to_go(blk: dict, multipliers) -> np.ndarray:
    """[T, K] per block of a window (`_window_blocks`) and step t: G0_t - G1_t, clipped at 0,
    where G_y is the least priced cost of the block's chain over steps t + 1 .. T - 1 given
    y_t = y (the dynamic programme of `_dual_value`, run backwards under the multipliers
    theta | nu | sigma). In units of block bytes / B_hbm: what leaving the block on host after
    step t costs the rest of the window over keeping it in HBM, with each later step's HBM and
    link time weighed by theta_t, 1 - theta_t (how far the LP finds that step HBM- or
    link-bound) and each held slot charged the capacity price nu_t. 0 after its last read."""
    z = np.asarray(multipliers, np.float64)
    T = blk["R"].shape[0]
    a, c, e, _, _ = _chain_costs(z[:T], z[T : 2 * T], z[2 * T :], blk, np)
    g0 = np.zeros(a.shape[1])
    g1 = np.zeros(a.shape[1])
    out = np.zeros(a.shape)
    for t in range(T - 1, -1, -1):
        out[t] = g0 - g1
        # from y_{t-1} = 0: stay out (0) or promote at t; from y_{t-1} = 1: demote or keep
        g0, g1 = np.minimum(g0, a[t] + c[t] + g1), np.minimum(e[t] + g0, a[t] + g1)
    return np.clip(out, 0.0, None)


def _window_start(R, valid_from, init, t0: int) -> dict:
    """How a sub-horizon starting at step t0 begins: sealing steps shifted to it, the initial
    placement for the first window only (later ones start free), the step before's reads."""
    return dict(
        valid_from=np.maximum(valid_from - t0, 0),
        init=init if t0 == 0 else None,
        prev_read=R[t0 - 1] if t0 > 0 else None,
    )


def dual_values(
    reads,
    fixed,
    capacity: int,
    rho: float,
    *,
    valid_from=None,
    init=None,
    window: int = 256,
    overlap: int = 64,
    keep_fetched: bool = False,
    demote_cost: float = 0.0,
    temperatures=DUAL_TEMPERATURES,
    iters: int = DUAL_ITERS,
) -> np.ndarray:
    """[T, N] float64: every block's `value_to_go` after every step of one layer, in units of
    block bytes / B_hbm, under the multipliers of the LP's Lagrangian dual (`lagrangian_bound`).

    The dual is ascended over windows of `window` steps (the first from `init`, the later ones
    from a free placement, as `layer_bound`'s sub-horizons), each extended by `overlap` steps
    whose values are dropped, so a value near a window's end still sees `overlap` steps of the
    block's future. temperatures, iters: the dual's ascent (`lagrangian_bound`); the other
    arguments as in `layer_bound`.
    """
    R = np.asarray(reads, bool)
    T, N = R.shape
    if window < 1 or overlap < 0:
        raise ValueError(f"window must be >= 1 and overlap >= 0, got {window}, {overlap}")
    fixed = np.asarray(fixed, np.float64)
    vf = np.zeros(N, np.int64) if valid_from is None else np.asarray(valid_from, np.int64)
    out = np.zeros((T, N))
    for t0 in range(0, T, window):
        t1 = min(T, t0 + window)
        t2 = min(T, t1 + overlap)
        kw = _window_start(R, vf, init, t0)
        blk = _window_blocks(
            R[t0:t2],
            fixed[t0:t2],
            capacity,
            rho,
            **kw,
            keep_fetched=keep_fetched,
            demote_cost=demote_cost,
        )
        if blk["R"].shape[1] == 0:
            continue
        _, z, _, _ = _ascend(blk, temperatures, iters)
        act = np.flatnonzero(R[t0:t2].any(0))
        out[t0:t1, act] = value_to_go(blk, z)[: t1 - t0]
    return out


SOLVERS = ("lagrangian", "highs")


def layer_bound(
    reads,
    fixed,
    capacity: int,
    rho: float,
    *,
    valid_from=None,
    init=None,
    solver: str = "lagrangian",
    window: int | None = None,
    keep_fetched: bool = False,
    demote_cost: float = 0.0,
    time_limit: float | None = None,
    iters: int = DEFAULT_ITERS,
    promote_write: float = 1.0,
) -> dict:
    """The bound of one layer, window by window (see the module docstring).

    Args:
      reads: [T, N] bool, the blocks each step reads.
      fixed: [T] float, HBM bytes of each step besides the placed blocks / block bytes.
      capacity: C, HBM pool blocks.
      rho: B_hbm / B_link.
      valid_from: [N] int, the step each block is sealed at (0: before step 0; >= T: never);
        None: all 0.
      init: [N] bool, HBM content before step 0; None: a free initial placement.
      solver: "lagrangian" (`lagrangian_bound`) or "highs" (the LP with HiGHS' interior point,
        `solve_lp`).
      window: steps per sub-horizon (None: one window of all T steps).
      keep_fetched, demote_cost: the simulator's rules.
      time_limit: seconds per window LP ("highs"; None: no limit).
      iters: L-BFGS-B iterations per temperature ("lagrangian").
      promote_write: HBM write per promotion, in blocks (tests only).
    Returns:
      {"bound": the bound in units of block bytes / B_hbm, "primal": the sum of the windows' LP
       optima ("highs"; None when a window did not finish or for "lagrangian"), "floor":
       sum_t max(F_t, (F_t + reads_t) x rho / (rho + 1)), the Unlimited bound with the tail
       block on the HBM side where the simulator keeps it (a window without duals falls back
       to its share), "status": "optimal" (every LP solved), "lagrangian" or the first failed
       window's message, "windows", "size": the largest window LP's size, "wall_s"}.
    """
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; expected one of {list(SOLVERS)}")
    R = np.asarray(reads, bool)
    T, N = R.shape
    fixed = np.asarray(fixed, np.float64)
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 steps (or None), got {window}")
    w = T if window is None else int(window)
    vf = np.zeros(N, np.int64) if valid_from is None else np.asarray(valid_from, np.int64)
    floor = np.maximum(fixed, (fixed + R.sum(1)) * rho / (rho + 1.0))  # tau_t >= floor_t
    status = "optimal" if solver == "highs" else "lagrangian"
    total, primal, size, wall = 0.0, 0.0 if solver == "highs" else None, {}, 0.0
    for t0 in range(0, T, w):
        t1 = min(T, t0 + w)
        kw = dict(
            **_window_start(R, vf, init, t0),
            keep_fetched=keep_fetched,
            demote_cost=demote_cost,
            promote_write=promote_write,
        )
        args = (R[t0:t1], fixed[t0:t1], capacity, rho)
        if solver == "lagrangian":
            sol = lagrangian_bound(*args, **kw, iters=iters)
            win = dict(steps=t1 - t0, blocks=int(R[t0:t1].any(0).sum()))
        else:
            lp = build_window_lp(*args, **kw)
            sol = solve_lp(lp, time_limit=time_limit)
            win = lp.size
            if sol["primal"] is None:
                primal = None
                if status == "optimal":
                    status = f"steps {t0}..{t1 - 1}: {sol['message']}"
            elif primal is not None:
                primal += sol["primal"]
        wall += sol["wall_s"]
        u = float(floor[t0:t1].sum())
        total += u if sol["bound"] is None else max(sol["bound"], u)
        if win["steps"] * win["blocks"] >= size.get("steps", 0) * size.get("blocks", 0):
            size = win
    return dict(
        bound=total,
        primal=primal,
        floor=float(floor.sum()),
        status=status,
        windows=len(range(0, T, w)),
        size=size,
        wall_s=wall,
    )


def trace_reads(trace, sparsity: float, steps: int, layers: Sequence[int], chunk: int = 128):
    """[steps, len(layers), N] bool: the simulator's read mask (`trace.read_mask`) per step."""
    out = []
    idx = np.asarray(layers, np.int64)
    for t0 in range(0, steps, chunk):
        c = min(chunk, steps - t0)
        r = read_mask(trace.mass(t0, c), trace.prompt_len, trace.block_size, sparsity, t0)
        out.append(np.asarray(r)[:, idx])
    return np.concatenate(out, 0)


def _trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx):
    """The per-layer LP's data for a trace, as `jaxkv.sim.simulate` charges it: reads [T, layers,
    N], fixed [T] and the tail block's bytes [T], valid_from, init, rho = B_hbm / B_link, and
    scale (seconds per block unit)."""
    geometry, capacity_blocks = cost.pool_capacity(
        geometry, hbm_budget, trace.num_layers, trace.block_size, capacity_blocks
    )
    P, bs, N = trace.prompt_len, trace.block_size, trace.num_blocks
    C = int(min(capacity_blocks, N))
    T = min(steps or trace.steps, trace.steps)
    reads = trace_reads(trace, sparsity, T, idx)
    b = float(geometry.token_bytes * bs)
    t = np.arange(T)
    tail = geometry.token_bytes * ((P + t) % bs + 1)
    fixed = (float(geometry.weight_bytes) + geometry.token_bytes + tail) / b
    new = bnd.new_blocks(P, bs, T, N)
    valid_from = np.where(np.arange(N) < P // bs, 0, T)
    valid_from[new[new >= 0]] = np.flatnonzero(new >= 0)
    return dict(
        reads=reads,
        fixed=fixed,
        tail=tail,
        capacity=C,
        T=T,
        valid_from=valid_from,
        init=bnd.initial_hbm(P, bs, N, C),
        rho=profile.hbm_bandwidth / profile.link_bandwidth,
        scale=b / profile.hbm_bandwidth,
        geometry=geometry,
        block_bytes=b,
    )


def trace_dual_values(
    trace,
    sparsity: float,
    *,
    geometry: cost.Geometry,
    profile: HardwareProfile,
    capacity_blocks: int | None = None,
    hbm_budget: float = cost.PAPER_HBM_BUDGET,
    steps: int | None = None,
    window: int = 256,
    overlap: int = 64,
    demote_cost: float = 0.0,
    keep_fetched: bool = False,
    temperatures=DUAL_TEMPERATURES,
    iters: int = DUAL_ITERS,
    progress: bool = False,
) -> np.ndarray:
    """[T, layers, N] float32 seconds: `dual_values` of every layer of a trace, with perfect
    knowledge of its reads (what `anneal-oracle+dual` in `jaxkv.sim.simulate` takes as the value of
    a block at the end of its window). Arguments as in `lp_bound_seconds`; window, overlap as in
    `dual_values`."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    idx = list(range(trace.num_layers))
    inp = _trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx)
    reads = inp["reads"]
    out = np.zeros(reads.shape, np.float32)
    bar = range(len(idx))
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"dual values s={sparsity:g}", unit="layer")
    for j in bar:
        v = dual_values(
            reads[:, j],
            inp["fixed"],
            inp["capacity"],
            inp["rho"],
            valid_from=inp["valid_from"],
            init=inp["init"],
            window=window,
            overlap=overlap,
            keep_fetched=keep_fetched,
            demote_cost=demote_cost,
            temperatures=temperatures,
            iters=iters,
        )
        out[:, j] = v * inp["scale"]
    return out


def lp_bound_seconds(
    trace,
    sparsity: float,
    *,
    geometry: cost.Geometry,
    profile: HardwareProfile,
    capacity_blocks: int | None = None,
    hbm_budget: float = cost.PAPER_HBM_BUDGET,
    layers: int | Sequence[int] | None = None,
    steps: int | None = None,
    solver: str = "lagrangian",
    window: int | None = None,
    demote_cost: float = 0.0,
    keep_fetched: bool = False,
    time_limit: float | None = None,
    iters: int = DEFAULT_ITERS,
    progress: bool = False,
) -> dict:
    """The LP lower bound on `jaxkv.sim.simulate`'s latency of every policy, in seconds.

    Args:
      trace: a FileTrace or SyntheticTrace (`jaxkv.sim.trace`).
      sparsity: s in [0, 1), as in `simulate`.
      geometry, profile: cost model, as in `simulate` (the trace's layer count rules).
      capacity_blocks: HBM pool blocks per layer (None: from hbm_budget, as `simulate` does).
      hbm_budget: HBM bytes in all, when capacity_blocks is None.
      layers: None (all), a count k (layers 0 .. k - 1) or a sequence of layer indices.
      steps: the first `steps` steps (None: all of the trace's).
      solver: "lagrangian" (the LP's dual ascended by `lagrangian_bound`: scales to the whole
        horizon, within about 0.1% of the LP optimum) or "highs" (the LP itself, HiGHS'
        interior point: exact, minutes per 128-step window at 2,000 blocks).
      window: steps per sub-horizon (None: the whole horizon; see the module docstring).
      demote_cost, keep_fetched: the simulator's rules (its defaults 0.0 and False).
      time_limit: seconds per window LP ("highs"; None: no limit).
      iters: L-BFGS-B iterations per temperature ("lagrangian").
      progress: tqdm bar over layers.
    Returns:
      {"layer_s": [per-layer bound, s], "total_s": their sum (compare with `simulate`'s
       latency_s summed over the same layers), "lp_s": the sum of the LP optima ("highs"; None
       when one did not finish or for "lagrangian"), "unlimited_s": the Unlimited bound over
       the same layers, "status": per layer, "optimal" (HiGHS solved every window),
       "lagrangian" or why not, "solver", "layers", "steps", "capacity_blocks", "windows",
       "size": the largest window, "wall_s": total seconds (read mask and solves),
       "layer_wall_s"}.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    if steps is not None and steps < 1:
        raise ValueError(f"steps must be >= 1 (or None), got {steps}")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1 steps (or None), got {window}")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; expected one of {list(SOLVERS)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if demote_cost < 0:
        raise ValueError(f"demote_cost must be >= 0, got {demote_cost}")
    if time_limit is not None and time_limit <= 0:
        raise ValueError(f"time_limit must be > 0 seconds (or None), got {time_limit}")
    n_layers = trace.num_layers
    if layers is None:
        idx = list(range(n_layers))
    elif isinstance(layers, (int, np.integer)):
        if not 1 <= layers <= n_layers:
            raise ValueError(f"layers must be a count in [1, {n_layers}], got {layers}")
        idx = list(range(int(layers)))
    else:
        idx = [int(i) for i in layers]
        bad = [i for i in idx if not 0 <= i < n_layers]
        if not idx or bad:
            raise ValueError(f"layers must be indices in [0, {n_layers - 1}], got {list(layers)!r}")
    w0 = time.perf_counter()
    inp = _trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx)
    reads, fixed, tail, C, T = inp["reads"], inp["fixed"], inp["tail"], inp["capacity"], inp["T"]
    valid_from, init, rho, scale = inp["valid_from"], inp["init"], inp["rho"], inp["scale"]
    geometry, b = inp["geometry"], inp["block_bytes"]
    # the simulator's Unlimited bound (`cost.unlimited_step_time`: the tail block splits too)
    unl = np.asarray(
        cost.unlimited_step_time(
            reads.sum(-1) * b + tail[:, None],  # [T, layers]
            profile=profile,
            weight_bytes=float(geometry.weight_bytes),
            hbm_write_bytes=geometry.token_bytes,
        ),
        np.float64,
    )
    bar = range(len(idx))
    if progress:
        from tqdm import tqdm

        bar = tqdm(bar, desc=f"lp bound s={sparsity:g}", unit="layer")
    out = dict(
        layer_s=[], lp_s=0.0, unlimited_s=0.0, status=[], layer_wall_s=[], size={}, solver=solver
    )
    for j in bar:
        res = layer_bound(
            reads[:, j],
            fixed,
            C,
            rho,
            valid_from=valid_from,
            init=init,
            solver=solver,
            window=window,
            keep_fetched=keep_fetched,
            demote_cost=demote_cost,
            time_limit=time_limit,
            iters=iters,
        )
        out["layer_s"].append(res["bound"] * scale)
        out["lp_s"] = (
            None
            if res["primal"] is None or out["lp_s"] is None
            else (out["lp_s"] + res["primal"] * scale)
        )
        out["unlimited_s"] += float(unl[:, j].sum())
        out["status"].append(res["status"])
        out["layer_wall_s"].append(res["wall_s"])
        if res["size"]["blocks"] >= out["size"].get("blocks", -1):
            out["size"] = res["size"]
        out["windows"] = res["windows"]
    out.update(
        total_s=float(sum(out["layer_s"])),
        layers=idx,
        steps=T,
        capacity_blocks=C,
        wall_s=time.perf_counter() - w0,
    )
    return out


__all__ = [
    "SOLVERS",
    "build_window_lp",
    "dual_bound",
    "dual_values",
    "lagrangian_bound",
    "layer_bound",
    "lp_bound_seconds",
    "solve_lp",
    "trace_dual_values",
    "trace_reads",
    "value_to_go",
]

"""The window LP of `jaxkv.sim.lp.bound`: its variables and rows, its weak-duality certificate and
its solve with HiGHS (`scipy.optimize.linprog`).

`build_window_lp` writes the LP of one layer over one window of steps (variables y, p, d, tau;
rows (1)-(5) of docs/lp_bound.md) in block units; `solve_lp` solves it with HiGHS' interior
point (no crossover by default) and reports `dual_bound` at the solver's row duals, a lower
bound on the LP optimum whatever the solver's tolerances. `window_start` says how a sub-horizon
begins, for both solvers. The derivation: docs/lp_bound.md.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import numpy as np
import scipy.optimize
import scipy.sparse as sp


@dataclasses.dataclass(frozen=True, eq=False)
class WindowSpec:
    """One layer's LP over one window of steps, in block units (docs/lp_bound.md): what the LP
    (`build_window_lp`), its per-block chains (`jaxkv.sim.lp.lagrangian.window_blocks`) and its
    dual bound (`lagrangian_bound`) are built from. `window_spec` cuts one from a layer.

    Attributes:
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
    """

    reads: np.ndarray
    fixed: np.ndarray
    capacity: int
    rho: float
    valid_from: np.ndarray | None = None
    init: np.ndarray | None = None
    prev_read: np.ndarray | None = None
    keep_fetched: bool = False
    demote_cost: float = 0.0
    promote_write: float = 1.0


def window_spec(R, fixed, capacity: int, rho: float, t0: int, t1: int, valid_from, init, **rules):
    """The spec of steps [t0, t1) of a layer whose steps read R [T, N] (fixed [T], valid_from
    [N], init [N] as for the whole layer): sealing steps shifted to t0, the initial placement
    for the first window only (later ones start free), the step before's reads; `rules`:
    keep_fetched, demote_cost, promote_write."""
    return WindowSpec(
        R[t0:t1], fixed[t0:t1], capacity, rho, **window_start(R, valid_from, init, t0), **rules
    )


@dataclasses.dataclass
class WindowLP:
    """min c x s.t. A x <= b, lb <= x <= ub; tau are the last T variables."""

    c: np.ndarray
    A: sp.csr_matrix
    b: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    size: dict


@dataclasses.dataclass
class _Vars:
    """The window LP's variables over the K blocks read in the window (ids into x, -1: absent).

    y[t, k] exists from the block's sealing step to its last read in the window (`pres`); the
    ny y variables are numbered row-major (sorted by step) as (tt, kk); p[t, k] exists where a
    row (2) or (3) bounds it (`hasp`, a mask over the y's); d and tau are numbered after them.
    """

    R: np.ndarray  # [T, K] bool: the reads of the blocks read in the window
    pres: np.ndarray  # [T, K] bool: where y exists
    tt: np.ndarray  # [ny] the step of each y
    kk: np.ndarray  # [ny] the block of each y
    yid: np.ndarray  # [T, K] the id of y[t, k]
    pid: np.ndarray  # [T, K] the id of p[t, k]
    inner: np.ndarray  # [ny] (2) against the previous step
    seal: np.ndarray  # [ny] (3): the block's sealing step, > 0
    start: np.ndarray  # [ny] (2) against the initial placement
    hasp: np.ndarray  # [ny] inner | seal | start
    prev: np.ndarray  # [K] bool: read by the step before the window
    init_k: np.ndarray  # [K] float: HBM content before the window (0 when free)
    ny: int
    n_p: int


class _Rows:
    """The sparse rows of A x <= b, appended one group at a time (`add` entries, then `close`)."""

    def __init__(self):
        self.rows, self.cols, self.vals, self.rhs = [], [], [], []
        self.n = 0  # rows closed so far: the first row of the next group

    def add(self, r, c, v):
        self.rows.append(np.asarray(r, np.int64))
        self.cols.append(np.asarray(c, np.int64))
        self.vals.append(np.broadcast_to(np.asarray(v, np.float64), np.shape(r)))

    def close(self, rhs):
        self.rhs.append(rhs)
        self.n += len(rhs)

    def matrix(self, nv: int) -> sp.csr_matrix:
        entries = (np.concatenate(self.rows), np.concatenate(self.cols))
        return sp.csr_matrix((np.concatenate(self.vals), entries), shape=(self.n, nv))


def _check_inputs(reads, fixed):
    R = np.asarray(reads, bool)
    if R.ndim != 2:
        raise ValueError(f"reads must be [steps, blocks], got shape {R.shape}")
    T = R.shape[0]
    fixed = np.asarray(fixed, np.float64)
    if fixed.shape != (T,):
        raise ValueError(f"fixed must have shape ({T},), got {fixed.shape}")
    return R, fixed


def _variables(R, valid_from, init, prev_read) -> _Vars:
    """Numbers the y and p variables of the blocks read in the window (the others stay out)."""
    T = R.shape[0]
    act = np.flatnonzero(R.any(0))
    R = R[:, act]
    K = act.size
    vf = np.zeros(K, np.int64) if valid_from is None else np.asarray(valid_from)[act]
    if np.any(R & (np.arange(T)[:, None] < vf[None])):
        raise ValueError("reads must not read a block before its valid_from step")
    prev = np.zeros(K, bool) if prev_read is None else np.asarray(prev_read, bool)[act]
    last = T - 1 - np.argmax(R[::-1], axis=0) if K else np.zeros(0, np.int64)
    steps = np.arange(T)[:, None]
    pres = (steps >= vf[None]) & (steps <= last[None])
    tt, kk = np.nonzero(pres)
    ny = tt.size
    yid = np.full((T, K), -1, np.int64)
    yid[tt, kk] = np.arange(ny)
    inner = tt > vf[kk]
    seal = (tt == vf[kk]) & (tt > 0)
    start = (tt == 0) & (init is not None)
    hasp = inner | seal | start
    n_p = int(hasp.sum())
    pid = np.full((T, K), -1, np.int64)
    pid[tt[hasp], kk[hasp]] = ny + np.arange(n_p)
    init_k = np.zeros(K) if init is None else np.asarray(init, bool)[act].astype(np.float64)
    return _Vars(R, pres, tt, kk, yid, pid, inner, seal, start, hasp, prev, init_k, ny, n_p)


def _promotion_rows(rows: _Rows, v: _Vars):
    """(2) y[t] - y[t - 1] - p[t] <= 0, and y[0] - p[0] <= init."""
    ti, ki = v.tt[v.inner], v.kk[v.inner]
    rr = rows.n + np.arange(ti.size)
    rows.add(rr, v.yid[ti, ki], 1.0)
    rows.add(rr, v.yid[ti - 1, ki], -1.0)
    rows.add(rr, v.pid[ti, ki], -1.0)
    rows.close(np.zeros(ti.size))
    ts, ks = v.tt[v.start], v.kk[v.start]
    rr = rows.n + np.arange(ts.size)
    rows.add(rr, v.yid[ts, ks], 1.0)
    rows.add(rr, v.pid[ts, ks], -1.0)
    rows.close(v.init_k[ks])


def _sealing_rows(rows: _Rows, v: _Vars, capacity: int):
    """(3) y[t, k] + sum_j y[t - 1, j] - p[t, k] <= C for the block k sealed at step t > 0."""
    for t, k in zip(v.tt[v.seal], v.kk[v.seal], strict=True):
        before = v.yid[t - 1][v.yid[t - 1] >= 0]
        rows.add(
            np.full(before.size + 2, rows.n),
            np.r_[v.yid[t, k], v.pid[t, k], before],
            np.r_[1.0, -1.0, np.ones(before.size)],
        )
        rows.close(np.array([float(capacity)]))


def _demotion_rows(rows: _Rows, v: _Vars):
    """(4) y[t - 1] - y[t] - d[t] <= 0, and 1 - y[0] - d[0] <= 0 for the blocks initially in HBM;
    returns the step of each d and their ids."""
    ti, ki = v.tt[v.inner], v.kk[v.inner]
    s0 = v.start & (v.init_k[v.kk] > 0)
    dt = np.concatenate([ti, v.tt[s0]])
    did = v.ny + v.n_p + np.arange(dt.size)
    rr = rows.n + np.arange(ti.size)
    rows.add(rr, v.yid[ti - 1, ki], 1.0)
    rows.add(rr, v.yid[ti, ki], -1.0)
    rows.add(rr, did[: ti.size], -1.0)
    rows.close(np.zeros(ti.size))
    rr = rows.n + np.arange(int(s0.sum()))
    rows.add(rr, v.yid[v.tt[s0], v.kk[s0]], -1.0)
    rows.add(rr, did[ti.size :], -1.0)
    rows.close(-np.ones(rr.size))
    return dt, did


def _step_time_rows(rows, v: _Vars, fixed, rho, tau, dt, did, *, keep_fetched, dc, write):
    """(5) tau_t >= HBM_t and tau_t >= link_t x rho, in block units:
    sum R y + hp p + dc d - tau <= -F and rho (-sum R y + lp p + dc d) - tau <= -rho sum R."""
    T = v.R.shape[0]
    tt, kk = v.tt, v.kk
    rd = v.R[tt, kk]
    tp, kp = tt[v.hasp], kk[v.hasp]
    kept = keep_fetched & np.where(tp > 0, v.R[np.maximum(tp - 1, 0), kp], v.prev[kp])
    hp = np.where(kept, write, write - v.R[tp, kp])
    lp = np.where(kept, 0.0, 1.0)
    r0 = rows.n
    rows.add(r0 + tt[rd], v.yid[tt[rd], kk[rd]], 1.0)
    rows.add(r0 + tp, v.pid[tp, kp], hp)
    rows.add(r0 + dt, did, dc)
    rows.add(r0 + np.arange(T), tau, -1.0)
    rows.close(-fixed)
    r0 = rows.n
    rows.add(r0 + tt[rd], v.yid[tt[rd], kk[rd]], -rho)
    rows.add(r0 + tp, v.pid[tp, kp], rho * lp)
    rows.add(r0 + dt, did, rho * dc)
    rows.add(r0 + np.arange(T), tau, -1.0)
    rows.close(-rho * v.R.sum(1).astype(np.float64))


def build_window_lp(spec: WindowSpec) -> WindowLP:
    """The LP of `spec` (one layer over one window of steps, in block units; docs/lp_bound.md):
    a WindowLP whose optimum (in units of b / B_hbm) is the window's bound."""
    capacity, rho = spec.capacity, spec.rho
    demote_cost, promote_write = spec.demote_cost, spec.promote_write
    R, fixed = _check_inputs(spec.reads, spec.fixed)
    T = R.shape[0]
    v = _variables(R, spec.valid_from, spec.init, spec.prev_read)
    rows = _Rows()
    _promotion_rows(rows, v)
    _sealing_rows(rows, v, capacity)
    dt, did = np.zeros(0, np.int64), v.ny + v.n_p + np.arange(0)
    if demote_cost > 0:
        dt, did = _demotion_rows(rows, v)
    n_d = dt.size
    n_tau = v.ny + v.n_p + n_d
    tau = n_tau + np.arange(T)
    # (1) capacity: sum_k y[t, k] <= C
    rows.add(rows.n + v.tt, v.yid[v.tt, v.kk], 1.0)
    rows.close(np.full(T, float(capacity)))
    kw = dict(keep_fetched=spec.keep_fetched, dc=demote_cost, write=promote_write)
    _step_time_rows(rows, v, fixed, rho, tau, dt, did, **kw)
    nv = n_tau + T
    A = rows.matrix(nv)
    c = np.zeros(nv)
    c[tau] = 1.0
    lb = np.zeros(nv)
    ub = np.ones(nv)
    per_step = (2.0 + promote_write + 2.0 * demote_cost) * v.pres.sum(1) + 1.0  # >= block terms
    ub[tau] = np.maximum(fixed + per_step, rho * per_step)
    size = dict(
        steps=T, blocks=v.R.shape[1], y=v.ny, p=v.n_p, d=n_d, rows=rows.n, nonzeros=int(A.nnz)
    )
    return WindowLP(c, A, np.concatenate(rows.rhs), lb, ub, size)


def dual_bound(lp: WindowLP, lam) -> float:
    """Weak-duality bound min over the box of c x + lam (A x - b), lam clipped to >= 0."""
    lam = np.maximum(np.asarray(lam, np.float64), 0.0)
    r = lp.c + lp.A.T @ lam
    return float(-lam @ lp.b + np.sum(np.minimum(r * lp.lb, r * lp.ub)))


def _linprog(lp: WindowLP, method: str, opts: dict):
    """scipy's HiGHS on the LP; an imprecise end without crossover is rerun with crossover."""
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
            return res
        opts["run_crossover"] = "on"


def solve_lp(
    lp: WindowLP, *, time_limit: float | None = None, method: str = "highs-ipm", tol: float = 1e-7
) -> dict:
    """Solves a WindowLP with HiGHS; returns {bound, primal, status, message, wall_s}.

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
    res = _linprog(lp, method, opts)
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


def window_start(R, valid_from, init, t0: int) -> dict:
    """How a sub-horizon starting at step t0 begins: sealing steps shifted to it, the initial
    placement for the first window only (later ones start free), the step before's reads."""
    return dict(
        valid_from=np.maximum(valid_from - t0, 0),
        init=init if t0 == 0 else None,
        prev_read=R[t0 - 1] if t0 > 0 else None,
    )


__all__ = [
    "WindowLP",
    "WindowSpec",
    "build_window_lp",
    "dual_bound",
    "solve_lp",
    "window_spec",
    "window_start",
]

"""A linear-programming lower bound on `jaxkv.sim.simulate`'s latency that counts promotion writes.

The bounds of `jaxkv.sim.bounds` ignore the HBM write every promotion costs, so on traces whose
read set churns they sit at the Unlimited bound while every policy pays for its promotions. Here
the placement problem, exactly as the simulator charges it, is relaxed to a linear program per
layer, whose optimum is at most every policy's latency. `lp_bound_seconds` bounds a trace in
seconds, `layer_bound` one layer, window by window (default: one window of the whole horizon),
with one of two solvers (`SOLVERS`), each reporting a certified lower bound on the LP optimum:
  * "lagrangian" (the default): the LP's partial Lagrangian dual, ascended by L-BFGS-B
    (`lagrangian_bound`, DEFAULT_ITERS = 200 iterations per temperature);
  * "highs": the LP itself (`build_window_lp`) with HiGHS' interior point (`solve_lp`), the bound
    taken at its row duals (`dual_bound`).
The dual's prices also value each block's future for a planner (`dual_values`,
`trace_dual_values`).

Where things are (this module imports the others, none imports it):
  * `jaxkv.sim.lp.model`: the window LP, its weak-duality certificate and the HiGHS solve;
  * `jaxkv.sim.lp.lagrangian`: the "lagrangian" solver (per-block chains, dual ascent);
  * `jaxkv.sim.lp.dual`: values for a planner from the dual's prices;
  * `jaxkv.sim.lp.trace`: a trace's reads and bytes as the LP's data;
  * here: the per-layer and per-trace bounds. The package (`jaxkv.sim.lp`) exports the public
    names of all five.
The model, why no policy beats it, its reductions, the solvers and their scale: docs/lp_bound.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from jaxkv import cost
from jaxkv.config import HardwareProfile
from jaxkv.sim.lp.lagrangian import DEFAULT_ITERS, lagrangian_bound
from jaxkv.sim.lp.model import WindowSpec, build_window_lp, solve_lp, window_spec
from jaxkv.sim.lp.trace import layer_progress, trace_inputs

SOLVERS = ("lagrangian", "highs")


def _solve_window(solver, spec: WindowSpec, *, iters, time_limit):
    """One window's bound: (the solver's result, the window's size)."""
    if solver == "lagrangian":
        sol = lagrangian_bound(spec, iters=iters)
        return sol, dict(steps=spec.reads.shape[0], blocks=int(spec.reads.any(0).sum()))
    lp = build_window_lp(spec)
    return solve_lp(lp, time_limit=time_limit), lp.size


def _add_primal(primal, status, sol, t0, t1):
    """The running sum of the windows' LP optima ("highs"), None once one did not finish, and
    the status naming the first window that did not."""
    if sol["primal"] is None:
        if status == "optimal":
            status = f"steps {t0}..{t1 - 1}: {sol['message']}"
        return None, status
    return (None if primal is None else primal + sol["primal"]), status


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
    """The bound of one layer, window by window (docs/lp_bound.md).

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
    rules = dict(keep_fetched=keep_fetched, demote_cost=demote_cost, promote_write=promote_write)
    for t0 in range(0, T, w):
        t1 = min(T, t0 + w)
        spec = window_spec(R, fixed, capacity, rho, t0, t1, vf, init, **rules)
        sol, win = _solve_window(solver, spec, iters=iters, time_limit=time_limit)
        if solver == "highs":
            primal, status = _add_primal(primal, status, sol, t0, t1)
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


def _check_args(sparsity, steps, window, solver, iters, demote_cost, time_limit):
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


def _layer_indices(layers, n_layers: int) -> list[int]:
    """`lp_bound_seconds`' layers argument as a list of layer indices."""
    if layers is None:
        return list(range(n_layers))
    if isinstance(layers, (int, np.integer)):
        if not 1 <= layers <= n_layers:
            raise ValueError(f"layers must be a count in [1, {n_layers}], got {layers}")
        return list(range(int(layers)))
    idx = [int(i) for i in layers]
    bad = [i for i in idx if not 0 <= i < n_layers]
    if not idx or bad:
        raise ValueError(f"layers must be indices in [0, {n_layers - 1}], got {list(layers)!r}")
    return idx


def _unlimited_s(inp: dict, profile: HardwareProfile) -> np.ndarray:
    """[T, layers] seconds: the simulator's Unlimited bound (`cost.unlimited_step_time`: the tail
    block splits too)."""
    geometry = inp["geometry"]
    return np.asarray(
        cost.unlimited_step_time(
            inp["reads"].sum(-1) * inp["block_bytes"] + inp["tail"][:, None],
            profile=profile,
            weight_bytes=float(geometry.weight_bytes),
            hbm_write_bytes=geometry.token_bytes,
        ),
        np.float64,
    )


def _add_layer(out: dict, res: dict, unlimited_s: float, scale: float):
    """Adds one layer's `layer_bound` to `lp_bound_seconds`' result."""
    out["layer_s"].append(res["bound"] * scale)
    out["lp_s"] = (
        None
        if res["primal"] is None or out["lp_s"] is None
        else (out["lp_s"] + res["primal"] * scale)
    )
    out["unlimited_s"] += unlimited_s
    out["status"].append(res["status"])
    out["layer_wall_s"].append(res["wall_s"])
    if res["size"]["blocks"] >= out["size"].get("blocks", -1):
        out["size"] = res["size"]
    out["windows"] = res["windows"]


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
      window: steps per sub-horizon (None: the whole horizon; see docs/lp_bound.md).
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
    _check_args(sparsity, steps, window, solver, iters, demote_cost, time_limit)
    idx = _layer_indices(layers, trace.num_layers)
    w0 = time.perf_counter()
    inp = trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx)
    unl = _unlimited_s(inp, profile)
    out = dict(
        layer_s=[], lp_s=0.0, unlimited_s=0.0, status=[], layer_wall_s=[], size={}, solver=solver
    )
    for j in layer_progress(len(idx), f"lp bound s={sparsity:g}", progress):
        res = layer_bound(
            inp["reads"][:, j],
            inp["fixed"],
            inp["capacity"],
            inp["rho"],
            valid_from=inp["valid_from"],
            init=inp["init"],
            solver=solver,
            window=window,
            keep_fetched=keep_fetched,
            demote_cost=demote_cost,
            time_limit=time_limit,
            iters=iters,
        )
        _add_layer(out, res, float(unl[:, j].sum()), inp["scale"])
    out.update(
        total_s=float(sum(out["layer_s"])),
        layers=idx,
        steps=inp["T"],
        capacity_blocks=inp["capacity"],
        wall_s=time.perf_counter() - w0,
    )
    return out

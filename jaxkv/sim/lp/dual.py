"""Values for a planner from the LP's Lagrangian dual (`jaxkv.sim.lp.lagrangian`).

At the dual's prices each block's chain is solved exactly, so running its dynamic programme
backwards gives, per block and step, what ending the step on host rather than in HBM costs over
the steps after it (`value_to_go`): later reads weighed by how far the LP finds their steps HBM-
or link-bound, slot time charged the capacity price. `dual_values` computes it for one layer,
window by window (default: 256-step windows seeing 64 steps more), `trace_dual_values` for every
layer of a trace in seconds; `anneal-oracle+dual` in `jaxkv.sim.simulate` takes it as the
terminal value of its short window. The derivation: docs/lp_bound.md.
"""

from __future__ import annotations

import numpy as np

from jaxkv import cost
from jaxkv.config import HardwareProfile
from jaxkv.sim.lp.lagrangian import ascend, chain_costs, window_blocks
from jaxkv.sim.lp.model import window_spec
from jaxkv.sim.lp.trace import layer_progress, trace_inputs

# `dual_values`' ascent: one L-BFGS-B stage of 50 iterations at temperature 0.03 (the bound's
# `lagrangian_bound` runs five stages of 200): prices for values need not be converged as a
# bound's multipliers do (measured: bench/RESULTS.md)
DUAL_TEMPERATURES = (0.03,)
DUAL_ITERS = 50


def value_to_go(blk: dict, multipliers) -> np.ndarray:
    """[T, K] per block of a window (`jaxkv.sim.lp.lagrangian.window_blocks`) and step t:
    G0_t - G1_t, clipped at 0, where G_y is the least priced cost of the block's chain over steps
    t + 1 .. T - 1 given y_t = y (the dual's dynamic programme, run backwards under the
    multipliers theta | nu | sigma). In units of block bytes / B_hbm: what leaving the block on
    host after step t costs the rest of the window over keeping it in HBM, with each later step's
    HBM and link time weighed by theta_t, 1 - theta_t (how far the LP finds that step HBM- or
    link-bound) and each held slot charged the capacity price nu_t. 0 after its last read."""
    z = np.asarray(multipliers, np.float64)
    T = blk["R"].shape[0]
    a, c, e, _, _ = chain_costs(z[:T], z[T : 2 * T], z[2 * T :], blk, np)
    g0 = np.zeros(a.shape[1])
    g1 = np.zeros(a.shape[1])
    out = np.zeros(a.shape)
    for t in range(T - 1, -1, -1):
        out[t] = g0 - g1
        # from y_{t-1} = 0: stay out (0) or promote at t; from y_{t-1} = 1: demote or keep
        g0, g1 = np.minimum(g0, a[t] + c[t] + g1), np.minimum(e[t] + g0, a[t] + g1)
    return np.clip(out, 0.0, None)


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
    from a free placement, as `jaxkv.sim.lp.bound.layer_bound`'s sub-horizons), each extended by
    `overlap` steps whose values are dropped, so a value near a window's end still sees `overlap`
    steps of the block's future. temperatures, iters: the dual's ascent (`lagrangian_bound`); the
    other arguments as in `layer_bound`.
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
        spec = window_spec(
            R, fixed, capacity, rho, t0, t2, vf, init,
            keep_fetched=keep_fetched, demote_cost=demote_cost,
        )  # fmt: skip
        blk = window_blocks(spec)
        if blk["R"].shape[1] == 0:
            continue
        _, z, _, _ = ascend(blk, temperatures, iters)
        act = np.flatnonzero(R[t0:t2].any(0))
        out[t0:t1, act] = value_to_go(blk, z)[: t1 - t0]
    return out


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
    a block at the end of its window). Arguments as in `jaxkv.sim.lp.bound.lp_bound_seconds`;
    window, overlap as in `dual_values`."""
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    idx = list(range(trace.num_layers))
    inp = trace_inputs(trace, sparsity, geometry, profile, capacity_blocks, hbm_budget, steps, idx)
    reads = inp["reads"]
    out = np.zeros(reads.shape, np.float32)
    for j in layer_progress(len(idx), f"dual values s={sparsity:g}", progress):
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


__all__ = ["DUAL_ITERS", "DUAL_TEMPERATURES", "dual_values", "trace_dual_values", "value_to_go"]

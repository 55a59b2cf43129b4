"""The LP relaxation's lower bound and its dual values (method: docs/lp_bound.md).

bound       the per-layer and per-trace bounds (`layer_bound`, `lp_bound_seconds`)
model       one window's spec (`WindowSpec`), its LP and the HiGHS solve
lagrangian  the "lagrangian" solver: per-block chains and the dual ascent
dual        values for a planner from the dual's prices
trace       a trace's reads and bytes as the LP's data
"""

from jaxkv.sim.lp.bound import SOLVERS, layer_bound, lp_bound_seconds
from jaxkv.sim.lp.dual import (
    DUAL_ITERS,
    DUAL_TEMPERATURES,
    dual_values,
    trace_dual_values,
    value_to_go,
)
from jaxkv.sim.lp.lagrangian import DEFAULT_ITERS, lagrangian_bound
from jaxkv.sim.lp.model import WindowSpec, build_window_lp, dual_bound, solve_lp, window_spec
from jaxkv.sim.lp.trace import trace_reads

__all__ = [
    "DEFAULT_ITERS",
    "DUAL_ITERS",
    "DUAL_TEMPERATURES",
    "SOLVERS",
    "WindowSpec",
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
    "window_spec",
]

"""What a simulation costs a trace in: its geometry, its batch and its HBM pool per layer.

Geometry (`resolve_geometry`): None -> the trace's own when it carries one (a recorded
version-2 file, `jaxkv.sim.trace`), else DEFAULT_GEOMETRY (the paper's, as before traces carried
one); "trace" -> the trace's own (ValueError when it has none); a preset name
(`jaxkv.cost.GEOMETRIES`) or a `jaxkv.cost.Geometry` -> that one. A geometry whose num_layers
differs from the trace's is costed with the trace's layers and its own per-layer sizes
(`jaxkv.cost.pool_capacity`); a trace's own always has the trace's layers (`load` checks).

Batch (`jaxkv.cost.batched`): B identical sequences decode together, each reading the trace's
blocks: per step the KV bytes (HBM and link reads, the token's write, migrations) scale by B,
the weights are read once, and the budget holds B sequences' pools.

Pool (`pool_blocks`): HBM blocks per layer of one sequence (the tail block extra; every sequence
of a batch has as many), from exactly one of
  capacity_blocks  given (per sequence, whatever the batch);
  hbm_fraction     F of the trace's blocks per layer (at its last step): max(1, ceil(F x blocks));
  hbm_budget       what the budget leaves after the parameters, shared by the batch's pools
                   (`jaxkv.cost.pool_capacity`), the default.
"""

from __future__ import annotations

import math

from jaxkv import cost
from jaxkv.config import check_number

DEFAULT_GEOMETRY = "paper"  # a trace without a geometry of its own is costed in the paper's
# result["setup"]["geometry_source"] -> the words the table uses
GEOMETRY_SOURCES = {
    "trace": "from the trace",
    "given": "given",
    "default": "the default: the trace carries none",
}


def resolve_geometry(trace, geometry=None, label: str = "geometry") -> tuple[cost.Geometry, str]:
    """(geometry, source) a trace is costed in; source one of GEOMETRY_SOURCES (see the module
    docstring). ValueError, naming `label`, for "trace" on a trace without a geometry or an
    unknown preset name."""
    own = getattr(trace, "geometry", None)
    if geometry is None:
        return (own, "trace") if own is not None else (cost.GEOMETRIES[DEFAULT_GEOMETRY], "default")
    if isinstance(geometry, cost.Geometry):
        return geometry, "given"
    if geometry == "trace":
        if own is None:
            raise ValueError(
                f"{label}='trace': the trace {trace.name!r} carries no geometry (a synthetic "
                "trace or one recorded before version 2); expected one of "
                f"{sorted(cost.GEOMETRIES)}"
            )
        return own, "trace"
    try:
        return cost.get_geometry(geometry), "given"
    except ValueError as e:
        raise ValueError(f"{label}={geometry!r}: {e} or 'trace'") from None


def pool_blocks(
    trace,
    geometry: cost.Geometry,
    *,
    hbm_budget: float,
    capacity_blocks: int | None = None,
    hbm_fraction: float | None = None,
) -> tuple[cost.Geometry, int, str]:
    """(geometry with the trace's layers, HBM pool blocks per layer of one sequence, the option
    that sized it: "capacity_blocks", "hbm_fraction" or "hbm_budget"); see the module docstring.
    ValueError when both capacity_blocks and hbm_fraction are given, F is outside (0, 1], or
    the budget leaves no room for one block."""
    if hbm_fraction is not None:
        check_number("hbm_fraction", hbm_fraction, low=0.0, high=1.0, low_open=True)
        if capacity_blocks is not None:
            raise ValueError(
                f"hbm_fraction={hbm_fraction!r} and capacity_blocks={capacity_blocks!r} both size "
                "the HBM pool: expected one of them"
            )
        capacity_blocks = max(1, math.ceil(hbm_fraction * trace.num_blocks))
    source = "hbm_budget" if capacity_blocks is None else "capacity_blocks"
    geometry, capacity = cost.pool_capacity(
        geometry, hbm_budget, trace.num_layers, trace.block_size, capacity_blocks
    )
    return geometry, capacity, "hbm_fraction" if hbm_fraction is not None else source


__all__ = ["DEFAULT_GEOMETRY", "GEOMETRY_SOURCES", "pool_blocks", "resolve_geometry"]

"""The vectorized annealer over block-to-tier assignments: problem, energy, greedy start, moves.

problem   `AnnealProblem` and its energy (`loads`, `energy`, the step's slopes)
greedy    the exact-scan starting point (`greedy_init`)
moves     moves, their exact prices and the start's certificate of local optimality
annealer  the chains, their schedule, `run` and `settle`
"""

from jaxkv.placement.anneal.annealer import (
    AnnealMetrics,
    AnnealResult,
    AnnealState,
    init,
    run,
    settle,
    step,
)
from jaxkv.placement.anneal.greedy import greedy_init
from jaxkv.placement.anneal.moves import block_deltas, certify, neighbourhood
from jaxkv.placement.anneal.problem import AnnealProblem, energy, loads

__all__ = [
    "AnnealMetrics",
    "AnnealProblem",
    "AnnealResult",
    "AnnealState",
    "block_deltas",
    "certify",
    "energy",
    "greedy_init",
    "init",
    "loads",
    "neighbourhood",
    "run",
    "settle",
    "step",
]

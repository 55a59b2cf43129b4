"""`Follow`: the in-step rule of the live policy (`Lrfu`, admit="value") and of an anneal
policy that plans a target between steps and follows it inside them ("+follow").

At every step, per layer, `jaxkv.placement.admission.follow_moves` promotes the host blocks
the step reads that `admit` takes (the read carries the block over the link: the HBM write is
the only extra cost) and demotes, to make room, the resident blocks ranked lowest: under a
plan, the ones its target leaves out, least expected first; under admit="value", the least
valuable. What runs on a layer's critical path is that vector rule alone. With admit="value"
the rule reads no plan (an anneal policy with it still plans, and is charged for, a target
the rule ignores).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.placement import statistics as imp
from jaxkv.placement.admission import FOLLOW_ADMITS, StepView, follow_moves, follow_value

FOLLOW_ADMITS_DEFAULT = "ranked"  # against "read" and "target", measured: bench/RESULTS.md


@dataclasses.dataclass(frozen=True)
class Follow:
    """The follow rule; `admit` ("read", "ranked", "target" or "value": `follow_moves`) says
    which of the step's host reads may displace which resident blocks. With `slack` a layer
    admits at most the promotions whose HBM writes its step's link time hides
    (`StepView.slack`, `jaxkv.placement.charging.free_promotions`): where the step is bound by
    HBM, a promotion would lengthen it and a host read costs nothing, so none is admitted."""

    admit: str = FOLLOW_ADMITS_DEFAULT
    slack: bool = False
    stateful = False

    def __post_init__(self):
        if self.admit not in FOLLOW_ADMITS:
            raise ValueError(f"Follow admit must be one of {FOLLOW_ADMITS}, got {self.admit!r}")
        if not isinstance(self.slack, bool):
            raise ValueError(f"Follow slack must be a bool, got {self.slack!r}")

    def init(self, rows: int, num_blocks: int):
        return ()

    def inputs(self, pstate, read_ema, reads, decay: float, layer=None, steady=None, ahead=None):
        """(target, priority, value) for `follow_moves` ([rows, N] each, or None): the plan's
        target and expected reads (`pstate`'s, [layers, N]; row `layer` as [1, N] if given), or
        under admit="value" the values alone: `follow_value`, or a row's steady read frequency
        where `steady` (`jaxkv.placement.statistics.steady_choice`'s (rows, [rows] bool)) picks
        it, plus 1 on `ahead` ([N] bool: layer 0's next reads, row 0's; `Lrfu.lookahead`)."""
        if self.admit == "value":
            value = follow_value(read_ema, reads, decay)
            if steady is not None:
                rows, pick = steady
                value = jnp.where(pick[:, None], rows, value)
            if ahead is not None:
                value = value.at[0].add(ahead.astype(value.dtype))
            return None, None, value
        if layer is None:
            return pstate.target, pstate.priority, None
        return pstate.target[layer][None], pstate.priority[layer][None], None

    def step(self, state, view: StepView, budget: int):
        """The rule on `view`'s rows (`jaxkv.placement.admission.Rule`)."""
        stats = view.stats
        steady = imp.steady_choice(stats, view.reads, view.valid, view.layer)
        target, priority, value = self.inputs(
            view.pstate,
            view.rows(stats.read_ema),
            view.reads,
            stats.decay,
            view.layer,
            steady,
            view.ahead,
        )
        adm = follow_moves(
            view.in_hbm,
            view.valid,
            view.reads,
            target,
            priority,
            view.room,
            budget,
            admit=self.admit,
            value=value,
        )
        if self.slack:
            if view.slack is None:
                raise ValueError(
                    "Follow(slack=True) caps the admissions at the step's HBM slack: expected "
                    "StepView.slack (the executors give it)"
                )
            n_p = jnp.minimum(adm.num_promote, view.slack)
            n_d = jnp.maximum(n_p - jnp.maximum(view.room, 0), 0)
            adm = dataclasses.replace(adm, num_promote=n_p, num_demote=n_d)
        return adm, state

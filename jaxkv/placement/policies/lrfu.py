"""`Lrfu` ("lrfu"): the live policy, LRFU inside the decode step."""

from __future__ import annotations

import dataclasses

from jaxkv.config import PROMPT_QUERIES, STEADY_QUERIES
from jaxkv.placement import registry
from jaxkv.placement.policies.base import KeepsPlacement
from jaxkv.placement.policies.follow import Follow


@dataclasses.dataclass(frozen=True)
class Lrfu(KeepsPlacement):
    """LRFU inside the decode step, the live policy: no plan, no forecast beyond the blocks'
    decayed read frequency. At every step, per layer, its rule (`Follow("value")`, the
    vector executor `jaxkv.placement.admission.follow_moves`) promotes a host block the step
    reads (from the copy the read fetched: an HBM write, no second link read) into a free
    slot, or over the least valuable resident block, read at this step or not, when its value
    (`follow_value`: `Stats.read_ema` with the step's reads folded in) is strictly higher.
    Under exact attention every block is read every step, all values tie and nothing moves.
    With `prompt_prior` (the default) the read frequency starts at the prompt's prior and the
    sealed blocks fill HBM in its order at prefill: the share of the prompt's last queries
    that would read each block (`jaxkv.decode.prompt`). Measured against the field's rules,
    the annealer's plans, Belady and the bounds: bench/RESULTS.md.

    steady_queries: n, a multiple of `PROMPT_QUERIES` (32), or 0 (off): the adaptive
      estimator (needs `prompt_prior`; None, the default: `STEADY_QUERIES`, 128, with it, else
      0). Each layer also keeps the prior of the prompt's last n queries, held constant, and per
      step values blocks by whichever estimator's top blocks (a layer's HBM slots) held more
      of the recent reads (`jaxkv.placement.statistics.steady_choice`): a trained model's
      drifting reads keep the decayed frequency, a stationary trace's the steady one.
    lookahead: True (the default): layer 0's next reads, known once the next token is sampled
      (the model's `first_query`), add 1 to their value in layer 0's admission
      (`jaxkv.decode.follow`); a model without `first_query` decodes without.
    slack: True (the default): a layer admits at most the promotions whose HBM writes its
      step's link time hides (`jaxkv.placement.charging.free_promotions`): none where the step
      is bound by HBM, where a promotion would lengthen it and a host read costs nothing. It
      beat the field's best rule (LFU, W-TinyLFU) in every case of the SmolLM2 traces, by up to
      3% where lrfu without it lost 0.4% (bench/RESULTS.md)."""

    name: str = "lrfu"
    follow: Follow = Follow("value")
    prompt_prior: bool = True
    steady_queries: int | None = None
    lookahead: bool = True
    slack: bool = True

    @property
    def rule(self):
        """`follow` with this policy's `slack`."""
        return dataclasses.replace(self.follow, slack=self.slack)

    def __post_init__(self):
        if not isinstance(self.follow, Follow) or self.follow.admit != "value":
            raise ValueError(f"Lrfu follow must be Follow('value'), got {self.follow!r}")
        for name in ("prompt_prior", "lookahead", "slack"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Lrfu {name} must be a bool, got {getattr(self, name)!r}")
        if self.steady_queries is None:
            object.__setattr__(self, "steady_queries", STEADY_QUERIES if self.prompt_prior else 0)
        n = self.steady_queries
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n % PROMPT_QUERIES:
            raise ValueError(
                f"Lrfu steady_queries={n!r}: expected 0 (off) or a positive multiple of "
                f"{PROMPT_QUERIES} (the prompt's last queries whose prior is held steady)"
            )
        if n and not self.prompt_prior:
            raise ValueError(
                f"Lrfu steady_queries={n} needs prompt_prior=True (its steady estimator is the "
                "prompt's prior)"
            )


registry.register_class(
    Lrfu,
    kind="live",
    doc="inside each step, promote a read block over a less often read one, from the prompt's "
    "prior (the live policy)",
    skip=("name", "follow"),
)

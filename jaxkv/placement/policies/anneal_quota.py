"""`AnnealQuota`: quotas per request and layer, re-chosen each window by the annealing planner.

The third way of sharing one HBM pool among the requests a serving engine decodes together
(issue 47, item 4), beside one pool shared by all under the live policy (lrfu) and a fixed
hot buffer per request (`jaxkv.placement.policies.lru_quota`):
  at a window boundary the annealer of "anneal+reuse" (`Anneal`: the Reuse forecast, the
  Unforeseen pricing, built by `jaxkv.placement.registry`, not copied) plans a target over the
  shared pool; its migrations move blocks as any planning policy's do (charged as today). The
  plan thereby sets how many HBM blocks each request (sequence = block index // `seq_blocks`)
  holds in each layer: that count is the request's quota for the window;
  between plans an LRU rule runs inside each quota (`AnnealQuotaRule`): a host block a step
  reads is admitted from the copy the read fetched (an HBM write, no second link read); while
  the pool has a free slot, the reader takes it; when the pool is full, the victim is the
  reading request's own least recently read resident block, so the split stays as the
  annealer chose it; a request with no HBM block in that layer then bypasses HBM.

The quota is "the blocks the request holds now", read from the rule's own residency at each
miss, so no state flows from the plan to the rule: the plan's migrations reach the rule as
blocks that entered or left HBM outside it (`SequentialRule.sync`). Not registered by name: it
needs the cache's blocks per sequence, so it is built as an object (`anneal_quota`):

    PlacementConfig(policy=anneal_quota(cache_config.max_blocks, window=16, budget=64),
                    window=16, max_moves=64)
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.config import check_number
from jaxkv.placement import registry
from jaxkv.placement.policies.anneal import Anneal
from jaxkv.placement.policies.lru_quota import LruQuotaRule

PLANNER = "anneal+reuse"  # the registered planner whose plan sets the split


@dataclasses.dataclass(frozen=True)
class AnnealQuotaRule(LruQuotaRule):
    """LRU inside each sequence's current share of the row, one row (`SequentialRule`'s hooks):
    the quota is the blocks the reading sequence holds, one more while a slot is free."""

    def quota_for(self, held, full):
        return held + (~full).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class AnnealQuota(Anneal):
    """`Anneal` whose in-step rule is `AnnealQuotaRule` (module docstring); `seq_blocks`: the
    cache's blocks per sequence (`CacheConfig.max_blocks`). Every other field is `Anneal`'s;
    `anneal_quota` fills them from the registered "anneal+reuse"."""

    name: str = "anneal-quota"
    seq_blocks: int = 1

    def __post_init__(self):
        check_number("AnnealQuota.seq_blocks", self.seq_blocks, integer=True, low=1)
        if self.follow is not None:
            raise ValueError(
                f"AnnealQuota.follow={self.follow!r}: expected None (its in-step rule is "
                "AnnealQuotaRule, LRU inside each request's share)"
            )
        super().__post_init__()

    @property
    def rule(self):
        return AnnealQuotaRule(seq_blocks=self.seq_blocks)


def anneal_quota(
    seq_blocks: int, *, window: int = 50, budget: int | None = None, **knobs
) -> AnnealQuota:
    """`AnnealQuota` planned as the registered `PLANNER` ("anneal+reuse") is in a live decode:
    W = `window` (equal to `PlacementConfig.window`), `budget` blocks moved per layer per plan
    and per step (None: the caller's `max_moves`), `knobs` the anneal family's
    (`jaxkv.placement.policies.anneal_knobs`)."""
    planner = registry.resolve(
        PLANNER, None, registry.Settings(window=window, budget=budget), **knobs
    )
    fields = {f.name: getattr(planner, f.name) for f in dataclasses.fields(Anneal)}
    return AnnealQuota(**{**fields, "name": "anneal-quota"}, seq_blocks=seq_blocks)

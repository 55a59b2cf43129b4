"""`LruQuota`: a fixed hot buffer per request (SGLang HiSparse's design), LRU inside each.

The HBM pool is split evenly among the sequences decoded together (the serving engine's
slots): each keeps at most `quota` of its sealed blocks per layer in HBM. A block a step reads
from host is admitted from the copy the read fetched (an HBM write, no second link read), as
the LRU hot buffer does (`jaxkv.placement.policies.lru`), but when its sequence holds its
quota already the victim is that sequence's own least recently read block, never another
request's. Below its quota a sequence takes a free slot, or when none is left the pool's least
recently read block. Blocks that enter HBM outside the rule (a sealed tail, a prompt's
placement at insert: `Engine(hbm_quota=...)` caps the latter) count against the quota and
leave it at the sequence's next admissions.

It is the baseline for one shared pool under the live policy (lrfu: every request's blocks
compete by value): `jaxkv bench-serve --quota` runs both in the same engine. Not registered by
name: it needs the cache's blocks per sequence, so it is built as an object:

    PlacementConfig(policy=LruQuota(quota=8, seq_blocks=cache_config.max_blocks))
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.placement import lists
from jaxkv.placement.policies.base import KeepsPlacement
from jaxkv.placement.policies.lru import RES, LruRule


@dataclasses.dataclass(frozen=True)
class LruQuotaRule(LruRule):
    """LRU with a per-sequence quota, one row (`SequentialRule`'s hooks). A miss of a sequence
    at its quota evicts that sequence's least recent block (admitted only when the quota is
    above 0); below it, the miss takes a free slot, or the row's least recent block. The quota
    is `quota_for`'s: the fixed `quota` here, a subclass may derive it from the row
    (`jaxkv.placement.policies.anneal_quota`)."""

    quota: int = 0
    seq_blocks: int = 1

    def quota_for(self, held, full):
        """[] int: the blocks the reading sequence may hold, given the blocks it holds (`held`,
        [] int32) and whether the row's slots are all taken (`full`, [] bool)."""
        return jnp.int32(self.quota)

    def miss(self, st, b, cap):
        n = st.where.shape[0]
        mine = jnp.arange(n) // self.seq_blocks == b // self.seq_blocks  # [N] b's sequence
        resident = st.where == RES
        held = jnp.sum(resident & mine).astype(jnp.int32)
        full = lists.size(st, RES) >= cap
        quota = self.quota_for(held, full)
        at_quota = held >= quota
        victim = jnp.where(
            at_quota, lists.oldest(st, RES, among=mine), jnp.where(full, lists.oldest(st, RES), n)
        )
        st = lists.drop(st, victim)
        admit = (cap > 0) & (quota > 0)
        return lists.push(st, jnp.where(admit, b, n), RES)


@dataclasses.dataclass(frozen=True)
class LruQuota(KeepsPlacement):
    """A fixed hot buffer of `quota` blocks per layer for each sequence (module docstring);
    `seq_blocks`: the cache's blocks per sequence (`CacheConfig.max_blocks`)."""

    quota: int = 0
    seq_blocks: int = 1
    name: str = "lru-quota"

    def __post_init__(self):
        for f in ("quota", "seq_blocks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if f == "quota" else 1):
                low = 0 if f == "quota" else 1
                raise ValueError(f"LruQuota.{f}={v!r}: expected an int >= {low}")

    @property
    def rule(self):
        return LruQuotaRule(quota=self.quota, seq_blocks=self.seq_blocks)

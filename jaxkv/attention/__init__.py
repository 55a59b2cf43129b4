"""Tier-aware decode attention: block selection, the XLA path and the tiered merge of parts.

select   which blocks a step reads (exact: every live block; sparse: Quest's top-k)
xla      attention over blocks laid out per sequence, and the dense reference
tiered   `tiered_attention`: the HBM, ring and host parts of a layer, merged by log-sum-exp
         (the Pallas kernel, `pallas_kernels.blocked_attention`, is one way to run a part)
"""

from jaxkv.attention.select import quest_ranks, select_blocks, window_starts
from jaxkv.attention.tiered import AttentionStats, resolve_impl, tiered_attention
from jaxkv.attention.xla import dense_attention_reference

__all__ = [
    "AttentionStats",
    "dense_attention_reference",
    "quest_ranks",
    "resolve_impl",
    "select_blocks",
    "tiered_attention",
    "window_starts",
]

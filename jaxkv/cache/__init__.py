"""The tiered KV cache: its pytree, pure operations, migration, slots, transfers and FP8 blocks.

The room's public names are importable from here (`from jaxkv import cache as kvc`;
`kvc.prefill(...)`); each lives in one module:
  layout     `TieredKVCache`, the pytree: pools, block table, free masks; shardings and the
             host-pool size check
  ops        prefill, write_token, advance, compact
  views      the debug views: to_dense, check_invariants, fragmentation
  migration  plan_moves / migrate: promotions and demotions as one bulk move list (`Moves`)
  slots      slot-table helpers (first free slots, ranks)
  transfer   reads and writes across memory kinds, one bulk transfer per pool and direction
  quant      FP8 blocks with per-block, per-KV-head scales
"""

from jaxkv.cache.layout import (
    GPU_HOST_LIMIT_DEFAULT_GB,
    GPU_HOST_LIMIT_VAR,
    TieredKVCache,
    cache_shardings,
    check_host_pool,
    gpu_host_limit_bytes,
)
from jaxkv.cache.migration import Moves, migrate, plan_moves
from jaxkv.cache.ops import advance, compact, prefill, write_token
from jaxkv.cache.views import check_invariants, fragmentation, to_dense

__all__ = [
    "GPU_HOST_LIMIT_DEFAULT_GB",
    "GPU_HOST_LIMIT_VAR",
    "Moves",
    "TieredKVCache",
    "advance",
    "cache_shardings",
    "check_host_pool",
    "check_invariants",
    "compact",
    "fragmentation",
    "gpu_host_limit_bytes",
    "migrate",
    "plan_moves",
    "prefill",
    "to_dense",
    "write_token",
]

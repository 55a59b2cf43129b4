"""Pallas Mosaic GPU kernels for jaxkv, each with a pure-jnp `<op>_reference` beside it.

Modules (import the functions from them, e.g.
`from pallas_kernels.blocked_attention import blocked_attention`):
  blocked_attention  paged decode attention -> (out, lse), bf16 / fp16 / fp32 pools or FP8
                     pools with per-block scales; BlockSizes; merge_partials
  blocked_attention_ref  its pure-jnp reference (re-exported by blocked_attention)
  compaction         in-place block moves; CompactionBlockSizes; compaction_moves (dense prefix)
  host_transfer      bulk row gather / scatter over a whole (pinned_host) pool, Triton lowering
  common             hopper_available() (can the kernels compile here?), shared params
  paging             input validation and block-list planning for blocked_attention

On CPU the kernels run in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`); on a
Hopper GPU they compile. The references run anywhere and are the XLA path. The package keeps
the module names unshadowed (no function re-exports), so `pallas_kernels.blocked_attention`
is always the module.
"""

try:  # registers Pallas' fuser config option, part of every jit key, before anything compiles:
    # the first kernel trace imports it otherwise, and every function compiled before then
    # recompiles at its next call (a compile inside a timed decode loop, once)
    from jax.experimental.pallas import fuser as _fuser  # noqa: F401
except ImportError:  # pragma: no cover - a jax without it
    pass

from pallas_kernels import (
    blocked_attention,
    blocked_attention_ref,
    common,
    compaction,
    host_transfer,
    paging,
)

__all__ = [
    "blocked_attention",
    "blocked_attention_ref",
    "common",
    "compaction",
    "host_transfer",
    "paging",
]

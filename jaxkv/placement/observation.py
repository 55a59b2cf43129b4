"""What the placement policy sees at a plan of the decode loop (`jaxkv.Decoder`): each
layer's sliding window, the sealed blocks a later step can still read, and the `Observation` of
every layer's blocks.
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.attention.select import window_starts
from jaxkv.config import CacheConfig
from jaxkv.placement import statistics as imp
from jaxkv.placement.policies import Observation


def layer_windows(model_config):
    """[layers] int32 sliding window of each layer (0: full attention), None without."""
    if getattr(model_config, "sliding_window", None) is None:
        return None
    return jnp.asarray(model_config.layer_windows(), jnp.int32)


def placeable(cache, c: CacheConfig, model_config):
    """[layers, N] bool: the sealed blocks a later step can read (`placeable_blocks` of the
    cache's tables)."""
    return placeable_blocks(cache.sealed, cache.lengths, c, model_config)


def placeable_blocks(sealed, lengths, c: CacheConfig, model_config):
    """[layers, N] bool: of the sealed blocks ([layers, batch, max_blocks] or [layers, N]) of
    sequences `lengths` [batch] tokens long, those a later step can read. A block wholly before
    its layer's sliding window at the next step is never read again (the window only moves
    forward), so no plan targets it and it leaves HBM first."""
    L, N = c.num_layers, c.batch * c.max_blocks
    sealed = sealed.reshape(L, N)
    windows = layer_windows(model_config)
    if windows is None:
        return sealed
    # the next step's query is at position `lengths`: it attends from lengths + 1 - w
    starts = window_starts(lengths[None] + 1, windows[:, None])  # [L, B]
    ends = (jnp.arange(c.max_blocks, dtype=jnp.int32) + 1) * c.block_size
    live = ends[None, None, :] > starts[:, :, None]  # [L, B, M]
    return sealed & live.reshape(L, N)


def observation(cache, stats: imp.Stats, step, c: CacheConfig, model_config) -> Observation:
    """What the policy sees at a plan: every layer's blocks (`observe` of the cache's tables)."""
    return observe(cache.in_hbm, cache.sealed, cache.lengths, stats, step, c, model_config)


def observe(in_hbm, sealed, lengths, stats: imp.Stats, step, c: CacheConfig, model_config):
    """The `Observation` of a plan at `step` from placement masks (in_hbm, sealed: [layers,
    batch, max_blocks] or [layers, N] bool), the sequences' `lengths` and the read statistics:
    the one constructor of the decode loop and of its replay in the simulator
    (`jaxkv.sim.loop`)."""
    L, N = c.num_layers, c.batch * c.max_blocks
    valid = placeable_blocks(sealed, lengths, c, model_config)
    return Observation.of(in_hbm.reshape(L, N), valid, stats, step, c.hbm_pool_slots)

"""The latency model of PAPER.md: a step reads both tiers in parallel and costs the slower one."""

from __future__ import annotations

import jax.numpy as jnp

from jaxkv.config import HardwareProfile


def layer_step_time(
    hbm_read_bytes,
    host_read_bytes,
    *,
    profile: HardwareProfile,
    weight_bytes=0.0,
    hbm_write_bytes=0.0,
    hbm_migration_bytes=0.0,
    link_migration_bytes=0.0,
):
    """Modeled time of one (step, layer): max(T_hbm, T_link), elementwise over any shape.

    Args:
      hbm_read_bytes: KV bytes read from HBM.
      host_read_bytes: KV bytes read from host memory over the link.
      profile: bandwidths.
      weight_bytes: the layer's weights, always read from HBM.
      hbm_write_bytes: bytes written to HBM (the new token's K and V).
      hbm_migration_bytes, link_migration_bytes: migration traffic charged to each side.
    Returns:
      seconds, broadcast shape of the inputs.
    """
    t_hbm = (
        jnp.asarray(hbm_read_bytes, jnp.float32) + weight_bytes + hbm_write_bytes + hbm_migration_bytes
    ) / profile.hbm_bandwidth
    t_link = (jnp.asarray(host_read_bytes, jnp.float32) + link_migration_bytes) / profile.link_bandwidth
    return jnp.maximum(t_hbm, t_link)

"""The seam through which `jaxkv.decode.sharded.ShardedDecoder` composes a `Decoder` that runs on
each device of a mesh under `shard_map`: `PerDevice`, passed as `Decoder(..., per_device=...)`.

A plain Decoder models one device with one host link. Run per device, three things change, and
`PerDevice` names them: which link each device has (its profile: the plan and the modeled time
price that device's own link bandwidth, chosen by the device's index with `lax.switch`; no
branch holds a collective, so devices may take different ones), which devices share one link
(their link bytes are summed, a `psum` outside any branch, before the modeled time), and which
devices plan together (their statistics are pooled over a mesh axis before the plan, one
all-reduce a step outside any branch, so their plans are one). Everything else is the Decoder's.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxkv._pytree import replace
from jaxkv.config import HardwareProfile


@dataclasses.dataclass(frozen=True)
class PerDevice:
    """What differs between, and is shared by, the devices a `Decoder` runs on (module doc).

    Attributes:
      profiles: the distinct hardware profiles of the devices' links, the first one the
        Decoder's own `profile`.
      index: [devices] the profile of each device, row-major over (axes[0], axes[1]).
      model_devices: the size of the second axis.
      axes: the mesh's two axis names, (data, model).
      shared_link: None, or the mesh axis whose devices share one host link.
      plan_axis: None, or the mesh axis over which devices pool their statistics to plan.
    """

    profiles: tuple[HardwareProfile, ...]
    index: tuple[int, ...]
    model_devices: int = 1
    axes: tuple[str, str] = ("data", "model")
    shared_link: str | None = None
    plan_axis: str | None = None

    def __post_init__(self):
        if not self.profiles or not all(isinstance(p, HardwareProfile) for p in self.profiles):
            raise ValueError(f"profiles={self.profiles!r}: expected HardwareProfiles, one or more")
        if not self.index or not all(0 <= i < len(self.profiles) for i in self.index):
            raise ValueError(
                f"index={self.index!r}: expected one profile index per device, each in "
                f"[0, {len(self.profiles)})"
            )
        for name in ("shared_link", "plan_axis"):
            axis = getattr(self, name)
            if axis is not None and axis not in self.axes:
                raise ValueError(f"{name}={axis!r}: expected None or one of {self.axes}")

    def choice(self) -> jax.Array:
        """[] int32: this device's profile (inside shard_map over `axes`)."""
        d = jax.lax.axis_index(self.axes[0]) * self.model_devices + jax.lax.axis_index(self.axes[1])
        return jnp.asarray(self.index, jnp.int32)[d]

    def pool_statistics(self, state):
        """`state` with its block statistics pooled over `plan_axis` (the mean of the decayed
        reads and mass, the latest read, the longest streak); unchanged without one."""
        if self.plan_axis is None:
            return state
        ax, st = self.plan_axis, state.statistics.blocks

        def pool(name, x):
            if x is None:
                return None
            if name in ("last_read", "streak"):
                return jax.lax.pmax(x, ax)
            return jax.lax.pmean(x, ax)

        fields = {
            f.name: pool(f.name, getattr(st, f.name))
            for f in dataclasses.fields(st)
            if not f.metadata.get("static")
        }
        return replace(state, statistics=replace(state.statistics, blocks=replace(st, **fields)))

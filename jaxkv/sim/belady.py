"""Belady's MIN with bypass as an in-step rule: the attainable limit of an HBM pool, offline.

After a step's reads, per layer, the pool keeps the blocks read soonest from the next step on,
among its residents, the blocks the step read from host (their copies are on the device: a
promotion rides the read, as every in-step rule's) and the blocks that seal before the next
step (they enter HBM for free where a slot is left: the rule leaves one for those it keeps). A
block never read again is never admitted. The kept set is the pool's size of those, soonest
first (ties by index), so the rule never prefetches and never pays a link read of its own: its
host reads are the fewest any placement of this pool can make (Belady's exchange argument;
`jaxkv.sim.bounds` proves it for the same candidates and counts the same crossings,
`min_link_crossings`), and its schedule priced by the cost model (`jaxkv.sim.loop.replay`) is
what such a placement costs: the limit a policy that decides inside the step can reach. It is
not a lower bound on the modeled time: where a step is bound by HBM reads, a host read can be
cheaper than a hit (the tiers read in parallel), and a policy that balances them may beat it;
`jaxkv.sim.loop.bounds` gives the lower bounds.

`Belady()` plans per layer (each layer's pool on its own, as the cache has them); with
`shared=True` one pool holds every layer's blocks, the sum of the layers' slots (a diagnostic:
the cache keeps a pool per layer). It reads every block's next read (`StepView.next_use`), so it
runs only in `jaxkv.sim.loop` (the decode loop's accounting, over a recorded decode or a trace).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jaxkv.placement import registry
from jaxkv.placement.admission import NEVER_READ, Admission, StepView, first_k
from jaxkv.placement.lists import rank_by_stamp
from jaxkv.placement.policies.base import KeepsPlacement

UNBOUNDED = 1 << 30  # Belady's budget: a step admits what it keeps, the executor's N at most


@dataclasses.dataclass(frozen=True)
class BeladyRule:
    """MIN with bypass on `view`'s rows (a `jaxkv.placement.admission.Rule`)."""

    shared: bool = False
    stateful = False
    needs_next_use = True

    def init(self, rows: int, num_blocks: int):
        return ()

    def step(self, state, view: StepView, budget: int):
        if view.next_use is None:
            raise ValueError(
                "Belady reads every block's next read (StepView.next_use): it runs in "
                "jaxkv.sim.loop, which knows the recorded future"
            )
        rows, n = view.in_hbm.shape
        if budget < n:
            raise ValueError(
                f"Belady admits every block it keeps: expected a budget of at least N={n} "
                f"blocks a row, got {budget} (its policy's budget is unbounded)"
            )
        nu = view.next_use
        in0 = view.in_hbm & view.valid
        miss = view.reads & view.valid & ~in0
        seal = jnp.zeros_like(in0) if view.sealing is None else view.sealing & ~in0
        pool = in0 | ((miss | seal) & (nu < NEVER_READ))
        cap = jnp.sum(in0, axis=-1) + jnp.maximum(view.room, 0)
        rank = _rank_rows(pool, nu)
        keep = pool & (rank < cap[:, None])
        pro, n_p = first_k(keep & miss, n)
        dem, n_d = first_k(in0 & ~keep, n)
        return Admission(pro, n_p, dem, n_d), state


def _rank_rows(mask, key):
    """[rows, N] int32: each row's `mask` blocks ranked 0, 1, ... by `key` ascending (ties by
    index), -1 elsewhere."""
    import jax

    return jax.vmap(rank_by_stamp)(mask, key)


@dataclasses.dataclass(frozen=True)
class Belady(KeepsPlacement):
    """Belady's MIN with bypass, in the step (offline: `jaxkv.sim.loop` only).

    shared: one pool for every layer (the sum of the layers' slots) instead of a pool per
      layer (a diagnostic: how much a pool shared across layers could gain)."""

    name: str = "belady"
    shared: bool = False
    needs_forecast = True  # it reads the future: the decode loop refuses it
    budget = UNBOUNDED

    def __post_init__(self):
        if not isinstance(self.shared, bool):
            raise ValueError(f"Belady shared must be a bool, got {self.shared!r}")

    @property
    def rule(self):
        return BeladyRule(self.shared)


registry.register_class(
    Belady,
    kind="oracle",
    doc="Belady's MIN with bypass in the step: the fewest host reads of a pool, priced "
    "(offline; shared=True: one pool for all layers)",
)

"""`Static`: fill HBM in write order, spill the rest to host, never migrate (the paper's)."""

from __future__ import annotations

import dataclasses

from jaxkv.placement import registry
from jaxkv.placement.policies.base import KeepsPlacement


@dataclasses.dataclass(frozen=True)
class Static(KeepsPlacement):
    """Fill HBM in write order, spill the rest to host, never migrate."""

    name: str = "static"


registry.register_class(Static, kind="online", doc="fill HBM in write order, never migrate")

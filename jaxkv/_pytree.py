"""Frozen dataclasses registered as pytrees; fields marked `static_field()` are metadata."""

from __future__ import annotations

import dataclasses

import jax


def static_field(**kwargs):
    """A dataclass field that is part of the treedef (hashable, compile-time) not a leaf."""
    return dataclasses.field(metadata={"static": True}, **kwargs)


def pytree_dataclass(cls):
    """Makes `cls` a frozen dataclass registered with jax.tree_util.register_dataclass."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static", False)]
    data = [f.name for f in fields if not f.metadata.get("static", False)]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def replace(obj, **changes):
    return dataclasses.replace(obj, **changes)

"""The scalar fields of a trace file and the optional fields of version 2: the recording
model's geometry (`GEOMETRY_FIELDS`, all or none) and the tokens its decode steps produced; how
they are written (`geometry_fields`) and read back with a ValueError naming a bad field
(`int_field`, `string_field`, `read_geometry`, `read_tokens`). The layout is documented in
`jaxkv.sim.trace`'s module docstring.
"""

from __future__ import annotations

import numpy as np

from jaxkv import cost

MAX_POSITION = 2**31 - 1  # token positions, block ids and token ids are int32
# version 2's geometry fields: the `jaxkv.cost.Geometry` field each holds (its batch is a
# simulation's, never stored) and its kind: a string (None), an integer (True) or bytes (False)
GEOMETRY_FIELDS = {
    "geometry_name": ("name", None),
    "geometry_num_layers": ("num_layers", True),
    "geometry_kv_heads": ("kv_heads", True),
    "geometry_head_dim": ("head_dim", True),
    "geometry_dtype_bytes": ("dtype_bytes", True),
    "geometry_weight_bytes": ("weight_bytes", False),
    "geometry_param_bytes": ("param_bytes", False),
}
V2_FIELDS = (*GEOMETRY_FIELDS, "tokens")  # the fields a version-1 file may not hold


def geometry_fields(geometry: cost.Geometry) -> dict:
    """The version-2 trace fields that store `geometry` (GEOMETRY_FIELDS; its batch is not
    stored: a trace records one sequence)."""
    out = {}
    for field, (attr, integer) in GEOMETRY_FIELDS.items():
        v = getattr(geometry, attr)
        out[field] = np.str_(v) if integer is None else (np.int64(v) if integer else np.float64(v))
    return out


def int_field(fields: dict, name: str) -> int:
    """A scalar integer field (a 0-d integer array or a Python int)."""
    a = np.asarray(fields[name])
    if a.ndim != 0:
        raise ValueError(f"trace field {name!r} has shape {a.shape}, expected a scalar")
    if a.dtype.kind not in "iu":
        raise ValueError(
            f"trace field {name!r} is {a.item()!r} of dtype {a.dtype}, expected an integer"
        )
    return int(a)


def string_field(fields: dict, name: str) -> str:
    """A scalar string field (a 0-d str or bytes array, or a Python str)."""
    n = np.asarray(fields[name])
    if n.ndim != 0 or n.dtype.kind not in "US":
        raise ValueError(
            f"trace field {name!r} has dtype {n.dtype} and shape {n.shape}, expected a string"
        )
    return n.item().decode(errors="replace") if n.dtype.kind == "S" else str(n)


def read_geometry(fields: dict, layers: int) -> cost.Geometry | None:
    """The geometry_* fields (GEOMETRY_FIELDS, all or none) as a Geometry, or None."""
    given = [f for f in GEOMETRY_FIELDS if f in fields]
    if not given:
        return None
    missing = [f for f in GEOMETRY_FIELDS if f not in fields]
    if missing:
        raise ValueError(
            f"trace is missing field {missing[0]!r}: a geometry needs all of "
            f"{list(GEOMETRY_FIELDS)}"
        )
    kw = {}
    for field, (attr, integer) in GEOMETRY_FIELDS.items():
        if integer is None:
            kw[attr] = string_field(fields, field)
            continue
        if integer:
            kw[attr] = int_field(fields, field)
            ok = kw[attr] >= 1
        else:
            a = np.asarray(fields[field])
            if a.ndim != 0 or a.dtype.kind not in "fiu":
                raise ValueError(
                    f"trace field {field!r} has dtype {a.dtype} and shape {a.shape}, expected a "
                    "real number"
                )
            kw[attr] = float(a)
            ok = np.isfinite(kw[attr]) and kw[attr] >= 0
        if not ok:
            expected = "an integer >= 1" if integer else "a finite number >= 0"
            raise ValueError(f"trace field {field!r} is {kw[attr]!r}, expected {expected}")
    if kw["num_layers"] != layers:
        raise ValueError(
            f"trace field 'geometry_num_layers' is {kw['num_layers']}, expected the trace's "
            f"{layers} layers (axis 1 of 'ids')"
        )
    return cost.Geometry(**kw)


def read_tokens(fields: dict, steps: int) -> np.ndarray | None:
    """The tokens field ([steps] int32 token ids), or None."""
    if "tokens" not in fields:
        return None
    tokens = np.asarray(fields["tokens"])
    if tokens.shape != (steps,):
        raise ValueError(
            f"trace field 'tokens' has shape {tokens.shape}, expected [steps] = ({steps},)"
        )
    if tokens.dtype.kind not in "iu":
        raise ValueError(f"trace field 'tokens' has dtype {tokens.dtype}, expected an integer")
    if tokens.size and (tokens.min() < 0 or tokens.max() > MAX_POSITION):
        bad = tokens.min() if tokens.min() < 0 else tokens.max()
        raise ValueError(
            f"trace field 'tokens' has token {int(bad)}, expected in [0, {MAX_POSITION}] (int32)"
        )
    return tokens.astype(np.int32)

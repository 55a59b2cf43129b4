"""Minimal safetensors reader / writer (numpy, memory-mapped), with errors that name the file and
tensor. Own implementation so that truncation and corruption are reported precisely and bf16
loads through ml_dtypes without PyTorch."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsFile:
    """Header of one .safetensors file, validated against the file size; tensors read lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        size = self.path.stat().st_size
        if size < 8:
            raise ValueError(
                f"{self.path}: truncated safetensors file ({size} bytes): expected at least an "
                "8-byte header length"
            )
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(
                    f"{self.path}: truncated or corrupt safetensors file: header length {n} "
                    f"bytes but the file has {size} bytes"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from None
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, meta in header.items():
            dtype = _DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has dtype {meta.get('dtype')!r}: expected "
                    f"one of {sorted(_DTYPES)}"
                )
            shape = tuple(int(d) for d in meta["shape"])
            begin, end = (int(o) for o in meta["data_offsets"])
            if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
                raise ValueError(
                    f"{self.path}: tensor {name!r} byte range [{begin}, {end}) does not hold "
                    f"shape {shape} of {meta['dtype']}"
                )
            if self._data_start + end > size:
                raise ValueError(
                    f"{self.path}: truncated safetensors file: tensor {name!r} ends at byte "
                    f"{self._data_start + end} but the file has {size} bytes"
                )
            self.entries[name] = (dtype, shape, begin, end)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only memory-mapped array."""
        dtype, shape, begin, _ = self.entries[name]
        if not shape or 0 in shape:
            return np.zeros(shape, dtype)
        return np.memmap(
            self.path, dtype=dtype, mode="r", offset=self._data_start + begin, shape=shape
        )


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike, metadata=None) -> None:
    """Write ``tensors`` (name -> array) as one safetensors file at ``path``."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise ValueError(f"save_file: tensor {name!r} has dtype {a.dtype}: unsupported")
        header[name] = {
            "dtype": _NAMES[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for a in arrays:
            f.write(a.tobytes())

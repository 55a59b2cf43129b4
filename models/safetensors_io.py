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
_LFS_POINTER = b"version https://git-lfs.github.com/spec/"  # a git-lfs pointer file's first line


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
            head = f.read(64)
            f.seek(0)
            (n,) = struct.unpack("<Q", f.read(8))
            if head.startswith(_LFS_POINTER):
                raise ValueError(
                    f"{self.path}: a git-lfs pointer ({size} bytes), not the safetensors weights: "
                    "fetch them with `git lfs pull` in the checkout"
                )
            if n > _MAX_HEADER or (8 + n > size and head[8:9] != b"{"):
                raise ValueError(
                    f"{self.path}: not a safetensors file: expected an 8-byte header length and "
                    f"a JSON header, got a header length of {n:,} bytes in a file of {size:,} "
                    f"bytes, starting {head[:16]!r}"
                )
            if 8 + n > size:
                raise ValueError(
                    f"{self.path}: truncated or corrupt safetensors file: header length {n} "
                    f"bytes but the file has {size} bytes"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise ValueError(
                f"{self.path}: corrupt safetensors header: a JSON {type(header).__name__}, "
                "expected an object of tensor entries"
            )
        header.pop("__metadata__", None)
        self._data_start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int]] = {}
        for name, meta in header.items():
            if not isinstance(meta, dict):
                raise ValueError(
                    f"{self.path}: tensor {name!r} has header entry {meta!r}: expected an "
                    "object with dtype, shape and data_offsets"
                )
            dtype = _DTYPES.get(meta.get("dtype"))
            if dtype is None:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has dtype {meta.get('dtype')!r}: expected "
                    f"one of {sorted(_DTYPES)}"
                )
            try:
                shape = tuple(int(d) for d in meta["shape"])
                begin, end = (int(o) for o in meta["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(
                    f"{self.path}: tensor {name!r} has a bad shape or data_offsets in its header "
                    f"entry {meta!r} ({type(e).__name__}: {e})"
                ) from None
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

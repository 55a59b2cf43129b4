"""Helpers shared by the Mosaic GPU kernels: device check, compiler / interpreter params,
SMEM layouts for WGMMA operands, the bf16 (hi, lo) split of fp32 operands."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

_target: str | None = None


@contextlib.contextmanager
def compile_target(platform: str):
    """Traces inside this context take the branches for `platform` ("gpu" / "cuda" / "cpu")
    where code would ask the default backend: compiled kernels instead of the interpreter,
    `hopper_available`, jaxkv's transfer mechanism. For ahead-of-time compiles for a GPU on a
    CPU machine (`jaxkv.gpu.aot`)."""
    global _target
    old, _target = _target, platform
    try:
        yield
    finally:
        _target = old


def target_platform() -> str:
    """The platform traces are for: `compile_target`'s, else the default backend."""
    return _target or jax.default_backend()


def single_device_sharding(device, memory_kind: str | None = None):
    """A sharding placing a whole array on `device` in `memory_kind` (None: the default).
    jax 0.12.1 deprecates constructing `jax.sharding.SingleDeviceSharding` directly in favour
    of `make_single_device_sharding`; older releases (0.11.2 on the lent GPU) may lack it."""
    make = getattr(jax.sharding, "make_single_device_sharding", None)
    if make is not None:
        return make(device, memory_kind=memory_kind)
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def on_gpu() -> bool:
    return target_platform() in ("gpu", "cuda", "rocm")


def hopper_available() -> bool:
    """True when the default device is a GPU the Mosaic GPU kernels compile for (sm_90+).

    For `impl="auto"` dispatch: elsewhere the kernels only run in the (slow) interpreter.
    """
    if not on_gpu():
        return False
    if _target is not None:  # an ahead-of-time compile: the targets are Hopper (sm_90) specs
        return True
    cap = getattr(jax.devices()[0], "compute_capability", None)
    try:
        return float(cap) >= 9.0
    except (TypeError, ValueError):
        return False


def compiler_params(**kwargs):
    """Mosaic GPU compiler params shared by the kernels (one place to pin lowering options)."""
    return plgpu.CompilerParams(**kwargs)


def _interpret_params(interpret):
    """None: interpret unless running on a GPU; True / False force it; a
    `plgpu.InterpretGPUParams` (e.g. with detect_races=True) is used as is.
    Returns plgpu interpret params or None (compile)."""
    if not isinstance(interpret, bool | None):
        return interpret
    if interpret is None:
        interpret = not on_gpu()
    if not interpret:
        return None
    params = getattr(plgpu, "InterpretGPUParams", None)
    if params is None:
        raise NotImplementedError(
            f"jax {jax.__version__} has no plgpu.InterpretGPUParams: the Mosaic GPU kernels "
            "cannot be interpreted on CPU with this version; use the *_reference functions"
        )
    return params()


def race_checked(call):
    """Runs `call(params)` in the Mosaic GPU interpreter with its race detector on and raises
    RuntimeError if a race was found.

    jax >= 0.12 raises by itself (`on_race="raise"`); jax 0.11 has no `on_race`: it prints the
    race and records it in the interpreter's race state, which is checked here.
    """
    fields = {f.name for f in dataclasses.fields(plgpu.InterpretGPUParams)}
    if "on_race" in fields:
        return jax.block_until_ready(
            call(plgpu.InterpretGPUParams(detect_races=True, on_race="raise"))
        )
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks  # no public accessor in 0.11

    out = jax.block_until_ready(call(plgpu.InterpretGPUParams(detect_races=True)))
    if gpu_callbacks.get_races().races_found:
        raise RuntimeError("the Mosaic GPU interpreter's race detector found a race")
    return out


def _swizzle(minor_elems: int, dtype) -> int:
    return plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)


def _smem_2d_transforms(minor_elems: int, dtype, swizzle: int | None = None) -> tuple:
    """Tiling + swizzle for a 2-D WGMMA operand whose minor dimension has `minor_elems`."""
    swizzle = swizzle or _swizzle(minor_elems, dtype)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


# Registers of an fp32 [rows, cols] tile being split into bf16 hi + lo: each (16, 16) sub-tile
# is spread over the 4 warps as 8x8 quarters (the WGMMA layout would need 64 rows), so every
# shape in multiples of 16 works, and the tile loads from / stores to swizzled SMEM.
SPLIT_LAYOUT = plgpu.Layout.TILED(
    plgpu.Tiling(((16, 16), (8, 8), (2,))), warp_dims=(-5, -4), lane_dims=(-3, -2), vector_dim=-1
)
# (a part, b part) of a @ b ~ a_lo @ b_hi + a_hi @ b_lo + a_hi @ b_hi, small terms first.
BF16X3 = ((1, 0), (0, 1), (0, 0))


def split_bf16(x):
    """fp32 x -> (hi, lo) bf16 with |x - hi - lo| <= 2^-16 |x|, for bf16x3 products."""
    hi = x.astype(jnp.bfloat16)
    return hi, (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)

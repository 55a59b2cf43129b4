"""Which decode attention implementation was measured fastest, per device kind: what
`impl="auto"` takes (`jaxkv.attention.tiered.resolve_impl`).

An entry is added only from a measurement (bench/bench_kernels.py on that device: the Pallas
kernel against the XLA path at the same shapes, in one run) and names its date and where the
figures are. A device kind not listed takes the XLA path: it is correct everywhere, and the
kernel is taken only where it was seen to be faster.
"""

from __future__ import annotations

import dataclasses

import jax

IMPLS_MEASURED = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Measured:
    """The implementation measured fastest on one device kind, and where the figures are."""

    impl: str  # "xla" | "pallas"
    date: str
    source: str


# keyed by `jax.Device.device_kind` ("cpu"; GPUs e.g. "NVIDIA H200")
MEASURED: dict[str, Measured] = {
    # the kernel runs only in the Mosaic GPU interpreter off a GPU: orders of magnitude slower
    "cpu": Measured(
        "xla", "2026-11-30", "bench/RESULTS.md section 6 (the interpreter; its times not quoted)"
    ),
}
DEFAULT = "xla"  # a device kind with no measurement


def measured_impl(device_kind: str | None = None) -> str:
    """The implementation recorded for `device_kind` (default: the first device's), or
    `DEFAULT` when none was measured there."""
    if device_kind is None:
        device_kind = jax.devices()[0].device_kind
    entry = MEASURED.get(device_kind)
    return DEFAULT if entry is None else entry.impl

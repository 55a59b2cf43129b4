"""Static, hashable configuration: cache geometry, hardware profiles, placement and annealing.

Every config here is a frozen dataclass so it can be passed to `jax.jit` as a static argument.
Validation happens in `__post_init__` and raises ValueError naming the value and what was
expected.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.cache.quant import FP8, FP8_MODES, fp8_block_bytes
from jaxkv.model_api import require_fields
from pallas_kernels.common import single_device_sharding

TIER_HBM = 0  # memory kind "device"
TIER_HOST = 1  # memory kind "pinned_host"
TIER_NONE = -1  # logical block not written (or living in the tail buffer)

HBM_KIND = "device"
HOST_KIND = "pinned_host"
HOST_KINDS = ("pinned_host", "unpinned_host", "device")

FETCH_OPTIONS = ("auto", "xla", "pallas")  # jaxkv.cache.transfer's mechanisms
HOST_TIERS = ("write-through", "exclusive")  # CacheConfig.host_tier
# the prompt's observation window (`jaxkv.decode.prompt`): its last positions whose queries count
PROMPT_QUERIES = 32
# lrfu's adaptive estimator: the prompt's last positions whose prior it holds steady
# (`jaxkv.placement.policies.Lrfu.steady_queries`; bench/notebook/2026-12-06-forecast-limits.md)
STEADY_QUERIES = 128
_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


_UNITS = ("fraction", "blocks", "bytes")  # the capacity keywords' units: hbm_<unit>, host_<unit>


def _old_capacity_message(tier: str, value) -> str:
    """The message refusing `hbm_capacity=` / `host_capacity=`, naming the keyword to use."""
    if isinstance(value, (float, np.floating)):
        use = f"{tier}_fraction={value!r}"
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        use = f"{tier}_blocks={value!r} (if blocks per layer) or {tier}_bytes={value!r} (if bytes)"
    else:
        use = f"{tier}_fraction=, {tier}_blocks= or {tier}_bytes="
    return (
        f"{tier}_capacity={value!r} is no longer accepted (an int meant blocks and a float a "
        f"fraction): say {use}; {tier}_fraction is a fraction in (0, 1] of the KV footprint, "
        f"{tier}_blocks blocks per layer, {tier}_bytes bytes across all layers"
    )


def _positive_int(name: str, value, minimum: int = 1) -> None:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_number(
    name: str,
    value,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    integer: bool = False,
) -> None:
    """Raises ValueError `"{name}={value!r}: expected ..."` unless `value` is a finite real number
    (an integer when `integer`; never a bool) within [low, high] (either end open with
    `low_open` / `high_open`; None = unbounded). The check behind the command-line options."""
    if isinstance(value, np.generic):
        value = value.item()
    if integer:
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        lo, hi = (b if b is None or not float(b).is_integer() else int(b) for b in (low, high))
        what = "an integer" if integer else "a finite number"
        if low is not None and high is not None:
            what += f" in {'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        elif low is not None:
            what += f" {'>' if low_open else '>='} {lo}"
        elif high is not None:
            what += f" {'<' if high_open else '<='} {hi}"
        raise ValueError(f"{name}={value!r}: expected {what}")


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Geometry and capacities of a TieredKVCache.

    The HBM capacity is said once, in exactly one of three units:
      hbm_fraction: a fraction in (0, 1] of the KV footprint `batch * max_blocks` blocks per
        layer (rounded up; 1.0 = all-HBM);
      hbm_blocks: HBM blocks per layer (K and V of one block of every KV head), at most the
        footprint;
      hbm_bytes: bytes of HBM for the KV pools of ALL layers together (what a memory budget
        says), counted at `hbm_block_bytes` a block: `hbm_bytes // (num_layers *
        hbm_block_bytes)` blocks per layer, capped at the footprint (a budget larger than the
        KV holds all of it). Under fp8="age" the full-precision ring comes on top.
    A float is never read as blocks nor an int as a fraction: `hbm_fraction=25` (a percentage)
    and `hbm_blocks` above the footprint (bytes meant as blocks) raise ValueError naming the
    keyword meant. The HBM capacity includes one tail block per sequence: the block being
    filled always lives in HBM, so it must be at least `batch` blocks per layer. The resolved
    size is `hbm_slots`. The host tier takes at most one of `host_fraction`, `host_blocks`,
    `host_bytes` (same units); none sizes the host pool (`host_slots`) for `host_tier`: every
    block (write-through), or everything that does not fit in HBM (exclusive). The former
    `hbm_capacity=` / `host_capacity=` (an int meaning blocks and a float a fraction, so `1`
    was one block and `1.0` all of them) are refused with a message naming the keyword to
    use: the rule read 8_000_000 bytes as every block and 25 percent as 25 blocks without a
    word.

    Attributes:
      num_layers, kv_heads, head_dim: model geometry.
      batch: number of sequences decoded together.
      max_len: longest sequence (prompt + generated tokens) the cache can hold.
      block_size: tokens per block (any positive integer; 16 by default).
      dtype: storage dtype name: "float32", "bfloat16" or "float16".
      host_memory_kind: memory kind of the host tier: "pinned_host" (the real thing),
        "unpinned_host", or "device" (the host tier emulated in device memory: same code path and
        metrics, no host memory; used where a tool cannot handle host operands, e.g. Pallas
        interpret mode inside a jit with pinned_host arguments fails to lower in jax 0.12.0.1).
      fetch: how blocks cross between the tiers (host reads, promotions, demotions, spills):
        "auto", "xla" or "pallas" (`jaxkv.cache.transfer`); every one moves a layer's blocks in one
        operation per pool, never block by block.
      fp8: "off" (every block in `dtype`); "host": every block on the host tier is stored as
        float8_e4m3fn with a dynamic fp32 scale per block and KV head (`jaxkv.cache.quant`), so it
        crosses the link at one byte an element; HBM blocks, the tail included, stay in
        `dtype`. Quantized when a block enters the host tier, dequantized on the device when it
        is read or promoted. "age": every sealed block is stored as FP8 in both tiers
        (quantized when it is sealed), and the tail plus the `fp8_age // block_size` most
        recent sealed blocks of each sequence are also kept in `dtype` in a device ring
        (`ring_blocks` entries per sequence) from which attention reads them: every token
        younger than `fp8_age` tokens is read at full precision, older ones in FP8, from HBM
        at half the bytes as well as over the link. Exact attention is bit-identical to all-HBM
        only with "off".
      fp8_age: tokens read at full precision under fp8="age": a multiple of block_size, >= 0
        (0: every sealed block is read in FP8, the tail alone in `dtype`). Must be 0 otherwise.
      host_tier: "write-through" (the default; an inclusive cache): every block gets its host
        copy when it is sealed, at host slot `sequence * max_blocks + block` (the host pool
        holds the whole KV, `batch * max_blocks` blocks per layer); HBM holds copies of a
        subset, so a demotion frees an HBM slot with no link traffic and a promotion copies the
        host block into HBM. Under fp8="host" a sealed block's HBM copy is its FP8 host copy
        dequantized (rounded when it is sealed), so the two copies always agree and exact
        attention does not depend on placement. "exclusive": every block lives in exactly one
        tier; a demotion writes the block back over the link. For hosts smaller than the KV
        (a host_* capacity below `batch * max_blocks`).
      paged_host: under write-through, the host copies live in one pool of `host_slots` pages
        shared by every sequence (the serving engine's cache, `jaxkv.serve`): a block takes
        the first free page when it is sealed (`TieredKVCache.host_page` records it) and
        gives it back when its sequence is released (`jaxkv.cache.rows.release`), so the host
        pool may be smaller than the footprint. Whoever fills the cache keeps a free page for
        every block that seals (the engine admits and preempts requests for it); the batch
        `prefill` does not take a paged cache. False (the default): block j of sequence b
        has its copy at page b * max_blocks + j.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    batch: int = 1
    max_len: int = 2048
    block_size: int = 16
    hbm_fraction: float | None = None
    hbm_blocks: int | None = None
    hbm_bytes: int | None = None
    host_fraction: float | None = None
    host_blocks: int | None = None
    host_bytes: int | None = None
    dtype: str = "float32"
    host_memory_kind: str = HOST_KIND
    fetch: str = "auto"
    fp8: str = "off"
    fp8_age: int = 0
    host_tier: str = "write-through"
    paged_host: bool = False
    # refused with a message naming the keyword to use (see the docstring); never stored
    hbm_capacity: dataclasses.InitVar[object] = None
    host_capacity: dataclasses.InitVar[object] = None

    def __post_init__(self, hbm_capacity=None, host_capacity=None):
        for tier, old in (("hbm", hbm_capacity), ("host", host_capacity)):
            if old is not None:
                raise ValueError(_old_capacity_message(tier, old))
        if self.host_tier not in HOST_TIERS:
            raise ValueError(f"host_tier must be one of {HOST_TIERS}, got {self.host_tier!r}")
        if self.fp8 not in FP8_MODES:
            raise ValueError(f"fp8 must be one of {FP8_MODES}, got {self.fp8!r}")
        _positive_int("fp8_age", self.fp8_age, minimum=0)
        if self.fp8 != "age" and self.fp8_age:
            raise ValueError(
                f"fp8_age={self.fp8_age} applies to fp8='age' only (fp8={self.fp8!r}): expected 0"
            )
        if self.fetch not in FETCH_OPTIONS:
            raise ValueError(f"fetch must be one of {FETCH_OPTIONS}, got {self.fetch!r}")
        if self.host_memory_kind not in HOST_KINDS:
            raise ValueError(
                f"host_memory_kind must be one of {HOST_KINDS}, got {self.host_memory_kind!r}"
            )
        for name in ("num_layers", "kv_heads", "head_dim", "batch", "max_len", "block_size"):
            _positive_int(name, getattr(self, name))
        if self.fp8_age % self.block_size:
            raise ValueError(
                f"fp8_age={self.fp8_age} tokens: expected a multiple of block_size="
                f"{self.block_size} (blocks are quantized whole)"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        hbm = self.hbm_slots  # validates the capacity spec
        if hbm < self.batch:
            raise ValueError(
                f"{self._spec('hbm')} gives {hbm} HBM blocks per layer, but each of the "
                f"batch={self.batch} sequences needs one HBM tail block: expected >= "
                f"{self.batch} blocks per layer{self._bytes_hint('hbm', self.batch)}"
            )
        if not isinstance(self.paged_host, bool):
            raise ValueError(f"paged_host must be a bool, got {self.paged_host!r}")
        if self.paged_host and not self.write_through:
            raise ValueError(
                "paged_host=True pages the write-through host copies: expected "
                f"host_tier='write-through', got {self.host_tier!r}"
            )
        if self.write_through and not self.paged_host and self.host_slots < self.total_blocks:
            raise ValueError(
                f"{self._spec('host')} gives {self.host_slots} host blocks per layer, but "
                f"host_tier='write-through' keeps a host copy of every block: expected "
                f"{self.total_blocks} (batch={self.batch} x {self.max_blocks} blocks of "
                f"{self.block_size} tokens for max_len={self.max_len}), or no host_* capacity; "
                "for a host smaller than the KV use host_tier='exclusive', or paged_host=True "
                "(a pool shared by the sequences, as the serving engine keeps it)"
            )
        if hbm + self.host_slots < self.total_blocks and not self.paged_host:
            raise ValueError(
                f"{self._spec('host')} gives {self.host_slots} host blocks per layer; with {hbm} "
                f"HBM blocks the cache needs at least {self.total_blocks - hbm} to hold "
                f"batch={self.batch} x max_len={self.max_len} tokens ({self.total_blocks} "
                f"blocks of {self.block_size}){self._bytes_hint('host', self.total_blocks - hbm)}"
            )

    @classmethod
    def for_model(cls, model_config, **kwargs) -> CacheConfig:
        """A CacheConfig with a model's geometry and dtype.

        Args:
          model_config: any object with num_layers, num_kv_heads, head_dim and dtype (e.g.
            `models.LlamaConfig`).
          **kwargs: the other CacheConfig fields (batch, max_len, block_size, capacities, ...).
        """
        require_fields(model_config, ("num_layers", "num_kv_heads", "head_dim", "dtype"))
        geometry = dict(
            num_layers=model_config.num_layers,
            kv_heads=model_config.num_kv_heads,
            head_dim=model_config.head_dim,
            dtype=str(model_config.dtype),
        )
        return cls(**{**geometry, **kwargs})

    def _spec(self, tier: str) -> str:
        """The capacity keyword given for `tier` ("hbm" or "host") as `name=value`."""
        given = [f"{tier}_{u}={getattr(self, f'{tier}_{u}')!r}" for u in _UNITS]
        given = [g for g in given if not g.endswith("=None")]
        return given[0] if given else f"no {tier}_* capacity"

    def _bytes_hint(self, tier: str, blocks: int) -> str:
        if getattr(self, f"{tier}_bytes") is None:
            return ""
        per = self.num_layers * getattr(self, f"{tier}_block_bytes")
        return (
            f" ({self.num_layers} layers x {per // self.num_layers:,} bytes per block = "
            f"{per:,} bytes a block across layers: {tier}_bytes >= {blocks * per:,})"
        )

    def _blocks(self, tier: str) -> int | None:
        """Blocks per layer that `tier`'s capacity keywords give, validated; None when none is
        given (allowed for the host tier only)."""
        given = {u: getattr(self, f"{tier}_{u}") for u in _UNITS}
        given = {u: v for u, v in given.items() if v is not None}
        names = ", ".join(f"{tier}_{u}=" for u in _UNITS)
        if len(given) > 1:
            said = ", ".join(f"{tier}_{u}={v!r}" for u, v in given.items())
            raise ValueError(f"{said}: expected exactly one of {names} (the same capacity, once)")
        if not given:
            if tier == "host":
                return None
            raise ValueError(
                f"no HBM capacity given: expected exactly one of {names} (e.g. hbm_fraction=1.0, "
                f"all {self.total_blocks} blocks per layer of the KV footprint, in HBM)"
            )
        ((unit, value),) = given.items()
        name, total = f"{tier}_{unit}", self.total_blocks
        if isinstance(value, np.generic):
            value = value.item()
        if unit == "fraction":
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1:
                hint = f" ({value:g}% is {name}={value / 100:g})" if value <= 100 else ""
                raise ValueError(
                    f"{name}={value!r}: expected a fraction in (0, 1] of the KV footprint "
                    f"({total} blocks per layer){hint}; for a block count say {tier}_blocks=, "
                    f"for bytes {tier}_bytes="
                )
            check_number(name, value, low=0.0, high=1.0, low_open=True)
            return max(1, math.ceil(value * total))
        if isinstance(value, float) and unit == "blocks" and 0 < value <= 1:
            raise ValueError(
                f"{name}={value!r}: expected a whole number of blocks per layer; for a fraction "
                f"of the KV footprint say {tier}_fraction={value!r}"
            )
        check_number(name, value, low=0, integer=True)
        if unit == "blocks":
            if value > total:
                raise ValueError(
                    f"{name}={value:,}: more than the KV footprint of {total:,} blocks per layer "
                    f"(batch={self.batch} x {self.max_blocks} blocks of {self.block_size} "
                    f"tokens): expected <= {total:,}; a byte budget is {tier}_bytes={value}, "
                    f"all of the footprint {tier}_fraction=1.0"
                )
            return value
        per = self.num_layers * getattr(self, f"{tier}_block_bytes")
        return min(value // per, total)

    @property
    def jnp_dtype(self):
        return _DTYPES[self.dtype]

    @property
    def max_blocks(self) -> int:
        """Logical blocks per sequence."""
        return -(-self.max_len // self.block_size)

    @property
    def total_blocks(self) -> int:
        """Blocks per layer when every sequence is at max_len (the KV footprint)."""
        return self.batch * self.max_blocks

    @property
    def hbm_slots(self) -> int:
        """HBM blocks per layer, tail buffer included: what the hbm_* keyword gives."""
        return self._blocks("hbm")

    @property
    def hbm_pool_slots(self) -> int:
        """HBM slots per layer that sealed blocks may use: one slot per sequence is reserved for
        the tail block being filled."""
        return self.hbm_slots - self.batch

    @property
    def write_through(self) -> bool:
        """Whether every sealed block keeps a host copy (host_tier="write-through")."""
        return self.host_tier == "write-through"

    @property
    def host_slots(self) -> int:
        """Host slots per layer (at least 1, so the host pool always exists): what the host_*
        keyword gives, else every block (write-through) or every block that does not fit in
        HBM (exclusive)."""
        host = self._blocks("host")
        if host is None:
            return (
                self.total_blocks
                if self.write_through
                else max(1, self.total_blocks - self.hbm_slots)
            )
        return max(1, host)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer: K and V for all KV heads."""
        itemsize = jnp.dtype(self.jnp_dtype).itemsize
        return 2 * self.block_size * self.kv_heads * self.head_dim * itemsize

    def fp8_in(self, tier: str) -> bool:
        """Whether the pools of `tier` ("hbm" or "host") hold FP8 blocks."""
        if tier not in ("hbm", "host"):
            raise ValueError(f"tier={tier!r}: expected 'hbm' or 'host'")
        return self.fp8 == "age" or (self.fp8 == "host" and tier == "host")

    @property
    def ring_blocks(self) -> int:
        """Entries per sequence of the full-precision ring under fp8="age" (the tail and the
        `fp8_age // block_size` most recent sealed blocks; logical block j at entry
        j % ring_blocks), else 0."""
        return self.fp8_age // self.block_size + 1 if self.fp8 == "age" else 0

    @property
    def hbm_dtype(self):
        """The HBM pools' storage dtype: float8_e4m3fn under fp8="age", else `dtype`."""
        return FP8 if self.fp8_in("hbm") else self.jnp_dtype

    @property
    def host_dtype(self):
        """The host pools' storage dtype: float8_e4m3fn under fp8="host" / "age", else `dtype`."""
        return FP8 if self.fp8_in("host") else self.jnp_dtype

    @property
    def fp8_block_bytes(self) -> int:
        """Bytes of one FP8 block of one layer: an element a byte plus the fp32 scales."""
        return fp8_block_bytes(self.block_size, self.kv_heads, self.head_dim)

    @property
    def host_block_bytes(self) -> int:
        """Bytes of one host-tier block of one layer (K and V, all KV heads): what a host read,
        spill, promotion or demotion moves over the link. Under FP8: one byte an element
        plus the fp32 scale of each (pool, KV head)."""
        return self.fp8_block_bytes if self.fp8_in("host") else self.block_bytes

    @property
    def hbm_block_bytes(self) -> int:
        """Bytes attention reads for one sealed block of one layer in the HBM pool (FP8 under
        fp8="age"; a block in the full-precision ring is read at `block_bytes`)."""
        return self.fp8_block_bytes if self.fp8_in("hbm") else self.block_bytes


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Bandwidths of the two tiers, in bytes per second, and HBM size in bytes."""

    name: str
    hbm_bandwidth: float
    link_bandwidth: float
    hbm_bytes: float
    notes: str = ""

    def __post_init__(self):
        for f in ("hbm_bandwidth", "link_bandwidth", "hbm_bytes"):
            v = getattr(self, f)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"HardwareProfile.{f} must be a positive number, got {v!r}")

    @property
    def alpha_star(self) -> float:
        """Ideal fraction of read bytes served from HBM: both tiers finish together."""
        return self.hbm_bandwidth / (self.hbm_bandwidth + self.link_bandwidth)

    @staticmethod
    def preset(name: str) -> HardwareProfile:
        if name not in PROFILES:
            raise ValueError(
                f"unknown hardware profile {name!r}; expected one of {sorted(PROFILES)}"
            )
        return PROFILES[name]

    @staticmethod
    def measure(nbytes: int = 256 << 20, repeats: int = 5) -> HardwareProfile:
        """Measures the running device: device copy bandwidth and host->device bandwidth.

        HBM bandwidth is taken as read+write bytes of a device-to-device copy per second; the link
        as bytes of a pinned_host -> device copy per second. Best of `repeats`.
        """
        dev = jax.devices()[0]
        sharding = single_device_sharding(dev)
        n = nbytes // 4
        x = jax.device_put(jnp.ones((n,), jnp.float32), sharding)
        h = jax.device_put(x, sharding.with_memory_kind(HOST_KIND))
        copy = jax.jit(lambda a: a + 1.0)
        fetch = jax.jit(lambda a: a, out_shardings=sharding.with_memory_kind(HBM_KIND))

        def best(fn, arg) -> float:
            fn(arg).block_until_ready()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn(arg).block_until_ready()
                times.append(time.perf_counter() - t)
            return min(times)

        hbm = 2 * nbytes / best(copy, x)
        link = nbytes / best(fetch, h)
        mem = getattr(dev, "memory_stats", lambda: None)() or {}
        total = float(mem.get("bytes_limit", 0) or 0) or 16e9
        return HardwareProfile(
            name=f"measured:{dev.platform}:{dev.device_kind}",
            hbm_bandwidth=hbm,
            link_bandwidth=link,
            hbm_bytes=total,
            notes="measured by HardwareProfile.measure()",
        )


PROFILES: dict[str, HardwareProfile] = {
    "gh200": HardwareProfile(
        "gh200", 4.0e12, 450e9, 96e9, "NVLink-C2C; measured H2D 346-420, D2H 170-297 GB/s"
    ),
    "gh200-paper": HardwareProfile("gh200-paper", 4.9e12, 450e9, 96e9, "the paper's numbers"),
    "h200-pcie": HardwareProfile("h200-pcie", 4.8e12, 55e9, 141e9, "PCIe Gen5; the lent test GPU"),
    "h100-pcie": HardwareProfile("h100-pcie", 3.35e12, 55e9, 80e9, "PCIe Gen5"),
    "a100-pcie": HardwareProfile("a100-pcie", 2.0e12, 25e9, 80e9, "PCIe Gen4; the seed's card"),
}


@dataclasses.dataclass(frozen=True)
class AnnealConfig:
    """Simulated-annealing schedule, scaled to the energy change of one move
    (`jaxkv.placement.anneal`).

    Attributes:
      chains: chains per layer, all starting from the greedy start.
      max_iters: iterations at most (one move per chain each); the temperature cools
        geometrically from T0 to t_final x T0 over them.
      candidates: k, the blocks per tier a chain rates best by the energy's slopes each
        iteration; it weighs their k x k swaps, k promotions and k demotions, priced exactly.
      t0_quantile: T0 is this quantile of the energy rises among the start's candidate moves,
        so about this share of the uphill moves it weighs is taken with odds >= 1/e of staying.
      t_final: the temperature at max_iters as a fraction of T0 (the last iterations descend).
      tolerance: the stop tolerance as a fraction of the move scale (the median energy change of
        the start's candidate moves), an absolute energy per layer: a move must gain more than
        it to count, and the start is certified optimal when no single move gains more.
      patience: a chain stops after this many iterations without improving its best energy by
        more than the tolerance.
    """

    chains: int = 4
    max_iters: int = 200
    candidates: int = 8
    t0_quantile: float = 0.1
    t_final: float = 1e-3
    tolerance: float = 0.05
    patience: int = 10

    def __post_init__(self):
        _positive_int("chains", self.chains)
        _positive_int("max_iters", self.max_iters)
        _positive_int("candidates", self.candidates)
        _positive_int("patience", self.patience)
        check_number("t0_quantile", self.t0_quantile, low=0.0, high=1.0)
        check_number("t_final", self.t_final, low=0.0, high=1.0, low_open=True)
        check_number("tolerance", self.tolerance, low=0.0)


@dataclasses.dataclass(frozen=True)
class PlacementConfig:
    """How and when the decode loop re-plans placement.

    Attributes:
      policy: a registered policy name (`jaxkv.placement.registry`: "lrfu", the live policy
        and the default; the field's rules "lru", "arc", "slru", "lfu", "tinylfu"; "static",
        "lru-plan"; "anneal" with the modifiers +reuse, +follow, +aw, +ec), or a policy object
        (`jaxkv.placement.policies.Policy`, e.g. a composed `Anneal`: online, with its
        `window` equal to this window), checked by the Decoder
        (`jaxkv.decode.setup.live_policy`).
      window: steps between plans (W); held in the decode state, so changing it never recompiles.
      adaptive_window: adapt W by +-window_step from the HBM hit rate, within
        [min_window, max_window].
      max_moves: migrations per layer per window (the migration budget); for a policy with an
        in-step rule (lrfu, the field's rules, +follow), promotions per layer per step.
      attention: "exact" reads every block; "sparse" reads the top-k blocks by the Quest bound.
      topk: blocks read in sparse mode: an int count or a float fraction of the written blocks.
      sink_blocks, recent_blocks: always read in sparse mode.
    """

    # a registered name or a jaxkv.placement.policies.Policy (which imports this module);
    # the default is `jaxkv.placement.registry.DEFAULT_LIVE`, the live policy
    policy: Any = "lrfu"
    window: int = 50
    adaptive_window: bool = False
    min_window: int = 20
    max_window: int = 100
    window_step: int = 10
    max_moves: int = 64
    attention: Literal["exact", "sparse"] = "exact"
    topk: int | float = 0.25
    sink_blocks: int = 1
    recent_blocks: int = 2
    compact_every: int = 0  # windows between compactions of the HBM pool; 0 = never

    def __post_init__(self):
        _positive_int("window", self.window)
        _positive_int("max_moves", self.max_moves, 0)
        if self.attention not in ("exact", "sparse"):
            raise ValueError(f"attention must be 'exact' or 'sparse', got {self.attention!r}")
        if isinstance(self.topk, (float, np.floating)):
            if not 0.0 < self.topk <= 1.0:
                raise ValueError(f"topk as a fraction must lie in (0, 1], got {self.topk!r}")
        else:
            _positive_int("topk", self.topk)
        _positive_int("sink_blocks", self.sink_blocks, 0)
        _positive_int("recent_blocks", self.recent_blocks, 0)
        _positive_int("compact_every", self.compact_every, 0)
        for name in ("min_window", "max_window", "window_step"):
            _positive_int(name, getattr(self, name))
        if not 1 <= self.min_window <= self.max_window:
            raise ValueError(
                f"need 1 <= min_window <= max_window, got {self.min_window}, {self.max_window}"
            )

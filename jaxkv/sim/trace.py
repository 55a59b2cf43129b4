"""Attention traces: the .npz format, validation, and seeded synthetic generators.

A trace says, for every decode step and layer, which blocks the step attends to and with what
(head-averaged, summed over the block's tokens) attention mass. The simulator applies a sparsity s
on top: at each (step, layer) the top ceil((1 - s) x sealed blocks) blocks by mass (mass > 0) are
read, plus the tail block (the one being filled, always in HBM).

File format (`save` / `load`, numpy .npz, version 1; version 2 when it carries a geometry or
tokens, which version 1 may not):
  version     [] int64           1 or 2
  prompt_len  [] int64           tokens in the context before decode step 0
  block_size  [] int64           tokens per block (1 = the paper's token granularity)
  ids         [steps, layers, K] int32    block ids attended at that (step, layer); -1 = padding
  mass        [steps, layers, K] float32  attention mass of each id, finite and >= 0; 0 on padding
  name        [] str (optional)  a label
  geometry_*  (optional, version 2) the recording model's `jaxkv.cost.Geometry`, all or none:
    geometry_name          [] str      a label (the model's)
    geometry_num_layers    [] int64    = the trace's layers
    geometry_kv_heads, geometry_head_dim, geometry_dtype_bytes  [] int64, >= 1 each
    geometry_weight_bytes  [] float64  weight bytes read per layer per decode step, >= 0
    geometry_param_bytes   [] float64  all parameter bytes, >= 0
  tokens      [steps] int32 (optional, version 2)  the token each decode step produced (step t's
              input is step t - 1's token; step 0's, the prefill's, is not stored)
At step t (0-based) the context holds prompt_len + t + 1 tokens (the new one included), so valid ids
are 0 .. ceil((prompt_len + t + 1) / block_size) - 1. K is free (a recorder may keep the top K
blocks only). `load` rejects a bad file with a ValueError naming the field. Compact storage
(`save(..., compact=True)`): ids as int16 when every id fits, mass as float16 (a positive mass
below float16's smallest subnormal is stored as that subnormal, so it stays read); `load`
upcasts both to int32 / float32. Rounding the mass to float16 (a relative error up to 2**-11)
can reorder blocks whose masses lie that close, and so change the top-k read set where
sparsity cuts between them. `save` writes a compressed .npz.

Every trace (file or synthetic) exposes the same duck type used by `jaxkv.sim.simulate`:
  prompt_len, block_size, num_layers, steps, num_blocks (blocks at the end of the trace), name,
  geometry and tokens (None unless a file carries them), and `mass(t0, n) -> [n, layers,
  num_blocks] float32` (dense mass of steps t0 .. t0 + n - 1; zero beyond each step's context and
  beyond the trace's last step).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import cost
from jaxkv.sim.trace_fields import (
    MAX_POSITION,
    V2_FIELDS,
    geometry_fields,
    int_field,
    read_geometry,
    read_tokens,
    string_field,
)

SYNTHETIC_KINDS = ("recency-low", "recency-high", "patterns", "real-like")
_REQUIRED = ("version", "prompt_len", "block_size", "ids", "mass")


def context_blocks(prompt_len: int, step, block_size: int):
    """Blocks in the context at `step` (the new token included); works on ints and arrays."""
    return (prompt_len + step + 1 + block_size - 1) // block_size


@dataclasses.dataclass(frozen=True, eq=False)
class FileTrace:
    """A recorded (or saved) trace held in memory in the sparse file layout; `geometry` and
    `tokens` are what a version-2 file carries (None when it does not)."""

    prompt_len: int
    block_size: int
    ids: np.ndarray  # [steps, layers, K] int32, -1 = padding
    mass_values: np.ndarray  # [steps, layers, K] float32
    name: str = "file"
    geometry: cost.Geometry | None = None  # the recording model's (batch 1)
    tokens: np.ndarray | None = None  # [steps] int32: the token each decode step produced

    @property
    def steps(self) -> int:
        return self.ids.shape[0]

    @property
    def num_layers(self) -> int:
        return self.ids.shape[1]

    @property
    def num_blocks(self) -> int:
        return context_blocks(self.prompt_len, self.steps - 1, self.block_size)

    def mass(self, t0: int, n: int) -> jax.Array:
        """Dense mass of steps t0 .. t0 + n - 1: [n, layers, num_blocks] float32."""
        idx = np.arange(t0, t0 + n)
        ok = idx < self.steps
        ids = np.where(ok[:, None, None], self.ids[np.minimum(idx, self.steps - 1)], -1)
        vals = self.mass_values[np.minimum(idx, self.steps - 1)]
        return _densify(jnp.asarray(ids), jnp.asarray(vals), self.num_blocks)


@functools.partial(jax.jit, static_argnums=2)
def _densify(ids, vals, num_blocks: int):
    n, layers, _ = ids.shape
    out = jnp.zeros((n, layers, num_blocks + 1), jnp.float32)
    safe = jnp.where(ids < 0, num_blocks, ids)  # padding goes to a dropped column
    t = jnp.arange(n)[:, None, None]
    lyr = jnp.arange(layers)[None, :, None]
    return out.at[t, lyr, safe].add(jnp.where(ids < 0, 0.0, vals))[..., :num_blocks]


def save(path, trace: FileTrace, *, compact: bool = False) -> None:
    """Writes `trace` as a compressed .npz (see the module docstring): version 2 when it carries
    a geometry or tokens, else version 1; `compact` stores ids as int16 (when every id fits)
    and mass as float16 (ValueError when a mass exceeds float16's range)."""
    ids = trace.ids.astype(np.int32)
    mass = trace.mass_values.astype(np.float32)
    if compact:
        f16 = np.finfo(np.float16)
        if mass.size and mass.max() > f16.max:
            raise ValueError(
                f"save(compact=True) stores mass as float16, whose largest value is "
                f"{float(f16.max):g}; got {float(mass.max()):g}: save without compact"
            )
        tiny = np.float32(f16.smallest_subnormal)
        mass = np.where((mass > 0) & (mass < tiny), tiny, mass).astype(np.float16)
        if ids.size == 0 or ids.max() <= np.iinfo(np.int16).max:
            ids = ids.astype(np.int16)
    extra = {}
    if trace.geometry is not None:
        extra |= geometry_fields(trace.geometry)
    if trace.tokens is not None:
        extra["tokens"] = np.asarray(trace.tokens, np.int32)
    np.savez_compressed(
        path,
        version=np.int64(2 if extra else 1),
        prompt_len=np.int64(trace.prompt_len),
        block_size=np.int64(trace.block_size),
        ids=ids,
        mass=mass,
        name=np.str_(trace.name),
        **extra,
    )


def check_entries(ids: np.ndarray, mass: np.ndarray) -> None:
    """Refuses what a trace cannot mean: mass on a padding entry (id -1) and a block listed
    twice at one (step, layer). (`load` also refuses a file with no mass at all.)"""
    pad = (ids < 0) & (mass != 0)
    if pad.any():
        t, layer, k = np.argwhere(pad)[0]
        raise ValueError(
            f"trace field 'mass' has {float(mass[t, layer, k]):g} on padding (id -1) at step {t}, "
            f"layer {layer}: expected 0 on padding"
        )
    srt = np.sort(ids, axis=-1)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        t, layer, k = np.argwhere(dup)[0]
        raise ValueError(
            f"trace field 'ids' lists block {int(srt[t, layer, k])} twice at step {t}, layer "
            f"{layer}: expected each block at most once per step and layer"
        )


def validate(fields: dict) -> FileTrace:
    """Checks a dict of trace fields and builds a FileTrace; ValueError names the bad field."""
    for f in _REQUIRED:
        if f not in fields:
            raise ValueError(f"trace is missing field {f!r}; expected fields {list(_REQUIRED)}")
    version = int_field(fields, "version")
    if version not in (1, 2):
        raise ValueError(f"trace field 'version' is {version}, expected 1 or 2")
    if version == 1 and any(f in fields for f in V2_FIELDS):
        f = next(f for f in V2_FIELDS if f in fields)
        raise ValueError(f"trace field {f!r} is a version-2 field, but 'version' is 1: expected 2")
    prompt_len = int_field(fields, "prompt_len")
    block_size = int_field(fields, "block_size")
    if prompt_len < 0:
        raise ValueError(f"trace field 'prompt_len' is {prompt_len}, expected >= 0")
    if block_size < 1:
        raise ValueError(f"trace field 'block_size' is {block_size}, expected >= 1")
    ids = np.asarray(fields["ids"])
    mass = np.asarray(fields["mass"])
    if ids.ndim != 3 or ids.shape[0] < 1 or ids.shape[1] < 1:
        raise ValueError(f"trace field 'ids' has shape {ids.shape}, expected [steps, layers, K]")
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"trace field 'ids' has dtype {ids.dtype}, expected an integer dtype")
    if mass.shape != ids.shape:
        raise ValueError(
            f"trace field 'mass' has shape {mass.shape}, expected the shape of 'ids' {ids.shape}"
        )
    if mass.dtype.kind not in "fiu":
        raise ValueError(
            f"trace field 'mass' has dtype {mass.dtype}, expected a real floating-point dtype "
            "(float32)"
        )
    if prompt_len + ids.shape[0] > MAX_POSITION:
        raise ValueError(
            f"trace field 'prompt_len' is {prompt_len}: with {ids.shape[0]} steps the positions "
            f"pass {MAX_POSITION} (int32), expected prompt_len <= {MAX_POSITION - ids.shape[0]}"
        )
    if ids.size and ids.min() < -1:
        raise ValueError(f"trace field 'ids' has id {int(ids.min())}, expected >= 0 (or -1 = pad)")
    limit = context_blocks(prompt_len, np.arange(ids.shape[0]), block_size)  # [steps]
    over = ids >= limit[:, None, None]
    if over.any():
        t, layer, k = np.argwhere(over)[0]
        raise ValueError(
            f"trace field 'ids' has id {int(ids[t, layer, k])} at step {t}, layer {layer}, beyond "
            f"the context's {int(limit[t])} blocks (expected < {int(limit[t])})"
        )
    if not np.all(np.isfinite(mass)):
        raise ValueError("trace field 'mass' has NaN or infinite values, expected finite")
    if mass.size and mass.min() < 0:
        raise ValueError(f"trace field 'mass' has value {float(mass.min())}, expected >= 0")
    check_entries(ids, mass)
    name = string_field(fields, "name") if "name" in fields else "file"
    geometry = read_geometry(fields, ids.shape[1])
    tokens = read_tokens(fields, ids.shape[0])
    ids, mass = ids.astype(np.int32), mass.astype(np.float32)
    return FileTrace(prompt_len, block_size, ids, mass, name, geometry, tokens)


def load(path) -> FileTrace:
    """Reads and validates a .npz trace (version 1 or 2); a file that is missing, not a .npz archive
    (a .npy array, truncated, corrupt) or holds an unreadable field raises ValueError."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"trace {str(p)!r}: file not found")
    if p.is_dir():
        raise ValueError(f"trace {str(p)!r}: is a directory, expected a .npz file")
    with open(p, "rb") as f:
        head = f.read(6)
    if not head.startswith((b"PK", b"\x93NUMPY")):  # a zip archive (.npz) or a .npy array
        what = "is empty" if not head else f"starts with {head!r}, not a zip archive's PK"
        raise ValueError(
            f"trace {str(p)!r}: not an .npz archive (the file {what}): expected a .npz of the "
            f"fields {list(_REQUIRED)} (jaxkv.sim.trace.save, jaxkv trace --out)"
        )
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 -- every way a file can fail to open as .npz
        raise ValueError(
            f"trace {str(p)!r}: not a readable .npz archive ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(z, np.lib.npyio.NpzFile):
        raise ValueError(
            f"trace {str(p)!r}: holds a single array (.npy), expected a .npz archive of the "
            f"fields {list(_REQUIRED)} (jaxkv.sim.trace.save)"
        )
    fields = {}
    with z:
        for k in z.files:
            try:
                fields[k] = z[k]
            except ValueError as e:
                if "allow_pickle" not in str(e):
                    raise ValueError(f"trace {str(p)!r}: field {k!r} is unreadable ({e})") from None
                raise ValueError(
                    f"trace {str(p)!r}: field {k!r} is an object array (pickled Python "
                    "objects), expected a numeric or string array"
                ) from None
            except Exception as e:  # noqa: BLE001 -- truncated or corrupt member
                raise ValueError(
                    f"trace {str(p)!r}: field {k!r} is unreadable, the file is truncated or "
                    f"corrupt ({type(e).__name__}: {e})"
                ) from None
    try:
        trace = validate(fields)
        if not np.asarray(fields["mass"]).any():  # every policy would read a 0% hit rate
            raise ValueError("trace field 'mass' is all zero: expected the ids' attention mass")
        return trace
    except ValueError as e:
        raise ValueError(f"trace {str(p)!r}: {str(e).removeprefix('trace ')}") from None


# --------------------------------------------------------------------------- synthetic traces


def _hash(*xs):
    """A stateless 32-bit integer hash (murmur3 finalizer) of uint32 arrays -> uniform in (0, 1)."""
    h = jnp.uint32(0x9E3779B9)
    for x in xs:
        h = h ^ (jnp.asarray(x).astype(jnp.uint32) + jnp.uint32(0x7F4A7C15) + (h << 6) + (h >> 2))
        h = h ^ (h >> 16)
        h = h * jnp.uint32(0x85EBCA6B)
        h = h ^ (h >> 13)
        h = h * jnp.uint32(0xC2B2AE35)
        h = h ^ (h >> 16)
    return (h.astype(jnp.float32) + 0.5) / 4294967296.0


@dataclasses.dataclass(frozen=True)
class SyntheticTrace:
    """A procedural trace: any window's mass is computed on demand from (seed, step, layer, block).

    Kinds:
      recency-low: mass = recency(age) x lognormal noise; each block redraws its noise every
        `redraw` steps (staggered), so about 10% of the read set changes per step.
      recency-high: the same with a noise redrawn every step and larger spread.
      real-like: recency x a slow noise (drifting over REAL_LIKE[0] steps) x a fast noise
        redrawn every step, calibrated to a recorded token-level trace of the default model
        (bench/notebook/2026-12-01-results-history.md, "Trace dynamics"): at s = 0.6 about 30%
        of the read set swaps per step, and about 45% of the blocks that leave it are read
        again two steps later (borderline tokens flicker in and out of the top set, as the
        paper's Reactive figures imply for its real trace); recency-low has 9% and 2%.
      patterns: the seed's mixture: steady-hot blocks (always heavy), intermittent bursts (on
        for a while, then off), late-long-tail blocks (old blocks that gain weight as decoding
        goes on), over a recency background.
    At block sizes below SPAN_TOKENS, noise and pattern kinds are drawn per passage of
    SPAN_TOKENS tokens (SPAN_SHARE of the noise variance shared), so token-level reads cluster
    as real attention does; at block sizes >= SPAN_TOKENS every block draws its own.
    """

    kind: str
    prompt_len: int = 31_299
    steps: int = 2_048
    num_layers: int = 32
    block_size: int = 16
    seed: int = 0

    def __post_init__(self):
        if self.kind not in SYNTHETIC_KINDS:
            raise ValueError(
                f"unknown synthetic trace {self.kind!r}; expected one of {list(SYNTHETIC_KINDS)}"
            )
        for f, low in (("steps", 1), ("num_layers", 1), ("block_size", 1), ("prompt_len", 0)):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < low:
                raise ValueError(f"synthetic trace {f} must be an integer >= {low}, got {v!r}")
        if self.prompt_len + self.steps > MAX_POSITION:
            raise ValueError(
                f"synthetic trace prompt_len + steps = {self.prompt_len} + {self.steps} passes "
                f"{MAX_POSITION} (positions are int32): expected at most that"
            )
        if not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            raise ValueError(f"synthetic trace seed must lie in [0, 2**32), got {self.seed}")

    @property
    def name(self) -> str:
        return f"synthetic:{self.kind}"

    @property
    def geometry(self) -> None:
        """No model recorded it: a synthetic trace carries no geometry (nor tokens)."""
        return None

    @property
    def tokens(self) -> None:
        return None

    @property
    def num_blocks(self) -> int:
        return context_blocks(self.prompt_len, self.steps - 1, self.block_size)

    def mass(self, t0: int, n: int) -> jax.Array:
        """Dense mass of steps t0 .. t0 + n - 1: [n, layers, num_blocks] float32."""
        return _synthetic_mass(self, jnp.int32(t0), n)


SPAN_TOKENS = 32  # synthetic traces: tokens of one "passage" that is attended together
REAL_LIKE = (12, 0.8, 0.6)  # real-like: slow-noise period (steps), slow and fast noise spreads
SPAN_SHARE = 0.75  # share of a token's noise variance that its passage shares


@functools.partial(jax.jit, static_argnums=(0, 2))
def _synthetic_mass(tr: SyntheticTrace, t0, n: int):
    bs = tr.block_size
    t = (t0 + jnp.arange(n, dtype=jnp.int32))[:, None, None]  # [n, 1, 1]
    layer = jnp.arange(tr.num_layers, dtype=jnp.int32)[None, :, None]  # [1, L, 1]
    blk = jnp.arange(tr.num_blocks, dtype=jnp.int32)[None, None, :]  # [1, 1, N]
    pos = (blk * bs + bs // 2).astype(jnp.float32)  # token position of the block's middle
    now = (tr.prompt_len + t).astype(jnp.float32)
    age = jnp.maximum(now - pos, 0.0)
    live = (blk < context_blocks(tr.prompt_len, t, bs)) & (t < tr.steps)
    seed = jnp.uint32(tr.seed)
    # Passages: attention to a token goes with attention to its neighbours (the premise of
    # page-level selection such as Quest), so noise and pattern kinds are drawn per span of
    # SPAN_TOKENS tokens (offset per layer, not aligned with pages) and mixed with a per-block
    # part; at block sizes >= SPAN_TOKENS each block is its own span.
    off = jnp.floor(_hash(seed, layer, 8) * SPAN_TOKENS).astype(jnp.int32)
    span = jnp.where(bs >= SPAN_TOKENS, blk, (blk * bs + bs // 2 + off) // SPAN_TOKENS)
    rho = jnp.where(bs >= SPAN_TOKENS, 0.0, SPAN_SHARE)

    def noise(*key):  # standard normal, shared by a span to the extent rho
        zs = jax.scipy.special.ndtri(_hash(seed, layer, span, *key, 9))
        zb = jax.scipy.special.ndtri(_hash(seed, layer, blk, *key))
        return jnp.sqrt(rho) * zs + jnp.sqrt(1.0 - rho) * zb

    # Per-layer recency scale between 2k and 16k tokens: some layers are local, some global.
    tau = 2000.0 * 8.0 ** _hash(seed, layer, 1)
    recency = 1.0 / (1.0 + age / tau)
    sink = jnp.where(blk * bs < 4, 4.0, 1.0)
    if tr.kind in ("recency-low", "recency-high"):
        redraw, sigma = (6, 1.0) if tr.kind == "recency-low" else (1, 1.5)
        phase = jnp.floor(_hash(seed, layer, span, 2) * redraw).astype(jnp.int32)
        epoch = (t + phase) // redraw
        m = recency * sink * jnp.exp(sigma * noise(epoch))
    elif tr.kind == "real-like":
        period, _, _ = REAL_LIKE
        u = (t + _hash(seed, layer, span, 2) * period) / period  # staggered per span
        f = u - jnp.floor(u)
        e = jnp.floor(u).astype(jnp.int32)
        slow = ((1 - f) * noise(e) + f * noise(e + 1)) / jnp.sqrt((1 - f) ** 2 + f**2)
        fast = noise(t, 10)
        m = recency * sink * jnp.exp(REAL_LIKE[1] * slow + REAL_LIKE[2] * fast)
    else:
        kind_u = _hash(seed, layer, span, 3)
        steady = kind_u < 0.08
        burst = (kind_u >= 0.08) & (kind_u < 0.5)
        late = (kind_u >= 0.5) & (kind_u < 0.6)
        period = 20 + jnp.floor(_hash(seed, layer, span, 4) * 60).astype(jnp.int32)
        phase = jnp.floor(_hash(seed, layer, span, 5) * period).astype(jnp.int32)
        on = _hash(seed, layer, span, (t + phase) // period, 6) < 0.35
        grow = jnp.clip((t.astype(jnp.float32) - 0.3 * tr.steps) / (0.4 * tr.steps + 1), 0, 1)
        z = noise((t + phase) // 5, 7)
        base = recency * jnp.exp(0.7 * z)
        m = base * sink
        m = m + jnp.where(steady, 3.0, 0.0) + jnp.where(burst & on, 2.0 * jnp.exp(0.5 * z), 0.0)
        m = m + jnp.where(late, 4.0 * grow, 0.0)
    return jnp.where(live, m, 0.0).astype(jnp.float32)


def parse_spec(
    spec: str, *, prompt_len: int, steps: int, num_layers: int, block_size: int, seed: int = 0
):
    """Builds a trace from a CLI spec: a .npz path or `synthetic:KIND`.

    Args:
      spec: path or `synthetic:KIND`, KIND one of SYNTHETIC_KINDS.
      prompt_len, steps, num_layers, block_size, seed: sizes of a synthetic trace (ignored for a
        file, whose own sizes rule).
    Returns:
      a FileTrace or SyntheticTrace.
    """
    if spec.startswith("synthetic:"):
        return SyntheticTrace(
            spec.split(":", 1)[1], prompt_len, steps, num_layers, block_size, seed
        )
    return load(spec)


def to_file_trace(trace, topk: int | None = None) -> FileTrace:
    """Materializes any trace into the sparse file layout (keeping the top `topk` per row)."""
    dense = np.asarray(trace.mass(0, trace.steps))  # [steps, layers, N]
    k = dense.shape[-1] if topk is None else min(topk, dense.shape[-1])
    order = np.argsort(-dense, axis=-1, kind="stable")[..., :k]
    vals = np.take_along_axis(dense, order, axis=-1)
    ids = np.where(vals > 0, order, -1).astype(np.int32)
    mass = np.where(vals > 0, vals, 0.0)
    geometry, tokens = getattr(trace, "geometry", None), getattr(trace, "tokens", None)
    return FileTrace(trace.prompt_len, trace.block_size, ids, mass, trace.name, geometry, tokens)


def read_stats(trace, sparsity: float, steps: int | None = None) -> dict:
    """Measures a trace's dynamics: read-set swap per step, re-reads, page fill, flicker.

    Returns:
      {"swap_per_step": mean fraction of the read set replaced between consecutive steps,
       "reread_within_50": fraction of blocks read at some step that are read again within 50,
       "page_fill": of the 16-token pages a step reads from, the mean share of blocks read
         (1.0: reads come in whole pages; at block sizes >= 16 every page is one block),
       "leavers_back_1" / "leavers_back_5": of the blocks that leave the read set (read at step
         t, not at t + 1), the share read again by step t + 2 / t + 6 (flicker: high for real
         attention, whose borderline tokens drift in and out of the top set)}.
    """
    n = min(steps or trace.steps, trace.steps)
    reads = np.asarray(read_mask(trace.mass(0, n), trace.prompt_len, trace.block_size, sparsity, 0))
    a, b = reads[:-1], reads[1:]
    swap = (a & ~b).sum(-1) / np.maximum(a.sum(-1), 1)
    horizon = 50
    later = np.zeros_like(reads)
    for d in range(1, horizon + 1):
        later[:-d] |= reads[d:]
    first = reads[: n - horizon] if n > horizon else reads
    rr = (first & later[: first.shape[0]]).sum() / max(first.sum(), 1)
    # leavers: blocks read at step t and not at t + 1; the share read again within d more steps
    left = a & ~b
    back = {}
    for d in (1, 5):
        again = np.zeros_like(left)
        for k in range(1, d + 1):
            again[: n - 1 - k] |= reads[1 + k :]
        m = max(n - 1 - d, 0)
        back[d] = float((left & again)[:m].sum() / max(left[:m].sum(), 1))
    # page fill: of the 16-token pages a step touches, the mean share of tokens it reads
    g = max(1, 16 // trace.block_size)
    pad = -reads.shape[-1] % g
    pages = np.pad(reads, ((0, 0), (0, 0), (0, pad))).reshape(*reads.shape[:2], -1, g)
    touched = pages.any(-1).sum(-1)
    fill = reads.sum(-1) / np.maximum(touched * g, 1)
    return {
        "swap_per_step": float(swap.mean()),
        "reread_within_50": float(rr),
        "page_fill": float(fill[touched > 0].mean()),
        "leavers_back_1": back[1],
        "leavers_back_5": back[5],
        "blocks": int(trace.num_blocks),
        "steps": int(n),
    }


def read_mask(mass, prompt_len: int, block_size: int, sparsity: float, t0):
    """The blocks each step reads: top ceil((1 - s) x sealed) sealed blocks by mass (mass > 0).

    Args:
      mass: [n, layers, N] float32, steps t0 .. t0 + n - 1.
      prompt_len, block_size: trace geometry.
      sparsity: s in [0, 1).
      t0: [] int, first step.
    Returns:
      [n, layers, N] bool.
    """
    return _read_mask(mass, prompt_len, block_size, float(sparsity), jnp.int32(t0))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _read_mask(mass, prompt_len, block_size, sparsity, t0):
    n, _, nb = mass.shape
    t = t0 + jnp.arange(n, dtype=jnp.int32)
    sealed = (prompt_len + t) // block_size  # [n]
    k = jnp.ceil((1.0 - sparsity) * sealed.astype(jnp.float32)).astype(jnp.int32)  # [n]
    ok = jnp.arange(nb)[None, None, :] < sealed[:, None, None]
    m = jnp.where(ok, mass, -1.0)
    srt = -jnp.sort(-m, axis=-1)  # descending
    thr = jnp.take_along_axis(
        srt,
        jnp.clip(k - 1, 0, nb - 1)[:, None, None] * jnp.ones(srt.shape[:2] + (1,), jnp.int32),
        axis=-1,
    )
    return ok & (m >= thr) & (m > 0) & (k > 0)[:, None, None]

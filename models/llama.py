"""Llama-family decoder in Flax NNX: RMSNorm, rotate-half RoPE (llama3 / linear scaling), GQA,
SwiGLU, tied or untied embeddings, optional attention / MLP biases (Qwen2, Llama variants).

Three entry points share one set of weights:

- ``__call__``: cache-free causal forward over positions ``0..T-1`` (the reference);
- ``prefill``: the same forward, also returning every layer's post-RoPE K and V
  (``prefill_at``: with the logits of one position per sequence only);
- ``decode_step``: one token per sequence, attention delegated to an ``attend`` callback (the
  tiered KV cache of ``jaxkv``), everything else (projections, RoPE, residuals, MLP) done here.

The layers are stored stacked (``Llama.layers`` is one :class:`Block` whose parameters carry a
leading ``[num_layers]`` axis) and every entry point runs them under one ``jax.lax.scan``: the
layer body is traced and compiled once, whatever the depth (32 layers compile as fast as 4).
``Llama.layer(i)`` returns layer ``i`` as a plain Block.

GQA mapping (binding for ``attend`` implementations): query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``, as Hugging Face's ``repeat_kv`` does.

Parameter layout: every projection weight is stored ``[in, out]`` (the transpose of PyTorch's
``nn.Linear.weight``), the embedding ``[vocab, dim]``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.causal import causal_attention

_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("llama3", "linear")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as Hugging Face's ``rope_scaling`` config entry.

    ``rope_type="llama3"`` (Llama 3.1 / 3.2) uses all four fields; ``"linear"`` divides every
    frequency by ``factor`` (position interpolation) and ignores the others.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(
                f"RopeScaling.rope_type={self.rope_type!r}: expected one of {_ROPE_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"RopeScaling.factor={self.factor}: expected > 0")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"RopeScaling high_freq_factor={self.high_freq_factor}, "
                f"low_freq_factor={self.low_freq_factor}: expected high > low > 0"
            )


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static, hashable description of a Llama-family decoder.

    ``sliding_window`` (Mistral, Qwen2): the query at position p attends the keys at
    positions k with p - k < sliding_window, in the layers ``sliding_layers`` (None: every
    layer; Qwen2 slides only from ``max_window_layers`` on). ``__call__`` / ``prefill`` apply
    it; ``decode_step`` delegates attention to ``attend``, which must apply
    ``layer_windows()`` (the dense reference and jaxkv's decoder do). ``init_std`` is the
    random-init scale (0.02 as in HF; the tiny test model uses more); loaded checkpoints
    overwrite every parameter.
    """

    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: RopeScaling | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    max_seq_len: int = 2048
    dtype: str = "float32"
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] | None = None
    init_std: float = 0.02
    # tensor parallelism (jaxkv.decode.sharded): this config is one shard's (num_heads, num_kv_heads
    # and ffn_dim its own), run under shard_map; the row-parallel projections (attention output,
    # MLP down) are summed over this mesh axis before their bias
    tp_axis: str | None = None

    def __post_init__(self):
        for name in (
            "vocab_size",
            "dim",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_dim",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r}: expected a positive int")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}: expected a whole GQA group size"
            )
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim}: expected an even number")
        if self.dtype not in _DTYPES:
            raise ValueError(f"LlamaConfig.dtype={self.dtype!r}: expected one of {_DTYPES}")
        w = self.sliding_window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w <= 0):
            raise ValueError(f"LlamaConfig.sliding_window={w!r}: expected None or an int > 0")
        if self.sliding_layers is not None:
            layers = self.sliding_layers
            ok = all(isinstance(i, int) and 0 <= i < self.num_layers for i in layers)
            if w is None or not ok or len(set(layers)) != len(layers):
                raise ValueError(
                    f"LlamaConfig.sliding_layers={layers!r}: expected None or distinct layer "
                    f"indices in [0, {self.num_layers}) with a sliding_window (got {w})"
                )
            object.__setattr__(self, "sliding_layers", tuple(sorted(layers)))

    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's sliding window in tokens, 0 for full attention."""
        w = self.sliding_window or 0
        slides = self.sliding_layers
        return tuple(w if slides is None or i in slides else 0 for i in range(self.num_layers))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        d, hd, f = self.dim, self.head_dim, self.ffn_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        attn = d * (q + 2 * kv) + q * d
        attn += (q + 2 * kv) * self.qkv_bias + d * self.o_bias
        mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
        per_layer = attn + mlp + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head


def rope_inv_freq(config: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] (float32), with the configured scaling applied.

    Computed as Hugging Face does (float32 base powers, llama3 smoothing between the low- and
    high-frequency wavelengths) so that positions rotate identically.
    """
    hd = config.head_dim
    exponents = np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / np.float32(hd)
    inv_freq = (1.0 / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    if rs.rope_type == "linear":
        return (inv_freq / np.float32(rs.factor)).astype(np.float32)
    old = rs.original_max_position_embeddings
    low_wavelen = old / rs.low_freq_factor
    high_wavelen = old / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


@functools.lru_cache(maxsize=64)
def _inv_freq_cached(config: LlamaConfig) -> np.ndarray:
    return rope_inv_freq(config)


def apply_rope(
    x: jax.Array,  # [..., heads, head_dim]
    positions: jax.Array,  # [...] int
    inv_freq: jax.Array,  # [head_dim // 2] float32
) -> jax.Array:  # [..., heads, head_dim], x.dtype
    """Rotate-half RoPE (HF Llama convention): pairs (i, i + head_dim/2) rotate together."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., hd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., 1, hd]
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _precision(dtype) -> jax.lax.Precision:
    # fp32 models are compared exactly against references: no TF32 / bf16 passes on GPU.
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> nnx.Param:
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype))


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled by a learned weight (HF LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float, dtype):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))  # [dim]
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * xf.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ w (+ b) with w stored [in, out]."""

    def __init__(self, d_in: int, d_out: int, *, bias: bool, std: float, dtype, rngs: nnx.Rngs):
        self.w = _init(rngs, (d_in, d_out), std, dtype)  # [in, out]
        self.b = nnx.Param(jnp.zeros((d_out,), dtype)) if bias else None  # [out]

    def __call__(self, x: jax.Array, sum_over: str | None = None) -> jax.Array:
        """[..., in] -> [..., out]; `sum_over`: a mesh axis whose shards of `in` are summed
        (a row-parallel projection under shard_map) before the bias is added once."""
        w = self.w[...]
        y = jnp.einsum("...i,io->...o", x, w, precision=_precision(w.dtype))
        if sum_over is not None:
            y = jax.lax.psum(y, sum_over)
        return y if self.b is None else y + self.b[...]


class Attention(nnx.Module):
    """Q/K/V/O projections; the attention itself lives in Llama (dense) or `attend` (cached)."""

    def __init__(self, c: LlamaConfig, std: float, *, rngs: nnx.Rngs):
        dt = c.jnp_dtype
        self.q = Linear(
            c.dim, c.num_heads * c.head_dim, bias=c.qkv_bias, std=std, dtype=dt, rngs=rngs
        )
        self.k = Linear(
            c.dim, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, std=std, dtype=dt, rngs=rngs
        )
        self.v = Linear(
            c.dim, c.num_kv_heads * c.head_dim, bias=c.qkv_bias, std=std, dtype=dt, rngs=rngs
        )
        self.o = Linear(
            c.num_heads * c.head_dim,
            c.dim,
            bias=c.o_bias,
            std=std / math.sqrt(2 * c.num_layers),
            dtype=dt,
            rngs=rngs,
        )


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, c: LlamaConfig, std: float, *, rngs: nnx.Rngs):
        self.tp_axis = c.tp_axis
        dt = c.jnp_dtype
        self.gate = Linear(c.dim, c.ffn_dim, bias=c.mlp_bias, std=std, dtype=dt, rngs=rngs)
        self.up = Linear(c.dim, c.ffn_dim, bias=c.mlp_bias, std=std, dtype=dt, rngs=rngs)
        self.down = Linear(
            c.ffn_dim,
            c.dim,
            bias=c.mlp_bias,
            std=std / math.sqrt(2 * c.num_layers),
            dtype=dt,
            rngs=rngs,
        )

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., dim] -> [..., dim]
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x), self.tp_axis)


class Block(nnx.Module):
    """One pre-norm decoder layer."""

    def __init__(self, c: LlamaConfig, std: float, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(c.dim, c.norm_eps, c.jnp_dtype)
        self.attn = Attention(c, std, rngs=rngs)
        self.mlp_norm = RMSNorm(c.dim, c.norm_eps, c.jnp_dtype)
        self.mlp = MLP(c, std, rngs=rngs)


AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


def stack_blocks(blocks: list[Block]) -> Block:
    """One Block whose parameters are those of ``blocks`` stacked on a leading layer axis."""
    graphdef, _ = nnx.split(blocks[0])
    states = [nnx.split(b)[1] for b in blocks]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


# the array axis each layer weight splits along under tensor parallelism ([layers, in, out])
_TP_SPLIT = {
    ("q", "w"): 2, ("k", "w"): 2, ("v", "w"): 2, ("q", "b"): 1, ("k", "b"): 1, ("v", "b"): 1,
    ("o", "w"): 1, ("gate", "w"): 2, ("up", "w"): 2, ("gate", "b"): 1, ("up", "b"): 1,
    ("down", "w"): 1,
}  # fmt: skip


def _key_name(k) -> str:
    return str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))


class Llama(nnx.Module):
    """Llama-family decoder. See the module docstring for the three entry points."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = c
        dt = c.jnp_dtype
        std = c.init_std
        self.embed = _init(rngs, (c.vocab_size, c.dim), std, dt)  # [vocab, dim]
        # built layer by layer (the same random draws as unstacked layers), stored stacked
        self.layers = stack_blocks([Block(c, std, rngs=rngs) for _ in range(c.num_layers)])
        self.final_norm = RMSNorm(c.dim, c.norm_eps, dt)
        self.lm_head = (  # [dim, vocab]
            None if c.tie_embeddings else _init(rngs, (c.dim, c.vocab_size), std, dt)
        )

    def tensor_shard(self, shards: int, axis: str | None) -> Llama:
        """One device's model under `shards`-way tensor parallelism over mesh axis `axis`
        (`jaxkv.model_api.TensorParallel`): abstract (no weights), with num_heads, num_kv_heads
        and ffn_dim divided by `shards` and the row-parallel projections summed over `axis`."""
        c = self.config
        for what, n in (
            ("KV heads", c.num_kv_heads),
            ("query heads", c.num_heads),
            ("ffn_dim", c.ffn_dim),
        ):
            if n % shards:
                raise ValueError(
                    f"ShardedDecoder: {what}={n} does not divide over the mesh's 'model' axis "
                    f"of {shards} devices"
                )
        local = dataclasses.replace(
            c,
            num_heads=c.num_heads // shards,
            num_kv_heads=c.num_kv_heads // shards,
            ffn_dim=c.ffn_dim // shards,
            tp_axis=axis,
        )
        return nnx.eval_shape(lambda: Llama(local, rngs=nnx.Rngs(0)))

    def tensor_split_axes(self, params) -> Any:
        """The axis each leaf of `params` (`nnx.split(self)[1]`) splits along over the mesh's
        "model" axis (`jaxkv.model_api.TensorParallel`): Q, K, V, gate and up by output (heads,
        ffn), O and down by input, summed after (`LlamaConfig.tp_axis`); the rest replicated."""

        def axis(path, _):
            names = [_key_name(k) for k in path if _key_name(k) != "value"]
            if len(names) >= 3 and names[0] == "layers":
                return _TP_SPLIT.get(tuple(names[-2:]))
            return None

        return jax.tree_util.tree_map_with_path(axis, params)

    def layer(self, i: int) -> Block:
        """Layer ``i`` (a Python int) as a Block of its own (a view for inspection and tests)."""
        if not 0 <= i < self.config.num_layers:
            raise ValueError(f"layer {i}: expected 0 <= i < num_layers={self.config.num_layers}")
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda x: x[i], state))

    def _scan_layers(self, body, carry, xs=None):
        """``jax.lax.scan`` of ``body(block, layer, carry, x) -> (carry, y)`` over the stacked
        layers, ``layer`` the traced int32 index: one traced and compiled layer body."""
        graphdef, state = nnx.split(self.layers)
        idx = jnp.arange(self.config.num_layers, dtype=jnp.int32)

        def step(carry, inp):
            st, i, x = inp
            return body(nnx.merge(graphdef, st), i, carry, x)

        return jax.lax.scan(step, carry, (state, idx, xs))

    # ----------------------------------------------------------------------------------------
    def _logits(self, h: jax.Array) -> jax.Array:  # [..., dim] -> [..., vocab] float32
        h = self.final_norm(h)
        if self.lm_head is None:
            w = self.embed[...]
            out = jnp.einsum("...d,vd->...v", h, w, precision=_precision(w.dtype))
        else:
            w = self.lm_head[...]
            out = jnp.einsum("...d,dv->...v", h, w, precision=_precision(w.dtype))
        return out.astype(jnp.float32)

    def _check_tokens(self, tokens: jax.Array, ndim: int, what: str):
        """Rank and dtype always; the id range when the tokens are concrete (under jit they
        are not, and the embedding lookup clamps an id outside the vocabulary)."""
        if tokens.ndim != ndim or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"{what}: got shape {tokens.shape} dtype {tokens.dtype}: expected an integer "
                f"array of rank {ndim}"
            )
        if not isinstance(tokens, jax.core.Tracer):
            ids = np.asarray(tokens)
            bad = (ids < 0) | (ids >= self.config.vocab_size)
            if bad.any():
                at = tuple(int(i[0]) for i in np.nonzero(bad))
                raise ValueError(
                    f"{what}: token id {int(ids[at])} at {at}: expected ids in [0, "
                    f"vocab_size={self.config.vocab_size})"
                )

    def _qkv(self, block: Block, x: jax.Array, positions: jax.Array):
        """x [..., dim], positions [...] -> q [..., H, hd], k, v [..., Hkv, hd] (RoPE applied)."""
        c = self.config
        lead = x.shape[:-1]
        q = block.attn.q(x).reshape(*lead, c.num_heads, c.head_dim)
        k = block.attn.k(x).reshape(*lead, c.num_kv_heads, c.head_dim)
        v = block.attn.v(x).reshape(*lead, c.num_kv_heads, c.head_dim)
        inv_freq = jnp.asarray(_inv_freq_cached(c))  # [head_dim // 2], a trace-time constant
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def _forward(self, tokens: jax.Array, *, return_kv: bool, logits_at=None):
        """tokens [B, T] -> logits (and k, v [L, B, T, Hkv, hd]): [B, T, V] f32 at every
        position, or [B, V] at `logits_at` [B] int positions only. Attention runs in query and
        key blocks (`models.causal`), never building the [T, T] scores."""
        c = self.config
        self._check_tokens(tokens, 2, "Llama tokens")
        b, t = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        windows = jnp.asarray(c.layer_windows(), jnp.int32)  # [L], scanned: 0 = full
        # a window every layer applies bounds the key blocks a query block reads
        band = c.sliding_window if c.sliding_layers is None else None
        h = self.embed[...][tokens]  # [B, T, dim]
        prec = _precision(c.jnp_dtype)

        def body(block, i, h, window):
            with jax.named_scope("attention"):
                q, k, v = self._qkv(block, block.attn_norm(h), positions)
                w = window if c.sliding_window is not None else None
                o = causal_attention(q, k, v, w, band=band, precision=prec)
                h = h + block.attn.o(o.reshape(b, t, c.num_heads * c.head_dim), c.tp_axis)
            with jax.named_scope("mlp"):
                h = h + block.mlp(block.mlp_norm(h))
            return h, ((k, v) if return_kv else None)

        h, kv = self._scan_layers(body, h, windows)
        if logits_at is not None:  # only the rows asked for reach the LM head
            at = jnp.clip(jnp.asarray(logits_at, jnp.int32), 0, t - 1)
            h = jnp.take_along_axis(h, at[:, None, None], axis=1)[:, 0]  # [B, dim]
        logits = self._logits(h)
        if not return_kv:
            return logits
        return logits, kv[0], kv[1]

    # ----------------------------------------------------------------------------------------
    def __call__(
        self,
        tokens: jax.Array,  # [batch, T] int
    ) -> jax.Array:  # [batch, T, vocab] float32
        """Cache-free causal forward at positions 0..T-1."""
        return self._forward(tokens, return_kv=False)

    def prefill(
        self,
        tokens: jax.Array,  # [batch, T] int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The causal forward, also returning each layer's K and V after RoPE.

        Prompts of different lengths may be right-padded into one batch: causal masking keeps a
        sequence's first ``len`` positions (their logits, K and V) exactly as if unpadded; its
        next-token logits are at ``len - 1``.

        Returns:
            logits [batch, T, vocab] float32, k and v [num_layers, batch, T, num_kv_heads,
            head_dim] in the model dtype.
        """
        return self._forward(tokens, return_kv=True)

    def prefill_at(
        self,
        tokens: jax.Array,  # [batch, T] int
        positions: jax.Array,  # [batch] int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`prefill` with the logits of one position per sequence only (the optional
        `prefill_at` of the model interface, `jaxkv.model_api`): the LM head runs on those
        rows alone, e.g. each right-padded prompt's last (``positions = lengths - 1``).

        Returns:
            logits [batch, vocab] float32 at ``positions`` (clipped to [0, T)), and k, v as
            `prefill`'s.
        """
        if positions.shape != tokens.shape[:1]:
            raise ValueError(
                f"Llama.prefill_at positions shape {positions.shape}: expected "
                f"({tokens.shape[0]},) (one position per sequence)"
            )
        return self._forward(tokens, return_kv=True, logits_at=positions)

    def decode_step(
        self,
        tokens: jax.Array,  # [batch] int
        positions: jax.Array,  # [batch] int: position of each token in its sequence
        attend: AttendFn,
        carry: Any,
    ) -> tuple[jax.Array, Any]:
        """One decoding step with attention delegated to ``attend``.

        For each layer ``i`` (a traced int32 scalar: the layers run under one ``lax.scan``, so
        ``attend`` is traced once and ``carry`` keeps one structure across layers) the model
        computes ``q`` [batch, num_heads, head_dim]
        and ``k_new``, ``v_new`` [batch, num_kv_heads, head_dim] (RoPE applied at ``positions``)
        and calls ``out, carry = attend(i, q, k_new, v_new, carry)``; ``attend`` stores the new
        K/V and returns the attention output ``out`` [batch, num_heads, head_dim] over every token
        of the sequence including the new one, scaled by 1/sqrt(head_dim), query head h reading
        KV head h // (num_heads // num_kv_heads).

        Returns:
            logits [batch, vocab] float32 and the final carry.
        """
        c = self.config
        self._check_tokens(tokens, 1, "Llama.decode_step tokens")
        if positions.shape != tokens.shape:
            raise ValueError(
                f"Llama.decode_step positions shape {positions.shape}: expected {tokens.shape} "
                "(one position per token)"
            )
        b = tokens.shape[0]
        h = self.embed[...][tokens]  # [B, dim]

        def body(block, i, hc, _):
            h, carry = hc
            with jax.named_scope("attention"):
                q, k, v = self._qkv(block, block.attn_norm(h), positions)
                out, carry = attend(i, q, k, v, carry)
                if out.shape != q.shape:
                    raise ValueError(
                        f"attend returned shape {out.shape}: expected {q.shape} "
                        "[batch, num_heads, head_dim]"
                    )
                o = out.astype(h.dtype).reshape(b, c.num_heads * c.head_dim)
                h = h + block.attn.o(o, c.tp_axis)
            with jax.named_scope("mlp"):
                h = h + block.mlp(block.mlp_norm(h))
            return (h, carry), None

        (h, carry), _ = self._scan_layers(body, (h, carry))
        return self._logits(h), carry

    def first_query(self, tokens: jax.Array, positions: jax.Array) -> jax.Array:
        """Layer 0's queries [batch, num_heads, head_dim] for ``tokens`` [batch] at ``positions``
        [batch], as ``decode_step`` passes them to ``attend`` (the optional part of the model
        interface, ``jaxkv.model_api``): they depend on the token and its position only, so the
        decode loop knows layer 0's next reads once the next token is sampled."""
        self._check_tokens(tokens, 1, "Llama.first_query tokens")
        block = self.layer(0)
        h = self.embed[...][tokens]
        return self._qkv(block, block.attn_norm(h), positions)[0]

"""What a model gives the decode loop (`jaxkv.Decoder`), written down and checked.

A model is a Flax NNX module (e.g. `models.Llama`) or plain JAX functions over a parameter
pytree wrapped as `FunctionalModel`. The Decoder uses exactly this of it (`Model`):

  config        hashable (a frozen dataclass or a NamedTuple: the Decoder compiles for it) with
                the ints num_layers, num_kv_heads, head_dim, vocab_size (`ModelConfig`);
                `dtype` too for `CacheConfig.for_model`; a sliding-window model also gives
                `sliding_window` and `layer_windows()` (each layer's window, 0 for none)
  prefill       (tokens [B, T] int32) -> (logits [B, T, vocab], k, v [layers, B, T,
                num_kv_heads, head_dim]): the causal forward over right-padded prompts, K
                after any position encoding (the cache stores it as given)
  decode_step   (tokens [B] int32, positions [B] int32, attend, carry) -> (logits [B, vocab],
                carry): one token per sequence at `positions` (the tokens already cached
                before it); for every layer it calls
                  out, carry = attend(layer, q, k_new, v_new, carry)
                with q [B, H, head_dim], k_new and v_new [B, num_kv_heads, head_dim] (H a
                multiple of num_kv_heads) and gets out [B, H, head_dim]: attention over every
                cached token of the sequence and the new one, which `attend` writes first.
                `attend` applies the 1/sqrt(head_dim) scale itself (pass q unscaled) and
                maps query head h to KV head h // (H // num_kv_heads) (multi-query: all to 0).
                `layer` is an int or a traced int32 (the layers may run under `lax.scan`);
                `carry` is the cache's state: thread it through unchanged in structure and
                return the last one. At prefill the Decoder also calls it once on batch x 32
                rows, the prompts' last positions, with an `attend` of its own
                (`jaxkv.decode.prompt`): rows are independent sequences of any count.
  prefill_at    optional: (tokens [B, T] int32, positions [B] int32) -> (logits [B, vocab], k,
                v): `prefill` with the logits at one position per sequence only (the Decoder
                asks for each prompt's last); without it the Decoder takes them from
                `prefill`'s [B, T, vocab]
  first_query   optional: (tokens [B] int32, positions [B] int32) -> q [B, H, head_dim], the
                queries `decode_step` passes to `attend` for layer 0 (they depend on the token
                and its position only). With it, `Lrfu(lookahead=True)` knows layer 0's next
                reads once the next token is sampled (`jaxkv.decode.follow`).

For an NNX module the Decoder's `params` are `nnx.split(model)[1]`; for a `FunctionalModel`
any pytree, given to its functions first: `prefill(params, tokens)` and
`decode_step(params, tokens, positions, attend, carry)`.

`check_model` checks all of this that can be checked before tracing (the kind of model, its
methods and their arity, the config's fields) when a Decoder is built, naming the missing
piece; `bind` checks the shapes the model passes and returns while it is traced.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

CONFIG_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "vocab_size")
_GUIDE = "(jaxkv.model_api: the model interface)"


@runtime_checkable
class ModelConfig(Protocol):
    """The config fields the decode loop reads (all ints >= 1); hashable."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


class AttendFn(Protocol):
    def __call__(self, layer, q, k_new, v_new, carry) -> tuple[jax.Array, Any]:
        """(out [B, H, head_dim], carry) from q [B, H, head_dim], k_new, v_new [B, KVH,
        head_dim]: scaled by 1/sqrt(head_dim), query head h reading KV head h // (H // KVH)."""
        ...


class Model(Protocol):
    """What `jaxkv.Decoder` uses of a model (module docstring)."""

    config: ModelConfig

    def prefill(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]: ...

    def decode_step(
        self, tokens: jax.Array, positions: jax.Array, attend: AttendFn, carry: Any
    ) -> tuple[jax.Array, Any]: ...

    # optional: def prefill_at(self, tokens, positions) -> (logits [B, vocab], k, v) and
    # def first_query(self, tokens, positions) -> jax.Array (module docstring)


class TensorParallel(Protocol):
    """What `jaxkv.decode.sharded.ShardedDecoder` needs of a model beyond `Model`: how it splits
    over a mesh's "model" axis (tensor parallelism). `models.llama.Llama` implements it."""

    def tensor_shard(self, shards: int, axis: str | None) -> Model:
        """The model one device of `shards` runs (abstract, e.g. `nnx.eval_shape`), its
        row-parallel outputs summed over mesh axis `axis` (None: one shard, nothing to sum).
        Raises ValueError naming a dimension that `shards` does not divide."""
        ...

    def tensor_split_axes(self, params) -> Any:
        """For each leaf of `params` (this model's state, `nnx.split`): the array axis it splits
        along over the "model" mesh axis, or None when every device holds all of it."""
        ...


@dataclasses.dataclass(frozen=True)
class FunctionalModel:
    """A model written as plain JAX functions over a parameter pytree (no flax needed).

    Args:
      config: the model's config (`ModelConfig`: hashable, with num_layers, num_kv_heads,
        head_dim, vocab_size; dtype for `CacheConfig.for_model`).
      prefill: (params, tokens [B, T]) -> (logits [B, T, vocab], k, v [layers, B, T, kv_heads,
        head_dim]).
      decode_step: (params, tokens [B], positions [B], attend, carry) -> (logits [B, vocab],
        carry), calling `attend` once per layer (module docstring).
      params: an example of the parameters (abstract ones do: `jax.ShapeDtypeStruct`s): only
        their bytes are kept, the weights a decode step reads, for the modeled step time
        and the plans' pricing. Give this or `weight_bytes`.
      weight_bytes: those bytes directly.
      first_query: optional, (params, tokens [B], positions [B]) -> layer 0's queries [B, H,
        head_dim] as `decode_step` computes them (module docstring).
      prefill_at: optional, (params, tokens [B, T], positions [B]) -> (logits [B, vocab], k,
        v): `prefill` with the logits at `positions` only (module docstring).

    The Decoder's `prefill`, `generate` etc. then take the params pytree itself.
    """

    config: Any
    prefill: Callable
    decode_step: Callable
    weight_bytes: float | None = None
    first_query: Callable | None = None
    params: dataclasses.InitVar[Any] = None
    prefill_at: Callable | None = None

    def __post_init__(self, params):
        if params is not None:
            nbytes = float(sum(_nbytes(x) for x in jax.tree_util.tree_leaves(params)))
            if self.weight_bytes is not None and self.weight_bytes != nbytes:
                raise ValueError(
                    f"FunctionalModel: weight_bytes={self.weight_bytes} differs from the "
                    f"params' {nbytes:.0f} bytes: give one of the two"
                )
            object.__setattr__(self, "weight_bytes", nbytes)
        wb = self.weight_bytes
        if wb is None:
            raise ValueError(
                "FunctionalModel needs params= (an example of the parameter pytree: its bytes "
                "are the weights a decode step reads, for the modeled step time) or "
                "weight_bytes="
            )
        if isinstance(wb, bool) or not isinstance(wb, int | float) or not wb >= 0:
            raise ValueError(f"FunctionalModel weight_bytes={wb!r}: expected a number >= 0")


def _nbytes(x) -> int:
    """Bytes of an array, a `jax.ShapeDtypeStruct` or a scalar."""
    if not hasattr(x, "shape"):
        x = np.asarray(x)
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _nnx_module(model) -> bool:
    """`model` is a flax NNX module (flax is imported only if the caller imported it)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(model, nnx.Module)


def check_model(model) -> Any:
    """Returns `model.config` after checking `model` against the interface (module
    docstring): TypeError naming the missing or mistyped piece, ValueError for a config
    field that is not an int >= 1."""
    functional = isinstance(model, FunctionalModel)
    if not functional and not _nnx_module(model):
        raise TypeError(
            f"model: a {type(model).__name__} is neither a flax nnx.Module nor a "
            "jaxkv.FunctionalModel; wrap a model written in plain JAX as FunctionalModel("
            f"config, prefill=..., decode_step=..., params=params) {_GUIDE}"
        )
    what = "FunctionalModel" if functional else f"model ({type(model).__name__})"
    if not hasattr(model, "config"):
        raise TypeError(f"{what} has no .config: expected one with {CONFIG_FIELDS} {_GUIDE}")
    for name, arity in (("prefill", 1), ("decode_step", 4)):
        fn = getattr(model, name, None)
        if not callable(fn):
            sig = "(tokens)" if name == "prefill" else "(tokens, positions, attend, carry)"
            raise TypeError(f"{what} has no method {name}{sig} {_GUIDE}")
        _check_arity(f"{what}.{name}", fn, arity + functional, functional)
    for name in ("first_query", "prefill_at"):
        fn = getattr(model, name, None)
        if callable(fn):
            _check_arity(f"{what}.{name}", fn, 2 + functional, functional)
        elif fn is not None:
            raise TypeError(f"{what}.{name} is not callable {_GUIDE}")
    check_model_config(model.config, f"{what}.config")
    return model.config


def has_first_query(model) -> bool:
    """The model (or what the Decoder keeps of it) gives the optional `first_query`."""
    return callable(getattr(model, "first_query", None))


def _check_arity(label: str, fn, n: int, functional: bool) -> None:
    """TypeError unless `fn` can be called with `n` positional arguments (when its signature
    can be read)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C function: nothing to read
        return
    try:
        sig.bind(*range(n))
    except TypeError:
        args = {"prefill": "tokens", "first_query": "tokens, positions"}
        args["prefill_at"] = "tokens, positions"
        args = ("params, " if functional else "") + args.get(
            label.rsplit(".", 1)[1], "tokens, positions, attend, carry"
        )
        raise TypeError(
            f"{label}{sig} cannot be called as {label.rsplit('.', 1)[1]}({args}) {_GUIDE}"
        ) from None


def require_fields(config, fields, label: str = "model config") -> None:
    """TypeError naming the first of `fields` that `config` lacks."""
    for name in fields:
        if not hasattr(config, name):
            raise TypeError(
                f"{label} ({type(config).__name__}) has no field {name!r}: expected a config "
                f"with {', '.join(fields)} {_GUIDE}"
            )


def check_model_config(config, label: str = "model config") -> None:
    """TypeError naming a missing field (`CONFIG_FIELDS`) or an unhashable config; ValueError
    for a field that is not an int >= 1."""
    require_fields(config, CONFIG_FIELDS, label)
    for name in CONFIG_FIELDS:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{label}.{name}={v!r}: expected an int >= 1")
    try:
        hash(config)
    except TypeError:
        raise TypeError(
            f"{label} ({type(config).__name__}) is not hashable: the Decoder compiles for "
            "its config; expected a frozen dataclass or a NamedTuple"
        ) from None
    if getattr(config, "sliding_window", None) is not None:
        windows = getattr(config, "layer_windows", None)
        if not callable(windows) or len(tuple(windows())) != config.num_layers:
            raise TypeError(
                f"{label} has a sliding_window but no layer_windows() giving "
                f"num_layers={config.num_layers} windows (0 for a full-attention layer)"
            )


def bind(static, params) -> Model:
    """The model to trace, from what the Decoder keeps (`static`: the nnx GraphDef or the
    `FunctionalModel`) and `params`, with the shapes it passes to `attend` and returns
    checked at trace time (ValueError naming the call, the shape and the one expected)."""
    if isinstance(static, FunctionalModel):
        cfg = static.config
        prefill = lambda tokens: static.prefill(params, tokens)  # noqa: E731
        decode = lambda *args: static.decode_step(params, *args)  # noqa: E731
        first = static.first_query and (lambda *args: static.first_query(params, *args))
        at = static.prefill_at and (lambda *args: static.prefill_at(params, *args))
        name = "FunctionalModel"
    else:
        from flax import nnx

        model = nnx.merge(static, params)
        cfg, prefill, decode, name = model.config, model.prefill, model.decode_step, "model"
        first = getattr(model, "first_query", None)
        at = getattr(model, "prefill_at", None)
    return _Checked(cfg, prefill, decode, name, first, at)


@dataclasses.dataclass(frozen=True)
class _Checked:
    """A model's prefill and decode_step with their shapes checked while traced."""

    config: Any
    _prefill: Callable
    _decode: Callable
    name: str
    _first: Callable | None = None
    _prefill_at: Callable | None = None

    def first_query(self, tokens, positions):
        """Layer 0's queries [B, H, head_dim] for `tokens` at `positions` (the model's
        optional `first_query`; ValueError without one)."""
        if self._first is None:
            raise ValueError(f"{self.name} has no first_query(tokens, positions) {_GUIDE}")
        q = self._first(tokens, positions)
        c, B = self.config, tokens.shape[0]
        H = q.shape[1] if q.ndim == 3 else 0
        if q.ndim != 3 or q.shape[0] != B or q.shape[2] != c.head_dim or H % c.num_kv_heads:
            raise ValueError(
                f"{self.name}.first_query returned shape {tuple(q.shape)}: expected (batch={B}, "
                f"heads, head_dim={c.head_dim}), heads a multiple of num_kv_heads={c.num_kv_heads}"
            )
        return q

    def prefill(self, tokens):
        out = self._prefill(tokens)
        c, (B, T) = self.config, tokens.shape
        kv = (c.num_layers, B, T, c.num_kv_heads, c.head_dim)
        if not isinstance(out, tuple | list) or len(out) != 3:
            raise ValueError(f"{self.name}.prefill returned {_kind(out)}: expected (logits, k, v)")
        want = dict(logits=(B, T, c.vocab_size), k=kv, v=kv)
        for (what, shape), x in zip(want.items(), out, strict=True):
            _check_shape(f"{self.name}.prefill's {what}", x, shape)
        return out

    def prefill_at(self, tokens, positions):
        """(logits [B, vocab] at `positions` [B], k, v): the model's `prefill_at` when it has
        one (its LM head on those rows only), else `prefill`'s logits taken there."""
        if self._prefill_at is None:
            logits, k, v = self.prefill(tokens)
            at = jnp.asarray(positions, jnp.int32)[:, None, None]
            return jnp.take_along_axis(logits, at, axis=1)[:, 0], k, v
        out = self._prefill_at(tokens, positions)
        c, (B, T) = self.config, tokens.shape
        kv = (c.num_layers, B, T, c.num_kv_heads, c.head_dim)
        if not isinstance(out, tuple | list) or len(out) != 3:
            raise ValueError(
                f"{self.name}.prefill_at returned {_kind(out)}: expected (logits, k, v)"
            )
        want = dict(logits=(B, c.vocab_size), k=kv, v=kv)
        for (what, shape), x in zip(want.items(), out, strict=True):
            _check_shape(f"{self.name}.prefill_at's {what}", x, shape)
        return out

    def decode_step(self, tokens, positions, attend, carry):
        c, B = self.config, tokens.shape[0]
        rows = _rows(B)
        layers: list = []  # each call's layer: a Python int, or None for a traced index

        def checked(layer, q, k_new, v_new, inner):
            H = q.shape[1] if q.ndim == 3 else 0
            if q.ndim != 3 or q.shape[0] != B or q.shape[2] != c.head_dim or H % c.num_kv_heads:
                raise ValueError(
                    f"{self.name}.decode_step passed attend q of shape {tuple(q.shape)}: "
                    f"expected ({B}, heads, head_dim={c.head_dim}), heads a multiple of "
                    f"num_kv_heads={c.num_kv_heads}; {rows}"
                )
            kv = (B, c.num_kv_heads, c.head_dim)
            _check_shape(f"{self.name}.decode_step's attend k_new", k_new, kv, rows)
            _check_shape(f"{self.name}.decode_step's attend v_new", v_new, kv, rows)
            layers.append(_static_layer(layer, c.num_layers, self.name))
            return attend(layer, q, k_new, v_new, inner)

        out = self._decode(tokens, positions, checked, carry)
        if not isinstance(out, tuple | list) or len(out) != 2:
            raise ValueError(
                f"{self.name}.decode_step returned {_kind(out)}: expected (logits, carry)"
            )
        logits, new = out
        _check_shape(f"{self.name}.decode_step's logits", logits, (B, c.vocab_size), rows)
        if jax.tree_util.tree_structure(new) != jax.tree_util.tree_structure(carry):
            raise ValueError(
                f"{self.name}.decode_step returned a carry of another structure than it was "
                "given: expected the last carry `attend` returned"
            )
        _check_layers(layers, c.num_layers, self.name)
        return logits, new


def _rows(B: int) -> str:
    """Why a decode_step call's batch is `B` (the Decoder calls it on more rows than the cache's
    batch at prefill), for shape errors."""
    return (
        f"{B} is the rows of this call, tokens.shape[0] (the Decoder also calls decode_step at "
        "prefill on batch x 32 or more rows, the prompts' last positions: a model must take "
        "its batch from its inputs, never fix it)"
    )


def _static_layer(layer, num_layers: int, name: str) -> int | None:
    """`layer` as a Python int when it is one (None: a traced index, as under lax.scan);
    ValueError when it is out of range."""
    if not isinstance(layer, int | np.integer):  # a traced index (or an array)
        return None
    if not 0 <= int(layer) < num_layers:
        raise ValueError(
            f"{name}.decode_step called attend for layer {int(layer)}: expected a layer in "
            f"[0, {num_layers}) (config.num_layers={num_layers})"
        )
    return int(layer)


def _check_layers(layers: list, num_layers: int, name: str) -> None:
    """ValueError unless a decode step called `attend` once for each of the `num_layers` layers
    (a layer never attended keeps no KV, one attended twice writes its token twice). Calls with
    a traced layer index (the layers under `lax.scan` or a loop) cannot be counted while
    tracing: with any of them only the Python-int layers are checked for repeats."""
    known = [x for x in layers if x is not None]
    twice = sorted({x for x in known if known.count(x) > 1})
    if twice:
        raise ValueError(
            f"{name}.decode_step called attend {known.count(twice[0])} times for layer "
            f"{twice[0]}: expected once per layer and step"
        )
    if None in layers:
        return
    missing = sorted(set(range(num_layers)) - set(known))
    if missing:
        said = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise ValueError(
            f"{name}.decode_step called attend for {len(known)} of config.num_layers="
            f"{num_layers} layers: never for layer{'s' if len(missing) > 1 else ''} {said}; "
            "expected one call per layer (each layer's new K and V are written by its call)"
        )


def _kind(x) -> str:
    """What a model returned, in words."""
    if isinstance(x, tuple | list):
        return f"a {type(x).__name__} of {len(x)}"
    if hasattr(x, "shape"):
        return f"an array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _check_shape(label: str, x, shape: tuple, note: str = "") -> None:
    have = tuple(getattr(x, "shape", ()))
    if have != shape:
        raise ValueError(
            f"{label} has shape {have}: expected {shape}" + (f"; {note}" if note else "")
        )

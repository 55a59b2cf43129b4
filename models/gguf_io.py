"""Read Llama-family models from a GGUF file (llama.cpp's format) with the `gguf` package.

`GGUFFile` opens the file, checks it before any tensor is read (architecture, tensor types,
shapes) and presents its tensors under their Hugging Face names and layout, dequantized to
float32 on demand: llama.cpp stores the Q and K projections of a Llama model with their rows
permuted for its rope layout (`convert_hf_to_gguf.py`'s `permute`), which `get` undoes, so the
loader of `models.hf` fills a `models.Llama` from either source. `config_from_gguf` reads the
model's `LlamaConfig` from the metadata and `tokenizer_from_gguf` builds a `tokenizers`
Tokenizer from the embedded vocabulary and merges (BPE, "gpt2" tokenizer model).

Supported: architectures "llama" (Llama 2 / 3 / 3.1 / 3.2, Mistral, SmolLM: llama.cpp writes
them all as "llama") and "qwen2"; tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Llama 3.1's rope scaling, which llama.cpp stores as the tensor
`rope_freqs.weight`, is read back into `RopeScaling("llama3")` and checked to reproduce it.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from models.llama import LlamaConfig, RopeScaling, rope_inv_freq

ARCHITECTURES = ("llama", "qwen2")
TOKENIZER_MODELS = ("gpt2",)
# GGUF's tokenizer.ggml.pre -> the pre-tokenizer regex llama.cpp applies (llama-vocab.cpp)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {  # name -> (split digits one by one first, regex or None for GPT-2's own)
    "default": (False, None),
    "gpt2": (False, None),
    "gpt-2": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "llama-bpe": (False, _LLAMA3),
    "llama3": (False, _LLAMA3),
    "qwen2": (False, _QWEN2),
}
_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # GGUF token types (gguf.TokenType)

# Hugging Face names (models.hf.hf_name) <-> GGUF names
_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_IGNORED = ("rope_freqs.weight",)  # read into the config, not a parameter


def is_gguf(path: str | os.PathLike) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return p.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


@functools.cache
def _reader_class():
    """gguf.GGUFReader over a plain ndarray view of its memmap: slicing a np.memmap builds a
    memmap object per slice, which made opening SmolLM2's file take 8.5 s instead of 1.6 s
    (and reading its tensors 13 s instead of 1.8 s) on these CPUs."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self):
            return self._array

        @data.setter
        def data(self, value):
            self._array = value.view(np.ndarray)

    return Reader


def _supported_types():
    from gguf import GGMLQuantizationType as Q

    names = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
    return {getattr(Q, n) for n in names + ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")}


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """`GGUFFile(path)`, reused while the file is unchanged (the loader, tokenizer, stop tokens
    and chat template each read the same file)."""
    p = Path(path).resolve()
    st = p.stat() if p.is_file() else None
    return _open_cached(p, st and (st.st_mtime_ns, st.st_size))


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, stamp) -> GGUFFile:
    return GGUFFile(path)


def hf_to_gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a Hugging Face one (None: no such tensor in GGUF)."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER:
        return f"blk.{parts[2]}.{_LAYER[parts[3]]}"
    return None


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor (None: not a model parameter we know)."""
    for hf, g in _GLOBAL.items():
        if name == g:
            return hf
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        for hf, g in _LAYER.items():
            if parts[2] == g:
                return f"model.layers.{parts[1]}.{hf}"
    return None


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row permutation of a Q or K projection [heads * head_dim, ...] (or bias)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of `permute_qk` (transformers' `reverse_permute_weights`)."""
    return (
        w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


class GGUFFile:
    """An opened GGUF file; raises ValueError (naming the file) for a file that is not GGUF, is
    truncated or corrupt, holds another architecture, or holds a tensor type we cannot read.

    `entries` are the Hugging Face names of its parameters; `shape(name)` their Hugging Face
    shape ([out, in] for a projection) and `get(name)` the float32 values, dequantized and with
    llama.cpp's Q/K row permutation undone. `meta(key, default)` reads a metadata value.
    """

    def __init__(self, path: str | os.PathLike):

        self.path = Path(path)
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "file not found"
            raise ValueError(f"{self.path}: {what} (expected a .gguf file)")
        if not is_gguf(self.path):
            raise ValueError(f"{self.path}: not a GGUF file (its first bytes are not 'GGUF')")
        try:
            self.reader = _reader_class()(self.path)
        except Exception as e:  # the reader raises ValueError, IndexError, struct errors...
            raise ValueError(
                f"{self.path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})"
            ) from None
        self.arch = self.meta("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported architecture {self.arch!r}: expected one of "
                f"{list(ARCHITECTURES)}"
            )
        supported = _supported_types()
        self._tensors = {}
        for t in self.reader.tensors:
            if t.tensor_type not in supported:
                raise ValueError(
                    f"{self.path}: tensor {t.name!r} has quantization type {t.tensor_type.name}: "
                    f"expected one of {sorted(q.name for q in supported)}"
                )
            self._tensors[t.name] = t
        unknown = sorted(
            n for n in self._tensors if gguf_to_hf_name(n) is None and n not in _IGNORED
        )
        if unknown:
            raise ValueError(
                f"{self.path}: unexpected tensors {unknown[:5]} ({len(unknown)}): expected only "
                f"those of a {self.arch} model"
            )
        self.entries = {gguf_to_hf_name(n): n for n in self._tensors if n not in _IGNORED}

    def meta(self, key: str, default=None):
        field = self.reader.fields.get(key)
        if field is None:
            return default
        return field.contents()

    def need(self, key: str):
        value = self.meta(key)
        if value is None:
            raise ValueError(f"{self.path}: metadata key {key!r} is missing")
        return value

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensors[self.entries[name]].shape))

    def raw(self, gguf_name: str) -> np.ndarray:
        """A tensor by its GGUF name, dequantized to float32, in the file's row layout."""
        import gguf

        t = self._tensors[gguf_name]
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise ValueError(
                f"{self.path}: tensor {gguf_name!r} could not be read ({type(e).__name__}: {e})"
            ) from None
        shape = tuple(int(d) for d in reversed(t.shape))
        return np.asarray(a, np.float32).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        gname = self.entries[name]
        a = self.raw(gname)
        if self.arch == "llama":  # llama.cpp permutes Q and K rows for llama models only
            if gname.endswith(("attn_q.weight", "attn_q.bias")):
                a = unpermute_qk(a, int(self.need("llama.attention.head_count")))
            elif gname.endswith(("attn_k.weight", "attn_k.bias")):
                kv = self.meta("llama.attention.head_count_kv")
                a = unpermute_qk(a, int(kv or self.need("llama.attention.head_count")))
        return a


def config_from_gguf(g: GGUFFile, *, dtype: str = "float32") -> LlamaConfig:
    """The :class:`LlamaConfig` of an opened GGUF file, from its metadata."""
    a = g.arch
    heads = int(g.need(f"{a}.attention.head_count"))
    dim = int(g.need(f"{a}.embedding_length"))
    head_dim = int(g.meta(f"{a}.attention.key_length") or dim // heads)
    vocab = g.meta(f"{a}.vocab_size")
    if vocab is None:
        vocab = g.shape("model.embed_tokens.weight")[0]
    bias = "model.layers.0.self_attn.q_proj.bias" in g.entries
    o_bias = "model.layers.0.self_attn.o_proj.bias" in g.entries
    config = LlamaConfig(
        vocab_size=int(vocab),
        dim=dim,
        num_layers=int(g.need(f"{a}.block_count")),
        num_heads=heads,
        num_kv_heads=int(g.meta(f"{a}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        ffn_dim=int(g.need(f"{a}.feed_forward_length")),
        norm_eps=_f32(g.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_f32(g.meta(f"{a}.rope.freq_base", 10000.0)),
        rope_scaling=None,
        tie_embeddings="lm_head.weight" not in g.entries,
        qkv_bias=bias,
        o_bias=o_bias,
        max_seq_len=int(g.meta(f"{a}.context_length", 2048)),
        dtype=dtype,
    )
    return _with_rope_scaling(g, config)


def _f32(value) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.99999974e-06:
    the shortest repr that round-trips through float32)."""
    return float(str(np.float32(value)))


def _with_rope_scaling(g: GGUFFile, config: LlamaConfig) -> LlamaConfig:
    """The config with the rope scaling the file states: `rope.scaling.type` linear, or Llama
    3.1's per-frequency divisors (the tensor `rope_freqs.weight`), read back as
    RopeScaling("llama3") and checked to reproduce the stored divisors."""
    import dataclasses

    a = g.arch
    kind = g.meta(f"{a}.rope.scaling.type")
    if kind == "linear":
        factor = float(g.need(f"{a}.rope.scaling.factor"))
        return dataclasses.replace(config, rope_scaling=RopeScaling(factor, rope_type="linear"))
    if kind not in (None, "none"):
        raise ValueError(
            f"{g.path}: rope scaling type {kind!r}: expected none, 'linear' or Llama 3.1's "
            "rope_freqs tensor"
        )
    if "rope_freqs.weight" not in g._tensors:
        return config
    divisors = g.raw("rope_freqs.weight").reshape(-1)  # [head_dim // 2]
    orig = int(g.meta(f"{a}.rope.scaling.original_context_length") or 8192)
    scaling = RopeScaling(
        factor=float(divisors.max()),
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=orig,
    )
    out = dataclasses.replace(config, rope_scaling=scaling)
    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None))
    if not np.allclose(plain / rope_inv_freq(out), divisors, rtol=1e-4):
        raise ValueError(
            f"{g.path}: rope_freqs.weight is not Llama 3.1's rope scaling (factor "
            f"{scaling.factor:g}, low/high frequency factors 1 / 4, original context {orig}): "
            "expected that, or no rope_freqs tensor"
        )
    return out


def tokenizer_from_gguf(g: GGUFFile):
    """A `tokenizers.Tokenizer` from the file's embedded BPE vocabulary and merges: byte-level
    BPE, the pre-tokenizer its `tokenizer.ggml.pre` names, control and user-defined tokens added
    as special tokens, BOS prepended when `tokenizer.ggml.add_bos_token` says so."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )

    kind = g.meta("tokenizer.ggml.model")
    if kind is None:
        raise ValueError(f"{g.path}: no embedded tokenizer (metadata 'tokenizer.ggml.model')")
    if kind not in TOKENIZER_MODELS:
        raise ValueError(
            f"{g.path}: tokenizer model {kind!r}: expected one of {list(TOKENIZER_MODELS)} "
            "(byte-level BPE); SentencePiece ('llama') vocabularies are not supported yet"
        )
    pre = g.meta("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{g.path}: pre-tokenizer {pre!r}: expected one of {sorted(PRE_TOKENIZERS)}"
        )
    tokens = list(g.need("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in g.need("tokenizer.ggml.merges")]
    types = list(g.meta("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    digits, regex = PRE_TOKENIZERS[pre]
    parts = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        parts.append(pre_tokenizers.Split(Regex(regex), behavior="isolated"))
        parts.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    tok.pre_tokenizer = parts[0] if len(parts) == 1 else pre_tokenizers.Sequence(parts)
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=ty == _TOKEN_CONTROL, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in special if a.special])
    tok.add_tokens([a for a in special if not a.special])
    bos = g.meta("tokenizer.ggml.bos_token_id")
    if g.meta("tokenizer.ggml.add_bos_token") and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def gguf_eos_ids(g: GGUFFile) -> tuple[int, ...]:
    """The stop tokens the file names: EOS, and end-of-turn / end-of-message when present."""
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [g.meta(k) for k in keys + ("tokenizer.ggml.eom_token_id",)]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))

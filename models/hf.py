"""Load (and save) Hugging Face Llama-family checkpoints from a local folder. Nothing is
downloaded.

Supported: ``LlamaForCausalLM`` (Llama 2 / 3 / 3.1 / 3.2, rope_scaling "llama3" or "linear"),
``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (qkv bias), tied or untied embeddings, one
``model.safetensors`` or shards with ``model.safetensors.index.json``. Both config styles are
read: ``rope_theta`` + ``rope_scaling`` (transformers 4) and ``rope_parameters`` (transformers 5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import Llama, LlamaConfig, RopeScaling
from models.safetensors_io import SafetensorsFile, save_file

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path}: file not found (expected a Hugging Face checkpoint folder)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: holds a JSON {type(data).__name__}, expected a JSON object ({{...}})"
        )
    return data


def _architecture(cfg: dict, path: Path) -> str:
    archs = cfg.get("architectures") or []
    for a in archs:
        if a in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[a]
    if not archs and cfg.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        return cfg["model_type"]
    raise ValueError(
        f"{path}: unsupported architecture {archs or cfg.get('model_type')!r}: expected one of "
        f"{sorted(SUPPORTED_ARCHITECTURES)}"
    )


def _rope(cfg: dict, path: Path) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters")
    if params is None:  # transformers 4 style
        theta = float(cfg.get("rope_theta", 10000.0))
        params = cfg.get("rope_scaling")
    else:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if not params:
        return theta, None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None

    def need(key):
        if params.get(key) is None:
            raise ValueError(f"{path}: rope type {kind!r} needs {key!r} in its rope parameters")
        return params[key]

    if kind == "linear":
        return theta, RopeScaling(factor=float(need("factor")), rope_type="linear")
    if kind == "llama3":
        # as transformers: without original_max_position_embeddings, max_position_embeddings
        orig = params.get("original_max_position_embeddings")
        if orig is None:
            orig = cfg.get("max_position_embeddings")
        if orig is None:
            raise ValueError(
                f"{path}: rope type 'llama3' needs 'original_max_position_embeddings' (or the "
                "config's 'max_position_embeddings')"
            )
        return theta, RopeScaling(
            factor=float(need("factor")),
            low_freq_factor=float(need("low_freq_factor")),
            high_freq_factor=float(need("high_freq_factor")),
            original_max_position_embeddings=int(orig),
        )
    raise ValueError(
        f"{path}: unsupported rope type {kind!r}: expected 'default', 'linear' or 'llama3'"
    )


def config_from_hf(cfg: dict, *, dtype: str = "float32", path: str = "config.json") -> LlamaConfig:
    """Translate a Hugging Face ``config.json`` dict into a :class:`LlamaConfig`."""
    p = Path(path)
    arch = _architecture(cfg, p)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{p}: hidden_act={act!r}: expected 'silu' (SwiGLU)")
    missing = [
        k
        for k in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
        )
        if k not in cfg
    ]
    if missing:
        raise ValueError(f"{p}: missing config keys {missing}")
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta, scaling = _rope(cfg, p)
    sliding, sliding_layers = _sliding_window(cfg, arch, p)
    attention_bias = bool(cfg.get("attention_bias", False))
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        dim=int(cfg["hidden_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        ffn_dim=int(cfg["intermediate_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or attention_bias,
        o_bias=attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        dtype=dtype,
        sliding_window=sliding,
        sliding_layers=sliding_layers,
    )


def _sliding_window(cfg: dict, arch: str, p: str) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, sliding_layers) as transformers reads them: Mistral slides in every
    layer; Qwen2 only with use_sliding_window, in the layers its layer_types mark
    "sliding_attention" (by default those from max_window_layers on)."""
    if arch == "mistral":
        w = cfg.get("sliding_window")
        layers = None
    elif arch == "qwen2" and cfg.get("use_sliding_window"):
        w = cfg.get("sliding_window", 4096)
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types")
        if types is None:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        allowed = ("sliding_attention", "full_attention")
        if len(types) != n or any(t not in allowed for t in types):
            raise ValueError(
                f"{p}: layer_types={types!r}: expected {n} entries, each one of {allowed}"
            )
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        return None, None
    if w is None or layers == ():
        return None, None
    if not isinstance(w, int) or isinstance(w, bool) or w <= 0:
        raise ValueError(f"{p}: sliding_window={w!r}: expected null or an int > 0")
    return w, layers


def load_config(path: str | os.PathLike, *, dtype: str = "float32") -> LlamaConfig:
    """The :class:`LlamaConfig` of the checkpoint folder ``path`` (its config.json)."""
    file = Path(path) / "config.json"
    return config_from_hf(_read_json(file), dtype=dtype, path=str(file))


def hf_name(path: tuple, layer: int | None = None) -> tuple[str, bool]:
    """Our parameter path -> (Hugging Face tensor name, whether the weight is transposed).

    A path under ``layers`` (stacked: one array for all layers) names layer ``layer``'s tensor.
    """
    if path == ("embed",):
        return "model.embed_tokens.weight", False
    if path == ("lm_head",):
        return "lm_head.weight", True
    if path == ("final_norm", "weight"):
        return "model.norm.weight", False
    if layer is None:
        raise ValueError(f"hf_name{path}: a stacked layer parameter needs its layer index")
    _, *rest = path
    pre = f"model.layers.{layer}"
    if rest == ["attn_norm", "weight"]:
        return f"{pre}.input_layernorm.weight", False
    if rest == ["mlp_norm", "weight"]:
        return f"{pre}.post_attention_layernorm.weight", False
    part, proj, kind = rest
    sub = "self_attn" if part == "attn" else "mlp"
    return f"{pre}.{sub}.{proj}_proj.{'weight' if kind == 'w' else 'bias'}", kind == "w"


def _tensor_names(path: tuple, num_layers: int) -> list[tuple[str, bool]]:
    """The Hugging Face tensors of one of our parameters: one, or one per layer (stacked)."""
    if path[0] == "layers":
        return [hf_name(path, i) for i in range(num_layers)]
    return [hf_name(path)]


def _open_shards(folder: Path) -> dict[str, SafetensorsFile]:
    """Tensor name -> the file that holds it."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: missing 'weight_map'")
        files = {}
        for fname in sorted(set(weight_map.values())):
            f = folder / fname
            if not f.is_file():
                raise ValueError(f"{f}: file not found (listed in {index.name})")
            files[fname] = SafetensorsFile(f)
        out = {}
        for name, fname in weight_map.items():
            if name not in files[fname].entries:
                raise ValueError(
                    f"{folder / fname}: tensor {name!r} listed in {index.name} is not in the file"
                )
            out[name] = files[fname]
        return out
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(
            f"{folder}: no *.safetensors file found (expected model.safetensors or shards with "
            "model.safetensors.index.json)"
        )
    out = {}
    for f in shards:
        sf = SafetensorsFile(f)
        out.update({name: sf for name in sf.entries})
    return out


def load_pretrained(path: str | os.PathLike, *, dtype: str = "float32") -> Llama:
    """Load a checkpoint into a :class:`Llama` with parameters in ``dtype``: a Hugging Face
    folder (config.json and safetensors), or a GGUF file (``models.gguf_io``: config and
    tokenizer from its metadata, weights dequantized).

    Raises:
        ValueError: a missing file or tensor, an unsupported architecture or quantization type,
            a tensor whose shape disagrees with the config, a truncated or corrupt file, or
            unexpected tensors (a checkpoint of another architecture); the message names the
            file/tensor.
    """
    from models import gguf_io

    source = Path(path)
    if source.is_file() and (source.suffix == ".gguf" or gguf_io.is_gguf(source)):
        g = gguf_io.open_gguf(source)
        config = gguf_io.config_from_gguf(g, dtype=dtype)
        return _fill(config, {name: g for name in g.entries}, source, "the GGUF metadata")
    if not source.is_dir():
        what = "not found" if not source.exists() else "not a directory or a GGUF file"
        raise ValueError(
            f"{source}: {what} (expected a Hugging Face checkpoint folder or a .gguf file)"
        )
    config = load_config(source, dtype=dtype)
    return _fill(config, _open_shards(source), source, "config.json")


def _fill(config: LlamaConfig, tensors: dict, source: Path, config_label: str) -> Llama:
    """A Llama of `config` with every parameter read from `tensors` (Hugging Face name -> a
    file with `shape(name)`, `get(name)` and `path`); ValueError names a missing, misshapen or
    unexpected tensor."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    target = jnp.dtype(config.dtype)
    used = set()
    flat = []
    for p, var in nnx.to_flat_state(state):
        names = _tensor_names(p, config.num_layers)
        shape = var.shape[1:] if p[0] == "layers" else var.shape
        parts = []
        for name, transpose in names:
            if name not in tensors:
                raise ValueError(f"{source}: tensor {name!r} not found in the checkpoint")
            file = tensors[name]
            expected = shape[::-1] if transpose else shape
            if file.shape(name) != tuple(expected):
                raise ValueError(
                    f"{file.path}: tensor {name!r} has shape {file.shape(name)}: expected "
                    f"{tuple(expected)} from {config_label}"
                )
            a = np.asarray(file.get(name))
            parts.append((a.T if transpose else a).astype(target))
            used.add(name)
        a = np.stack(parts) if p[0] == "layers" else parts[0]
        flat.append((p, var.replace(jnp.asarray(a))))
    unexpected = sorted(
        n
        for n in tensors
        if n not in used
        and not n.endswith(_IGNORED_SUFFIXES)
        and not (config.tie_embeddings and n == "lm_head.weight")
    )
    if unexpected:
        raise ValueError(
            f"{source}: unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
            f" ({len(unexpected)}): expected only those of a {type(abstract).__name__} with this "
            f"{config_label}"
        )
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_tokenizer(path: str | os.PathLike):
    """The ``tokenizers.Tokenizer`` of a checkpoint folder (its tokenizer.json) or of a GGUF
    file (built from its embedded vocabulary and merges, ``models.gguf_io``)."""
    from tokenizers import Tokenizer

    from models import gguf_io

    if Path(path).is_file() and gguf_io.is_gguf(path):
        return gguf_io.tokenizer_from_gguf(gguf_io.open_gguf(path))
    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"{file}: file not found (expected a tokenizer.json)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises a bare Exception on a corrupt file
        raise ValueError(
            f"{file}: not a readable tokenizer ({type(e).__name__}: {e}); expected a Hugging "
            "Face tokenizers file, or none (the model then reads bytes)"
        ) from None


def eos_token_ids(path: str | os.PathLike) -> tuple[int, ...]:
    """The stop tokens of a checkpoint (may be empty): a GGUF file's EOS, end-of-turn and
    end-of-message ids; a folder's from generation_config.json, config.json and
    tokenizer_config.json's ``eos_token`` (all of them, in that order)."""
    from models import gguf_io

    if Path(path).is_file() and gguf_io.is_gguf(path):
        return gguf_io.gguf_eos_ids(gguf_io.open_gguf(path))
    folder = Path(path)
    ids: list[int] = []
    for fname in ("generation_config.json", "config.json"):
        f = folder / fname
        if f.is_file():
            eos = _read_json(f).get("eos_token_id")
            if eos is not None:
                ids += [int(i) for i in eos] if isinstance(eos, list) else [int(eos)]
    token = _tokenizer_config(folder).get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and (folder / "tokenizer.json").is_file():
        tid = load_tokenizer(folder).token_to_id(token)
        if tid is not None:
            ids.append(int(tid))
    return tuple(dict.fromkeys(ids))


def chat_template(path: str | os.PathLike) -> str | None:
    """The chat template (Jinja) of a GGUF file (``tokenizer.chat_template``) or a folder
    (tokenizer_config.json's ``chat_template``, or chat_template.jinja), or None."""
    from models import gguf_io

    if Path(path).is_file() and gguf_io.is_gguf(path):
        return gguf_io.open_gguf(path).meta("tokenizer.chat_template")
    folder = Path(path)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = _tokenizer_config(folder).get("chat_template")
    return template if isinstance(template, str) else None


def special_token(path: str | os.PathLike, which: str) -> str:
    """The text of the checkpoint's BOS or EOS token (`which` "bos" / "eos"), "" if none."""
    from models import gguf_io

    if which not in ("bos", "eos"):
        raise ValueError(f"special_token: which={which!r}: expected 'bos' or 'eos'")
    if Path(path).is_file() and gguf_io.is_gguf(path):
        g = gguf_io.open_gguf(path)
        tid = g.meta(f"tokenizer.ggml.{which}_token_id")
        tokens = g.meta("tokenizer.ggml.tokens") if tid is not None else None
        return str(tokens[int(tid)]) if tokens is not None and int(tid) < len(tokens) else ""
    token = _tokenizer_config(Path(path)).get(f"{which}_token")
    token = token.get("content") if isinstance(token, dict) else token
    return token if isinstance(token, str) else ""


def _tokenizer_config(folder: Path) -> dict:
    f = folder / "tokenizer_config.json"
    return _read_json(f) if f.is_file() else {}


def hf_config_dict(config: LlamaConfig, **extra: Any) -> dict:
    """A transformers-readable ``config.json`` dict (LlamaForCausalLM) for ``config``."""
    if config.qkv_bias != config.o_bias or config.sliding_window is not None:
        raise ValueError(
            "hf_config_dict: qkv_bias without o_bias (Qwen2) or a sliding window (Mistral) "
            "cannot be written as LlamaForCausalLM"
        )
    rs = config.rope_scaling
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None
        if rs is None
        else {
            "rope_type": rs.rope_type,
            "factor": rs.factor,
            "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        },
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "max_position_embeddings": config.max_seq_len,
        "hidden_act": "silu",
        "torch_dtype": config.dtype,
    }
    out.update(extra)
    return out


def save_pretrained(model: Llama, path: str | os.PathLike, *, tokenizer=None, **extra) -> None:
    """Write ``model`` as a Hugging Face Llama checkpoint folder (config.json,
    model.safetensors, and tokenizer.json when ``tokenizer`` is given); ``extra`` goes into
    config.json (e.g. ``eos_token_id``)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config_dict(model.config, **extra)
    tensors = {}
    for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        a = np.asarray(jax.device_get(var[...]))
        stacked = p[0] == "layers"
        for i, (name, transpose) in enumerate(_tensor_names(p, model.config.num_layers)):
            x = a[i] if stacked else a
            tensors[name] = np.ascontiguousarray(x.T if transpose else x)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save(str(folder / "tokenizer.json"))

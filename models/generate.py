"""Generating text over a tiered KV cache: what `jaxkv generate` (models/generate_cli.py), the
demo and the trace command share: the request's checks (`check_request`, before any model
loads), loading a model by name or path, chat prompts, and `start` (a prefilled `Stream` of
the answer's text) / `generate_text` (the whole answer)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

import jaxkv.sim  # noqa: F401  (registers the oracles: their names get the precise refusal)
from jaxkv import Decoder, Greedy, Sampling
from jaxkv.config import CacheConfig, PlacementConfig, check_number
from jaxkv.decode.state import PAD_ID, summarize
from jaxkv.placement import presets
from models import chat
from models.default import default_model
from models.hf import (
    chat_template,
    eos_token_ids,
    load_pretrained,
    load_tokenizer,
    special_token,
)
from models.stream import Stream

WINDOW = 16  # steps between a planning policy's plans
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
    if not spec:
        raise ValueError(
            f"{label}='': expected 'default', a named model ({', '.join(sorted(named.MODELS))}), "
            "a checkpoint folder or a .gguf file"
        )
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


def chat_prompt(
    spec: str,
    tokenizer,
    message: str | None = None,
    *,
    system: str | None = None,
    messages: list[dict] | None = None,
) -> str:
    """A conversation under the model's chat template, ready for the assistant's answer: one
    user turn `message`, or the turns `messages` ({"role", "content"}, last a user turn), after
    a `system` turn when given (Jinja, sandboxed, as transformers renders it); ValueError
    without a template, or when the template refuses the turns."""
    template = chat_template(model_source(spec)) if tokenizer is not None else None
    if not template:
        raise ValueError(
            f"--chat: model {spec!r} has no chat template; use --prompt instead (it continues "
            "the text)"
        )
    turns = list(messages) if messages is not None else [{"role": "user", "content": message}]
    if system is not None:
        if turns and turns[0]["role"] == "system":
            raise ValueError("--system: the messages begin with a system turn already")
        turns.insert(0, {"role": "system", "content": system})
    src = model_source(spec)
    return chat.render(
        template,
        turns,
        bos=special_token(src, "bos"),
        eos=special_token(src, "eos"),
        who=repr(spec),
    )


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


@dataclasses.dataclass(frozen=True)
class Request:
    """What `jaxkv generate` (and `generate_text`) decodes: the text (a prompt to continue, or
    with `chat` a user message; or `messages`, a conversation), checked by `check_request`."""

    prompt: str | None = None
    model: str = "default"
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    hbm_fraction: float | None = None
    hbm_blocks: int | None = None
    hbm_bytes: float | None = None
    policy: Any = LIVE_POLICY
    attention: str = "exact"
    topk: float = 0.25
    fp8: str = "off"
    fp8_age: int = 0
    seed: int = 0
    chat: bool = False
    system: str | None = None
    messages: tuple | None = None


def check_request(r: Request, label=lambda name: name) -> None:
    """Checks a request before the model loads; ValueError naming each argument by
    `label(name)` (the CLI passes its option names) with its value and what was expected."""
    if r.messages is None and not r.prompt:
        raise ValueError(f"{label('prompt')} is empty: expected at least one character")
    if r.system is not None and not (r.chat or r.messages is not None):
        raise ValueError(
            f"{label('system')} is a chat model's system turn: expected it with "
            f"{label('chat')} or {label('messages')} (a continuation has no turns)"
        )
    check_model_spec(r.model, label("model"))
    check_number(label("max_new_tokens"), r.max_new_tokens, integer=True, low=1)
    check_number(label("temperature"), r.temperature, low=0.0)
    if r.top_k is not None:
        check_number(label("top_k"), r.top_k, integer=True, low=1)
    if r.top_p is not None:
        check_number(label("top_p"), r.top_p, low=0.0, high=1.0, low_open=True)
    if r.temperature == 0:
        given = [label(k) for k in ("top_k", "top_p") if getattr(r, k) is not None]
        if given:
            one = len(given) == 1
            raise ValueError(
                f"{' and '.join(given)} truncate{'s' if one else ''} sampling, but "
                f"{label('temperature')}=0 decodes greedily: expected {label('temperature')} > 0 "
                f"with {'it' if one else 'them'}, or {'no' if one else 'neither'} "
                f"{given[0] if one else 'of them'}"
            )
    hbm_capacity({k: getattr(r, k) for k in HBM_KEYWORDS}, label)
    if isinstance(r.policy, str):
        check_live_policy(r.policy, label("policy"))
    else:
        _check_policy_object(r.policy, label("policy"))
    if r.attention not in ("exact", "sparse"):
        raise ValueError(f"{label('attention')}={r.attention!r}: expected exact or sparse")
    check_number(label("topk"), r.topk, low=0.0, high=1.0, low_open=True)
    check_number(label("seed"), r.seed, integer=True, low=0, high=2**32 - 1)
    # the FP8 settings (the model's geometry does not matter)
    CacheConfig(
        num_layers=1, kv_heads=1, head_dim=1, hbm_fraction=1.0, fp8=r.fp8, fp8_age=r.fp8_age
    )


def _check_policy_object(policy, label: str) -> None:
    """ValueError unless `policy` is a policy object a live decode can run."""
    from jaxkv.decode.setup import live_policy_object

    window = getattr(policy, "window", WINDOW)
    try:
        live_policy_object(PlacementConfig(policy=policy, window=window), {})
    except (TypeError, ValueError) as e:
        raise ValueError(f"{label}: {e}") from None


def load_policy(spec: str, label: str = "--policy"):
    """A preset name as it is, or the policy object that "module:attribute" (or
    "file.py:attribute") names, as `jaxkv simulate --policies` takes it."""
    if ":" not in spec:
        return spec
    from jaxkv.sim.checks import load_policy as load

    return load(spec, label)


def start(r: Request, *, progress=None) -> tuple[Stream, dict]:
    """Loads the model, encodes the request, prefills and returns (a `Stream` of the answer's
    text, what it is: dict(tokenizer, prompt_ids, stop, model_config)). `progress(what)` is
    told each stage. The request is checked first (`check_request`)."""
    import jax

    check_request(r)
    say = progress or (lambda what: None)
    say("loading the model")
    model, tokenizer = load_model(r.model)
    mc = model.config
    if r.messages is not None or r.chat:
        text = chat_prompt(r.model, tokenizer, r.prompt, system=r.system, messages=r.messages)
        ids = encode(tokenizer, text, mc.vocab_size, special=False)
    else:
        ids = encode(tokenizer, r.prompt, mc.vocab_size)
    room = mc.max_seq_len - len(ids)
    if room < 1:
        raise ValueError(
            f"the prompt is {len(ids):,} tokens and the model's context {mc.max_seq_len:,}: "
            "no room to generate; expected a shorter prompt"
        )
    new = min(r.max_new_tokens, room)
    cfg = CacheConfig.for_model(
        mc,
        batch=1,
        max_len=len(ids) + new,
        block_size=16,
        fp8=r.fp8,
        fp8_age=r.fp8_age,
        **hbm_capacity({k: getattr(r, k) for k in HBM_KEYWORDS}),
    )
    sampler = Greedy() if r.temperature == 0 else Sampling(r.temperature, r.top_k, r.top_p)
    stop = stop_ids(r.model)
    window = WINDOW if isinstance(r.policy, str) else getattr(r.policy, "window", WINDOW)
    placement = PlacementConfig(policy=r.policy, window=window, attention=r.attention, topk=r.topk)
    dec = Decoder(model, cfg, placement, max_new_tokens=new, sampler=sampler, eos_id=stop or None)
    _, params = nnx.split(model)
    say(f"compiling and running the prefill of {len(ids):,} tokens")
    state = dec.prefill(params, ids[None], key=jax.random.key(r.seed))
    stream = Stream(
        dec,
        params,
        state,
        lambda t: decode_text(tokenizer, t),
        stop=stop,
        context_full=new < r.max_new_tokens,
    )
    return stream, dict(tokenizer=tokenizer, prompt_ids=ids, stop=stop, model_config=mc)


def generate_text(prompt: str | None = None, *, model_spec: str = "default", **kw) -> tuple:
    """Generates a continuation of `prompt` (with chat=True, the answer to `prompt` as a user
    turn under the model's chat template; with messages=[...], the answer to a conversation);
    returns (text, summary): the decode's `summarize` plus finish_reason and token_ids. The
    text stops before the model's first stop token (`stop_ids`); max_new_tokens is cut to what
    the model's context holds (finish_reason "context_full" then). Keywords: `Request`'s
    fields; the cache's HBM at most one of hbm_fraction / hbm_blocks / hbm_bytes (none: 25%
    of the KV). Everything is checked before the model loads (ValueError naming the
    argument)."""
    if kw.get("messages") is not None:
        kw["messages"] = tuple(kw["messages"])
    stream, _ = start(Request(prompt=prompt, model=model_spec, **kw))
    for _ in stream:
        pass
    summary = summarize(stream.state)
    return stream.text, summary | dict(
        finish_reason=stream.finish_reason, token_ids=list(stream.ids)
    )

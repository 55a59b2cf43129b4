"""`jaxkv generate`: continue a prompt with the default model (or a local HF checkpoint) decoding
over a tiered KV cache."""

from __future__ import annotations

import argparse
import sys

import numpy as np
from flax import nnx

from jaxkv.config import CacheConfig, PlacementConfig
from jaxkv.decode import Decoder, Greedy, Sampling, summarize
from models.default import default_model
from models.hf import load_pretrained, load_tokenizer


def load_model(spec: str):
    """(model, tokenizer or None) for "default" or a local Hugging Face checkpoint folder."""
    if spec == "default":
        return default_model()
    tokenizer = None
    try:
        tokenizer = load_tokenizer(spec)
    except ValueError:
        pass  # a checkpoint without tokenizer.json: fall back to bytes
    return load_pretrained(spec), tokenizer


def encode(tokenizer, text: str, vocab_size: int) -> np.ndarray:
    if tokenizer is None:
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        if vocab_size < 256:
            raise ValueError(
                f"a model without a tokenizer needs vocab_size >= 256 (bytes), got {vocab_size}"
            )
        return ids
    return np.asarray(tokenizer.encode(text).ids, np.int32)


def decode_text(tokenizer, ids) -> str:
    if tokenizer is None:
        return bytes(int(i) for i in ids if i < 256).decode("utf-8", errors="replace")
    return tokenizer.decode([int(i) for i in ids])


def generate_text(
    prompt: str,
    *,
    model_spec: str = "default",
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    hbm_fraction: float = 0.25,
    policy: str = "lru",
    seed: int = 0,
) -> tuple[str, dict]:
    """Generates a continuation; returns (text, decode summary)."""
    import jax

    if not prompt:
        raise ValueError("prompt is empty: expected at least one character")
    model, tokenizer = load_model(model_spec)
    mc = model.config
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
        hbm_capacity=hbm_fraction,
    )
    sampler = Greedy() if temperature == 0 else Sampling(temperature, top_k, top_p)
    eos = None
    if tokenizer is not None:
        for name in ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"):
            eos = tokenizer.token_to_id(name)
            if eos is not None:
                break
    dec = Decoder(
        model,
        cfg,
        PlacementConfig(policy=policy, window=16),
        max_new_tokens=max_new_tokens,
        sampler=sampler,
        eos_id=eos,
    )
    _, params = nnx.split(model)
    state = dec.prefill(params, ids[None], key=jax.random.key(seed))
    state = dec.generate(params, state)
    n = int(state.num_tokens)
    return decode_text(tokenizer, np.asarray(state.tokens[0, :n])), summarize(state)


def _cmd(args) -> int:
    text, summary = generate_text(
        args.prompt,
        model_spec=args.model,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        hbm_fraction=args.hbm_fraction,
        policy=args.policy,
        seed=args.seed,
    )
    print(args.prompt + text)
    print(
        f"\n[{summary['steps'] + 1} tokens; HBM hit rate {100 * summary['hbm_hit_rate']:.1f}%, "
        f"{summary['migrated_blocks']} blocks migrated]",
        file=sys.stderr,
    )
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt over a tiered KV cache")
    p.add_argument("--prompt", required=True)
    p.add_argument("--model", default="default", help="'default' or a local HF checkpoint folder")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--hbm-fraction", type=float, default=0.25)
    p.add_argument("--policy", default="lru")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_cmd)

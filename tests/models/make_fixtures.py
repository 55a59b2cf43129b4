"""Build the tiny Hugging Face reference checkpoints under tests/models/fixtures/.

Run with an interpreter that has the `reference` extra (torch, transformers), e.g.:

    python -m venv /tmp/refenv && /tmp/refenv/bin/pip install torch==2.13.0 transformers safetensors
    /tmp/refenv/bin/python tests/models/make_fixtures.py [NAME ...]   # all, or just these

For every architecture it initialises a tiny random model with transformers (PyTorch, CPU, fp32),
rounds its weights to bf16 (the checkpoint is stored in bf16 to keep fixtures small; the
reference is computed in fp32 from exactly those rounded weights), and saves the checkpoint plus
reference.npz: a fixed prompt, the greedy continuation of the cache-free forward, and the fp32
logits of the whole sequence. Weights get a larger-than-default random init (and random norm
weights and biases) so that every tensor matters and greedy argmaxes are far from ties.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

OUT = Path(__file__).resolve().parent / "fixtures"
PROMPT_LEN, NEW_TOKENS = 10, 10
COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=128,
    hidden_act="silu",
)
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

# name -> (config class, model class, config kwargs, save kwargs)
CASES = {
    "llama2": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=10000.0, rms_norm_eps=1e-5, num_key_value_heads=4),
        dict(max_shard_size="40KB"),
    ),
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=500000.0), {}),
    "llama31": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(rope_theta=10000.0, rope_scaling=LLAMA3_SCALING),
        {},
    ),
    "llama32": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_theta=10000.0,
            rope_scaling=LLAMA3_SCALING,
            tie_word_embeddings=True,
            num_key_value_heads=1,
        ),
        {},
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(rope_theta=10000.0, sliding_window=14),
        {},
    ),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(rope_theta=1000000.0, tie_word_embeddings=True),
        {},
    ),
    # Qwen2 with a sliding window in layer 1 only (layer 0 < max_window_layers attends all),
    # a window of 5 tokens: most of the 20-token sequence falls outside it.
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(
            rope_theta=1000000.0,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        ),
        {},
    ),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                new = 1.0 + 0.2 * torch.randn(p.shape, generator=g)
            elif name.endswith("bias"):
                new = 0.5 * torch.randn(p.shape, generator=g)
            elif "embed_tokens" in name:
                new = torch.randn(p.shape, generator=g)
            else:  # [out, in]
                new = torch.randn(p.shape, generator=g) * (1.5 / math.sqrt(p.shape[1]))
            p.copy_(new.to(torch.bfloat16).to(torch.float32))


def _tokenizer(folder: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))


def build(name: str, seed: int) -> dict:
    """Build one fixture; seeds are tried upwards until the continuation is varied."""
    for s in range(seed, seed + 50):
        info = _build(name, s)
        if info["distinct_new_tokens"] >= 5 and info["min_top2_gap"] >= 0.01:
            return info
    raise RuntimeError(f"{name}: no seed in [{seed}, {seed + 50}) gives a varied continuation")


def _build(name: str, seed: int) -> dict:
    cfg_cls, model_cls, kwargs, save_kwargs = CASES[name]
    config = getattr(transformers, cfg_cls)(**{**COMMON, **kwargs})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)._from_config(config, attn_implementation="eager")
    model = model.to(torch.float32).eval()
    _randomise(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, config.vocab_size, PROMPT_LEN)
    seq = torch.tensor(prompt[None], dtype=torch.long)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(seq, use_cache=False).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        logits = model(seq[:, :-1], use_cache=False).logits[0].float().numpy()
    top2 = np.sort(logits, -1)[:, -2:]
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True, **save_kwargs)
    (folder / "generation_config.json").unlink(missing_ok=True)
    np.savez_compressed(
        folder / "reference.npz",
        prompt=prompt.astype(np.int32),
        continuation=seq[0, PROMPT_LEN:].numpy().astype(np.int32),
        logits=logits.astype(np.float32),
    )
    if name == "llama3":
        _tokenizer(folder, config.vocab_size)
    return {
        "seed": seed,
        "files": sorted(p.name for p in folder.iterdir()),
        "min_top2_gap": float((top2[:, 1] - top2[:, 0]).min()),
        "distinct_new_tokens": len(set(seq[0, PROMPT_LEN:].tolist())),
    }


def main(names: list[str]) -> None:
    """Builds the fixtures `names` (all of CASES when empty); VERSIONS.json keeps the others."""
    OUT.mkdir(exist_ok=True)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}: expected some of {sorted(CASES)}")
    versions = OUT / "VERSIONS.json"
    summary = json.loads(versions.read_text()) if names and versions.exists() else {}
    built_with = dict(torch=torch.__version__, transformers=transformers.__version__)
    if not names:
        summary.update(built_with)
    for i, name in enumerate(CASES):
        if names and name not in names:
            continue
        summary[name] = {**build(name, seed=1000 + i), **({} if not names else built_with)}
        print(name, summary[name], file=sys.stderr)
    versions.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

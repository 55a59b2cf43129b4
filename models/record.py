"""`jaxkv trace`: record an attention trace while really decoding.

Decodes a prompt with a model over a TieredKVCache and writes, for every decode step and layer,
the blocks the step attended to and their attention mass (averaged over query heads, summed over
each block's tokens) in the simulator's .npz format (`jaxkv.sim.trace`, version 2), with the
model's geometry (`model_geometry`: what `jaxkv simulate` costs the trace in by default) and the
token each step produced. With
`--sparsity 0` (exact attention) every block of the context is recorded; with `--sparsity S`
decoding reads only the top (1 - S) fraction of blocks by the Quest bound (plus sink and recent
blocks) and the trace holds those read sets.

    jaxkv trace --model default --prompt-file F --steps 500 --out trace.npz
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxkv import Decoder, cost
from jaxkv.cli import atomic_output
from jaxkv.config import CacheConfig, PlacementConfig, check_number
from jaxkv.sim import trace as kvtrace
from jaxkv.sim import trace_fields
from models.generate import check_model_spec, encode, load_model


def model_geometry(model, name: str) -> cost.Geometry:
    """The cost model's geometry of `model` (a models.Llama), its sizes counted from its state.

    param_bytes: every parameter's bytes. weight_bytes, read per layer per decode step: one
    layer's parameters (the stacked `layers` parameters over their leading layer axis) plus the
    final norm and the LM head's matrix (the embedding when tied) spread evenly over the layers,
    since a decode step reads every layer once and the head once for its logits (of the input
    embedding it reads one row, not counted). dtype_bytes: the KV cache's element, the model's
    dtype (`CacheConfig.for_model`; bf16: 2).
    """
    mc = model.config
    total = layers = head = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        top = getattr(path[0], "key", None)
        nbytes = int(leaf.size) * leaf.dtype.itemsize
        total += nbytes
        if top == "layers":
            if leaf.shape[:1] != (mc.num_layers,):
                keys = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ValueError(
                    f"model parameter {keys} has shape {leaf.shape}, expected the stacked "
                    f"layers' leading axis of {mc.num_layers}"
                )
            layers += nbytes
        elif top in ("final_norm", "lm_head") or (top == "embed" and mc.tie_embeddings):
            head += nbytes
    L = mc.num_layers
    dtype_bytes = np.dtype(mc.jnp_dtype).itemsize
    return cost.Geometry(
        name, L, mc.num_kv_heads, mc.head_dim, dtype_bytes, (layers + head) / L, total
    )


def record_trace(
    model,
    prompt_ids: np.ndarray,
    steps: int,
    *,
    sparsity: float = 0.0,
    block_size: int = 16,
    name: str = "recorded",
    model_name: str = "model",
    progress: bool = True,
) -> kvtrace.FileTrace:
    """Greedy-decodes `steps` tokens after `prompt_ids` and returns the attention trace.

    Args:
      model: a models.Llama.
      prompt_ids: [T] int token ids.
      steps: decode steps to record (>= 1).
      sparsity: 0 for exact attention, else the fraction of blocks NOT read, in [0, 1).
      block_size: tokens per block of the trace and the cache.
      name: the trace's label.
      model_name: its geometry's name (`model_geometry`).
    Returns:
      A validated FileTrace with ids/mass [steps, layers, K], K = blocks at the last step, the
      model's geometry and the tokens [steps] the decode steps produced.
    """
    from tqdm.auto import tqdm

    mc = model.config
    prompt_ids = np.asarray(prompt_ids, np.int32)
    if prompt_ids.ndim != 1:
        raise ValueError(f"prompt_ids has shape {prompt_ids.shape}, expected [T] token ids")
    if len(prompt_ids) < 1:
        raise ValueError("the prompt is empty (0 tokens): expected at least one token")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsity must lie in [0, 1), got {sparsity!r}")
    max_len = len(prompt_ids) + steps + 1
    if max_len > mc.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + steps ({steps}) exceeds the model's "
            f"max_seq_len={mc.max_seq_len}"
        )
    cfg = CacheConfig.for_model(
        mc,
        batch=1,
        max_len=max_len,
        block_size=block_size,
        hbm_fraction=1.0,
    )
    if sparsity == 0.0:
        placement = PlacementConfig(policy="static", attention="exact", window=1 << 20)
    else:
        placement = PlacementConfig(
            policy="static", attention="sparse", topk=float(1.0 - sparsity), window=1 << 20
        )
    # the XLA path: a trace records each block's attention mass, which the Pallas kernel
    # does not return (`Decoder.collects_mass`)
    dec = Decoder(model, cfg, placement, max_new_tokens=steps + 1, impl="xla")
    _, params = nnx.split(model)
    state = dec.prefill(params, prompt_ids[None])
    K = cfg.max_blocks
    ids = np.full((steps, mc.num_layers, K), -1, np.int32)
    mass = np.zeros((steps, mc.num_layers, K), np.float32)
    bar = tqdm(range(steps), desc="recording", disable=not progress, file=sys.stderr, leave=False)
    bar.set_postfix_str("compiling the step")  # the first step compiles: no 0% that hangs
    for t in bar:
        state = dec.step(params, state)
        if t == 0:
            bar.set_postfix_str("")
        m = np.asarray(state.step_mass[:, 0]) / mc.num_heads  # [layers, max_blocks]
        n_ctx = kvtrace.context_blocks(len(prompt_ids), t, block_size)
        read = m[:, :n_ctx] > 0
        for layer in range(mc.num_layers):
            sel = np.flatnonzero(read[layer])
            ids[t, layer, : len(sel)] = sel
            mass[t, layer, : len(sel)] = m[layer, sel]
    # column 0 of the token buffer is the prefill's token; decode step t produced column t + 1
    tokens = np.asarray(state.tokens[0, 1 : steps + 1], np.int32)  # [steps]
    return kvtrace.validate(
        {
            "version": 2,
            "prompt_len": len(prompt_ids),
            "block_size": block_size,
            "ids": ids,
            "mass": mass,
            "name": name,
            "tokens": tokens,
            **trace_fields.geometry_fields(model_geometry(model, model_name)),
        }
    )


def save_atomic(path: str | os.PathLike, trace: kvtrace.FileTrace, *, compact=False) -> None:
    """Writes the trace through a temporary file, so a failure leaves nothing half-written
    (`compact`: `jaxkv.sim.trace.save`'s int16 ids and float16 mass)."""
    with atomic_output(path, ".npz") as tmp:  # removed on a failure or Ctrl-C
        kvtrace.save(tmp, trace, compact=compact)


def check_writable(path: str | os.PathLike, label: str = "out") -> None:
    """Raises ValueError unless a file can be written at `path` (its folder existing or
    creatable, writable, and `path` itself not a folder), without creating anything."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{label}={str(path)!r}: is a directory, expected a file path")
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(
            f"{label}={str(path)!r}: {str(folder)!r} is a file, so no folder can be made there"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{label}={str(path)!r}: the folder {str(folder)!r} is not writable")
    # os.access misses read-only mounts and what root may not do (/sys): try for real, with a
    # file where the output goes, or the first folder that would have to be made
    try:
        if folder == path.absolute().parent:
            with tempfile.TemporaryFile(dir=folder):
                pass
        else:
            with tempfile.TemporaryDirectory(dir=folder):
                pass
    except OSError as e:
        what = "write" if folder == path.absolute().parent else "make a folder"
        raise ValueError(
            f"{label}={str(path)!r}: cannot {what} in {str(folder)!r} ({e.strerror or e})"
        ) from None


def _check_args(args) -> Path:
    """Checks every option of `jaxkv trace` before the model loads; returns the prompt file."""
    text_path = Path(args.prompt_file)
    if not text_path.is_file():
        what = "is a directory" if text_path.is_dir() else "file not found"
        raise ValueError(f"--prompt-file {str(text_path)!r}: {what}")
    try:
        text = text_path.read_text(errors="replace")  # bytes that are not UTF-8 become U+FFFD
    except OSError as e:
        raise ValueError(
            f"--prompt-file {str(text_path)!r}: unreadable ({e.strerror or e})"
        ) from None
    if not text.strip():
        raise ValueError(
            f"--prompt-file {str(text_path)!r}: the file is empty: expected the prompt's text"
        )
    check_model_spec(args.model, "--model")
    check_number("--prompt-tokens", args.prompt_tokens, integer=True, low=0)
    check_number("--steps", args.steps, integer=True, low=1)
    check_number("--sparsity", args.sparsity, low=0.0, high=1.0, high_open=True)
    check_number("--block-size", args.block_size, integer=True, low=1)
    check_writable(args.out, "--out")
    return text_path


def _cmd(args) -> int:
    text_path = _check_args(args)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    ids = encode(tokenizer, text_path.read_text(errors="replace"), model.config.vocab_size)
    if args.prompt_tokens:
        ids = ids[: args.prompt_tokens]
    trace = record_trace(
        model,
        ids,
        args.steps,
        sparsity=args.sparsity,
        block_size=args.block_size,
        name=args.name or text_path.name,
        model_name="default" if args.model == "default" else Path(args.model).resolve().name,
    )
    save_atomic(args.out, trace, compact=args.compact)
    print(
        f"wrote {args.out}: prompt {trace.prompt_len} tokens, {trace.steps} steps, "
        f"{trace.num_layers} layers, block {trace.block_size}"
    )
    print(geometry_line(trace.geometry))
    return 0


def geometry_line(g: cost.Geometry) -> str:
    """What `jaxkv trace` says of the geometry it stored."""
    return (
        f"geometry {g.name} (what jaxkv simulate costs the trace in): {g.num_layers} layers, "
        f"{g.kv_heads} KV heads x {g.head_dim}, {g.dtype_bytes} bytes an element "
        f"({g.token_bytes:,} B a token-layer), {g.weight_bytes / 1e6:,.2f} MB of weights read "
        f"per layer per step, {g.param_bytes / 1e6:,.1f} MB of parameters"
    )


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="record an attention trace while decoding")
    p.add_argument(
        "--model",
        default="default",
        help="'default', 'smollm2', a local HF checkpoint folder or a .gguf file",
    )
    p.add_argument(
        "--prompt-file",
        required=True,
        help="the text to decode after (UTF-8; bytes that are not are read as U+FFFD)",
    )
    p.add_argument(
        "--prompt-tokens", type=int, default=0, help="truncate the prompt to its first N (0 = all)"
    )
    p.add_argument("--steps", type=int, default=500, help="decode steps to record")
    p.add_argument(
        "--sparsity",
        type=float,
        default=0.0,
        help="share of blocks each step does not read (0: exact attention, every block read)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="the model's parameters and KV cache (the stored geometry's bytes per element)",
    )
    p.add_argument("--name", default=None, help="the trace's label (default: the prompt file's)")
    p.add_argument(
        "--compact",
        action="store_true",
        help="store ids as int16 and mass as float16 (about half the file; the mass rounded)",
    )
    p.add_argument("--out", required=True, help="the trace file to write (.npz)")
    p.set_defaults(func=_cmd)

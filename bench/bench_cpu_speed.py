"""Measured speed of SmolLM2-135M on this machine: jaxkv's all-HBM decoder against the same model
with a plain dense KV cache (`models.dense`) and, when a Python with transformers and torch is
given or importable, against transformers on the same prompt ids. Prefill seconds and decode
milliseconds per step, medians of `--runs`, the ratios from this one run.

    python bench/bench_cpu_speed.py                       # batch 1 and 8, 2,048-token prompt
    python bench/bench_cpu_speed.py --transformers-python /path/to/venv/bin/python
    python bench/bench_cpu_speed.py --batches 1 --prompt-tokens 256 --steps 8 --runs 1  # quick

What is timed, per system and batch (every row holds the same prompt: the start of the standard
library's argparse.py, `--prompt-tokens` ids of the model's tokenizer):
  prefill  the prompt's forward pass, its KV stored and the first token chosen (jaxkv:
           `Decoder.prefill`, which also recomputes the prompt's last queries; dense:
           `Llama.prefill` into a `DenseKV`; transformers: one forward with `logits_to_keep=1`)
  decode   `--steps` greedy steps after it, one token per sequence each (jaxkv: `generate`;
           dense: a jitted loop of `Llama.decode_step` over the dense cache; transformers: a
           loop of forwards over its `DynamicCache`), wall time / steps.
Each system runs once untimed first (jax: compiles); the timed runs alternate between the
systems, so that the machine's load falls on each alike. jaxkv runs exact attention with every
block in HBM (hbm_fraction=1.0, policy static): the cache's own overhead against a dense one.
The greedy tokens of the three are compared (printed: how many agree).

transformers runs in its own process (`--worker`), with torch threads = the machine's cores
(`--threads`), sdpa attention, float32, the GGUF file dequantized by transformers' loader.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

STEPS, PROMPT_TOKENS, RUNS = 64, 2048, 3


def _median(xs):
    return float(statistics.median(xs))


# ---- transformers (runs in a process of its own: it needs only torch and transformers) -------


def transformers_worker(args) -> dict:
    """Times transformers on the ids in args.ids (a .npy-free JSON list) and prints JSON."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    path = args.gguf
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path),
        gguf_file=os.path.basename(path),
        dtype=torch.float32,
        attn_implementation="sdpa",
    )
    model.eval()
    ids = json.loads(open(args.ids).read())
    out = {"torch": torch.__version__, "transformers": transformers.__version__, "cases": []}
    for b in args.batches:
        x = torch.tensor([ids] * b)
        prefill, decode, tokens = [], [], None
        for run in range(args.runs + 1):
            with torch.inference_mode():
                t0 = time.perf_counter()
                o = model(x, use_cache=True, logits_to_keep=1)
                tok = o.logits[:, -1].argmax(-1)
                t1 = time.perf_counter()
                past, toks = o.past_key_values, [tok]
                for _ in range(args.steps):
                    o = model(tok[:, None], past_key_values=past, use_cache=True)
                    past, tok = o.past_key_values, o.logits[:, -1].argmax(-1)
                    toks.append(tok)
                t2 = time.perf_counter()
            if run:  # the first run warms up
                prefill.append(t1 - t0)
                decode.append((t2 - t1) / args.steps)
            tokens = torch.stack(toks, 1)[0].tolist()
        out["cases"].append(dict(batch=b, prefill=prefill, decode=decode, tokens=tokens))
    return out


def transformers_python(python: str) -> str | None:
    """`python` when it imports torch and transformers, else None (printing that they are
    skipped)."""
    probe = subprocess.run(
        [python, "-c", "import torch, transformers"], capture_output=True, text=True
    )
    if probe.returncode:
        print(f"transformers: skipped ({python} cannot import torch and transformers)")
        return None
    return python


def versions(python: str) -> dict:
    """{"torch": ..., "transformers": ...} of that Python."""
    code = "import json, torch, transformers; print(json.dumps(dict(torch=torch.__version__, "
    code += "transformers=transformers.__version__)))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def run_transformers(python, gguf, ids, batches, steps, runs, threads) -> dict:
    """The worker's JSON: transformers timed in a process of its own (`transformers_worker`)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([int(i) for i in ids], f)
    cmd = [python, os.path.abspath(__file__), "--worker", "--gguf", str(gguf), "--ids", f.name]
    cmd += ["--batches", ",".join(map(str, batches)), "--steps", str(steps)]
    cmd += ["--runs", str(runs), "--threads", str(threads)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if res.returncode:
        raise RuntimeError(f"the transformers worker failed:\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# ---- jaxkv and the dense cache -------------------------------------------------------------------


def jaxkv_runner(model, params, prompts, steps):
    """A function that runs jaxkv once (all-HBM, exact) and returns (prefill seconds, decode
    seconds per step, greedy tokens of row 0); compiled by its first call."""
    import jax
    import numpy as np

    from jaxkv import CacheConfig, Decoder, PlacementConfig

    B, T = prompts.shape
    cfg = CacheConfig.for_model(
        model.config, batch=B, max_len=T + steps + 1, block_size=16, hbm_fraction=1.0
    )
    dec = Decoder(model, cfg, PlacementConfig(policy="static"), max_new_tokens=steps + 1)
    state = jax.block_until_ready(dec.prefill(params, prompts))  # compiles
    jax.block_until_ready(dec.generate(params, state, until=1))  # `until` is traced

    def run():
        t0 = time.perf_counter()
        state = jax.block_until_ready(dec.prefill(params, prompts))
        t1 = time.perf_counter()
        state = jax.block_until_ready(dec.generate(params, state, until=steps))
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / steps, np.asarray(state.tokens[0, : steps + 1]).tolist()

    return run


def dense_runner(model, params, prompts, steps):
    """`jaxkv_runner` for the same model over a plain dense KV cache (`models.dense`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from models import dense_kv_from_prefill, make_dense_attend

    B, T = prompts.shape
    graphdef = nnx.graphdef(model)
    attend = make_dense_attend(model.config)
    max_len = T + steps + 1

    @jax.jit
    def prefill_fn(params, prompts):
        m = nnx.merge(graphdef, params)
        logits, k, v = m.prefill_at(prompts, jnp.full((B,), T - 1, jnp.int32))
        return dense_kv_from_prefill(k, v, max_len), jnp.argmax(logits, -1).astype(jnp.int32)

    @jax.jit
    def decode_fn(params, kv, tok, n):
        m = nnx.merge(graphdef, params)
        out = jnp.zeros((B, steps + 1), jnp.int32).at[:, 0].set(tok)

        def body(i, carry):
            kv, tok, out = carry
            logits, kv = m.decode_step(tok, kv.lengths, attend, kv)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            return kv, tok, out.at[:, i + 1].set(tok)

        return jax.lax.fori_loop(0, n, body, (kv, tok, out))

    kv, tok = jax.block_until_ready(prefill_fn(params, prompts))  # compiles
    jax.block_until_ready(decode_fn(params, kv, tok, 1))

    def run():
        t0 = time.perf_counter()
        kv, tok = jax.block_until_ready(prefill_fn(params, prompts))
        t1 = time.perf_counter()
        _, _, out = jax.block_until_ready(decode_fn(params, kv, tok, steps))
        t2 = time.perf_counter()
        return t1 - t0, (t2 - t1) / steps, np.asarray(out[0]).tolist()

    return run


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def agree(a, b) -> str:
    n = min(len(a), len(b))
    same = next((i for i in range(n) if a[i] != b[i]), n)
    return f"{same}/{n}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    ap.add_argument("--steps", type=int, default=STEPS, help="decode steps timed")
    ap.add_argument("--runs", type=int, default=RUNS, help="timed runs (medians), after a warm-up")
    ap.add_argument(
        "--transformers-python",
        default=sys.executable,
        help="a Python that imports torch and transformers (default: this one; skipped if not)",
    )
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.batches = [int(x) for x in str(args.batches).split(",")]
    if args.worker:
        print(json.dumps(transformers_worker(args)))
        return 0
    for name in ("prompt_tokens", "steps", "runs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")

    import jax
    import numpy as np
    from flax import nnx

    from models.demo import encode_prompt
    from models.generate import load_model, model_source

    model, tokenizer = load_model("smollm2")
    ids = encode_prompt(model, tokenizer, args.prompt_tokens)
    params = nnx.split(model)[1]
    dev = jax.devices()[0]
    print(
        f"SmolLM2-135M float32, prompt {len(ids)} tokens (argparse.py), {args.steps} greedy "
        f"steps, medians of {args.runs} runs; jax {jax.__version__} on {dev.device_kind} "
        f"({os.cpu_count()} cores, {platform.machine()})"
    )
    hf_python, hf = None, None
    if not args.no_transformers:
        hf_python = transformers_python(args.transformers_python)
        if hf_python:
            hf = versions(hf_python)
            line = f"transformers {hf['transformers']}, torch {hf['torch']}"
            print(f"{line} ({args.threads} threads)")
    rows = []
    for b in args.batches:
        prompts = np.tile(ids[None], (b, 1)).astype(np.int32)
        runners = dict(
            jaxkv=jaxkv_runner(model, params, prompts, args.steps),
            dense=dense_runner(model, params, prompts, args.steps),
        )
        times = {k: ([], [], None) for k in runners}
        hf_case = dict(prefill=[], decode=[], tokens=None)
        for r in range(args.runs):  # interleaved: the machine's load hits every system alike
            for key, run in runners.items():
                p, d, toks = run()
                times[key][0].append(p)
                times[key][1].append(d)
                times[key] = (times[key][0], times[key][1], toks)
                progress(f"batch {b} run {r + 1}: {key} prefill {p:.2f} s, {1e3 * d:.1f} ms/step")
            if hf_python:
                case = run_transformers(
                    hf_python, model_source("smollm2"), ids, [b], args.steps, 1, args.threads
                )["cases"][0]
                hf_case["prefill"] += case["prefill"]
                hf_case["decode"] += case["decode"]
                hf_case["tokens"] = case["tokens"]
                progress(
                    f"batch {b} run {r + 1}: transformers prefill {case['prefill'][0]:.2f} s, "
                    f"{1e3 * case['decode'][0]:.1f} ms/step"
                )
        (jp, jd, jt), (dp, dd, dt) = times["jaxkv"], times["dense"]
        row = dict(
            batch=b,
            jaxkv_prefill_s=_median(jp),
            jaxkv_step_ms=1e3 * _median(jd),
            dense_prefill_s=_median(dp),
            dense_step_ms=1e3 * _median(dd),
            tokens_jaxkv_vs_dense=agree(jt, dt),
        )
        if hf_python:
            row.update(
                hf_prefill_s=_median(hf_case["prefill"]),
                hf_step_ms=1e3 * _median(hf_case["decode"]),
                tokens_jaxkv_vs_hf=agree(jt, hf_case["tokens"]),
            )
        rows.append(row)
    head = "| batch | | prefill s | decode ms/step | tok/s | prefill vs jaxkv | step vs jaxkv |"
    print("\n" + head + "\n|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["batch"]
        systems = [("jaxkv all-HBM", "jaxkv"), ("dense cache", "dense")]
        systems += [("transformers", "hf")] if "hf_step_ms" in r else []
        for label, key in systems:
            p, s = r[f"{key}_prefill_s"], r[f"{key}_step_ms"]
            rel = (
                ""
                if key == "jaxkv"
                else f"{r['jaxkv_prefill_s'] / p:.2f}x | {r['jaxkv_step_ms'] / s:.2f}x"
            )
            rel = rel or " | "
            print(f"| {b} | {label} | {p:.2f} | {s:.1f} | {1e3 * b / s:.1f} | {rel} |")
    print("\n(ratios: jaxkv's time over the system's; below 1.00x jaxkv is faster)")
    for r in rows:
        line = f"batch {r['batch']}: greedy tokens agree, jaxkv vs dense "
        line += r["tokens_jaxkv_vs_dense"]
        if "tokens_jaxkv_vs_hf" in r:
            line += f", jaxkv vs transformers {r['tokens_jaxkv_vs_hf']}"
        print(line)
    if args.json:
        meta = dict(jax=jax.__version__, device=dev.device_kind, cores=os.cpu_count())
        if hf:
            meta.update(transformers=hf["transformers"], torch=hf["torch"])
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, args=vars(args), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

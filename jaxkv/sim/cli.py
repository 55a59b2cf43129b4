"""`jaxkv simulate`: the trace-driven placement simulator from the command line."""

from __future__ import annotations

import json

from jaxkv import cost
from jaxkv.cache.quant import FP8_MODES
from jaxkv.config import AnnealConfig, HardwareProfile, check_number
from jaxkv.placement.policies import FOLLOW_ADMITS
from jaxkv.placement.presets import NOW_SPREAD, NOW_WINDOW, split_policies
from jaxkv.sim import sizing
from jaxkv.sim import trace as tr
from jaxkv.sim.checks import ARG_BOUNDS, check_args, check_policies, load_policy
from jaxkv.sim.simulate import DUAL_WINDOW, FOLLOW_WINDOW, simulate
from jaxkv.sim.sizing import DEFAULT_GEOMETRY  # a trace without its own: the paper's regime

# the sizes of a synthetic trace (`jaxkv.sim.trace.SyntheticTrace`) by default
TRACE_SIZE = {"prompt_len": 31_299, "steps": 2_048, "layers": 32, "block_size": 16}
DEFAULT_HBM_GB = cost.PAPER_HBM_BUDGET / 1e9  # --hbm-gb when no option sizes the pool
# `jaxkv simulate`'s own step count: a few minutes on 2 CPU cores with the default policies
# (the paper decoded 10,239 steps; --steps 2048 is the benchmarks' length)
SIMULATE_STEPS = 256


def regime_line(result: dict) -> str:
    """What share of the KV the HBM pool holds, and what that means for placement; when every
    block fits, the options that would make the pool hold part of it (`pool_hints`)."""
    s = result["setup"]
    share = s["capacity_blocks"] / max(s["blocks"], 1)
    what = "placement decides which reads cross the link"
    if share >= 1:
        what = "every block fits: placement cannot matter (try " + ", ".join(pool_hints(s)) + ")"
    elif s["capacity_blocks"] == 0:
        what = "every read crosses the link, so placement cannot matter (try --hbm-fraction 0.5)"
    batch = s.get("batch", 1)
    per = f", per sequence of a batch of {batch}" if batch > 1 else ""
    return (
        f"HBM holds {100 * min(share, 1):.0f}% of the KV blocks per layer "
        f"({s['capacity_blocks']:,} of {s['blocks']:,}{per}, {geometry_words(s)}): {what}"
    )


def geometry_words(setup: dict) -> str:
    """The geometry's name and where it came from, e.g. `geometry smollm2 (from the trace)`."""
    source = sizing.GEOMETRY_SOURCES.get(setup.get("geometry_source"))
    return f"geometry {setup['geometry']}" + (f" ({source})" if source else "")


def pool_hints(setup: dict) -> list[str]:
    """Options under which the pool of this run's setup would hold part of the KV, each checked
    against `jaxkv.sim.sizing`'s sizing: --hbm-fraction 0.5; as the pool was sized, a smaller
    --capacity-blocks, or the --hbm-gb that leaves about half, the smallest --batch that no
    longer fits and --geometry paper where its pool would not hold every block."""
    blocks, hints = setup["blocks"], ["--hbm-fraction 0.5"]
    if setup.get("pool_from") == "capacity_blocks":
        hints.append(f"--capacity-blocks below {blocks:,}")
    keys = ("hbm_budget", "param_bytes", "token_bytes", "layers", "block_size")
    if setup.get("pool_from") != "hbm_budget" or any(setup.get(k) is None for k in keys):
        return hints
    budget, params, tb, layers, bs = (setup[k] for k in keys)
    batch = setup.get("batch", 1)
    if blocks >= 2:  # half the blocks and each sequence's tail block
        gb = (params + layers * batch * tb * bs * (blocks // 2 + 1)) / 1e9
        hints.append(f"--hbm-gb {gb:.4g} (about half)")
    more = int((budget - params) // (layers * tb * bs * (blocks + 1))) + 1
    cap = int((budget - params) // (layers * tb * more)) // bs - 1
    if cap >= 1:
        hints.append(f"--batch {more} (a pool of {cap:,} blocks a sequence)")
    if setup["geometry"] != "paper":
        paper = cost.batched(cost.GEOMETRIES["paper"], batch)
        try:
            cap = cost.pool_capacity(paper, budget, layers, bs)[1]
        except ValueError:  # no room at all for the paper's KV
            cap = -1
        if 1 <= cap < blocks:
            hints.append(f"--geometry paper (a pool of {cap:,} blocks)")
    return hints


def format_table(result: dict) -> str:
    """The human-readable table of `simulate`'s result."""
    s = result["setup"]
    w = max(16, 2 + max(map(len, result["policies"]), default=0))  # the policy column
    lines = [
        regime_line(result),
        f"trace {s['trace']}  steps {s['steps']}  prompt {s['prompt_len']}  block {s['block_size']}"
        f"  layers {s['layers']}  HBM pool {s['capacity_blocks']}/{s['blocks']} blocks  "
        f"s={s['sparsity']:g}  profile {s['profile']}  {geometry_words(s)}"
        + (f"  batch {s['batch']}" if s.get("batch", 1) > 1 else ""),
        f"{'policy':<{w}}{'latency s':>11}{'tok/s':>9}{'vs static':>10}{'vs unlim':>9}"
        f"{'HBM hit':>9}{'migrated GB':>12}{'plan s':>9}{'+plan':>8}",
    ]
    for name, v in result["policies"].items():
        sp = v["speedup_vs_static"]
        lines.append(
            f"{name:<{w}}{v['latency_s']:>11.4f}{v['tokens_per_s']:>9.1f}"
            f"{(f'{sp:.2f}x' if sp else '-'):>10}{v['vs_unlimited']:>9.3f}"
            f"{100 * v['hbm_hit_rate']:>8.1f}%{v['migrated_bytes'] / 1e9:>12.2f}"
            f"{v['plan_seconds']:>9.2f}{v['vs_unlimited_with_plan']:>8.3f}"
            + (f"  ({v['tuned']})" if "tuned" in v else "")
        )
    b = result["bounds"]
    unl = b["unlimited_s"]
    lines.append(
        f"bound@capacity (free per-step placement): {b['capacity_s']:.4f} s "
        f"({b['capacity_s'] / unl:.3f} x unlimited)"
    )
    if b.get("cache_s") is None:
        lines.append(f"bound@cache (fewest link crossings): not computed, {b.get('cache_note')}")
    else:
        lines.append(
            f"bound@cache (fewest link crossings, Belady): {b['cache_s']:.4f} s "
            f"({b['cache_s'] / unl:.3f} x unlimited); with the capacity bound "
            f"{b['best_s']:.4f} s ({b['best_s'] / unl:.3f} x)"
        )
    lines.append(
        f"+plan: latency with the plan time measured on {s['device']} charged serially, / unlimited"
    )
    return "\n".join(lines)


def add_simulation_args(p, *, geometry: str | None = "llama3-8b", chunk: int = 100) -> None:
    """The trace-size, cost-model and policy flags of `jaxkv simulate`, shared with
    bench/bench_simulate.py; `simulation_kwargs` turns them into `simulate` arguments.
    `geometry`: --geometry's default (None: the trace's own, else the paper's)."""
    p.add_argument("--prompt-len", type=int, default=TRACE_SIZE["prompt_len"])
    p.add_argument("--steps", type=int, default=TRACE_SIZE["steps"])
    p.add_argument("--layers", type=int, default=TRACE_SIZE["layers"])
    p.add_argument("--profile", default="gh200-paper")
    p.add_argument(
        "--geometry",
        default=geometry,
        help=f"the model a trace is costed as: {'|'.join(sorted(cost.GEOMETRIES))}, or trace "
        "(the recording model's, stored in a recorded trace); default: "
        + (geometry or f"the trace's own when it carries one, else {DEFAULT_GEOMETRY}"),
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoding together, each reading the trace's blocks (a modeled batch of "
        "identical sequences): KV bytes per step x B, weights once, the HBM budget holds B pools",
    )
    p.add_argument(
        "--hbm-gb",
        type=float,
        default=None,
        help=f"HBM in all (weights + the batch's KV), GB; default {DEFAULT_HBM_GB:g}",
    )
    p.add_argument(
        "--capacity-blocks",
        type=int,
        default=None,
        help="HBM pool blocks per layer of each sequence (overrides --hbm-gb)",
    )
    p.add_argument(
        "--hbm-fraction",
        type=float,
        default=None,
        help="HBM pool per layer of each sequence as this fraction of the trace's blocks, in "
        "(0, 1]; not with --capacity-blocks or --hbm-gb",
    )
    p.add_argument("--window", type=int, default=10, help="anneal lookahead W")
    p.add_argument("--interval", type=int, default=1, help="anneal: steps between plans (>= 1)")
    p.add_argument("--discount", type=float, default=0.8, help="anneal: per-step discount")
    p.add_argument(
        "--now-window",
        type=int,
        default=NOW_WINDOW,
        help="anneal+now: lookahead W (it knows the step it plans for, so plans over few steps)",
    )
    p.add_argument(
        "--now-spread",
        type=float,
        default=NOW_SPREAD,
        help="anneal+now: later steps priced at their expected time with this multiple of the "
        "forecast's deviation (jaxkv.placement.pricing.Spread); 0 = the max of expected loads",
    )
    p.add_argument("--oracle-window", type=int, default=3, help="anneal-oracle lookahead W")
    p.add_argument(
        "--oracle-discount",
        type=float,
        default=0.4,
        help="anneal-oracle: weight discount^t of window step t in its energy",
    )
    p.add_argument(
        "--oracle-tail",
        type=int,
        default=30,
        help="anneal-oracle: steps after its window whose reads value a resident block (a full "
        "pool evicts the blocks needed latest); 0 = off",
    )
    p.add_argument(
        "--dual-window",
        type=int,
        default=DUAL_WINDOW,
        help="anneal-oracle+dual lookahead W (its blocks' value after the window comes from the "
        "LP dual: jaxkv.sim.lp.dual.dual_values)",
    )
    p.add_argument(
        "--follow-window",
        type=int,
        default=FOLLOW_WINDOW,
        help="anneal+follow: steps between its plans, and their lookahead W (between plans a "
        "per-step rule follows the target: jaxkv.placement.policies.follow_moves)",
    )
    p.add_argument(
        "--follow-admit",
        choices=FOLLOW_ADMITS,
        default=None,
        help="anneal+follow: which host blocks a step reads its rule may promote "
        "(jaxkv.placement.policies.follow_moves): every one (read), one that outranks its victim "
        "(ranked), the target's only (target), or one read more often than its victim, the "
        "plan unused (value, lrfu's rule); default: the preset's (jaxkv.placement.policies.Follow)",
    )
    p.add_argument(
        "--ride",
        type=float,
        default=None,
        help="anneal policies: share of later re-plans priced in (promotion at a block's first "
        "read; jaxkv.placement.pricing.Ride), 0 = a plan's placement held over its window; "
        "default: each policy's own (0 for anneal, 1 for +now / +follow)",
    )
    p.add_argument("--chains", type=int, default=AnnealConfig().chains, help="anneal chains")
    p.add_argument("--chunk", type=int, default=chunk)
    p.add_argument("--demote-cost", type=float, default=0.0)
    p.add_argument(
        "--keep-fetched",
        action="store_true",
        help="promoting a block read from host at the last step needs no second link read",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fp8",
        choices=FP8_MODES,
        default="off",
        help="host: host-tier blocks are FP8 with per-block scales (jaxkv.cache.quant), so "
        "they cross "
        "the link at about half the bytes; age: every placed block is FP8 in both tiers (the "
        "decode loop's full-precision ring of recent blocks is not simulated)",
    )


def _option(name: str) -> str:
    """The command-line option of a `simulate` argument."""
    return "--hbm-gb" if name == "hbm_budget" else "--" + name.replace("_", "-")


def check_simulation_args(args) -> None:
    """Checks the flags of `add_simulation_args` (and --sparsity where the parser has it) before
    any work; ValueError names the option, its value and what was expected."""
    values = {name: getattr(args, name, None) for name in ARG_BOUNDS}
    values["hbm_budget"] = args.hbm_gb
    check_args(values, label=_option)
    for option, value, low in (("--prompt-len", args.prompt_len, 0), ("--layers", args.layers, 1)):
        if value is not None:
            check_number(option, value, integer=True, low=low)
    check_number("--chains", args.chains, integer=True, low=1)
    if args.hbm_fraction is not None:
        for option, value in (
            ("--capacity-blocks", args.capacity_blocks),
            ("--hbm-gb", args.hbm_gb),
        ):
            if value is not None:
                raise ValueError(
                    f"--hbm-fraction={args.hbm_fraction!r} and {option}={value!r} both size the "
                    "HBM pool: expected one of --hbm-fraction, --capacity-blocks, --hbm-gb"
                )
    try:
        HardwareProfile.preset(args.profile)
    except ValueError as e:
        raise ValueError(f"--profile={args.profile!r}: {e}") from None
    if args.geometry not in (None, "trace"):
        sizing.resolve_geometry(None, args.geometry, "--geometry")


def simulation_kwargs(args) -> dict:
    """`simulate` keyword arguments from the flags of `add_simulation_args`, checked first
    (`check_simulation_args`)."""
    check_simulation_args(args)
    geometry = args.geometry
    return dict(
        profile=HardwareProfile.preset(args.profile),
        geometry=geometry if geometry in (None, "trace") else cost.get_geometry(geometry),
        batch=args.batch,
        hbm_budget=(DEFAULT_HBM_GB if args.hbm_gb is None else args.hbm_gb) * 1e9,
        capacity_blocks=args.capacity_blocks,
        hbm_fraction=args.hbm_fraction,
        chunk=args.chunk,
        demote_cost=args.demote_cost,
        fp8=args.fp8,
        keep_fetched=args.keep_fetched,
        window=args.window,
        interval=args.interval,
        discount=args.discount,
        now_window=args.now_window,
        now_spread=args.now_spread,
        oracle_window=args.oracle_window,
        oracle_discount=args.oracle_discount,
        oracle_tail=args.oracle_tail,
        dual_window=args.dual_window,
        follow_window=args.follow_window,
        follow_admit=args.follow_admit,
        ride=args.ride,
        anneal_config=AnnealConfig(chains=args.chains),
        seed=args.seed,
    )


def add_cli(sub) -> None:
    """Adds `jaxkv simulate`."""
    p = sub.add_parser(
        "simulate",
        help="trace-driven placement simulation",
        description="Trace-driven KV placement simulation under the paper's cost model.",
    )
    p.add_argument(
        "--trace",
        default="synthetic:recency-low",
        help="a .npz path or synthetic:recency-low|recency-high|patterns|real-like",
    )
    p.add_argument("--sparsity", type=float, default=0.6)
    p.add_argument(
        "--policies",
        default="static,lru-plan,page,paper-sa,anneal,anneal-oracle,unlimited",
        help="comma-separated preset names (jaxkv.placement.presets), or module:attribute (or "
        "file.py:attribute) naming a policy object, e.g. a composed policies.Anneal, imported "
        "from the working directory and reported under its name",
    )
    p.add_argument("--block-size", type=int, default=None)
    # a recorded trace that stores its model's geometry is costed in it; any other in the
    # paper's regime: its MHA geometry (16 KiB per token-layer) under the 24 GB budget leaves
    # HBM about half the KV, so placement decides the step time; Llama-3.1-8B's GQA KV (4 KiB)
    # fits whole in the same budget: --geometry llama3-8b
    add_simulation_args(p, geometry=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    # the trace sizes apply to synthetic traces only: None tells a default from a given option
    p.set_defaults(func=_main, prompt_len=None, steps=None, layers=None)


def check_cli_args(args) -> list[str]:
    """Checks every option of `jaxkv simulate` before a trace is read, fills in a synthetic
    trace's default sizes, and returns the policies: names, and the policy objects that items
    written module:attribute name (`load_policy`). ValueError names the option, its value and
    what was expected."""
    sizes = {"prompt_len": args.prompt_len, "steps": args.steps, "layers": args.layers}
    sizes["block_size"] = args.block_size
    if args.trace.startswith("synthetic:"):
        kind = args.trace.split(":", 1)[1]
        if kind not in tr.SYNTHETIC_KINDS:
            raise ValueError(
                f"--trace={args.trace!r}: unknown synthetic trace {kind!r}; expected one of "
                f"{[f'synthetic:{k}' for k in tr.SYNTHETIC_KINDS]} or a .npz path"
            )
        defaults = TRACE_SIZE | {"steps": SIMULATE_STEPS}
        for name, value in sizes.items():
            setattr(args, name, defaults[name] if value is None else value)
        if args.geometry == "trace":
            raise ValueError(
                f"--geometry='trace': a synthetic trace carries no geometry; expected one of "
                f"{sorted(cost.GEOMETRIES)} (or a recorded .npz trace that stores one)"
            )
    else:
        given = [_option(n) for n, v in sizes.items() if v is not None]
        if given:
            raise ValueError(
                f"--trace={args.trace!r} is a recorded trace, whose own sizes apply: "
                f"{', '.join(given)} size{'s' if len(given) == 1 else ''} synthetic traces only; "
                "drop " + ("it" if len(given) == 1 else "them")
            )
    if args.block_size is not None:
        check_number("--block-size", args.block_size, integer=True, low=1)
    names = split_policies(args.policies)
    if not names:
        raise ValueError(
            f"--policies={args.policies!r}: expected comma-separated policy names, e.g. "
            "static,lru-plan,anneal,unlimited"
        )
    policies = [load_policy(n) if ":" in n else n for n in names]
    check_policies(policies, "--policies")
    return policies


def _main(args) -> int:
    names = check_cli_args(args)
    kwargs = simulation_kwargs(args)  # checks the numeric options, profile and geometry
    trace = tr.parse_spec(  # a file's own sizes apply (the size options are None then)
        args.trace,
        prompt_len=args.prompt_len,
        steps=args.steps,
        num_layers=args.layers,
        block_size=args.block_size,
        seed=args.seed,
    )
    if args.geometry == "trace":  # a file without a geometry: named by its option
        sizing.resolve_geometry(trace, "trace", "--geometry")
    result = simulate(trace, names, sparsity=args.sparsity, progress=not args.no_progress, **kwargs)
    if args.json:
        keys = (
            "latency_s",
            "tokens_per_s",
            "speedup_vs_static",
            "vs_unlimited",
            "hbm_hit_rate",
            "migrated_bytes",
            "plan_seconds",
        )
        print(
            json.dumps(
                {
                    "policies": {n: {k: v[k] for k in keys} for n, v in result["policies"].items()},
                    "bounds": result["bounds"],
                    "setup": result["setup"],
                }
            )
        )
    else:
        print(format_table(result))
    return 0


__all__ = [
    "DEFAULT_HBM_GB",
    "add_cli",
    "add_simulation_args",
    "check_cli_args",
    "check_simulation_args",
    "format_table",
    "geometry_words",
    "pool_hints",
    "simulation_kwargs",
]

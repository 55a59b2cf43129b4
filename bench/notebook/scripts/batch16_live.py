"""Lab script (bench/notebook/2026-12-05-batch16.md): the real model decoding a batch of 16
sequences, where KV reads weigh on the step, in the decode loop's accounting.

SmolLM2-135M, 16 different stdlib modules' first PROMPT tokens each, sparse attention (top
25%), HBM 10% of the KV (a pool under the read set), h200-pcie (or `--profile`). One decode is
recorded (lru, W 1; `jaxkv.sim.loop.record`) and every policy is replayed on its reads
(`jaxkv.sim.loop.replay`, equal to a policy's own decode to 1e-6 on its own record; another
policy's record differs from it at rounding level only; a policy that starts from the
prompt's prior, lrfu, replays from its own state one step after prefill), with the bounds of
`jaxkv.sim.loop.bounds`. Planning is charged as
`jaxkv.summarize` charges it: each policy's plan time on this CPU (`plan_seconds`, its own
decoder started from the same prefill) over the recorded decode's CPU step time, per window.

  python bench/notebook/scripts/batch16_live.py [--steps 32] [--hbm 0.10] [--profile P]
"""

import argparse
import dataclasses
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT)]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import Decoder  # noqa: E402
from jaxkv.config import CacheConfig, PlacementConfig  # noqa: E402
from jaxkv.sim import loop  # noqa: E402
from models.generate import load_model  # noqa: E402

MODULES = (
    "argparse", "difflib", "inspect", "typing", "dataclasses", "functools", "pathlib", "shutil",
    "subprocess", "tarfile", "zipfile/__init__", "textwrap", "logging/__init__", "json/decoder",
    "email/message", "http/client",
)  # fmt: skip
PROMPT = 2048
POLICIES = (
    ("static", 1),
    ("lru-plan", 1),
    ("lru-plan", 16),
    ("anneal", 16),
    ("anneal+reuse+follow", 16),
    ("lrfu", 16),
)


def prompts(tok) -> np.ndarray:
    lib = Path(sysconfig.get_paths()["stdlib"])
    rows = []
    for m in MODULES:
        ids = np.asarray(tok.encode((lib / f"{m}.py").read_text()).ids, np.int32)
        if len(ids) < PROMPT:
            raise SystemExit(f"{m}.py has {len(ids)} tokens, expected >= {PROMPT}")
        rows.append(ids[:PROMPT])
    return np.stack(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--hbm", type=float, default=0.10)
    ap.add_argument("--profile", default="h200-pcie", help="the modeled profile, e.g. gh200-paper")
    ap.add_argument(
        "--same",
        action="store_true",
        help="every row the first module's prompt (as a trace's batch: one sequence, B x bytes)",
    )
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    params = nnx.split(model)[1]
    ids = prompts(tok)
    if args.same:
        ids = np.broadcast_to(ids[:1], ids.shape).copy()
    B, n = ids.shape[0], args.steps
    cfg = CacheConfig.for_model(
        model.config, batch=B, max_len=PROMPT + n + 8, block_size=16, hbm_fraction=args.hbm
    )

    def decoder(policy, w):
        placement = PlacementConfig(policy=policy, window=w, attention="sparse")
        return Decoder(model, cfg, placement, max_new_tokens=n + 4, profile=args.profile)

    t0 = time.perf_counter()
    rec_dec = decoder("lru-plan", 1)
    pre = rec_dec.model_prefill(params, ids)
    jax.block_until_ready(pre)
    print(f"prefill of {B} x {PROMPT} tokens: {time.perf_counter() - t0:.0f} s", flush=True)
    state = rec_dec.step(params, rec_dec.prefill(params, ids, prefilled=pre))  # compiles
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    rec, _ = loop.record(rec_dec, params, state, n)
    step_s = (time.perf_counter() - t0) / n
    print(f"recorded {n} steps, {step_s:.2f} s a step on this CPU", flush=True)
    setup0 = loop.LoopSetup.of(rec_dec)
    b = loop.bounds(setup0, rec)
    bound = B * n / b["best"]
    rows = {}
    for policy, w in POLICIES:
        d = decoder(policy, w)
        own = rec
        if d.policy.prompt_prior:  # its own start, the prompt's prior (jaxkv.decode.prompt)
            first = d.step(params, d.prefill(params, ids, prefilled=pre))  # as the record's
            own = dataclasses.replace(rec, start=loop.start_of(first))
        got = loop.replay(loop.LoopSetup.of(d), own).summary()
        tps = got["modeled_tokens_per_s"]
        plan_s = 0.0
        if policy != "static":
            s = d.prefill(params, ids, prefilled=pre)
            plan_s = d.plan_seconds(params, s)
        share = plan_s * (-(-n // w)) / n / step_s
        rows[(policy, w)] = (tps, tps / (1 + share), got["hbm_hit_rate"], plan_s, share)
        print(f"  {policy} W {w}: {tps:,.0f} tok/s, +plan {tps / (1 + share):,.0f}", flush=True)
    one = " (one prompt)" if args.same else ""
    base = max(rows[("static", 1)][1], *(r[1] for (p, _), r in rows.items() if p == "lru-plan"))
    print(
        f"\nSmolLM2-135M, batch {B} x {PROMPT} prompt tokens{one}, {n} steps, sparse top 25%, HBM "
        f"{args.hbm:.0%} ({cfg.hbm_slots} of {cfg.total_blocks} blocks), {args.profile}; jax "
        f"{jax.__version__} on {jax.devices()[0].platform}; modeled tok/s"
    )
    kinds = ("unlimited", "capacity", "cache", "best")
    print("bounds: " + ", ".join(f"{k} {B * n / b[k]:,.0f}" for k in kinds))
    print(
        f"{'policy':<24} {'W':>3} {'hit':>6} {'tok/s':>9} {'plan ms':>8} {'share':>6} "
        f"{'+plan':>9} {'gap closed':>10}"
    )
    for (p, w), (tps, wp, hit, plan_s, share) in rows.items():
        gap = (wp - base) / (bound - base) if bound > base else float("nan")
        print(
            f"{p:<24} {w:>3} {hit:6.1%} {tps:9,.0f} {1e3 * plan_s:8.1f} {share:6.1%} "
            f"{wp:9,.0f} {gap:10.0%}"
        )
    print("gap closed: (+plan - max(static, lru at either W)) / (best bound - that)")


if __name__ == "__main__":
    main()

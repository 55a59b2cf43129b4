"""Decoding on a mesh of simulated devices (`jaxkv.decode.sharded`) against one device.

Runs the tiny model (4 query / 2 KV heads) with batch 4 on one device and on a 4 x 2 ("data",
"model") mesh of simulated CPU devices, with window staggering off and on, and prints per run:
whether the tokens equal one device's, the modeled tokens/s (per step the slowest device's
modeled time; `jaxkv.decode.sharded.summarize`), the largest number of devices migrating in one
step, and the wall time per step on this machine (simulated devices share its cores: a
correctness run, not a speed figure).

With `--plan-over device,model` it also runs the mesh with one plan per model group (the
devices of a data row pool their statistics over the "model" axis, `plan_over="model"`) next
to one plan per device.

    python bench/bench_sharded.py [--attention exact|sparse] [--policy lru] [--shared-link model]
        [--plan-over device,model]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import (
    Decoder,  # noqa: E402
    summarize,  # noqa: E402
)
from jaxkv.config import CacheConfig, PlacementConfig  # noqa: E402
from jaxkv.decode import sharded  # noqa: E402
from models import tiny_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--attention", default="sparse", choices=("exact", "sparse"))
    ap.add_argument("--policy", default="lru-plan")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument(
        "--shared-link", default=None, choices=("data", "model"),
        help="the devices along this mesh axis share one host link",
    )  # fmt: skip
    ap.add_argument(
        "--plan-over", default="device",
        help="device and/or model (comma separated): one plan per device or per model group",
    )  # fmt: skip
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    plan_overs = args.plan_over.split(",")
    bad = [p for p in plan_overs if p not in ("device", "model")]
    if bad:
        ap.error(f"--plan-over {args.plan_over!r}: expected device and/or model, got {bad}")
    model = tiny_model(0)
    _, params = nnx.split(model)
    B, new = 4, args.new_tokens
    cfg = CacheConfig.for_model(model.config, batch=B, max_len=256, block_size=8, hbm_fraction=0.25)
    pl = PlacementConfig(policy=args.policy, window=args.window, attention=args.attention, topk=0.3)
    prompts = np.asarray(jax.random.randint(jax.random.key(7), (B, 120), 0, 256), np.int32)
    lens = np.array([120, 90, 101, 64], np.int32)
    rows = []
    one = Decoder(model, cfg, pl, max_new_tokens=new, profile="h200-pcie")
    st = one.generate(params, one.prefill(params, prompts, lens), until=2)  # compile
    jax.block_until_ready(st)
    t0 = time.perf_counter()
    st = one.generate(params, st)
    jax.block_until_ready(st)
    ref = np.asarray(st.tokens)
    s1 = summarize(st)
    moved1 = np.asarray(st.metrics.moved_trace)[: s1["steps"]]
    rows.append(
        dict(
            run="1 device",
            mesh="1x1",
            stagger=None,
            plan_over=None,
            tokens_equal=True,
            modeled_tokens_per_s=s1["modeled_tokens_per_s"],
            hbm_hit_rate=s1["hbm_hit_rate"],
            migrated_blocks=s1["migrated_blocks"],
            max_devices_migrating=int((moved1 > 0).max()),
            wall_ms_per_step=1e3 * (time.perf_counter() - t0) / max(s1["steps"] - 2, 1),
        )
    )
    mesh = sharded.make_mesh(4, 2)
    for plan_over, stagger in [(p, st) for p in plan_overs for st in (0, 1)]:
        dec = sharded.ShardedDecoder(
            model,
            cfg,
            pl,
            mesh=mesh,
            stagger=stagger,
            max_new_tokens=new,
            profile="h200-pcie",
            shared_link=args.shared_link,
            plan_over=plan_over,
        )
        sp = dec.shard_params(params)
        state = dec.generate(sp, dec.prefill(sp, prompts, lens), until=2)  # compile
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state = dec.generate(sp, state)
        jax.block_until_ready(state)
        wall = time.perf_counter() - t0
        s = sharded.summarize(dec, state)
        moved = np.asarray(s["moved_per_device_step"])
        rows.append(
            dict(
                run=f"stagger {stagger}, plan/{plan_over}",
                mesh="4x2",
                stagger=stagger,
                plan_over=plan_over,
                tokens_equal=bool(np.array_equal(dec.tokens(state), ref)),
                modeled_tokens_per_s=s["modeled_tokens_per_s"],
                hbm_hit_rate=s["hbm_hit_rate"],
                migrated_blocks=s["migrated_blocks"],
                max_devices_migrating=int((moved > 0).sum(axis=0).max()),
                wall_ms_per_step=1e3 * wall / max(s["steps"] - 2, 1),
            )
        )
    out = dict(
        model="tiny (2 layers, 4 q / 2 kv heads x 16)",
        batch=B,
        attention=args.attention,
        policy=args.policy,
        window=args.window,
        shared_link=args.shared_link,
        new_tokens=new,
        device=f"{jax.device_count()} x {jax.devices()[0].device_kind} (simulated)",
        jax=jax.__version__,
        rows=rows,
    )
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"tiny model, batch {B}, {args.attention} attention, {args.policy}, W={args.window}, "
        f"{new} tokens; {out['device']}, jax {out['jax']}; modeled on h200-pcie; "
        f"shared link: {args.shared_link or 'none (one per device)'}"
    )
    print(
        f"{'run':<24} {'mesh':>5} {'same tokens':>11} {'model tok/s':>12} {'hit':>6} "
        f"{'moved':>6} {'max movers/step':>15} {'wall ms/step':>12}"
    )
    for r in rows:
        print(
            f"{r['run']:<24} {r['mesh']:>5} {str(r['tokens_equal']):>11} "
            f"{r['modeled_tokens_per_s']:>12.0f} {r['hbm_hit_rate']:>6.3f} "
            f"{r['migrated_blocks']:>6} {r['max_devices_migrating']:>15} "
            f"{r['wall_ms_per_step']:>12.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

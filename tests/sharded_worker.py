"""Runs a sharded decode in a fresh interpreter (the mesh needs devices jax was started with):
`python tests/sharded_worker.py CASE [--process-id I --processes N --port P]`; prints one
JSON line. Used by tests/test_sharded.py; CASE is "mesh" (8 simulated CPU devices, one
process), "distributed" (one of N processes under jax.distributed on localhost) or "nan" (a
token whose embedding is NaN in one sequence's prompt: the error `generate` raises)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=("mesh", "distributed", "nan"))
    ap.add_argument("--devices", type=int, default=8, help="CPU devices of this process")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--policy", default="lru-plan")
    ap.add_argument("--policy-kwargs", default="{}", help="JSON knobs of the policy")
    ap.add_argument("--attention", default="exact")
    ap.add_argument("--fp8", default="off")
    ap.add_argument("--fp8-age", type=int, default=0)
    ap.add_argument("--mesh", default="4,2", help="data,model")
    ap.add_argument("--stagger", type=int, default=1)
    ap.add_argument("--link-gbps", default=None, help="per-device link GB/s, comma separated")
    ap.add_argument("--shared-link", default=None, choices=("data", "model"))
    ap.add_argument("--plan-over", default="device", choices=("device", "model"))
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    if args.case == "distributed":
        jax.distributed.initialize(
            coordinator_address=f"localhost:{args.port}",
            num_processes=args.processes,
            process_id=args.process_id,
            local_device_ids=list(range(args.devices)),
        )
    import numpy as np
    from flax import nnx

    from jaxkv.config import CacheConfig, PlacementConfig
    from jaxkv.decode import sharded
    from jaxkv.decode.decoder import Decoder
    from models import tiny_model

    model = tiny_model(0)
    if args.case == "nan":
        return _nan_case(args, model)
    _, params = nnx.split(model)
    nd, nm = (int(x) for x in args.mesh.split(","))
    B, new = 4, 16
    cfg = CacheConfig.for_model(
        model.config,
        batch=B,
        max_len=96,
        block_size=8,
        hbm_fraction=0.25,
        fp8=args.fp8,
        fp8_age=args.fp8_age,
    )
    pl = PlacementConfig(policy=args.policy, window=4, attention=args.attention, topk=0.3)
    knobs = json.loads(args.policy_kwargs)
    prompts = np.asarray(jax.random.randint(jax.random.key(7), (B, 45), 0, 256), np.int32)
    lens = np.array([45, 30, 41, 12], np.int32)
    with jax.default_device(jax.local_devices()[0]):  # the one-device reference, per process
        one = Decoder(model, cfg, pl, max_new_tokens=new, policy_kwargs=knobs)
        ref = np.asarray(one.generate(params, one.prefill(params, prompts, lens)).tokens)
    mesh = sharded.make_mesh(nd, nm)
    bws = None if args.link_gbps is None else [float(x) * 1e9 for x in args.link_gbps.split(",")]
    dec = sharded.ShardedDecoder(
        model,
        cfg,
        pl,
        mesh=mesh,
        stagger=args.stagger,
        max_new_tokens=new,
        link_bandwidths=bws,
        shared_link=args.shared_link,
        plan_over=args.plan_over,
        profile="h200-pcie",
        policy_kwargs=knobs,
    )
    sp = dec.shard_params(params)
    state = dec.prefill(sp, prompts, lens)
    kinds0 = sorted({s.data.sharding.memory_kind for s in state.cache.host_k.addressable_shards})
    state = dec.generate(sp, state)
    summary = sharded.summarize(dec, state)
    tiers = sharded._host(state.cache.tier)  # [data, model, layers, batch, max_blocks]
    mass = sharded._host(state.statistics.blocks.mass_ema)  # [data, model, layers, N]
    pools = {
        name: sorted(
            {s.data.sharding.memory_kind for s in getattr(state.cache, name).addressable_shards}
        )
        for name in ("host_k", "host_v", "hbm_k", "hbm_v", "ring_k", "ring_v")
    }
    print(
        json.dumps(
            dict(
                process=jax.process_index(),
                processes=jax.process_count(),
                devices=jax.device_count(),
                local_devices=jax.local_device_count(),
                tokens=dec.tokens(state).tolist(),
                reference=ref.tolist(),
                kinds_after_prefill=kinds0,
                pool_kinds=pools,
                host_dtype=str(state.cache.host_k.dtype),
                hbm_dtype=str(state.cache.hbm_k.dtype),
                # per data row: do its model devices place their shards alike?
                rows_place_alike=[bool((t == t[0]).all()) for t in tiers],
                rows_share_statistics=[bool((m == m[0]).all()) for m in mass],
                shards=len(state.cache.host_k.addressable_shards),
                phases=summary["phases"],
                window=pl.window,
                moved=np.asarray(summary["moved_per_device_step"]).tolist(),
                latency=sharded._host(state.metrics.latency)[..., : summary["steps"]]
                .reshape(mesh.size, -1)
                .tolist(),
                host_bytes=sharded._host(state.metrics.host_bytes)[..., : summary["steps"]]
                .reshape(mesh.size, -1)
                .tolist(),
                summary={
                    k: v for k, v in summary.items() if k not in ("moved_per_device_step", "mesh")
                },
            )
        ),
        flush=True,
    )
    if args.case == "distributed":
        jax.distributed.shutdown()
    return 0


def _nan_case(args, model) -> int:
    """Sequence 3 of 4 holds token 255, whose embedding is NaN (no other prompt holds it):
    prints the NonFiniteLogitsError's message and the tokens of the state it carries."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxkv.config import CacheConfig, PlacementConfig
    from jaxkv.decode import sharded
    from jaxkv.decode.state import NonFiniteLogitsError

    model.embed.value = model.embed.value.at[255].set(jnp.nan)
    _, params = nnx.split(model)
    nd, nm = (int(x) for x in args.mesh.split(","))
    cfg = CacheConfig.for_model(model.config, batch=4, max_len=64, block_size=8, hbm_fraction=0.5)
    pl = PlacementConfig(policy=args.policy, window=2)
    dec = sharded.ShardedDecoder(model, cfg, pl, mesh=sharded.make_mesh(nd, nm), max_new_tokens=4)
    prompts = np.array(jax.random.randint(jax.random.key(7), (4, 20), 0, 255), np.int32)
    prompts[3, 5] = 255
    sp = dec.shard_params(params)
    message, tokens = None, None
    try:
        state = dec.generate(sp, dec.prefill(sp, prompts, np.array([20, 13, 17, 9], np.int32)))
        tokens = dec.tokens(state)
    except NonFiniteLogitsError as e:
        message, tokens = str(e), dec.tokens(e.state)
    print(json.dumps(dict(message=message, tokens=tokens.tolist())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The sharded decode step (`jaxkv.decode.sharded`) compiled for 8 H200s on a machine without a GPU.

A Llama-3.1-8B-shaped model (bench/gpu_ops.py's shape, abstract: nothing allocated at full size)
on a mesh of 8 simulated CPU devices is traced, lowered for CUDA and compiled as one SPMD
program of 8 partitions for the compile-only topology "1x1x8" (one host, 8 GPUs). Per device and
step it reports what bench/gpu_ops.py reports for one GPU, and the collectives (the tensor
parallel all-reduces: two per layer, attention output and MLP down).

    JAX_PLATFORMS=cpu python bench/gpu_ops_sharded.py [--layers 32] [--context 32k] [--check]

--check (exit 1 on failure): no while loop of unknown trip count (static / LRU; the annealer's
plan converges in a loop of its own), host KV traffic of at most 2 transfers per layer and
direction plus 2, and the two all-reduces in the layer body when the model axis is > 1.
Host syncs are reported, not checked: each device decides on the device whether its staggered
window ends (a `conditional`), which the analysis counts as a host sync unless XLA captured it
in a command buffer.

The host transfers compile with fetch="xla" here: the Pallas (Triton) transfer kernels need
the target GPU at lowering time, which jax takes from an abstract GPU mesh in context, and a
shard_map requires its own (CPU) mesh as the context instead; bench/gpu_ops.py covers the
kernels on one GPU.
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
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from gpu_ops import LLAMA_8B, SMALL, abstract_model, cache_config, parse_tokens  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from jaxkv.config import PlacementConfig  # noqa: E402
from jaxkv.decode import sharded  # noqa: E402
from jaxkv.gpu import aot as gc  # noqa: E402
from jaxkv.gpu import hlo  # noqa: E402

NEW_TOKENS = 64


def _struct(x, sharding):
    host = sharding.memory_kind == "pinned_host"
    kw = {"_memory_space": jax.memory.Space.Host} if host else {}
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, **kw)


def compile_case(*, layers, context, batch, data, model, mode, policy, shape, stagger=1):
    """(row dict, CompiledModule) of the sharded step of one case."""
    max_len = context + NEW_TOKENS
    m = abstract_model(layers, shape, max_len)
    mc = m.config
    # fetch="xla": the Triton transfer kernels need an abstract GPU mesh (module docstring)
    cfg = cache_config(mc, batch, max_len, fetch="xla")
    mesh = sharded.make_mesh(data, model)
    pl = PlacementConfig(policy=policy, attention=mode, topk=0.25, window=50)
    dec = sharded.ShardedDecoder(
        m, cfg, pl, mesh=mesh, stagger=stagger, max_new_tokens=NEW_TOKENS, profile="h200-pcie"
    )
    params = jax.tree.map(
        lambda x, s: _struct(x, NamedSharding(mesh, s)), nnx.split(m)[1], dec.param_specs
    )
    prefill = dec._prefill_fn(context)
    nd = data
    dsh = NamedSharding(mesh, jax.sharding.PartitionSpec(sharded.DATA))
    prompts = jax.ShapeDtypeStruct((nd, batch // nd, context), jnp.int32, sharding=dsh)
    lengths = jax.ShapeDtypeStruct((nd, batch // nd), jnp.int32, sharding=dsh)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    state = jax.eval_shape(prefill, params, prompts, lengths, key)
    state = jax.tree.map(_struct, state, dec.state_shardings(state))
    t0 = time.perf_counter()
    mod = gc.compile_for_gpu(
        dec._step_fn, params, state, topology="1x1x8", partitions=8, mesh=mesh, name="sharded_step"
    )
    a = mod.analyze(scope="host_part")
    text = mod.hlo_text
    row = dict(
        fn="sharded_step",
        mesh=f"{data}x{model}",
        context=context,
        batch=batch,
        mode=mode,
        policy=policy,
        **hlo.summary(a),
        all_reduces=text.count(" all-reduce-start(") + text.count(" all-reduce("),
        compile_s=round(time.perf_counter() - t0, 1),
    )
    return row, mod


def check(row: dict, layers: int) -> list[str]:
    """The must-holds of one case (module docstring); the annealer's plan loops until it
    converges (an unknown trip count by design, as bench/gpu_ops.py reports it), so loops are
    checked for the static / LRU policies only."""
    bad, case = [], f"{row['mesh']} {row['mode']} {row['policy']}"
    if row["policy"] in ("static", "lru-plan") and row["unknown_trip_loops"]:
        bad.append(f"{case}: {row['unknown_trip_loops']} unknown-trip loops")
    tp = int(row["mesh"].split("x")[1]) > 1
    want = 2 if tp else 0  # in the scanned layer body, compiled once
    if row["all_reduces"] != want:
        bad.append(f"{case}: {row['all_reduces']} all-reduces in the program, expected {want}")
    for k in ("h2d", "d2h"):
        limit = 2 * layers + 2
        if row[k] > limit:
            bad.append(f"{case}: {k}={row[k]} > {limit}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--context", default="32k")
    ap.add_argument("--small", action="store_true", help="the tests' small shape, not the 8B")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    context = parse_tokens(args.context)
    shape = SMALL if args.small else LLAMA_8B
    cases = [  # (data, model, batch, mode, policy)
        (1, 8, 1, "exact", "lru-plan"),
        (2, 4, 8, "sparse", "anneal"),
    ]
    if shape["num_kv_heads"] % 8:
        cases = [(4, 2, 8, "exact", "lru-plan"), (8, 1, 8, "sparse", "anneal")]
    rows, bad = [], []
    for d, mdl, b, mode, pol in cases:
        row, _ = compile_case(
            layers=args.layers, context=context, batch=b, data=d, model=mdl, mode=mode,
            policy=pol, shape=shape,
        )  # fmt: skip
        rows.append(row)
        bad += check(row, args.layers)
        if not args.json:
            print(json.dumps(row), flush=True)
    out = dict(
        device="H200 x8 (compile-only, topology 1x1x8)",
        jax=jax.__version__,
        layers=args.layers,
        cases=rows,
        failures=bad,
    )
    if args.json:
        print(json.dumps(out, indent=1))
    for b in bad:
        print("FAIL:", b, file=sys.stderr)
    return 1 if (args.check and bad) else 0


if __name__ == "__main__":
    sys.exit(main())

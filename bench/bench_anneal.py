"""Planning cost: one window's plan (2,048 blocks x 32 layers x W = 50, 32 chains) on this device,
next to the modeled GH200 decode time of that window.

    .venv/bin/python bench/bench_anneal.py [--blocks 2048 --layers 32 --window 50 --chains 32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxkv import cost
from jaxkv.config import AnnealConfig, HardwareProfile
from jaxkv.placement import anneal
from jaxkv.sim import trace as tr
from jaxkv.sim.trace import read_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--window", type=int, default=50)
    ap.add_argument("--chains", type=int, default=AnnealConfig().chains)
    ap.add_argument("--sparsity", type=float, default=0.6)
    ap.add_argument("--profile", default="gh200")
    ap.add_argument("--geometry", default="llama3-8b")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    prof = HardwareProfile.preset(args.profile)
    geo = cost.get_geometry(args.geometry)
    bs = 16
    prompt = args.blocks * bs
    trace = tr.SyntheticTrace(
        "patterns", prompt_len=prompt, steps=args.window + 1, num_layers=args.layers, block_size=bs
    )
    n = trace.num_blocks
    reads = read_mask(trace.mass(0, args.window), prompt, bs, args.sparsity, 0)  # [W, L, N]
    cap = min(geo.hbm_capacity_tokens(cost.PAPER_HBM_BUDGET) // bs - 1, n // 2)
    valid = jnp.broadcast_to(jnp.arange(n) < args.blocks, (args.layers, n))
    x0 = jnp.broadcast_to(jnp.arange(n) < cap, (args.layers, n))
    w = args.window
    problem = anneal.AnnealProblem(
        forecast=jnp.swapaxes(reads.astype(jnp.float32), 0, 1),
        x0=x0,
        valid=valid,
        fixed=jnp.full((w,), geo.weight_bytes + geo.token_bytes * 9, jnp.float32),
        weight=jnp.ones((w,), jnp.float32),
        promote_hbm=jnp.ones((args.layers, n)),
        promote_link=jnp.ones((args.layers, n)),
        profile=prof,
        block_bytes=float(bs * geo.token_bytes),
        capacity=int(cap),
    )
    cfg = AnnealConfig(chains=args.chains)

    def timed(fn):
        jax.block_until_ready(fn())
        best = float("inf")
        for _ in range(args.repeats):
            t = time.perf_counter()
            out = jax.block_until_ready(fn())
            best = min(best, time.perf_counter() - t)
        return best, out

    greedy = jax.jit(anneal.greedy_init)
    t_init, xg = timed(lambda: greedy(problem))
    t_run, res = timed(lambda: anneal.run(problem, jax.random.key(0), cfg))
    e, st = res.energy, res.state
    window_s = float(jnp.sum(e))  # modeled decode time of the window (all layers), planned x
    e_init = float(jnp.sum(anneal.energy(problem, xg)))
    e_x0 = float(jnp.sum(anneal.energy(problem, x0)))
    dev = jax.devices()[0]
    print(f"device {dev.platform}:{dev.device_kind}  jax {jax.__version__}")
    print(
        f"problem: {args.blocks} blocks x {args.layers} layers, W={w}, {args.chains} chains, "
        f"HBM pool {cap} blocks/layer, s={args.sparsity}, profile {prof.name}, geometry {geo.name}"
    )
    print("| step | seconds | modeled window decode s | plan / window |")
    print("|---|---|---|---|")
    print(f"| greedy init (prefix scan) | {t_init:.4f} | {e_init:.5f} | {t_init / e_init:.2f} |")
    print(
        f"| anneal run ({int(st.it)} iterations) | {t_run:.4f} | {window_s:.5f} | "
        f"{t_run / window_s:.2f} |"
    )
    print(
        f"energy: current placement {e_x0:.5f} s -> greedy {e_init:.5f} s -> annealed "
        f"{window_s:.5f} s"
    )


if __name__ == "__main__":
    main()

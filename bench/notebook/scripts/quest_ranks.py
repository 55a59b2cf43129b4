"""Lab script (bench/notebook/2026-12-05-quest-ranks.md): does the Quest selection's own block
ranking at step t predict the reads of step t + 1 better than recency?

Records a sparse decode (lru) with every layer's Quest rank and k at every step, through a
`jax.debug.callback` wrapped around `jaxkv.attention.select.quest_ranks` (research only: the
callback is a host sync), checks that rank < k reproduces the recorded reads, then measures:
  - churn: the share of step t + 1's reads that step t did not read;
  - per layer, the share of step t + 1's reads among the C blocks a predictor ranks first at
    step t (C = half, one and two read sets): recency (steps since the last read), the Quest
    rank ratio (rank / k), recency with ties broken by rank; and the oracle (C = one read set
    holds all of them);
  - P(read at t + 1) by rank-ratio bin, for blocks read and not read at t.

  python bench/notebook/scripts/quest_ranks.py bench  # bench_decode's 8k mh case (W 8)
  python bench/notebook/scripts/quest_ranks.py real   # the demo's SmolLM2 sparse case (W 1)
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import Decoder  # noqa: E402
from jaxkv.attention import select as att  # noqa: E402
from jaxkv.config import CacheConfig, PlacementConfig  # noqa: E402
from jaxkv.sim import loop  # noqa: E402

STORE = []  # (layer, rank [B, M], k [B]) per layer call, in call order
_ranks = att.quest_ranks


def _ranks_and_keep(q, cache, layer, lengths, placement, *, window=None):
    """`jaxkv.attention.select.quest_ranks` (what select_blocks reads), with its ranks and k sent to
    STORE."""
    written, rank, k = _ranks(q, cache, layer, lengths, placement, window=window)

    def keep(layer, rank, k):
        STORE.append((int(layer), np.asarray(rank), np.asarray(k)))

    jax.debug.callback(keep, layer, rank, k)
    return written, rank, k


att.quest_ranks = _ranks_and_keep


def _record(dec, params, state, steps):
    STORE.clear()
    rec, _ = loop.record(dec, params, state, steps)
    L = dec.cache_config.num_layers
    per_step = [sorted(STORE[i * L : (i + 1) * L], key=lambda s: s[0]) for i in range(steps)]
    ranks = np.stack([np.stack([s[1] for s in g]) for g in per_step])
    ks = np.stack([np.stack([s[2] for s in g]) for g in per_step])
    same = ((ranks < ks[..., None]) == np.asarray(rec.reads)).mean()
    print(f"recorded {steps} steps; rank < k equals the recorded reads: {same:.0%}")
    return rec, ranks, ks


def record_bench():
    import bench_decode as bd

    argv = ["--shape", "mh", "--contexts", "8192", "--steps", "24", "--window", "8"]
    args = bd.parse_args([*argv, "--modes", "sparse", "--policies", "lru-plan"])
    n = args.warmup + args.steps
    model = bd.build_model(args, 8192 + n + 2 + bd.MARGIN)
    [(_, frac, placement, _)] = [x for x in bd.cases(args) if not x[0].startswith("all-hbm")]
    cfg = CacheConfig.for_model(
        model.config,
        batch=1,
        max_len=8192 + n + 2 + bd.MARGIN,
        block_size=args.block_size,
        hbm_fraction=frac,
        host_tier=args.host_tier,
    )
    dec = Decoder(model, cfg, placement, max_new_tokens=n + 2, profile=args.profile)
    params = nnx.split(model)[1]
    state, _ = bd.fill_cache(dec, params, args, 8192, 1, np.random.default_rng(args.seed))
    return _record(dec, params, state, n)


def record_real():
    from models.demo import demo_prompt, load_model

    model, tok = load_model("smollm2")
    ids, _ = demo_prompt("smollm2", model, tok, 2048)
    params = nnx.split(model)[1]
    cfg = CacheConfig.for_model(
        model.config, batch=1, max_len=2048 + 64, block_size=16, hbm_fraction=0.25
    )
    placement = PlacementConfig(policy="lru-plan", window=1, attention="sparse")
    dec = Decoder(model, cfg, placement, max_new_tokens=64, profile="h200-pcie")
    return _record(dec, params, dec.prefill(params, ids[None]), 63)


def _top_c_share(pred, reads, C):
    """Share of step t + 1's reads among the C blocks per layer that pred[t] ranks first."""
    T, L = reads.shape[:2]
    got = 0
    for t in range(T - 1):
        for layer in range(L):
            top = np.argsort(-pred[t, layer].reshape(-1), kind="stable")[:C]
            got += reads[t + 1, layer].reshape(-1)[top].sum()
    return got / reads[1:].sum()


def analyze(rec, ranks, ks):
    R = np.asarray(rec.reads)  # [T, L, B, M]
    T, L, B, M = R.shape
    ratio = ranks.reshape(T, L, B, M) / ks.reshape(T, L, B)[..., None]
    per = R.sum((2, 3)).mean()
    print(f"{T} steps, {L} layers, {B * M} blocks per layer, {per:.0f} reads per layer-step")
    print(f"churn: reads at t + 1 not read at t: {(R[1:] & ~R[:-1]).sum() / R[1:].sum():.1%}")
    last = np.full((L, B * M), -1e9)
    recency = np.zeros((T, L, B * M))
    for t in range(T):
        last[R[t].reshape(L, -1)] = t
        recency[t] = last - t  # 0: read at t
    recency = recency.reshape(T, L, B, M)
    for f in (0.5, 1.0, 2.0):
        C = int(per * f)
        print(
            f"C = {C:4d} ({f:g} read set): recency {_top_c_share(recency, R, C):.3f}, "
            f"rank {_top_c_share(-ratio, R, C):.3f}, recency then rank "
            f"{_top_c_share(recency * 10 - np.minimum(ratio, 9), R, C):.3f}, "
            f"oracle {min(1.0, f):.3f}"
        )
    nxt, rr = R[1:], ratio[:-1]
    print("P(read at t + 1 | rank / k at t), blocks not read at t:")
    bins = [1, 1.25, 1.5, 2, 3, np.inf]
    for lo, hi in zip(bins[:-1], bins[1:], strict=True):
        m = ~R[:-1] & (rr >= lo) & (rr < hi)
        if m.any():
            print(f"  [{lo}, {hi}): {m.sum():7d} blocks, p = {nxt[m].mean():.3f}")
    print("P(read at t + 1 | rank / k at t), blocks read at t:")
    for lo, hi in ((0, 0.25), (0.25, 0.5), (0.5, 0.75), (0.75, 1.0)):
        m = R[:-1] & (rr >= lo) & (rr < hi)
        print(f"  [{lo}, {hi}): {m.sum():7d} blocks, p = {nxt[m].mean():.3f}")


if __name__ == "__main__":
    if sys.argv[1:] not in (["bench"], ["real"]):
        raise SystemExit("usage: quest_ranks.py bench|real")
    analyze(*(record_bench() if sys.argv[1] == "bench" else record_real()))

"""Lab script (bench/notebook/2026-12-06-prompt-prior.md): lrfu's start from the prompt's
observation window, and the values tried beside it, replayed on recorded decodes.

Records an lrfu decode without the prior (`prompt_prior=False`) with every layer's Quest ranks
(`quest_ranks.py`'s recording), computes the prior of the prompt's last n queries with the
library's own `jaxkv.decode.prompt` (n = 32 ... 256), and replays lrfu with the start and the
value of each variant in the decode loop's accounting (`jaxkv.sim.loop`; the value replaces
`follow_value`, everything else is the loop's). Prints modeled tok/s (no plan: lrfu has none),
the bounds from the recorded start and from the best start, and the hindsight references.

  python bench/notebook/scripts/prompt_prior.py bench     # bench_decode's 8k case (random init)
  python bench/notebook/scripts/prompt_prior.py real 0.25 # the demo (SmolLM2), HBM 25% / 0.10
"""

import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(Path(__file__).parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import quest_ranks as qr  # noqa: E402
from flax import nnx  # noqa: E402

from jaxkv import Decoder  # noqa: E402
from jaxkv.config import CacheConfig, PlacementConfig  # noqa: E402
from jaxkv.decode import prompt as pp  # noqa: E402
from jaxkv.model_api import bind  # noqa: E402
from jaxkv.placement.policies import Follow, Lrfu  # noqa: E402
from jaxkv.sim import loop  # noqa: E402

VALUE = {}  # the value of the step being traced ([layers, N]), set by the scan's body


@dataclasses.dataclass(frozen=True)
class GivenValue(Follow):
    """admit="value" with the value given per step (`VALUE`) instead of `follow_value`."""

    def inputs(self, pstate, read_ema, reads, decay, layer=None, **_):
        return None, None, VALUE["x"]


def replay(dec, rec, values) -> float:
    """Modeled tok/s of lrfu on `rec` (its start as given) with `values` [T, layers, N]."""
    setup = loop.LoopSetup.of(dec, policy=Lrfu(follow=GivenValue("value"), prompt_prior=False))

    def scan(rec, values):
        st = rec.start
        carry = (st.in_hbm, st.lengths, st.stats, st.placement, st.step, jnp.int32(0))

        def body(cr, xs):
            r, m, i, v = xs
            VALUE["x"] = v
            return loop._step(setup, cr, (r, m, i, None))

        steps = jnp.arange(rec.reads.shape[0], dtype=jnp.int32)
        return jax.lax.scan(body, carry, (rec.reads, rec.mass, steps, values))[1]

    m = jax.jit(scan)(rec, jnp.asarray(values, jnp.float32))
    seconds = float(np.sum(np.asarray(m.latency, np.float64)))
    return rec.reads.shape[0] * dec.cache_config.batch / seconds


def setup(which: str, frac: float, extra: int = 0, kw=None):
    """(decoder, params, prompts, steps) of the case; lrfu without the prior, or with the
    policy kwargs `kw`. `extra` (bench only): room for that many more steps, with the case's
    own HBM pool (the blocks past the case's are never read)."""
    kw = {"prompt_prior": False} if kw is None else kw
    if which == "bench":
        import bench_decode as bd

        argv = ["--shape", "mh", "--contexts", "8192", "--steps", "24", "--window", "8"]
        args = bd.parse_args([*argv, "--modes", "sparse", "--policies", "lrfu"])
        n = args.warmup + args.steps
        [(_, frac, placement, _)] = [x for x in bd.cases(args) if not x[0].startswith("all-hbm")]

        def config(model, steps, **hbm):
            return CacheConfig.for_model(
                model.config, batch=1, max_len=8192 + steps + 2 + bd.MARGIN,
                block_size=args.block_size, host_tier=args.host_tier, **hbm,
            )  # fmt: skip

        model = bd.build_model(args, 8192 + n + extra + 2 + bd.MARGIN)
        cfg = config(model, n, hbm_fraction=frac)
        if extra:
            cfg = config(model, n + extra, hbm_blocks=cfg.hbm_slots)
        dec = Decoder(
            model, cfg, placement, max_new_tokens=n + extra + 2, profile=args.profile,
            policy_kwargs=kw,
        )  # fmt: skip
        rng = np.random.default_rng(args.seed)  # bench_decode's fill_cache
        prompts = rng.integers(0, model.config.vocab_size, (1, 8192), dtype=np.int32)
        return dec, nnx.split(model)[1], prompts, n
    from models.demo import demo_prompt, load_model

    model, tok = load_model("smollm2")
    ids, _ = demo_prompt("smollm2", model, tok, 2048)
    cfg = CacheConfig.for_model(
        model.config, batch=1, max_len=2048 + 64, block_size=16, hbm_fraction=frac
    )
    placement = PlacementConfig(policy="lrfu", window=1, attention="sparse")
    dec = Decoder(model, cfg, placement, max_new_tokens=64, profile="h200-pcie", policy_kwargs=kw)
    return dec, nnx.split(model)[1], ids[None], 63


def ema_of(R, x0, d):
    """[T, layers, N]: the read frequency after each step of reads R [T, layers, N], an EMA of
    decay d from x0 (lrfu's `read_ema` with the step folded in)."""
    out, x = np.zeros(R.shape, np.float32), x0.copy()
    for t in range(R.shape[0]):
        x = d * x + (1 - d) * R[t]
        out[t] = x
    return out


def adaptive(R, sealed, room, p, fast, slow, d=0.9):
    """(values [T, layers, N], the share of (step, layer)s on `slow`): per layer and step the
    estimator, `fast` or `slow` ([T, layers, N], both starting from p), whose top `room` blocks
    before the step caught more of the step's reads R, decayed by d (ARC's idea)."""
    T, L, N = R.shape
    out, sf, ss, pf, ps, used = np.zeros((T, L, N), np.float32), 0.0, 0.0, p, p, []
    for t in range(T):
        hits = [
            np.take_along_axis(R[t], np.argsort(-np.where(sealed, x, -np.inf))[:, :room], 1)
            for x in (pf, ps)
        ]
        sf, ss = d * sf + hits[0].sum(1), d * ss + hits[1].sum(1)
        out[t] = np.where((ss > sf)[:, None], slow[t], fast[t])
        used.append(float(np.mean(ss > sf)))
        pf, ps = fast[t], slow[t]
    return out, float(np.mean(used))


def top(p, sealed, room):
    """[layers, N] bool: the `room` highest of `p` per layer among `sealed`, ties by index."""
    L, N = p.shape
    out = np.zeros((L, N), bool)
    for layer in range(L):
        key = np.where(sealed, -p[layer], np.inf)
        idx = np.lexsort((np.arange(N), key))[:room]
        out[layer, idx[np.isfinite(key[idx])]] = True
    return out


def main():
    which, frac = sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 0.25
    dec, params, prompts, steps = setup(which, frac)
    state = dec.prefill(params, prompts)
    c = dec.cache_config
    L, B, M = c.num_layers, c.batch, c.max_blocks
    N = B * M
    # the prompt's last 256 queries, with the library's own recomputation
    model = bind(dec.graphdef, params)
    lengths = jnp.asarray([prompts.shape[1]], jnp.int32)
    _, k, v = model.prefill(jnp.asarray(prompts))
    qs = pp.prompt_queries(model, jnp.asarray(prompts), lengths, k, v, n=256)
    prior = {
        n: np.asarray(pp.prompt_prior(qs[:, :, -n:], state.cache, dec.placement)).reshape(L, N)
        for n in (32, 64, 128, 256)
    }
    rec, ranks, ks = qr._record(dec, params, state, steps)  # donates the state
    R = np.asarray(rec.reads, np.float32).reshape(-1, L, N)
    T = R.shape[0]
    st = rec.start
    sealed = (np.arange(M)[None] < (np.asarray(st.lengths) // c.block_size)[:, None]).reshape(N)
    room = int(np.asarray(st.in_hbm).reshape(L, N).sum(1).max())

    def ema(x0, d):
        return ema_of(R, x0, d)

    def start(p, place=True):
        s = dataclasses.replace(st, stats=dataclasses.replace(st.stats, read_ema=jnp.asarray(p)))
        if place:
            s = dataclasses.replace(s, in_hbm=jnp.asarray(top(p, sealed, room).reshape(L, B, M)))
        return dataclasses.replace(rec, start=s)

    zero = np.zeros((L, N), np.float32)
    print(f"{which}: lrfu without the prior {replay(dec, rec, ema(zero, 0.9)):,.0f} tok/s")
    p32 = prior[32]
    rows = [("prior 32, read_ema only (no placement)", start(p32, False), ema(p32, 0.9))]
    for n in (32, 64, 256):
        p = prior[n]
        rows += [(f"prior {n} + placement, decay {d}", start(p), ema(p, d)) for d in (0.9, 0.97)]
        rows.append(
            (f"prior {n} + placement, the prior held constant", start(p), np.stack([p] * T))
        )
    for n in (32, 256):
        v, used = adaptive(R, sealed, room, p32, ema(p32, 0.9), np.stack([prior[n]] * T))
        rows.append((f"adaptive: decay 0.9 or constant prior {n} ({used:.0%} slow)", start(p32), v))
    r = ranks.reshape(T, L, N) / np.maximum(ks.reshape(T, L, B), 1)
    x, rank_ema = p32.copy(), np.zeros((T, L, N), np.float32)
    for t in range(T):  # the Quest ranks, softened: 1 at rank 0, 0 from 3 k on
        x = 0.97 * x + 0.03 * np.clip(1 - r[t] / 3, 0, 1)
        rank_ema[t] = x
    rows.append(("prior 32 + placement, EMA 0.97 of the ranks", start(p32), rank_ema))
    hind = R.mean(0) * sealed
    oracle = "hindsight read frequency (an oracle) + its placement"
    rows.append((oracle, start(hind), np.stack([hind] * T)))
    for name, rec_v, values in rows:
        print(f"  {name:<58} {replay(dec, rec_v, values):9,.0f}")
    setup_ = loop.LoopSetup.of(dec)
    best = loop.bounds(setup_, rec)
    print(f"  bound (best start, jaxkv.sim.loop.bounds) {T / best['best']:,.0f} tok/s")


if __name__ == "__main__":
    main()

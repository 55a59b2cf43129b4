"""Lab script (bench/notebook/2026-12-06-forecast-limits.md): how far an online estimate of the
reads can take lrfu on bench_decode's 8k case (random init), and whether a forecast of the next
step's queries is the lever beyond it.

  prior     Records bench_decode's 8k lrfu decode (without the prompt's prior), computes the
            prior of the prompt's last n = 32, 256 and 512 queries (`jaxkv.decode.prompt`),
            and replays lrfu in the decode loop's accounting (`jaxkv.sim.loop`, through
            prompt_prior.py's `replay`) from each prior's start, with its value held constant
            or as an EMA (decay 0.9, lrfu's; 0.97). Prints modeled tok/s and the share of the
            gap between max(static, lru) (bench/RESULTS.md section 5, W 8: 4,911) and the best
            bound that each closes. (512 queries take about 10 GB.)
  forecast  An exact-attention decode of the same model and prompt, 28 greedy steps, with the
            Quest selection (`select_blocks`) of every step's queries: the reads. At each step
            t, after the next token is known, a second `decode_step` of that token at the next
            position whose `attend` returns step t's attention outputs (the stale forward: what
            the model API allows without attending) gives queries, hence a forecast of step
            t + 1's reads. Prints the forecast's precision and recall against the reads of
            t + 1 (and recency's), then the link crossings of lrfu's rule (value = EMA + beta x
            forecast) relative to Belady's, in a numpy model of the rule: `follow_moves`'
            "value" admission on a pool of C blocks per layer, which reproduces the loop's
            lrfu on the recorded decode exactly (12,130 host reads, 7,749 tok/s).
  lookahead Replays lrfu (as `prior`) with the next step's reads of layer 0 added to its value:
            layer 0's queries depend on the token and its position only, so its next reads
            are known exactly once the next token is sampled. Alone and on top of the adaptive
            estimator (`prompt_prior.adaptive`), with every layer's next reads as the oracle.
            bench (the 8k case, with the share of its gap) or real 0.25 / 0.10 (the demo).
  decoded   lrfu without its two additions, with the adaptive estimator alone (`steady_queries`
            at its default 128), with the lookahead alone, and with both (lrfu's defaults since
            2026-12-06 (6)), decoded in the loop itself, the same cases (1-2 min each; the
            real model's 4 min).

  python bench/notebook/scripts/forecast_limits.py prior
  python bench/notebook/scripts/forecast_limits.py forecast
  python bench/notebook/scripts/forecast_limits.py lookahead [bench | real 0.25 | real 0.10]
  python bench/notebook/scripts/forecast_limits.py decoded [bench | real 0.25 | real 0.10] [0,1,2,3]
"""

import dataclasses
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(Path(__file__).parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import prompt_prior as pp_script  # noqa: E402

from jaxkv.attention.select import select_blocks  # noqa: E402
from jaxkv.cache import ops as cache_ops  # noqa: E402
from jaxkv.cache.layout import TieredKVCache  # noqa: E402
from jaxkv.decode import prompt as pp  # noqa: E402
from jaxkv.model_api import bind  # noqa: E402
from jaxkv.sim import loop  # noqa: E402

EXTRA = 100  # held-out steps: the read frequency of the same decode after the recorded ones
BASE = 4911.0  # max(static, lru) with planning charged, bench/RESULTS.md section 5 (lru, W 8)


def held_out(c, steps: int, extra: int):
    """[steps + extra, layers, 1, M] float32: the reads of bench_decode's 8k decode continued
    for `extra` steps, with the case's model, prompt and HBM pool, over the blocks of the
    case's cache `c` (`prompt_prior.setup` with `extra`)."""
    dec, params, prompts, _ = pp_script.setup("bench", 0.25, extra=extra)
    rec, _ = loop.record(dec, params, dec.prefill(params, prompts), steps + extra)
    return np.asarray(rec.reads)[..., : c.max_blocks].astype(np.float32)


@dataclasses.dataclass
class Case:
    """A recorded lrfu decode (without the prompt's prior) and what the replays need."""

    dec: object
    rec: object
    R: np.ndarray  # [T, layers, N] float32: the reads
    priors: dict  # n -> [layers, N]: the prior of the prompt's last n queries
    sealed: np.ndarray  # [N] bool: the blocks sealed at the start
    room: int  # the HBM slots of a layer
    bound: float  # the best bound, tok/s

    def start(self, p):
        """The record with read_ema p and HBM holding p's top blocks at the start."""
        st = self.rec.start
        stats = dataclasses.replace(st.stats, read_ema=jnp.asarray(p))
        top = pp_script.top(p, self.sealed, self.room).reshape(st.in_hbm.shape)
        s = dataclasses.replace(st, stats=stats, in_hbm=jnp.asarray(top))
        return dataclasses.replace(self.rec, start=s)

    def report(self, rows, base):
        """Replays lrfu with each row's (name, start prior, values [T, layers, N]); prints tok/s
        and, with `base` (max(static, lru)), the share of the gap to the bound it closes."""
        for name, p, vals in rows:
            tps = pp_script.replay(self.dec, self.start(p), vals)
            share = f"  closes {(tps - base) / (self.bound - base):5.1%}" if base else ""
            print(f"  {name:<52} {tps:8,.0f} tok/s{share}", flush=True)


def record_case(which: str, frac: float, ns=(32,)) -> Case:
    """`prompt_prior.setup`'s case, its priors of n in `ns` queries and its lrfu record."""
    dec, params, prompts, steps = pp_script.setup(which, frac)
    state = dec.prefill(params, prompts)
    c = dec.cache_config
    L, N = c.num_layers, c.batch * c.max_blocks
    model = bind(dec.graphdef, params)
    toks = jnp.asarray(prompts)
    lengths = jnp.asarray([prompts.shape[1]], jnp.int32)
    _, k, v = model.prefill(toks)
    priors = {}
    for n in ns:
        qs = pp.prompt_queries(model, toks, lengths, k, v, n=n)
        priors[n] = np.asarray(pp.prompt_prior(qs, state.cache, dec.placement)).reshape(L, N)
        del qs
    rec, _ = loop.record(dec, params, state, steps)
    R = np.asarray(rec.reads, np.float32).reshape(-1, L, N)
    st = rec.start
    sealed = np.arange(c.max_blocks)[None] < (np.asarray(st.lengths) // c.block_size)[:, None]
    room = int(np.asarray(st.in_hbm).reshape(L, N).sum(1).max())
    bound = R.shape[0] * c.batch / loop.bounds(loop.LoopSetup.of(dec), rec)["best"]
    return Case(dec, rec, R, priors, sealed.reshape(N), room, bound)


def prior():
    case = record_case("bench", 0.25, (32, 256, 512))
    c, R, sealed = case.dec.cache_config, case.R, case.sealed
    L, N, T = c.num_layers, c.batch * c.max_blocks, R.shape[0]

    def ema(x0, d):
        return pp_script.ema_of(R, x0, d)

    print(f"8k, lrfu from each prior's start; best bound {case.bound:,.0f} tok/s, base {BASE:,.0f}")
    hind = R.mean(0) * sealed
    rows = [(f"prior {n}, {name}", p, vals)
            for n, p in case.priors.items()
            for name, vals in (("constant", np.stack([p] * T)), ("EMA 0.9 (lrfu)", ema(p, 0.9)),
                               ("EMA 0.97", ema(p, 0.97)))]  # fmt: skip
    rows.append(("hindsight read frequency (an oracle), constant", hind, np.stack([hind] * T)))
    longer = held_out(c, T, EXTRA).reshape(-1, L, N)
    differ = int((longer[:T] != R).sum())
    print(f"the longer decode's first {T} steps: {differ} of {int(R.sum()):,} reads differ")
    held = longer[T:].mean(0) * sealed
    name = f"read frequency of steps {T}..{T + EXTRA - 1}, constant"
    rows.append((name, held, np.stack([held] * T)))
    case.report(rows, BASE)


def lookahead(which: str = "bench", frac: str = "0.25"):
    """lrfu's value plus the next step's reads of the first layers (layer 0's are known once
    the next token is: its queries depend on the token and position only), alone and on top of
    the adaptive estimator (`prompt_prior.adaptive`: per layer, EMA 0.9 from the prior of 32
    queries or the constant prior of 256, whichever's top blocks caught more reads)."""
    case = record_case(which, float(frac), (32, 256))
    R, (p32, p256) = case.R, (case.priors[32], case.priors[256])
    T, L = R.shape[:2]
    nxt = np.concatenate([R[1:], np.zeros_like(R[:1])])

    def ahead(vals, layers=1, b=1.0):
        m = (np.arange(L) < layers).astype(np.float32)[None, :, None]
        return vals + b * m * nxt

    fast = pp_script.ema_of(R, p32, 0.9)
    slow, used = pp_script.adaptive(R, case.sealed, case.room, p32, fast, np.stack([p256] * T))
    print(f"{which} {frac}: best bound {case.bound:,.0f} tok/s; adaptive on slow {used:.0%}")
    rows = [
        ("lrfu (EMA 0.9 from the prior of 32)", fast),
        ("lrfu + layer 0's next reads", ahead(fast)),
        ("lrfu + 0.3 x layer 0's next reads", ahead(fast, b=0.3)),
        ("adaptive 32 / 256", slow),
        ("adaptive 32 / 256 + layer 0's next reads", ahead(slow)),
        ("lrfu + every layer's next reads (an oracle)", ahead(fast, L)),
    ]
    case.report([(n, p32, v) for n, v in rows], BASE if which == "bench" else None)


def decoded(which: str = "bench", frac: str = "0.25", only: str = "0,1,2,3"):
    """lrfu without its additions, with the adaptive estimator, the lookahead, both, decoded in
    the loop (`Decoder` through `jaxkv.sim.loop.record`): modeled tok/s, the best bound, and
    where the steady estimator leads at the end. `only`: which of the four, e.g. "0,2"."""
    off = {"steady_queries": 0, "lookahead": False}  # lrfu before both additions
    variants = (off, {"lookahead": False}, {"steady_queries": 0}, {})  # {}: lrfu's defaults
    for kw in (variants[int(i)] for i in only.split(",")):
        dec, params, prompts, steps = pp_script.setup(which, float(frac), kw=kw)
        rec, end = loop.record(dec, params, dec.prefill(params, prompts), steps)
        B = dec.cache_config.batch
        tps = steps * B / float(np.sum(np.asarray(rec.decoded.latency, np.float64)))
        bound = steps * B / loop.bounds(loop.LoopSetup.of(dec), rec)["best"]
        s, lead = end.statistics.blocks, ""
        if s.steady is not None:
            wins = np.mean(np.asarray(s.steady_hits) > np.asarray(s.ema_hits))
            lead = f"; the steady estimator leads on {wins:.0%} of the layers at the end"
        share = f" (closes {(tps - BASE) / (bound - BASE):.1%})" if which == "bench" else ""
        name = f"{which} {frac} lrfu {kw or '(defaults)'}"
        print(f"{name}: {tps:,.0f} tok/s{share}, bound {bound:,.0f}{lead}")


def follow_misses(R, sealed, C, init, value):
    """Host reads of lrfu's rule on reads R [T, L, N]: at each step, the host blocks read fill
    free slots, then displace the least valuable resident while strictly more valuable
    (`follow_moves`' "value" admission; value(t) [L, N] after step t's reads); a block that
    seals stays in HBM while a slot is free."""
    T, L, _ = R.shape
    H, misses = init.copy(), 0
    for t in range(T):
        host = R[t] & ~H & sealed[t][None]
        misses += int(host.sum())
        v = value(t)
        for layer in range(L):
            cand = np.flatnonzero(host[layer])
            cand = cand[np.argsort(-v[layer, cand], kind="stable")]
            res = np.flatnonzero(H[layer])
            res = res[np.argsort(v[layer, res], kind="stable")]
            free, i = C - len(res), 0
            for b in cand:
                if free > 0:
                    H[layer, b], free = True, free - 1
                elif i < len(res) and v[layer, b] > v[layer, res[i]]:
                    H[layer, res[i]], H[layer, b], i = False, True, i + 1
                else:
                    break
        if t + 1 < T:
            for b in np.flatnonzero(sealed[t + 1] & ~sealed[t]):
                H[:, b] |= H.sum(1) < C
    return misses


def belady_misses(R, C, init):
    """Belady with bypass: after each step keep the C blocks (of those resident or just read)
    read soonest."""
    T, L, N = R.shape
    H, misses = init.copy(), 0
    for t in range(T):
        misses += int((R[t] & ~H).sum())
        nxt = np.full((L, N), T)
        for u in range(T - 1, t, -1):
            nxt = np.where(R[u], u, nxt)
        for layer in range(L):
            idx = np.flatnonzero(H[layer] | R[t, layer])
            idx = idx[np.argsort(nxt[layer, idx], kind="stable")][:C]
            H[layer] = False
            H[layer, idx[nxt[layer, idx] < T]] = True
    return misses


def check_numpy_model(dec, params, prompts, prior, steps):
    """The numpy model of lrfu's rule on the Decoder's recorded decode: its host reads, and the
    tok/s they imply (the case is link-bound: the best bound x Belady's crossings / them)."""
    c = dec.cache_config
    L, N = c.num_layers, c.batch * c.max_blocks
    rec, _ = loop.record(dec, params, dec.prefill(params, prompts), steps)
    b = loop.bounds(loop.LoopSetup.of(dec), rec)
    R = np.asarray(rec.reads).reshape(-1, L, N)
    lengths = np.asarray(rec.start.lengths)[0] + np.arange(R.shape[0])
    sealed = np.arange(N)[None] < (lengths // c.block_size)[:, None]
    C = c.hbm_pool_slots
    ema = [prior]
    for t in range(R.shape[0]):
        ema.append(0.9 * ema[-1] + 0.1 * R[t])
    got = follow_misses(R, sealed, C, pp_script.top(prior, sealed[0], C), lambda t: ema[t + 1])
    bel = sum(b["crossings"])
    print(
        f"numpy model on the recorded decode: {got:,} host reads (Belady {bel:,}), "
        f"{R.shape[0] / b['best'] * bel / got:,.0f} tok/s"
    )


def forecast(G: int = 28):
    dec, params, prompts, _ = pp_script.setup("bench", 0.25)
    c = dec.cache_config
    L, B, N = c.num_layers, c.batch, c.batch * c.max_blocks
    model = bind(dec.graphdef, params)
    toks = jnp.asarray(prompts)
    P = toks.shape[1]
    lengths = jnp.asarray([P], jnp.int32)
    logits, k, v = model.prefill(toks)
    kv = (k.astype(c.jnp_dtype), v.astype(c.jnp_dtype))
    cache = cache_ops._prefill(TieredKVCache.create(c), *kv, lengths)
    q32 = pp.prompt_queries(model, toks, lengths, k, v)
    prior = np.asarray(pp.prompt_prior(q32, cache, dec.placement)).reshape(L, N)
    check_numpy_model(dec, params, prompts, prior, G)
    KV, D, H = k.shape[3], k.shape[4], q32.shape[3]
    S = P + G + 1
    kd = jnp.zeros((L, B, S, KV, D), jnp.float32).at[:, :, :P].set(k.astype(jnp.float32))
    vd = jnp.zeros((L, B, S, KV, D), jnp.float32).at[:, :, :P].set(v.astype(jnp.float32))
    q0 = jnp.zeros((L, B, H, D), q32.dtype)

    @jax.jit
    def exact(tok, pos, kd, vd):  # one exact step: (logits, K, V, queries, attention outputs)
        def attend(layer, q, k_new, v_new, carry):
            kd, vd, qs, outs = carry
            kd = kd.at[layer, :, pos].set(k_new.astype(jnp.float32))
            vd = vd.at[layer, :, pos].set(v_new.astype(jnp.float32))
            qg = q.astype(jnp.float32).reshape(B, KV, H // KV, D)
            s = jnp.einsum("bkgd,btkd->bkgt", qg, kd[layer]) / math.sqrt(D)
            p = jax.nn.softmax(jnp.where(jnp.arange(S) <= pos, s, -jnp.inf), -1)
            out = jnp.einsum("bkgt,btkd->bkgd", p, vd[layer]).reshape(B, H, D).astype(q.dtype)
            return out, (kd, vd, qs.at[layer].set(q), outs.at[layer].set(out))

        t, p = jnp.full((B,), tok), jnp.full((B,), pos)
        return model.decode_step(t, p, attend, (kd, vd, q0, q0))

    @jax.jit
    def stale(tok, pos, outs):  # the next token's queries with the last step's outputs
        def attend(layer, q, k_new, v_new, qs):
            return outs[layer], qs.at[layer].set(q)

        return model.decode_step(jnp.full((B,), tok), jnp.full((B,), pos), attend, q0)[1]

    @jax.jit
    def select(qs, pos):
        at = jnp.full((B,), pos + 1)
        return jax.vmap(lambda i: select_blocks(qs[i], cache, i, at, dec.placement))(jnp.arange(L))

    tok, R, F = int(jnp.argmax(logits[0, P - 1])), [], []
    for t in range(G):
        lg, (kd, vd, qs, outs) = exact(tok, P + t, kd, vd)
        nxt = int(jnp.argmax(lg[0]))
        R.append(np.asarray(select(qs, P + t)).reshape(L, N))
        F.append(np.asarray(select(stale(nxt, P + t + 1, outs), P + t + 1)).reshape(L, N))
        tok = nxt
    sealed0 = np.arange(N) < P // c.block_size  # the prompt's blocks (the tail is HBM's)
    R, F = np.stack(R) & sealed0, np.stack(F) & sealed0
    print("layer  precision  recall  recency's recall  forecast = step t's reads  new reads caught")
    for layer in range(L):
        f, r, now = F[:-1, layer], R[1:, layer], R[:-1, layer]
        h, new = (f & r).sum(), r & ~now
        print(
            f"{layer:5}  {h / f.sum():9.2f}  {h / r.sum():6.2f}  {(now & r).sum() / r.sum():16.2f}"
            f"  {(f & now).sum() / f.sum():25.2f}  {(f & new).sum() / new.sum():16.2f}"
        )
    hit = (F[:-1] & R[1:]).sum()
    print(
        f"forecast of step t + 1's reads (stale forward): precision {hit / F[:-1].sum():.2f}, "
        f"recall {hit / R[1:].sum():.2f}; recency (step t's reads) recall "
        f"{(R[:-1] & R[1:]).sum() / R[1:].sum():.2f}"
    )
    C, sealed = c.hbm_pool_slots, np.broadcast_to(sealed0, (G, N))
    init = pp_script.top(prior, sealed0, C)
    first = np.where(R.any(0), R.argmax(0), G)
    best = np.zeros((L, N), bool)
    for layer in range(L):
        o = np.argsort(np.where(sealed0, first[layer], G + 1), kind="stable")[:C]
        best[layer, o[first[layer, o] < G]] = True
    bel = belady_misses(R, C, best)
    ema = [prior]
    for t in range(G):
        ema.append(0.9 * ema[-1] + 0.1 * R[t])
    nxt = np.concatenate([R[1:], np.zeros_like(R[:1])]).astype(np.float32)
    cases = [("lrfu (EMA 0.9 from the prior)", lambda t: ema[t + 1])]
    for b in (0.3, 1):
        cases.append((f"lrfu + {b} x the forecast", lambda t, b=b: ema[t + 1] + b * F[t]))
    cases.append(("lrfu + the next step's reads (an oracle)", lambda t: ema[t + 1] + nxt[t]))
    rng = np.random.default_rng(0)
    for p in (0.3, 0.5):  # the oracle with each entry re-drawn (Bernoulli of the mean) w.p. p
        redraw = rng.random(nxt.shape) < p
        noisy = np.where(redraw, rng.random(nxt.shape) < nxt.mean(), nxt)
        name = f"lrfu + the next reads, {p:.0%} re-drawn"
        cases.append((name, lambda t, x=noisy: ema[t + 1] + x[t]))
    hind = R.mean(0)
    cases.append(("hindsight read frequency (an oracle)", lambda t: hind))
    print(f"host reads relative to Belady's ({bel:,}), pool {C} blocks per layer, {G} steps:")
    for name, value in cases:
        start = pp_script.top(hind, sealed0, C) if name.startswith("hindsight") else init
        print(f"  {name:<44} {follow_misses(R, sealed, C, start, value) / bel:.3f}")


if __name__ == "__main__":
    modes = {"prior": prior, "forecast": forecast, "lookahead": lookahead, "decoded": decoded}
    modes[sys.argv[1]](*sys.argv[2:])

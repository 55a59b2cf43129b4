"""A serving run priced after the fact on a hardware profile and a model's sizes: modeled
throughput, TTFT and TPOT, HBM hit rate, link bytes.

An engine records every iteration (`Engine.log`): the prompt tokens a chunk prefilled, the
prompt inserted into a slot, and the decode step's block reads, promotions, demotions and
plan moves per layer (`StepOut`). `price` turns that record into modeled seconds per
iteration, with the decode loop's own step model (`jaxkv.placement.charging.step_latency`:
per layer max(T_hbm, T_link), weights and the tokens' write on the HBM side), on any profile
and at any model's per-layer sizes (`Sizes`): the same recorded reads priced at another
model's block and weight bytes (the simulator's convention for a geometry other than the
trace's, `jaxkv.sim.sizing`: the run's layers, the geometry's per-layer sizes).

What the step model does not cover is priced in the same terms and said here:
  - a prefill chunk of n tokens starting at position s: one pass over the layer's weights,
    its prompt's KV so far read once ((s + n) tokens) and its n tokens' KV written, all on
    the HBM side (`jaxkv.cost.layer_step_time`). It is a bytes bound: a GPU's prefill is
    compute-bound, so TTFT is a lower bound;
  - an insert: the prompt's sealed blocks written once over the link to the host pool
    (write-through), on the link side of the iteration that inserts it;
  - planning: a policy that plans (`jaxkv.decode.window`) is charged as `jaxkv.summarize`
    charges it: every modeled decode step lengthened by the share of a wall step that one plan
    per window adds on this device (`plan_share`).
An iteration's modeled time is its prefill part plus its decode step (the engine runs them one
after the other). Arrival times are the engine's iterations (`Request.submitted`): a request
submitted before iteration i is counted from the start of i.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import CacheConfig, HardwareProfile
from jaxkv.cost import Geometry, layer_step_time
from jaxkv.placement.charging import link_migration_bytes, step_latency

_DTYPE_OF_BYTES = {1: "float8", 2: "bfloat16", 4: "float32"}


@dataclasses.dataclass(frozen=True)
class Sizes:
    """A model's per-layer sizes, what pricing needs.

    Attributes:
      name: what to call them in a report ("as decoded", "llama3-8b").
      kv_heads, head_dim, dtype: the KV geometry (dtype a `CacheConfig` dtype name).
      weight_bytes: bytes of weights a decode step reads per layer.
    """

    name: str
    kv_heads: int
    head_dim: int
    dtype: str
    weight_bytes: float

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of one layer at these sizes: K and V of every KV head."""
        itemsize = {"bfloat16": 2, "float16": 2, "float32": 4}[self.dtype]
        return 2 * block_size * self.kv_heads * self.head_dim * itemsize

    @staticmethod
    def of_engine(engine, name: str = "as decoded") -> Sizes:
        """The engine's own: its cache's KV geometry and dtype, its model's weight bytes per
        layer (`jaxkv.Decoder.weight_bytes_per_layer`)."""
        c = engine.cache_config
        w = engine.core.decoder.weight_bytes_per_layer
        return Sizes(name, c.kv_heads, c.head_dim, c.dtype, float(w))

    @staticmethod
    def of_geometry(g: Geometry) -> Sizes:
        """A cost geometry's (`jaxkv.cost.GEOMETRIES`), e.g. Llama-3.1-8B's in bf16."""
        if g.dtype_bytes not in (2, 4):
            raise ValueError(f"geometry {g.name!r}: dtype_bytes={g.dtype_bytes}: expected 2 or 4")
        return Sizes(g.name, g.kv_heads, g.head_dim, _DTYPE_OF_BYTES[g.dtype_bytes],
                     float(g.weight_bytes))  # fmt: skip


def priced_config(c: CacheConfig, sizes: Sizes) -> CacheConfig:
    """`c` (its layers, slots, block size, host tier, FP8 mode) at `sizes`' KV geometry."""
    return dataclasses.replace(c, kv_heads=sizes.kv_heads, head_dim=sizes.head_dim,
                               dtype=sizes.dtype)  # fmt: skip


def prefill_seconds(it, c: CacheConfig, profile: HardwareProfile, sizes: Sizes) -> float:
    """Modeled seconds of an iteration's prefill part (`Engine.log`'s `Iteration` `it`): its
    chunk (weights once, the prompt's KV so far read, the chunk's written) and its insert (the
    prompt's sealed blocks over the link), per layer the slower side, all layers."""
    if not (it.chunk or it.inserted):
        return 0.0
    pc = priced_config(c, sizes)
    token_b = pc.block_bytes / pc.block_size  # one token's K and V in one layer
    read = (it.chunk_start + it.chunk) * token_b if it.chunk else 0.0
    link = (it.inserted // pc.block_size) * float(pc.host_block_bytes)
    t = layer_step_time(read, link, profile=profile, weight_bytes=sizes.weight_bytes if
                        it.chunk else 0.0, hbm_write_bytes=it.chunk * token_b)  # fmt: skip
    return c.num_layers * float(t)


def iteration_seconds(log, c: CacheConfig, profile: HardwareProfile, sizes: Sizes,
                      plan_share: float = 0.0) -> dict:  # fmt: skip
    """Per iteration of `log` ([iterations] arrays): "prefill" and "step" modeled seconds (the
    step's with planning charged by `plan_share`), and the decode steps' "hbm_bytes" (KV reads,
    weights, token writes, migrations' HBM side) and "link_bytes" (host reads and plan moves),
    all layers; "decoded" tokens. Module docstring for what is priced how."""
    pc = priced_config(c, sizes)
    W = sizes.weight_bytes
    n = len(log)
    prefill = np.array([prefill_seconds(it, c, profile, sizes) for it in log])
    step = np.zeros(n)
    hbm_bytes, link_bytes = np.zeros(n), np.zeros(n)
    idx = [i for i, it in enumerate(log) if it.out is not None]
    decoded = np.array([it.decoded for it in log], np.int64)
    if idx:
        f = {k: np.stack([log[i].out[k] for i in idx]) for k in
             ("hbm_blocks", "host_blocks", "moved", "promoted", "demoted")}  # fmt: skip
        hbm_b = f["hbm_blocks"] * float(pc.hbm_block_bytes)  # [steps, L]
        host_b = f["host_blocks"] * float(pc.host_block_bytes)

        def one(h, x, m, p, d):
            return step_latency(pc, profile, W, h, x, m, p, d)

        lat = jax.vmap(one)(*(jnp.asarray(a) for a in (hbm_b, host_b, f["moved"],
                            f["promoted"], f["demoted"])))  # fmt: skip
        step[idx] = np.asarray(lat, np.float64) * (1.0 + max(plan_share, 0.0))
        mig_l = np.asarray(link_migration_bytes(pc, jnp.asarray(f["moved"]),
                                                jnp.asarray(f["demoted"])))  # fmt: skip
        write = pc.batch * pc.block_bytes / pc.block_size
        mig_h = (f["moved"] + f["promoted"]) * float(pc.hbm_block_bytes)
        hbm_bytes[idx] = (hbm_b + W + write + mig_h).sum(axis=1)
        link_bytes[idx] = (host_b + mig_l).sum(axis=1)
    return dict(prefill=prefill, step=step, hbm_bytes=hbm_bytes, link_bytes=link_bytes,
                decoded=decoded)  # fmt: skip


def price(engine, profile: HardwareProfile | str, sizes: Sizes | None = None, *,
          plan_share: float = 0.0, request_ids=None) -> dict:  # fmt: skip
    """A run of `engine` (its log and requests) priced on `profile` at `sizes` (None: the
    engine's own): a dict of

      tokens, modeled_seconds, tokens_per_s: every token produced (first tokens included) over
        the run's modeled time;
      ttft_p50_s, ttft_p99_s: submission to first token; tpot_p50_s, tpot_p99_s: first to
        last token over the tokens between (requests with two tokens or more);
      hbm_hit_rate: block reads served by HBM (tails included) over all block reads;
      link_bytes_per_token: the decode steps' link bytes over the tokens they produced;
      link_share, hbm_bound: the decode steps' link bytes over their HBM bytes, and whether it
        stays below B_link / B_hbm (then the steps are HBM-bound as a whole);
      steps, preemptions, plan_share.

    `request_ids`: the requests whose TTFT and TPOT count (None: every one with a token)."""
    profile = HardwareProfile.preset(profile) if isinstance(profile, str) else profile
    sizes = sizes or Sizes.of_engine(engine)
    log = engine.log
    t = iteration_seconds(log, engine.cache_config, profile, sizes, plan_share)
    per_iter = t["prefill"] + t["step"]
    clock = np.cumsum(per_iter)
    start = clock - per_iter
    ids = engine.requests if request_ids is None else request_ids
    ttft, tpot, tokens = [], [], 0
    for rid in ids:
        r = engine.requests[rid]
        tokens += len(r.tokens)
        if not r.token_iters:
            continue
        first = clock[r.token_iters[0]]
        ttft.append(first - start[r.submitted])
        if len(r.token_iters) > 1:
            tpot.append((clock[r.token_iters[-1]] - first) / (len(r.token_iters) - 1))
    seconds = float(clock[-1]) if len(clock) else 0.0
    hbm_reads = sum(int(it.out["hbm_blocks"].sum()) for it in log if it.out is not None)
    host_reads = sum(int(it.out["host_blocks"].sum()) for it in log if it.out is not None)
    decoded = int(t["decoded"].sum())
    link, hbm = float(t["link_bytes"].sum()), float(t["hbm_bytes"].sum())
    share = link / hbm if hbm else 0.0

    def pct(x, q):
        return float(np.percentile(x, q)) if x else float("nan")

    return dict(
        profile=profile.name,
        sizes=sizes.name,
        tokens=tokens,
        modeled_seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else float("nan"),
        ttft_p50_s=pct(ttft, 50),
        ttft_p99_s=pct(ttft, 99),
        tpot_p50_s=pct(tpot, 50),
        tpot_p99_s=pct(tpot, 99),
        hbm_hit_rate=hbm_reads / max(hbm_reads + host_reads, 1),
        link_bytes_per_token=link / max(decoded, 1),
        link_share=share,
        hbm_bound=bool(share <= profile.link_bandwidth / profile.hbm_bandwidth),
        steps=int(sum(it.out is not None for it in log)),
        preemptions=int(engine.preemptions),
        plan_share=float(max(plan_share, 0.0)),
    )


def plan_share(engine, repeats: int = 3) -> float:
    """The share of a decode step's wall time that planning adds on this device, as
    `jaxkv.summarize` charges it: one plan's wall seconds (`jaxkv.Decoder`'s `_plan` on the
    engine's state, best of `repeats`; 0 for a policy that does not plan) times the windows,
    spread over the decode steps, over the median wall time of a step that ends no window."""
    from jaxkv.decode.setup import best_seconds
    from jaxkv.placement.policies import plans

    dec = engine.core.decoder
    steps = [it for it in engine.log if it.out is not None]
    plain = [it.wall_step for it in steps if not it.window]
    windows = sum(it.window for it in steps)
    if not plans(dec.policy) or not windows or not plain or engine.state is None:
        return 0.0
    seconds = best_seconds(dec._plan, engine.state.decode, repeats)
    return seconds * windows / len(steps) / float(np.median(plain))

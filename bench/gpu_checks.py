"""The must-hold checks of bench/gpu_ops.py's compiled cases (its module docstring says what
they hold): host syncs, loops and their trip counts, host transfers, one lowered program at
every context, executed operations within a band, compiled bytes against the cost model's,
the prefill's temporary memory. `gpu_ops.py --check` and tests/test_gpu_compile.py apply them
to the case rows `gpu_ops.py` builds (dicts: fn, context, batch, mode, policy and the
`jaxkv.gpu.hlo.analyze` fields)."""

from __future__ import annotations

BYTES_BAND = 1.25  # compiled step bytes accessed / modeled bytes, at most
# ... checked up to this context. Past it the sparse step is over the band (1.38x at 128k, the
# 8B shape, batch 1): the HBM part and the staging pool are each sized for the whole
# selection, and XLA's analysis counts both widths (masked entries read one block, cached),
# which outweighs the weights at long context (bench/notebook/2026-12-07-hot-path.md)
BYTES_CHECKED_CONTEXT = 32768
PREFILL_TEMP_SHARE = 0.10  # the prefill's temporary memory, at most this share of HBM


def transfer_failures(row: dict, layers: int) -> list[str]:
    """Host traffic must-holds of one case row: the step's host KV reads (transfers inside the
    READ_SCOPE named scope) and migrate's transfers in each direction at most 2 per layer (one
    bulk transfer per layer for K and one for V); compact touches no host memory."""
    limit, fn, out = 2 * layers, row["fn"], []
    if fn == "step":
        if row["host_reads"] > limit:
            out.append(f"{row['host_reads']} host KV reads > 2 per layer ({limit})")
    elif fn == "migrate":
        out += [f"{row[d]} {d} > 2 per layer ({limit})" for d in ("h2d", "d2h") if row[d] > limit]
    elif fn == "compact" and row["h2d"] + row["d2h"]:
        out.append(f"{row['h2d']} h2d + {row['d2h']} d2h: compact should not touch host memory")
    return out


def group_key(row: dict) -> tuple:
    """(fn, batch, mode, policy) of a case row: the rows that differ only in context."""
    return (row["fn"], row["batch"], row["mode"], row["policy"])


def check(cases: list[dict], layers: int) -> list[str]:
    """The must-hold failures of a list of case rows (see the module docstring)."""
    fails = []
    groups: dict[tuple, dict[int, int]] = {}
    programs: dict[tuple, dict[int, tuple]] = {}
    plan_trips: dict[tuple, dict[int, dict]] = {}
    for r in cases:
        tag = f"{r['fn']} ctx={r['context']} B={r['batch']} {r['mode']} {r['policy']}"
        if r["host_syncs"]:
            fails.append(f"{tag}: {r['host_syncs']} host syncs (expected 0)")
        if r["unknown_trip_loops"]:
            fails.append(f"{tag}: {r['unknown_trip_loops']} unknown-trip loops (expected 0)")
        if r["fn"] == "window_step":
            # the plan's own loops have trip counts the policy fixes (the annealer's max_iters,
            # the forecast's window), never the context's: checked across contexts below
            plan_trips.setdefault(group_key(r), {})[r["context"]] = dict(r.get("loop_trips", {}))
        # the loops allowed are scans over layers (known trip count = layers): the step's one,
        # and the prefill's forward and, for a policy that starts from the prompt's prior, its
        # recomputation of the prompt's last positions (`jaxkv.decode.prompt`); nothing in the
        # program can repeat per block
        layer_loop = r["fn"] in ("step", "prefill") and layers > 1
        allowed = 2 if r["fn"] == "prefill" else 1
        trips = r.get("loop_trips", {})
        pairs = prefill_pairs(r["context"]) if r["fn"] == "prefill" else None
        other = {
            int(n): k
            for n, k in trips.items()
            if not (layer_loop and int(n) == layers) and int(n) != pairs
        }
        if r["fn"] != "window_step" and (other or (layer_loop and trips.get(layers, 0) > allowed)):
            fails.append(
                f"{tag}: while loops with trip counts {dict(trips)} (expected "
                + (f"at most {allowed} over the {layers} layers)" if layer_loop else "none)")
            )
        fails += [f"{tag}: {m}" for m in transfer_failures(r, layers)]
        # the model prices a step's reads and writes; a follow policy's step also moves
        # blocks (its promotions), priced apart: its ratio is reported, not checked
        priced = (r["policy"] == "-" or not _follows(r["policy"])) and (
            r["context"] <= BYTES_CHECKED_CONTEXT
        )
        if priced and r.get("bytes_ratio") is not None and r["bytes_ratio"] > BYTES_BAND:
            fails.append(
                f"{tag}: compiled bytes accessed {r['bytes_accessed'] / 1e9:.2f} GB are "
                f"{r['bytes_ratio']:.2f}x the modeled {r['modeled_total'] / 1e9:.2f} GB "
                f"(expected <= {BYTES_BAND}x)"
            )
        if r["fn"] == "prefill" and r.get("temp_share") is not None:
            if r["temp_share"] > PREFILL_TEMP_SHARE:
                fails.append(
                    f"{tag}: temporary memory {r['temp_gb']:.2f} GB is {r['temp_share']:.1%} of "
                    f"HBM (expected <= {PREFILL_TEMP_SHARE:.0%})"
                )
        key = group_key(r)
        groups.setdefault(key, {})[r["context"]] = r["gpu_ops"]
        programs.setdefault(key, {})[r["context"]] = (r["program_ops"], r["program_digest"])
    for key, by_ctx in programs.items():
        if len({d for _, d in by_ctx.values()}) > 1:
            fails.append(
                f"{' '.join(map(str, key))}: the program's operations change with context "
                f"{ {c: n for c, (n, _) in by_ctx.items()} } (expected the same list at every "
                "context: a shape-dependent branch in the program?)"
            )
    for key, by_ctx in plan_trips.items():
        if len({tuple(sorted(t.items())) for t in by_ctx.values()}) > 1:
            fails.append(
                f"{' '.join(map(str, key))}: loop trip counts change with context {by_ctx} "
                "(expected the same at every context: a loop per block in the plan?)"
            )
    for key, by_ctx in groups.items():
        if not ops_context_free(by_ctx):
            fails.append(
                f"{' '.join(map(str, key))}: gpu_ops grow with context {by_ctx} (more than "
                f"{OPS_BAND:.0%} apart: per-block work in the program?)"
            )
    return fails


def prefill_pairs(context: int) -> int:
    """Trips of the prefill attention's scan over (query block, key block) pairs at `context`
    tokens (`models.causal`: the causal triangle of blocks; one scan per layer, a known trip
    count): the one loop besides the layers' that the prefill may hold."""
    from models import causal

    blk = min(causal.BLOCK, context)
    return len(causal.block_pairs(-(-context // blk), blk, None)[0])


def _follows(policy: str) -> bool:
    """The policy runs an in-step rule (`Policy.rule`) inside the decode step."""
    from jaxkv.cost import CostModel
    from jaxkv.placement import presets

    return policy != "-" and presets.resolve(policy, CostModel()).rule is not None


def policy_free(cases: list[dict]) -> list[str]:
    """The decode step plans nothing, so every policy must compile it to the same operations
    (a policy's work belongs to the window step); failures for (context, batch, mode) groups
    whose steps differ. A policy with a per-step rule (`+follow`, lrfu) is the exception by
    design: its every step runs the follow rule and one bulk migration after the layers
    (`jaxkv.decode`), so it is left out."""
    groups: dict[tuple, dict[str, int]] = {}
    for r in cases:
        if r["fn"] == "step" and not _follows(r["policy"]):
            groups.setdefault((r["context"], r["batch"], r["mode"]), {})[r["policy"]] = r["gpu_ops"]
    return [
        f"step ctx={k[0]} B={k[1]} {k[2]}: gpu_ops differ by policy {v}"
        for k, v in groups.items()
        if len(set(v.values())) > 1
    ]


# XLA's GPU codegen picks kernels by size (a softmax reduction over 25k tokens becomes two
# kernels where one over 6k is one, a GEMM is split along K, a mask or a gather is no longer fused
# into its consumers once the cost model says duplicating it costs more), so one program executes
# more operations at a longer context: the 32-layer 8B decode step 2,213 / 2,469 / 2,502 at
# 8k / 32k / 128k (exact, batch 1), 2,565 / 2,757 / 2,886 (sparse), each from one and the same
# lowered program (checked: `program_digest`). With no loop in the program but the scan over
# layers (checked too), nothing can repeat per block; anything per block would grow with the
# 16x the blocks from 8k to 128k. The band bounds what codegen may add.
OPS_BAND = 0.5


def explain(sources: dict[tuple, dict[int, dict]]) -> list[str]:
    """Where the executed operations of one program differ between contexts: for each
    (fn, batch, mode, policy) group, the (kind, source op) pairs whose counts differ
    (`analyze`'s ops_by_source), as lines "group: kind source: n1 / n2 / n3"."""
    out = []
    for key, by_ctx in sources.items():
        ctxs = sorted(by_ctx)
        names = set().union(*(by_ctx[c] for c in ctxs))
        for name in sorted(names):
            counts = [by_ctx[c].get(name, 0) for c in ctxs]
            if len(set(counts)) > 1:
                out.append(
                    f"{' '.join(map(str, key))}: {name[0]} {name[1]}: "
                    + " / ".join(f"{n} at {c}" for n, c in zip(counts, ctxs, strict=True))
                )
    return out


def ops_context_free(by_context: dict[int, int]) -> bool:
    """True when the gpu_ops of one function at several contexts lie within OPS_BAND."""
    lo, hi = min(by_context.values()), max(by_context.values())
    return hi <= lo * (1 + OPS_BAND)

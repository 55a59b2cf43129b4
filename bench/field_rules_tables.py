"""The tables of bench/RESULTS.md, section 5, "The live policy against the field's rules and
Belady" (issue 45), printed as Markdown from the JSON the three benchmarks write.

Reads (each optional; a missing file is said and skipped):
- bench/results/loop_traces.json: `python bench/loop_traces.py bench/traces/smollm2_gpl3.npz
  bench/traces/smollm2_doctest.npz --json bench/results/loop_traces.json` (about 20 min);
- bench/results/demo_sparse_25.json and demo_sparse_10.json: `jaxkv demo --attention sparse
  --no-plot --json [--hbm-fraction 0.10] > ...` (about 4 min each);
- bench/results/decode_mh_8k_sparse_wt.json: `bench/bench_decode.py --shape mh --contexts 8192
  --steps 24 --window 8 --modes sparse --host-tier write-through --bounds --json ...`.

For each case: every field rule (`jaxkv policies` lists them), the live policy, Belady's MIN
with bypass priced by the cost model (the attainable limit), the bounds; "vs best rule" is
the modeled speed over the best field rule's of the same run, and "share of the gap" the live
policy's share of the way from the best field rule to Belady's priced schedule. Belady's
schedule has the most HBM hits, not the shortest time: where a step is bound by HBM reads, its
extra promotions cost more than the link reads they save, and it can be slower than a rule;
there the share is not defined and the table says so.

    python bench/field_rules_tables.py [--results bench/results]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FIELD = ("lru", "arc", "slru", "lfu", "tinylfu")  # the field's rules (issue 45)
LIVE = "lrfu"
OURS = ("static", "lru-plan", "anneal", "anneal+reuse+follow")
SUMMARY: list[str] = []  # one row per case, for the table that leads the section


def _summarize(case: str, rows, best: str, limit: str | None, bound: str, fmt) -> None:
    live, rule = rows[LIVE]["speed"], rows[best]["speed"]
    lim = f"{fmt(rows[limit])} ({_ratio(rows[limit]['speed'], rule)})" if limit else "-"
    share = _share(rule, live, rows[limit]["speed"]) if limit else "-"
    share = "n/a (Belady slower)" if share.startswith("not defined") else share
    SUMMARY.append(
        f"| {case} | {best} {fmt(rows[best])} | **{fmt(rows[LIVE])}** | **{_ratio(live, rule)}** "
        f"| {lim} | {bound} | {share} |"
    )


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}x"


def _share(best_rule: float, live: float, limit: float) -> str:
    """The live policy's share of the way from the best rule to the limit, in speed."""
    if limit <= best_rule:
        return (
            f"not defined: Belady's priced schedule is {_ratio(limit, best_rule)} the best "
            "rule's speed"
        )
    share = (live - best_rule) / (limit - best_rule)
    return f"{share:.0%}" + (" (past Belady's schedule)" if share > 1 else "")


def _case_table(rows, unit: str, best_rule: str, limit: str) -> list[str]:
    """rows: name -> dict(speed=..., hits=str, moved=int); speed in `unit` (higher is better)."""
    out = [f"| policy | HBM hits | blocks moved | {unit} | vs best rule ({best_rule}) |"]
    out.append("|---|---|---|---|---|")
    base = rows[best_rule]["speed"]
    for name, r in rows.items():
        label = f"**{name}**" if name in (LIVE, best_rule) else name
        speed = r.get("shown") or f"{r['speed']:,.0f}"
        out.append(
            f"| {label} | {r['hits']} | {r['moved']:,} | {speed} | {_ratio(r['speed'], base)} |"
        )
    return out


def traces(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    out = [
        f"Replayed real traces ({d['date'][:10]}, {d['device']}, jax {d['jax']}; "
        f"`python bench/loop_traces.py {' '.join(d['args']['traces'])} --json {path}`): "
        "modeled ms per decode step (all layers), planning charged; the ratios and the gap's "
        "share are taken in speed (1 / ms).",
        "",
    ]
    for c in d["cases"]:
        P = c["policies"]
        names = [n for n in (*OURS, *FIELD, LIVE, "belady", "belady:shared") if n in P]
        rows = {
            n: dict(
                speed=1000.0 / P[n]["modeled_ms"],
                shown=f"{P[n]['modeled_ms']:.2f}",
                hits=f"{P[n]['sealed_hits']:,} ({P[n]['sealed_hits'] / P[n]['sealed_reads']:.1%})",
                moved=P[n]["migrated_blocks"],
            )
            for n in names
        }
        best = max((n for n in FIELD if n in P), key=lambda n: rows[n]["speed"])
        tr = c["trace"].split(" ")[0]
        _summarize(
            f"{tr}, {c['label']} (ms)",
            rows,
            best,
            "belady",
            f"{c['bounds_ms']['best']:.2f}",
            lambda r: r["shown"],
        )
        out += [
            f"**{c['trace']}, {c['label']}** (pool {c['pool_blocks']} of {c['blocks']} blocks "
            f"per layer, {c['steps']} steps; best bound {c['bounds_ms']['best']:.2f} ms):",
            "",
            *_case_table(rows, "modeled ms / step", best, "belady"),
            "",
            f"{LIVE} {_ratio(rows[LIVE]['speed'], rows[best]['speed'])} the best field rule; "
            f"share of the best-rule-to-Belady gap: "
            f"{_share(rows[best]['speed'], rows[LIVE]['speed'], rows['belady']['speed'])}.",
            "",
        ]
    return out


def demo(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    P = d["policies"]
    limit = "belady (limit)"
    rows = {
        n: dict(
            speed=P[n]["modeled_tokens_per_s_with_plan"],
            hits=f"{P[n]['hbm_hit_rate']:.1%}",
            moved=P[n]["migrated_blocks"],
        )
        for n in P
    }
    rows = {("lru" if n == "lru" else n): r for n, r in rows.items()}
    best = max((n for n in FIELD if n in P), key=lambda n: rows[n]["speed"])
    bound = d["bound_tokens_per_s"]["best"]
    _summarize(
        f"the demo, HBM {d['hbm_fraction']:.0%} (tok/s)",
        rows,
        best,
        limit,
        f"{bound:,.0f}",
        lambda r: f"{r['speed']:,.0f}",
    )
    return [
        f"**The demo, {d['model_name']}, {d['attention']}, {d['profile']}, HBM "
        f"{d['hbm_fraction']:.0%}** ({d['hbm_blocks']} of {d['total_blocks']} blocks per layer; "
        f"{d['prompt_tokens']:,} prompt tokens, {d['new_tokens']} generated; {d['device']}, jax "
        f"{d['jax']}; `jaxkv demo --attention sparse --no-plot --json"
        + ("" if d["hbm_fraction"] == 0.25 else f" --hbm-fraction {d['hbm_fraction']:.2f}")
        + f"`; best bound {bound:,.0f} tok/s):",
        "",
        *_case_table(rows, "modeled tok/s, planning charged", best, limit),
        "",
        f"{LIVE} {_ratio(rows[LIVE]['speed'], rows[best]['speed'])} the best field rule; share "
        f"of the best-rule-to-Belady gap: "
        f"{_share(rows[best]['speed'], rows[LIVE]['speed'], rows[limit]['speed'])}.",
        "",
    ]


def decode(path: Path) -> list[str]:
    d = json.loads(path.read_text())
    rows, limit = {}, None
    for r in d["rows"]:
        name = r["policy"]
        rows[name] = dict(
            speed=r["modeled_tokens_per_s_with_plan"],
            hits=f"{r['hbm_hit_rate']:.1%}",
            moved=r["migrated_blocks"],
        )
    b = (d.get("bounds") or [{}])[0]
    if "belady" in b:
        r, limit = b["belady"], "belady (limit)"
        rows[limit] = dict(
            speed=r["modeled_tokens_per_s"],
            hits=f"{r['hbm_hit_rate']:.1%}",
            moved=r["migrated_blocks"],
        )
    missing = [n for n in (*FIELD, LIVE) if n not in rows]
    if missing:
        return [f"(bench_decode: {', '.join(missing)} missing from {path}; rerun it)", ""]
    best = max(FIELD, key=lambda n: rows[n]["speed"])
    a = d["args"]
    bounds = b.get("bounds_tokens_per_s") or {}
    tail = f"; best bound {bounds['best']:,.0f} tok/s" if "best" in bounds else ""
    share = (
        _share(rows[best]["speed"], rows[LIVE]["speed"], rows[limit]["speed"])
        if limit
        else "no Belady row in this JSON"
    )
    _summarize(
        f"bench_decode {a['contexts']} (tok/s)",
        rows,
        best,
        limit,
        f"{bounds['best']:,.0f}" if "best" in bounds else "-",
        lambda r: f"{r['speed']:,.0f}",
    )
    return [
        f"**bench_decode, random-init Llama (8 layers), {a['contexts']} tokens, sparse top "
        f"{a['topk']:.0%}, {a['profile']}, HBM {a['hbm_fraction']:.0%}, {a['host_tier']}** "
        f"({d['date'][:10]}, {d['device']}, jax {d['jax']}{tail}; `JAX_PLATFORMS=cpu "
        f".venv/bin/python bench/bench_decode.py --shape {a['shape']} --contexts {a['contexts']} "
        f"--steps {a['steps']} --window {a['window']} --modes {a['modes']} --host-tier "
        f"{a['host_tier']} --bounds --json {path}`, 25 min; Belady replayed on the "
        "first tiered run's reads):",
        "",
        *_case_table(rows, "modeled tok/s, planning charged", best, limit or best),
        "",
        f"{LIVE} {_ratio(rows[LIVE]['speed'], rows[best]['speed'])} the best field rule; share "
        f"of the best-rule-to-Belady gap: {share}.",
        "",
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="bench/results", help="the folder of the JSON files")
    args = ap.parse_args(argv)
    root = Path(args.results)
    parts = [
        (demo, root / "demo_sparse_25.json"),
        (demo, root / "demo_sparse_10.json"),
        (decode, root / "decode_mh_8k_sparse_wt.json"),
        (traces, root / "loop_traces.json"),
    ]
    body = []
    for fn, path in parts:
        if not path.exists():
            body.append(f"({path} missing: run the command in this script's docstring)\n")
            continue
        body += fn(path)
    print(
        "| case | best field rule | lrfu | lrfu / best rule | Belady, priced (/ best rule) "
        "| best bound | lrfu's share of the best-rule-to-Belady gap |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(SUMMARY) + "\n")
    print("\n".join(body))
    return 0


if __name__ == "__main__":
    sys.exit(main())

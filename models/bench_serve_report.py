"""`jaxkv bench-serve`'s report: the headline table, the per-run table and the figure."""

from __future__ import annotations

from pathlib import Path

from jaxkv.cli import atomic_output


def _verdict(row: dict) -> str:
    if row["policy"] == "all-hbm":
        return "reference"
    if row["loses"]:
        return "tiering LOSES"
    return "wins" if row["hbm_bound"] else "wins, link-bound"


def format_headline(report: dict) -> str:
    """The headline table: per sizes and profile, each engine's modeled tokens/s, its ratio to
    the all-HBM engine at N, the ceiling 1 + W / (N x r), the tiered steps' link bytes over
    their HBM bytes against B_link / B_hbm, and what that says."""
    o = report["options"]
    base = next(r for r in report["runs"] if r["all_hbm"])
    lines = [
        f"headline: HBM holds the full KV of N={o['n']} requests ({base['hbm_blocks_per_layer']} "
        f"blocks of {o['block_size']} tokens a layer); {o['attention']} attention"
        + (f" (top {100 * o['topk']:.0f}% of blocks)" if o["attention"] == "sparse" else "")
        + f"; model {report['model']}, {report['layers']} layers",
        "ratio: modeled tokens/s over the all-HBM engine's at N (planning charged); ceiling: "
        "1 + W / (N x r) while both engines are HBM-bound; link/HBM: the tiered steps' link "
        "bytes over their HBM bytes, HBM-bound below the limit B_link / B_hbm",
    ]
    rows = report["headline"]
    per = {}
    for row in rows:
        per.setdefault(row["sizes"], row)
    lines += [
        f"read fraction (all-HBM, full batch): {100 * rows[0]['read_fraction']:.1f}% of the "
        "blocks written; the ceiling at that fraction with 80 GB of KV in HBM: "
        + ", ".join(f"{s} {r['deployed_ceiling']:.2f}x" for s, r in per.items())
    ]
    q = report.get("quality")
    if q is not None:
        lines.append(
            f"sparse quality at that fraction (top {100 * q['topk']:.0f}%, {q['read_share']:.1%} "
            f"of exact's block reads; {q['batch']} windows of the corpus, {q['prompt_len']} "
            f"tokens then {q['steps']} teacher-forced, {q['positions']:,} positions): top-1 "
            f"agreement with exact {q['top1_agreement']:.1%}, KL(exact || sparse) mean "
            f"{q['kl_mean']:.4f} / p99 {q['kl_p99']:.4f} nats, perplexity {q['ppl_exact']:.3f} "
            f"exact, {q['ppl_sparse']:.3f} sparse ({q['ppl_delta_pct']:+.2f}%); every engine "
            "decodes the sparse all-HBM engine's tokens"
        )
    w = max(9, *(len(r["policy"]) for r in report["headline"]))
    head = (
        f"{'sizes':<34} {'profile':<10} {'engine':<{w}} {'conc':>5} {'tok/s':>11} {'ratio':>6} "
        f"{'ceiling':>7} {'link/HBM':>9} {'limit':>6}  verdict"
    )
    lines += ["", head, "-" * len(head)]
    last = None
    for row in report["headline"]:
        key = (row["sizes"], row["profile"])
        if last is not None and key != last:
            lines.append("")
        last = key
        lines.append(
            f"{row['sizes'][:34]:<34} {row['profile']:<10} {row['policy']:<{w}} "
            f"{row['concurrency']:>5} {row['tokens_per_s']:>11,.0f} {row['ratio']:>5.2f}x "
            f"{row['ceiling']:>6.2f}x {100 * row['link_share']:>8.2f}% "
            f"{100 * row['link_limit']:>5.1f}%  {_verdict(row)}"
        )
    return "\n".join(lines)


def format_runs(report: dict) -> str:
    """Per run: modeled figures at the model's own sizes on each profile, TTFT and TPOT p50 /
    p99 in ms, hit rate, link bytes per token, preemptions, wall seconds."""
    own = report["own_sizes"]
    profiles = report["options"]["price_profiles"]
    w = max(9, *(len(r["policy"]) for r in report["runs"]))
    head = (
        f"{'engine':<{w}} {'conc':>4} {'profile':<10} {'tok/s':>10} {'TTFT p50/p99 ms':>17} "
        f"{'TPOT p50/p99 ms':>17} {'hit':>6} {'link B/tok':>11} {'preempt':>7} {'wall s':>7} "
        f"{'step ms':>7}"
    )
    lines = [f"per run, priced at {own}:", head, "-" * len(head)]
    for r in report["runs"]:
        for prof in profiles:
            p = r["priced"][own][prof]
            lines.append(
                f"{r['policy']:<{w}} {r['concurrency']:>4} {prof:<10} {p['tokens_per_s']:>10,.0f} "
                f"{1e3 * p['ttft_p50_s']:>8.3f}/{1e3 * p['ttft_p99_s']:<8.3f} "
                f"{1e3 * p['tpot_p50_s']:>8.4f}/{1e3 * p['tpot_p99_s']:<8.4f} "
                f"{100 * p['hbm_hit_rate']:>5.1f}% {p['link_bytes_per_token']:>11,.0f} "
                f"{r['preemptions']:>7} {r['wall_s']:>7.1f} {r['wall_step_ms']:>7.1f}"
            )
    return "\n".join(lines)


def format_report(report: dict) -> str:
    o = report["options"]
    work = (
        f"workload: {o['requests_per_slot']:g} requests per slot, prompts {o['prompt_len'][0]}-"
        f"{o['prompt_len'][1]} tokens, outputs {o['output_len'][0]}-{o['output_len'][1]} "
        "(uniform), cut from the standard library's sources; "
        + (f"Poisson arrivals at {o['rate']:g}/s" if o["rate"] else "fixed concurrency")
        + f"; seed {o['seed']}\nthe engines decide under {o['profile']} (lrfu's slack: the "
        "promotions its link time hides); every profile prices those same decisions"
    )
    return "\n\n".join([work, format_headline(report), format_runs(report)])


def plot_report(report: dict, path: Path) -> Path | None:
    """A PNG: modeled throughput and TPOT p50 against concurrency, one line per policy, the
    all-HBM engine as the reference point, one row per pricing profile (the model's own
    sizes); None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    own = report["own_sizes"]
    profiles = report["options"]["price_profiles"]
    fig, axes = plt.subplots(len(profiles), 2, figsize=(10, 3.4 * len(profiles)), squeeze=False)
    policies = [p for p in dict.fromkeys(r["policy"] for r in report["runs"]) if p != "all-hbm"]
    base = next(r for r in report["runs"] if r["all_hbm"])
    for (ax_t, ax_p), prof in zip(axes, profiles, strict=True):
        for i, pol in enumerate(policies):
            rs = [r for r in report["runs"] if r["policy"] == pol]
            x = [r["concurrency"] for r in rs]
            ax_t.plot(x, [r["priced"][own][prof]["tokens_per_s"] for r in rs], "o-",
                      color=f"C{i}", label=pol)  # fmt: skip
            ax_p.plot(x, [1e3 * r["priced"][own][prof]["tpot_p50_s"] for r in rs], "o-",
                      color=f"C{i}", label=pol)  # fmt: skip
        b = base["priced"][own][prof]
        ax_t.plot([base["concurrency"]], [b["tokens_per_s"]], "ks", label="all-HBM")
        ax_p.plot([base["concurrency"]], [1e3 * b["tpot_p50_s"]], "ks", label="all-HBM")
        for ax, what in ((ax_t, "modeled tokens/s"), (ax_p, "TPOT p50 (ms, modeled)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel(what)
            ax.set_title(f"{prof}", fontsize=9)
            ax.legend(fontsize=8)
    fig.suptitle(f"jaxkv bench-serve: {report['model']}, HBM holds N={base['concurrency']}",
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    with atomic_output(path, ".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path

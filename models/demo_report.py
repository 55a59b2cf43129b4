"""The demo's report: its table, its figure and how each policy compares with the field's
rules and Belady's limit (`jaxkv demo`, models.demo)."""

from __future__ import annotations

from pathlib import Path

from jaxkv.cli import atomic_output

FIELD_RULES = ("lru", "arc", "slru", "lfu", "tinylfu")  # the ratios are taken against the best


def hbm_said(report: dict) -> str:
    """The policies' HBM as the report's capacity gave it: "25% of the KV footprint", or the
    blocks or bytes given with the blocks per layer and the fraction they make."""
    given = report.get("hbm_capacity", {})
    pct = f"{100 * report['hbm_fraction']:.0f}% of the KV footprint"
    if "hbm_blocks" in given:
        return f"{given['hbm_blocks']:,} blocks per layer of {report['total_blocks']:,}: {pct}"
    if "hbm_bytes" in given:
        return (
            f"{given['hbm_bytes']:,} bytes: {report['hbm_blocks']:,} blocks per layer of "
            f"{report['total_blocks']:,}, {pct}"
        )
    return pct


LIMIT = "belady (limit)"  # the report's row of `jaxkv.sim.loop.limit`


def best_field_rule(report: dict) -> tuple[str, float] | None:
    """(name, modeled tok/s) of the fastest of the field's rules in the report, or None."""
    pol = report["policies"]
    field = {n: pol[n]["modeled_tokens_per_s_with_plan"] for n in FIELD_RULES if n in pol}
    if not field:
        return None
    best = max(field, key=field.get)
    return best, field[best]


def gap_closed(report: dict) -> str:
    """What the limit and bound rows mean, and the share of the gap between the best of the
    field's rules and Belady's priced schedule that each other policy closes, planning
    charged."""
    pol = report["policies"]
    said = (
        "belady (limit): Belady's MIN with bypass, the fewest host reads this HBM can make, "
        "priced (jaxkv.sim.loop.limit); bound: no placement of this HBM size reads these blocks "
        "faster (jaxkv.sim.loop.bounds: the fewest link crossings, and HBM re-chosen for free "
        "before each step)"
    )
    best, limit = best_field_rule(report), pol.get(LIMIT, {}).get("modeled_tokens_per_s")
    if best is None or limit is None:
        return said
    name, base = best
    gap = limit - base
    if gap <= 0:
        return said + (
            f"; Belady's schedule is no faster than the best field rule ({name}) here: its "
            "promotions' HBM writes cost more than the host reads they save"
        )
    if gap <= 0.01 * limit:
        return said + f"; the best field rule ({name}) is within 1% of Belady's"
    closed = [
        f"{n} {100 * (r['modeled_tokens_per_s_with_plan'] - base) / gap:.0f}%"
        for n, r in pol.items()
        if n not in ("all-hbm", LIMIT, *FIELD_RULES)
    ]
    return said + (
        f"; gap from the best field rule ({name}) to Belady closed, plan charged: "
        + ", ".join(closed)
    )


def format_table(report: dict) -> str:
    rows = [
        (
            "policy",
            "W",
            "HBM hit rate",
            "blocks migrated",
            "modeled tok/s",
            "plan ms (/step)",
            "modeled tok/s, plan charged",
            "wall tok/s",
        )
    ]
    base = report["policies"]["all-hbm"]["wall_tokens_per_s"]
    for name, r in report["policies"].items():
        wall = r["wall_tokens_per_s"]
        rows.append(
            (
                name,
                "-" if r.get("window") is None else str(r["window"]),
                f"{100 * r['hbm_hit_rate']:.1f}%",
                str(r["migrated_blocks"]),
                f"{r['modeled_tokens_per_s']:,.0f}",
                "-" if r.get("replayed") else f"{r['plan_ms']:.2f} ({r['plan_ms_per_step']:.3f})",
                f"{r['modeled_tokens_per_s_with_plan']:,.0f}",
                "replayed" if wall is None else f"{wall:,.1f} ({wall / base:.2f}x)",
            )
        )
    bound = report.get("bound_tokens_per_s")
    if bound:
        rows.append(("bound (any placement)", "", "", "", f"{bound['best']:,.0f}", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if bound:
        lines += ["", gap_closed(report)]
    lossless = report["lossless"] if report["attention"] == "exact" else report["placement_free"]
    head = (
        f"jaxkv demo: {report['model']}; prompt {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} generated; HBM {hbm_said(report)} (all-hbm: 100%); "
        f"{report['attention']} attention; modeled on "
        f"{report['profile']}; wall on {report['device']}, jax {report['jax']}"
    )
    note = (
        "W: steps between plans; plan ms: one plan's wall time on this device (/step: spread "
        "over the W steps); 'plan charged' lengthens each modeled step by the share of a "
        "step's wall time that planning adds here; replayed: the first tiered run's reads "
        "replayed in the decode loop's own accounting (jaxkv.sim.loop: the decoder's admission "
        "function and costs, equal to a decode's), no wall time"
    )
    if report["attention"] == "exact":
        tail = (
            "lossless: tokens identical to the all-HBM cache under every policy"
            if lossless
            else "NOT lossless: some policy changed the generated tokens"
        )
    else:
        tail = (
            "placement-free: sparse attention approximates the model, but its tokens are "
            "identical to the all-HBM cache's under every policy"
            if lossless
            else "NOT placement-free: some policy changed the sparse run's tokens"
        )
    said = report["answer"].strip()
    who = "the model's answer" if report.get("chat") else "the model's continuation"
    answer = f"{who} (all-HBM cache, {report['attention']} attention): {said!r}"
    return "\n".join([head, "", answer, "", *lines, "", note, tail])


def plot_report(reports: list[dict], path: Path) -> Path | None:
    """A PNG of modeled tokens/s (planning charged) and HBM hit rate per policy, one row of
    panels per run; None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(len(reports), 2, figsize=(10, 3.2 * len(reports)), squeeze=False)
    for (ax_t, ax_h), r in zip(axes, reports, strict=True):
        names = list(r["policies"])
        tps = [r["policies"][n]["modeled_tokens_per_s_with_plan"] / 1e3 for n in names]
        hit = [100 * r["policies"][n]["hbm_hit_rate"] for n in names]
        colors = ["0.6" if n == "all-hbm" else f"C{i}" for i, n in enumerate(names)]
        title = f"{r['attention']} attention, {r['profile']}"
        ax_t.barh(names, tps, color=colors)
        ax_t.set_xlabel("modeled tokens/s (thousands), planning charged")
        ax_t.set_title(title)
        ax_t.invert_yaxis()
        ax_h.barh(names, hit, color=colors)
        ax_h.set_xlabel("HBM hit rate (%)")
        ax_h.set_xlim(0, 100)
        ax_h.set_title(f"HBM holds {100 * r['hbm_fraction']:.0f}% of the KV")
        ax_h.invert_yaxis()
    fig.suptitle(f"jaxkv demo: {reports[0]['model']}", fontsize=9)
    fig.tight_layout()
    with atomic_output(path, ".png") as tmp:  # no half-written figure on a failure or Ctrl-C
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return path

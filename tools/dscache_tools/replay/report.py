"""The outputs of ``dscache replay``: the aligned table and the PNG plot."""

from __future__ import annotations

from pathlib import Path

from dscache_tools.replay.simulate import ReplayReport


def format_table(report: ReplayReport) -> str:
    """Plain aligned text: one row per policy and capacity, then the bounds.

    ``of Belady`` is the policy's token hit ratio over Belady's at the same
    capacity; ``x LRU`` its token hit ratio over LRU's.
    """
    header = ("capacity", "policy", "token hit", "block hit", "of Belady", "x LRU")
    rows: list[tuple[str, ...]] = []
    capacities = list(dict.fromkeys(r.capacity_blocks for r in report.results))
    capacities += [b.capacity_blocks for b in report.belady if b.capacity_blocks not in capacities]
    for capacity in capacities:
        bound = report.belady_at(capacity)
        lru = report.result("lru", capacity)
        for r in report.results:
            if r.capacity_blocks != capacity:
                continue
            tok = r.ratios.token_hit_ratio
            rows.append(
                (
                    str(capacity),
                    r.label,
                    f"{tok:.4f}",
                    f"{r.ratios.block_hit_ratio:.4f}",
                    _ratio(tok, bound.token_hit_ratio if bound else None, "{:.1%}"),
                    _ratio(tok, lru.token_hit_ratio if lru else None, "{:.3f}"),
                )
            )
        if bound is not None:
            rows.append(
                (
                    str(capacity),
                    "belady",
                    f"{bound.token_hit_ratio:.4f}",
                    f"{bound.block_hit_ratio:.4f}",
                    "100.0%",
                    _ratio(bound.token_hit_ratio, lru.token_hit_ratio if lru else None, "{:.3f}"),
                )
            )
    rows.append(
        (
            "inf",
            "ideal",
            f"{report.ideal.token_hit_ratio:.4f}",
            f"{report.ideal.block_hit_ratio:.4f}",
            "",
            "",
        )
    )
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = [
        f"trace {report.trace}: {report.requests} requests",
        "  ".join(
            h.rjust(w) if i != 1 else h.ljust(w)
            for i, (h, w) in enumerate(zip(header, widths, strict=True))
        ),
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.rjust(w) if i != 1 else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )
    return "\n".join(lines)


def _ratio(value: float, base: float | None, fmt: str) -> str:
    if base is None or base <= 0:
        return "-"
    return fmt.format(value / base)


def write_png(report: ReplayReport, path: str | Path) -> None:
    """Token hit ratio per policy vs capacity, with the Belady and ideal lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    try:
        for name in dict.fromkeys(r.label for r in report.results):
            points = sorted(
                (r.capacity_blocks, r.ratios.token_hit_ratio)
                for r in report.results
                if r.label == name
            )
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
        if report.belady:
            points = sorted((b.capacity_blocks, b.ratios.token_hit_ratio) for b in report.belady)
            ax.plot(
                [p[0] for p in points],
                [p[1] for p in points],
                "k--",
                marker="s",
                label="belady (offline optimal)",
            )
        ax.axhline(
            report.ideal.token_hit_ratio, color="grey", linestyle=":", label="ideal (infinite)"
        )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("capacity (blocks)")
        ax.set_ylabel("token hit ratio")
        ax.set_title(f"{Path(report.trace).name}: {report.requests} requests")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)

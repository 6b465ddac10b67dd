"""The Kubernetes demo's figure: weights and hit rates over time for both rollouts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dscache_tools.demo.output import pyplot
from dscache_tools.loadgen import percentile


def write_png(report: dict[str, Any], path: Path) -> None:
    """Weights and hit rates over time for both rollouts, as a PNG."""
    plt = pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(14, 8), sharex="col")
    for col, (key, title) in enumerate(
        (("warm_canary", "cache-warmth-aware canary"), ("blind_rolling", "blind rolling update"))
    ):
        tl = report["timeline"][key]
        top, bottom = axes[0][col], axes[1][col]
        if key == "warm_canary":
            pts = [(e["t_s"], e["value"]) for e in tl["events"] if e["what"] == "weight"]
            ylabel = "canary weight (% of new sessions)"
        else:
            pts = [
                (e["t_s"], 100.0 * e["value"][0] / max(1, e["value"][2]))
                for e in tl["events"]
                if e["what"].endswith("_updated") and e["value"][2]
            ]
            ylabel = "updated pods (%)"
        if pts:
            xs = [p[0] for p in pts] + [max((r["t_s"] for r in tl["requests"]), default=0)]
            ys = [p[1] for p in pts] + [pts[-1][1]]
            top.step(xs, ys, where="post", color="#2980b9")
        top.set_ylim(-5, 105)
        top.set_ylabel(ylabel)
        top.set_title(title)
        top.grid(alpha=0.3)
        bins: dict[int, list[dict[str, Any]]] = {}
        for r in tl["requests"]:
            bins.setdefault(int(r["t_s"] // 15), []).append(r)
        xs, hit, p99 = [], [], []
        for b_, rs in sorted(bins.items()):
            ok = [r for r in rs if r["ok"]]
            prompt = sum(r["prompt_tokens"] for r in ok)
            xs.append(b_ * 15 + 7.5)
            hit.append(sum(r["cached_tokens"] for r in ok) / prompt if prompt else float("nan"))
            p99.append(percentile([r["ttft_s"] for r in ok if r["ttft_s"] is not None], 99) or 0)
        bottom.plot(xs, hit, "o-", color="#27ae60", label="token hit ratio (15 s bins)")
        bottom.set_ylim(0, 1.05)
        bottom.set_xlabel("seconds since the revision change")
        bottom.set_ylabel("token hit ratio")
        bottom.grid(alpha=0.3)
        twin = bottom.twinx()
        twin.plot(xs, p99, "s--", color="#c0392b", label="TTFT P99 (15 s bins)")
        twin.set_ylabel("TTFT P99 (s)")
        lines = bottom.get_legend_handles_labels()
        more = twin.get_legend_handles_labels()
        bottom.legend(lines[0] + more[0], lines[1] + more[1], loc="lower right", fontsize=8)
    ratios = report["ratios"]
    fig.suptitle(
        "dscache demo kubernetes: recomputed share canary/blind "
        f"{ratios['recomputed_share']}, TTFT P99 canary/blind {ratios['ttft_p99']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The Kubernetes demo's figures, from what the client saw, and its table.

Contract:
    * Recomputed prompt tokens are prompt tokens minus cached tokens of the
      successful requests; errors are counted, never dropped.
    * A rollout's cost is measured beyond the steady state of the same traffic
      (``excess_recomputed_*``); below it is noise, counted as 0 in the ratios.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dscache_tools.demo.kube.watch import Phase
from dscache_tools.demo.output import cell
from dscache_tools.loadgen import RequestResult, percentile


def figures(results: Sequence[tuple[float, RequestResult]]) -> dict[str, Any]:
    """What the client saw over ``results``."""
    ok = [r for _, r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "requests": len(results),
        "errors": sum(not r.ok for _, r in results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "recomputed_tokens": prompt - cached,
        "recomputed_share": (prompt - cached) / prompt if prompt else None,
        "token_hit_ratio": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
    }


def served_by(res: RequestResult) -> str | None:
    """The model pod that answered (the last address of the router's debug header)."""
    if not res.ok or not res.upstream:
        return None
    return res.upstream.split(",")[-1].strip() or None


#: How the turn that moved a session reached the router: with the session's id (its
#: turn before carried the same), with a new id (a reconnect), or with none (a dropped
#: id: the router keyed it by its prompt).
MOVE_KEYS = ("session", "new_id", "no_id")


@dataclass(frozen=True)
class Move:
    """A session's first turn on another pod while its pod still served.

    ``indistinguishable``: the turn carried no id its old pod's router knew (none, or a
    new one) and the pod it went to held its whole history from another conversation
    (that conversation's turn, served there before, left the same messages and answer):
    its request named nothing that told the two conversations apart.
    """

    session: str
    turn: int
    started_s: float  # the moved turn's start, seconds into the part's load
    key: str  # one of MOVE_KEYS
    before: str
    after: str
    indistinguishable: bool


def moves(results: Sequence[RequestResult]) -> list[Move]:
    """Sessions whose pod changed from one turn to the next while the old pod kept
    serving (it answered a request that started at or after the moved turn): the
    router placed them anew, not a pod going away; one :class:`Move` per session, its
    first such turn. Needs the router's debug headers."""
    last_seen: dict[str, float] = {}
    turns: dict[str, list[tuple[RequestResult, str]]] = {}  # (turn, pod that served it)
    left: dict[tuple[str, str], list[tuple[float, str]]] = {}  # (pod, digest) -> (started, session)
    for r in results:
        pod = served_by(r)
        if pod is not None:
            last_seen[pod] = max(last_seen.get(pod, r.started_s), r.started_s)
            turns.setdefault(r.session, []).append((r, pod))
            if r.left_digest:
                left.setdefault((pod, r.left_digest), []).append((r.started_s, r.session))
    found = []
    for served in turns.values():
        served.sort(key=lambda turn: turn[0].started_s)
        for (old, before), (new, after) in itertools.pairwise(served):
            if before == after or last_seen[before] < new.started_s:
                continue
            key = (
                "no_id"
                if new.session_id is None
                else "session"
                if new.session_id == old.session_id
                else "new_id"
            )
            twins = left.get((after, new.history_digest), [])
            same = any(s != new.session and t < new.started_s for t, s in twins)
            started = round(new.started_s, 1)
            found.append(
                Move(new.session, new.turn, started, key, before, after, key != "session" and same)
            )
            break
    return found


def count_by_key(found: Sequence[Move]) -> dict[str, int]:
    """How many of ``found`` each key of :data:`MOVE_KEYS` moved (0 for none)."""
    counts = dict.fromkeys(MOVE_KEYS, 0)
    for move in found:
        counts[move.key] += 1
    return counts


def sessions_moved_by_key(results: Sequence[RequestResult]) -> dict[str, int]:
    """How many sessions :func:`moves` finds, by how their moved turn was keyed
    (:data:`MOVE_KEYS`)."""
    return count_by_key(moves(results))


def sessions_moved(results: Sequence[RequestResult]) -> int:
    """How many sessions :func:`sessions_moved_by_key` counts, whatever their key."""
    return sum(sessions_moved_by_key(results).values())


def per_step(phase: Phase, label: str) -> list[dict[str, Any]]:
    """Hit rate of the requests started during each value of ``label`` (weight, pods)."""
    marks = [(t, v) for t, lab, v in phase.events if lab == label and t >= phase.started]
    first = [(phase.started, _value_at(phase, label, phase.started)), *marks]
    out = []
    for i, (t, value) in enumerate(first):
        end = first[i + 1][0] if i + 1 < len(first) else float("inf")
        chunk = [(s, r) for s, r in phase.results if t <= s < end]
        if not chunk:
            continue
        f = figures(chunk)
        out.append(
            {
                label: value,
                "from_s": round(t - phase.started, 1),
                "requests": f["requests"],
                "token_hit_ratio": f["token_hit_ratio"],
                "ttft_p99_s": f["ttft_p99_s"],
            }
        )
    return out


def _value_at(phase: Phase, label: str, t: float) -> Any:
    value = None
    for when, lab, v in phase.events:
        if lab == label and when <= t:
            value = v
    return value


def phase_report(phase: Phase, label: str) -> dict[str, Any]:
    f = figures(phase.results)
    f["rollout_s"] = (
        round(phase.completed - phase.started, 1) if phase.completed is not None else None
    )
    f["window_s"] = round(
        max((s for s, _ in phase.results), default=phase.started) - phase.started, 1
    )
    f["per_step"] = per_step(phase, label)
    # What the rollout itself cost: recomputation beyond the steady state's share.
    steady = figures(phase.before)
    f["steady_recomputed_share"] = steady["recomputed_share"]
    f["steady_requests"] = steady["requests"]
    if steady["recomputed_share"] is not None and f["recomputed_share"] is not None:
        excess = f["recomputed_tokens"] - steady["recomputed_share"] * f["prompt_tokens"]
        f["excess_recomputed_tokens"] = round(excess)
        f["excess_recomputed_share"] = excess / f["prompt_tokens"] if f["prompt_tokens"] else None
    else:
        f["excess_recomputed_tokens"] = f["excess_recomputed_share"] = None
    return f


def ratios(canary: dict[str, Any], blind: dict[str, Any]) -> dict[str, float | None]:
    def div(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    def excess(part: dict[str, Any]) -> float | None:
        # Below the steady state is noise, not a negative cost.
        x = part["excess_recomputed_share"]
        return None if x is None else max(0.0, x)

    return {
        "recomputed_tokens": div(canary["recomputed_tokens"], blind["recomputed_tokens"]),
        "recomputed_share": div(canary["recomputed_share"], blind["recomputed_share"]),
        "excess_recomputed_share": div(excess(canary), excess(blind)),
        "ttft_p99": div(canary["ttft_p99_s"], blind["ttft_p99_s"]),
    }


def timeline(phase: Phase) -> dict[str, Any]:
    return {
        "events": [
            {"t_s": round(t - phase.started, 2), "what": label, "value": value}
            for t, label, value in phase.events
        ],
        "requests": [
            {
                "t_s": round(s - phase.started, 2),
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "ttft_s": r.ttft_s,
                "ok": r.ok,
            }
            for s, r in phase.results
        ],
    }


def restore_started(phase: Phase, label: str) -> float | None:
    """When a second rolling update began after ``phase`` completed, if one did.

    ``label`` events are (updated, ready, total) pods of the Deployment: a new
    rollout shows as fewer updated pods than pods.
    """
    if phase.completed is None:
        return None
    for t, lab, value in phase.events:
        if lab == label and t > phase.completed and value[0] < value[2]:
            return t
    return None


TARGETS = {"recomputed_share": 0.3, "ttft_p99": 0.5}


def lookups_line(seen: dict[str, float]) -> str:
    """One part's router lookups (``watch.router_lookups``), as a person reads them."""

    def results(kind: str) -> str:
        found = {k.split("/", 1)[1]: int(v) for k, v in seen.items() if k.startswith(kind + "/")}
        return ", ".join(f"{n} {result}" for result, n in found.items()) or "none"

    answers = int(seen.get("holder_answers", 0))
    late = answers - int(seen.get("holder_answers_in_time", 0))
    return (
        f"sessions {results('locates')}; holders {results('holders')} "
        f"(picker answers: {answers}, {late} over 250 ms); "
        f"conversation ledgers {results('conversations')}"
    )


def format_table(report: dict[str, Any]) -> str:
    """The rollout comparison (markdown)."""
    a, b = report["warm_canary"], report["blind_rolling"]

    def ratio(x: Any, y: Any) -> str:
        return f"{x / y:.2f}x" if isinstance(x, (int, float)) and y else "-"

    rows = [
        ("rollout (revision change to done)", "rollout_s", ".2f s"),
        ("requests in the window", "requests", ","),
        ("prompt tokens", "prompt_tokens", ","),
        ("recomputed prompt tokens", "recomputed_tokens", ","),
        ("recomputed share", "recomputed_share", ".3f"),
        ("recomputed share before the change", "steady_recomputed_share", ".3f"),
        ("recomputed beyond that share", "excess_recomputed_share", ".3f"),
        ("token hit ratio", "token_hit_ratio", ".3f"),
        ("TTFT P50", "ttft_p50_s", ".2f s"),
        ("TTFT P99", "ttft_p99_s", ".2f s"),
        ("errors", "errors", ","),
    ]
    lines = [
        "| | warm canary | blind rolling update | canary / blind |",
        "|---|---:|---:|---:|",
    ]
    for title, key, spec in rows:
        r = ratio(a.get(key), b.get(key)) if key not in ("requests", "rollout_s") else ""
        if key == "excess_recomputed_share":
            x = report["ratios"].get(key)
            r = "-" if x is None else f"{x:.2f}x"
        lines.append(f"| {title} | {cell(a.get(key), spec)} | {cell(b.get(key), spec)} | {r} |")
    lines.append("")
    lines.append("canary steps (requests started at each weight):")
    for step in a["per_step"]:
        hr = step["token_hit_ratio"]
        lines.append(
            f"  weight {step['weight']}: from {step['from_s']:>6.1f} s, {step['requests']} "
            f"requests, token hit {'-' if hr is None else f'{hr:.3f}'}"
        )
    lines.append("blind rolling update (updated, ready, total pods):")
    for step in b["per_step"]:
        label = next(k for k in step if k.endswith("_updated"))
        hr = step["token_hit_ratio"]
        lines.append(
            f"  pods {step[label]}: from {step['from_s']:>6.1f} s, {step['requests']} requests, "
            f"token hit {'-' if hr is None else f'{hr:.3f}'}"
        )
    lines.append("")
    lines.append(f"good revision promoted: {report['promoted']}")
    lines.append(f"bad revision rolled back by the gate: {report['bad_revision_rolled_back']}")
    latency = report.get("router_weight_latency_s")
    lines.append(
        "weight change to the router serving it: "
        + (
            "-"
            if latency is None
            else f"{latency:.2f} s (slowest of {len(report['router_weight_latency_samples_s'])})"
        )
    )
    moved = report.get("sessions_moved_by_router")
    replicas = report.get("options", {}).get("router_replicas", 1)
    lines.append(
        f"sessions the router moved while their pod served ({replicas} router replicas): "
        + ("-" if moved is None else f"{moved} (target 0)")
        + "".join(
            f"; {n} by a turn keyed {key}"
            for key, n in (report.get("sessions_moved_by_router_by_key") or {}).items()
        )
        + (
            ""
            if (twins := report.get("sessions_moved_by_router_indistinguishable")) is None
            else f"; {twins} indistinguishable from another conversation"
        )
    )
    for part, seen in (report.get("router_lookups_by_part") or {}).items():
        lines.append(f"router lookups in {part}: {lookups_line(seen)}")
    for key, goal in TARGETS.items():
        value = report["ratios"].get(key)
        met = value is not None and value <= goal
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"target {key} canary/blind <= {goal}: {shown} {'met' if met else 'MISSED'}")
    return "\n".join(lines)

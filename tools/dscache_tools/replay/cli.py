"""``dscache replay``'s command line: arguments, progress bar, exit codes.

Exit codes: 0 on success, 2 on bad arguments or an unreadable trace (a message
naming the file and line, no traceback).

``--trace`` is a file, or ``finance``/``chat`` for a built-in workload
(:mod:`~dscache_tools.replay.workloads`). A capacity ``N%`` is that share of the
trace's distinct blocks (its working set), rounded down, at least one block.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from dscache_sidecar.eviction import DEFAULT_POLICY, POLICIES, Signalled, make_policy

from dscache_tools.replay.report import format_table, write_png
from dscache_tools.replay.signals import derive
from dscache_tools.replay.simulate import replay
from dscache_tools.replay.trace import Trace, load_trace
from dscache_tools.replay.workloads import BUILTIN, WorkloadTrace, build

logger = logging.getLogger(__name__)


def _parse_capacities(text: str, working_set: int = 0) -> list[int]:
    out: list[int] = []
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            continue
        try:
            if part.endswith("%"):
                share = float(part[:-1])
                if not 0 < share <= 100:
                    raise ValueError
                value = max(1, int(working_set * share / 100))
            else:
                value = int(part)
        except ValueError:
            raise ValueError(
                f"--capacity-blocks: {part!r} is neither an integer nor a share in (0, 100]%"
            ) from None
        if value < 1:
            raise ValueError(f"--capacity-blocks: {value} must be >= 1")
        out.append(value)
    if not out:
        raise ValueError("--capacity-blocks: give at least one capacity")
    return list(dict.fromkeys(out))


def _parse_policies(text: str | None) -> list[str]:
    if text is None:
        return list(dict.fromkeys([DEFAULT_POLICY, "lru"]))
    names = [p.strip() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(POLICIES)
    unknown = [n for n in names if n not in POLICIES]
    if unknown or not names:
        known = ", ".join(POLICIES)
        raise ValueError(
            f"--policy: unknown {', '.join(unknown) or '(empty)'}; known: {known}, all"
        )
    return list(dict.fromkeys(names))


def _load(args: argparse.Namespace) -> Trace:
    name = str(args.trace)
    if name in BUILTIN and not Path(name).exists():
        return build(
            WorkloadTrace(
                name,
                sessions=getattr(args, "sessions", 0),
                block_tokens=getattr(args, "block_tokens", 16),
                arrivals=getattr(args, "arrivals", "poisson"),
                seed=getattr(args, "seed", 0),
            )
        )
    return load_trace(name)


def _distinct(trace: Trace) -> int:
    return len({b for r in trace.requests for b in r.blocks})


def run_cli(args: argparse.Namespace) -> int:
    """``dscache replay``: prints the table, writes JSON/PNG if asked; returns the exit code."""
    try:
        _parse_capacities(str(args.capacity_blocks), 1)  # reject bad input before any work
        policies = _parse_policies(args.policy)
        kinds = [k.strip() for k in str(getattr(args, "signals", "") or "").split(",") if k.strip()]
        trace = _load(args)
        capacities = _parse_capacities(str(args.capacity_blocks), _distinct(trace))
        plan = (
            derive(
                trace,
                kinds,
                coverage=getattr(args, "signal_coverage", 1.0),
                queue_s=getattr(args, "queue_s", 2.0),
                seed=getattr(args, "seed", 0),
            )
            if kinds
            else None
        )
    except ValueError as exc:  # TraceError included
        print(f"dscache replay: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:  # a built-in trace without the server's tokenizer
        print(f"dscache replay: {exc}", file=sys.stderr)
        return 2
    if not trace.requests:
        print(f"dscache replay: no requests in {args.trace}", file=sys.stderr)
        return 2
    logger.info(
        "replaying %d requests (%d blocks) from %s: policies %s at %s blocks",
        len(trace.requests),
        trace.total_blocks,
        trace.path,
        ",".join(policies),
        ",".join(map(str, capacities)),
    )
    from tqdm import tqdm

    takes = [p for p in policies if isinstance(make_policy(p, 1), Signalled)]
    signalled = len(takes) if plan is not None else 0
    runs = len(capacities) * (len(policies) + signalled + (0 if args.no_belady else 1))
    with tqdm(total=runs * len(trace.requests), unit="req", file=sys.stderr, disable=None) as bar:

        def tick(n: int) -> None:
            bar.update(n)

        report = replay(
            trace, policies, capacities, belady=not args.no_belady, tick=tick, signals=plan
        )
    print(format_table(report))
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(report.as_json(), indent=2) + "\n")
        except OSError as exc:
            print(f"dscache replay: cannot write {args.json_out}: {exc}", file=sys.stderr)
            return 2
    if args.png_out:
        try:
            write_png(report, args.png_out)
        except ModuleNotFoundError as exc:
            print(
                f"dscache replay: --png needs matplotlib: pip install 'dscache[bench]' ({exc})",
                file=sys.stderr,
            )
            return 2
        except OSError as exc:
            print(f"dscache replay: cannot write {args.png_out}: {exc}", file=sys.stderr)
            return 2
    return 0

"""``dscache templates``: mine prewarm templates from captured requests, and match them.

Light module: argument parsing only; the handlers import
:mod:`dscache_tools.templates` (the server's tokenizer, the sidecar's Bloom filter).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dscache.cli import Commands

if TYPE_CHECKING:
    from dscache_tools.templates import Chat

log = logging.getLogger(__name__)


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache templates mine`` and ``match``; ``bench`` is not used."""
    del bench
    t = sub.add_parser(
        "templates",
        help="mine block-aligned prompt prefixes shared by many requests as prewarm prompts",
    )
    tsub = t.add_subparsers(dest="templates_command", metavar="ACTION", required=True)
    m = tsub.add_parser(
        "mine",
        help="rank the shared prefixes of captured requests; write them as prewarm prompts",
        description="Tokenizes each request as the model server does, counts how many "
        "requests start with each block-aligned prefix and writes the prefixes that save "
        "the most prefill, as a `dscache prewarm` prompts file (best first).",
    )
    _add_inputs(m)
    m.add_argument("--top", type=int, default=100, help="templates kept (default 100)")
    m.add_argument("--block-tokens", type=int, default=256, help="tokens per block (256)")
    m.add_argument(
        "--min-count", type=int, default=2, help="requests that must share a prefix (default 2)"
    )
    m.add_argument(
        "--min-conversations",
        type=int,
        default=2,
        help="distinct conversations that must share it; prompt-log records are each "
        "their own (default 2)",
    )
    m.add_argument("--out", required=True, help="write the prewarm prompts (JSONL) here")
    m.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here")
    m.add_argument("--bloom", default=None, help="write the templates' block keys as a filter here")
    m.add_argument(
        "--root-hex",
        default=None,
        help="chain root of the filter's keys, 64 hex digits (default: the miner's fixed root)",
    )
    m.set_defaults(handler=_run_mine)

    c = tsub.add_parser(
        "match",
        help="share of requests whose first block is a template block (a --bloom filter)",
    )
    c.add_argument("--bloom", required=True, help="filter written by `templates mine --bloom`")
    _add_inputs(c)
    c.add_argument("--block-tokens", type=int, default=256, help="tokens per block (256)")
    c.add_argument(
        "--root-hex", default=None, help="the root the filter was written with (its default)"
    )
    c.add_argument("--json", dest="json_out", default=None, help="write the figures as JSON here")
    c.set_defaults(handler=_run_match)


def _add_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        action="append",
        default=[],
        help="requests as `dscache workload` writes them (repeatable)",
    )
    p.add_argument(
        "--log",
        action="append",
        default=[],
        help='captured prompts, JSONL of {"messages": [...]} (repeatable)',
    )


def _read(args: argparse.Namespace) -> list[Chat] | None:
    from dscache_tools.templates import read_chats

    if not args.workload and not args.log:
        log.error("give at least one --workload or --log file")
        return None
    try:
        return read_chats([Path(p) for p in args.workload], [Path(p) for p in args.log])
    except (OSError, ValueError) as exc:
        log.error("cannot read requests: %s", exc)
        return None


def _run_mine(args: argparse.Namespace) -> int:
    from dscache_tools.templates import MineOptions, mine, parse_root, table, template_filter
    from dscache_tools.workload import load_server_tokenizer

    try:
        options = MineOptions(
            top=args.top,
            block_tokens=args.block_tokens,
            min_count=args.min_count,
            min_conversations=args.min_conversations,
        )
        root = parse_root(args.root_hex)
    except ValueError as exc:
        log.error("%s", exc)
        return 2
    chats = _read(args)
    if chats is None:
        return 2
    mined = mine(chats, load_server_tokenizer(), options)
    print(table(mined))
    Path(args.out).write_text(mined.prompts_jsonl(), encoding="utf-8")
    print(f"wrote {len(mined.templates)} prewarm prompts to {args.out}")
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps(mined.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        print(f"wrote {args.json_out}")
    if args.bloom:
        Path(args.bloom).write_bytes(template_filter(mined, root).to_bytes())
        print(f"wrote {len(mined.keys(root))} template block keys to {args.bloom}")
    return 0


def _run_match(args: argparse.Namespace) -> int:
    from dscache_sidecar.holdings import HoldingsFilter, HoldingsFormatError

    from dscache_tools.templates import match, parse_root
    from dscache_tools.workload import load_server_tokenizer

    try:
        root = parse_root(args.root_hex)
        templates = HoldingsFilter.from_bytes(Path(args.bloom).read_bytes())
    except (OSError, ValueError, HoldingsFormatError) as exc:
        log.error("%s", exc)
        return 2
    chats = _read(args)
    if chats is None:
        return 2
    report = match(
        chats,
        load_server_tokenizer(),
        templates,
        root=root,
        block_tokens=args.block_tokens,
    ).to_dict()
    print(
        f"{report['first_block_matches']} of {report['requests']} requests "
        f"({100 * report['match_share']:.1f}%) start with a template block; "
        f"{100 * report['matched_token_share']:.1f}% of prompt tokens lie in leading "
        "template blocks"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json_out}")
    return 0

"""``dscache train``: a small model of a preset's architecture, trained briefly on CPU.

Light module: argument parsing only; the handler imports
:mod:`dscache_tools.training` (torch, transformers, the DeepSeek tokenizer).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from dscache.cli import Commands

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|min|h)?\s*$")
_UNIT_SECONDS = {None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache train``; ``bench`` is not used."""
    del bench
    t = sub.add_parser(
        "train",
        help="train a small model of a preset's architecture on CPU (cached), for measuring "
        "what lossy KV codecs cost in quality",
        description="Trains the preset's architecture with a compact vocabulary on Python's "
        "own documentation and finance-workload text for a number of steps (or a wall-clock "
        "budget), or reuses the "
        "cached checkpoint of the same recipe; prints steps, seconds, held-out perplexity "
        "before and after, and the checkpoint directory (load_engine loads it; its token ids "
        "are the compact vocabulary's, see vocab.npy there, not the DeepSeek tokenizer's).",
    )
    t.add_argument(
        "--preset",
        required=True,
        choices=["mini-gqa", "tiny-deepseek-v3"],
        help="architecture to train",
    )
    stop = t.add_mutually_exclusive_group()
    stop.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="optimizer steps (default: the preset's recipe, about 3 minutes on two cores)",
    )
    stop.add_argument(
        "--budget",
        type=parse_duration,
        default=None,
        help="train for a wall-clock budget instead: 180, 180s, 3m (how many steps fit, and "
        "so the model, then depends on the machine)",
    )
    t.add_argument("--seed", type=int, default=0, help="init and data-order seed (default 0)")
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory the checkpoint is kept under, as OUT/<preset>-<recipe hash> "
        "(default ${DSCACHE_MODELS_CACHE} or ${XDG_CACHE_HOME:-~/.cache}/dscache/models)",
    )
    t.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's choice)"
    )
    t.add_argument(
        "--exact-architecture",
        action="store_true",
        help="train the preset's own widths (tiny-deepseek-v3 is trained at half width by "
        "default: at full width 180 s leave it near unigram quality)",
    )
    t.set_defaults(handler=_run_train)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"not a positive number of steps: {text!r}")
    return value


def parse_duration(text: str) -> float:
    """Seconds of ``180``, ``180s``, ``2.5m``, ``3min`` or ``1h``."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a positive duration: {text!r} (e.g. 180s, 3m)")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def _run_train(args: argparse.Namespace) -> int:
    from dscache_tools.training import trained_model

    if args.threads is not None and args.threads < 1:
        raise SystemExit(f"dscache train: --threads must be >= 1, not {args.threads}")
    model = trained_model(
        args.preset,
        steps=args.steps,
        budget_s=args.budget,
        seed=args.seed,
        cache_root=args.out,
        threads=args.threads,
        overrides={} if args.exact_architecture else None,
    )
    rows = [
        ("preset", model.preset),
        ("vocabulary", f"{model.vocab_size} ids (compact; vocab.npy maps to DeepSeek ids)"),
        ("steps", str(model.steps)),
        ("seconds", f"{model.seconds:.1f}"),
        ("held-out tokens", str(len(model.heldout))),
        ("initial perplexity", f"{model.initial_perplexity:.1f}"),
        ("final perplexity", f"{model.heldout_perplexity:.1f}"),
        ("path", str(model.path)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0

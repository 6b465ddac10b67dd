"""The ``dscache`` command line.

Each component contributes its subcommands through a
``register(subparsers, bench_subparsers)`` function in a light module
(``<component>.cli``) that imports nothing heavy at module level, so
``dscache sidecar`` never loads torch. The modules are found through the
``dscache.commands`` entry points of the installed distributions (``dscache``'s
runtime components, ``dscache-tools``' benches, demo and dev cluster); the core
names none of them. Each entry point names, in brackets, the extra that brings its
dependencies. A component whose extra is not installed is reported with the
``pip install`` line that adds it: a command whose handler cannot import a
third-party module exits 2 with ``dscache X needs the 'E' extra: pip install
'dscache[E]'`` (no traceback), and a component whose light module cannot even be
imported is listed at the end of ``dscache --help``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TypeAlias

from dscache import __version__

#: The entry point group of the ``dscache`` subcommands.
COMMANDS_GROUP = "dscache.commands"


def components() -> list[tuple[str, str]]:
    """(module with ``register``, extra that provides it) of every installed component,
    in a stable order (by entry point name)."""
    found = sorted(entry_points(group=COMMANDS_GROUP), key=lambda ep: ep.name)
    return [(ep.module, ep.extras[0] if ep.extras else ep.name) for ep in found]


Handler = Callable[[argparse.Namespace], int]

#: What a component's ``register(commands, benches)`` adds its subcommands to.
Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def build_parser() -> argparse.ArgumentParser:
    """The full parser with every installed component's subcommands."""
    parser = argparse.ArgumentParser(
        prog="dscache",
        description="Prefix KV-cache reuse for long-context LLM services.",
    )
    parser.add_argument("--version", action="version", version=f"dscache {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default INFO)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    bench = sub.add_parser("bench", help="benchmarks: each prints a table and writes JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bench.set_defaults(handler=lambda _args: _print_help(bench))
    missing: list[str] = []
    for module_name, extra in components():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            missing.append(_missing_line(module_name, extra, exc))
            continue
        before = set(sub.choices) | {f"bench {b}" for b in bench_sub.choices}
        module.register(sub, bench_sub)
        # Each new command remembers the extra that brings its dependencies.
        for name, command in sub.choices.items():
            if name not in before:
                command.set_defaults(extra_=extra)
        for name, command in bench_sub.choices.items():
            if f"bench {name}" not in before:
                command.set_defaults(extra_=extra)
    if missing:
        parser.epilog = "not installed:\n  " + "\n  ".join(missing)
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _missing_line(module_name: str, extra: str, exc: ModuleNotFoundError) -> str:
    # The component's own module is part of the distribution; only its
    # dependencies can be missing. Say which extra brings them.
    name = module_name.split(".", maxsplit=1)[0]
    return f"{name}: pip install 'dscache[{extra}]' (missing module {exc.name})"


def _ours(module: str | None) -> bool:
    return bool(module) and str(module).split(".")[0].startswith("dscache")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``dscache`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return handler(args)
    except ModuleNotFoundError as exc:
        if _ours(exc.name):
            raise  # our own module missing is a broken install or a bug, not an extra
        extra = getattr(args, "extra_", "all")
        command = " ".join(a for a in (args.command, getattr(args, "bench_command", None)) if a)
        print(
            f"dscache {command} needs the '{extra}' extra: pip install 'dscache[{extra}]' "
            f"(missing module {exc.name})",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())

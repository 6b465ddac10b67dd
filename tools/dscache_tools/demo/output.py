"""What both demos do with their report: print it, write the JSON and the PNG.

Contract:
    * The JSON is the report as returned (indent 2, trailing newline); the PNG is
      drawn only when asked for, with matplotlib's file-only Agg backend (the
      'bench' extra; a clear error naming it when missing).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a clear error."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise RuntimeError(
            f"the PNG needs the 'bench' extra: pip install 'dscache[bench]' ({exc})"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def cell(value: Any, spec: str) -> str:
    """A table cell: ``value`` in format ``spec``, a unit after a space; ``-`` for None.

    ``cell(0.25, ".3f")`` is ``0.250``; ``cell(1.5, ".2f s")`` is ``1.50 s``.
    """
    if value is None:
        return "-"
    fmt, _, unit = spec.partition(" ")
    text = format(value, fmt)
    return f"{text} {unit}" if unit else text


def publish(
    report: dict[str, Any],
    table: str,
    json_out: Path | None,
    png_out: Path | None,
    write_png: Callable[[dict[str, Any], Path], None],
) -> None:
    """Prints ``table``, writes the JSON and the PNG where asked, and the wall time."""
    print()
    print(table)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nJSON written to {json_out}")
    if png_out is not None:
        write_png(report, png_out)
        print(f"PNG written to {png_out}")
    print(f"demo took {report['wall_s']:.0f} s")

"""What the quick-bench tests share: run ``dscache bench NAME --quick`` and read its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_quick_bench(
    name: str, out: Path, timeout_s: float, *extra: str
) -> tuple[dict[str, Any], str]:
    """Runs the bench in a fresh interpreter (as a user does), writing its JSON to ``out``:
    the JSON and what it printed (its table).

    Fails the test with the command's last output when it exits non-zero.
    """
    done = subprocess.run(
        [sys.executable, "-m", "dscache.cli", "bench", name, "--quick", *extra]
        + ["--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc, done.stdout

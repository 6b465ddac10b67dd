"""``dscache_tools.eppcheck.build``: two callers at once (the local and the cluster test
lanes of one run) build the driver once; the second waits and gets the first's binary.

The compiler is replaced by a small, named fake (it writes a file after a pause): what is
under test is the lock and the reuse, not Go (``test_epp_reference.py`` builds the real one).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from dscache_tools import eppcheck


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "go.mod").write_text("module example.test/driver\n\ngo 1.26\n")
    (src / "main.go").write_text("package main\n\nfunc main() {}\n")
    return src


def test_two_callers_at_once_compile_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiled: list[Path] = []
    guard = threading.Lock()

    def fake_compile(source: Path, binary: Path) -> None:  # stands in for `go build`
        with guard:
            compiled.append(binary)
        time.sleep(0.5)
        binary.write_text("driver")

    monkeypatch.setattr(eppcheck, "_compile", fake_compile)
    src, root = _source(tmp_path), tmp_path / "cache"
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda _: eppcheck.build(src, root), range(2)))
    assert got[0] == got[1] and got[0].read_text() == "driver"
    assert compiled == [got[0]]
    # Unchanged sources: reused at once; a changed one builds anew and the old driver goes.
    assert eppcheck.build(src, root) == got[0] and len(compiled) == 1
    (src / "main.go").write_text("package main\n\nfunc main() { println() }\n")
    again = eppcheck.build(src, root)
    assert again != got[0] and len(compiled) == 2
    assert again.is_file() and not got[0].exists()

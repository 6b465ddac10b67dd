"""Building a Go part for the dev cluster with the real Go toolchain and module proxy.

The Kubernetes parts take many minutes; ``stringer`` from golang.org/x/tools goes
through the same steps (wrapper module, ``go build``, install, stamp) in seconds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from dscache_tools.devcluster.build import build_parts, is_part_current
from dscache_tools.devcluster.gobuild import Part, build_cache

STRINGER = Part(
    name="stringer",
    version="v0.47.0",
    module="golang.org/x/tools",
    packages={"golang.org/x/tools/cmd/stringer": "stringer"},
)


@pytest.mark.slow
def test_a_part_builds_and_leaves_no_go_build_cache_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binary and its stamp stay; Go's build cache (GiBs for Kubernetes) goes once
    every part is built, and the user's own GOCACHE is not touched."""
    users_cache = tmp_path / "users-gocache"
    users_cache.mkdir()
    monkeypatch.setenv("GOCACHE", str(users_cache))
    base = tmp_path / "root"
    lines: list[str] = []
    build_parts([STRINGER], base, lines.append)
    binary = STRINGER.directory(base) / "bin" / "stringer"
    done = subprocess.run([str(binary), "-help"], capture_output=True, text=True, check=False)
    assert "Usage of stringer" in done.stderr
    assert is_part_current(STRINGER, base)
    assert not build_cache(base).exists()
    assert any("removing Go's build cache" in line for line in lines), lines
    assert not any(users_cache.iterdir())
    # A second build finds it current and compiles nothing.
    lines.clear()
    build_parts([STRINGER], base, lines.append)
    assert lines == [f"stringer v0.47.0: cached in {STRINGER.directory(base) / 'bin'}"]

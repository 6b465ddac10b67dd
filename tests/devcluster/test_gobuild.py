"""Building a Go part for the dev cluster with the real Go toolchain and module proxy.

The Kubernetes parts take many minutes; ``hello`` from golang.org/x/example goes
through the same steps (wrapper module, ``go build``, install, stamp) in seconds
(with Go's build cache empty: 16 CPU-s here, where ``stringer`` from
golang.org/x/tools, which this test built before, took 34).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from dscache_tools.devcluster.build import build_parts, is_part_current
from dscache_tools.devcluster.gobuild import Part, build_cache

HELLO = Part(
    name="hello",
    version="v0.0.0-20250915201037-7f05d217867b",
    module="golang.org/x/example/hello",
    packages={"golang.org/x/example/hello": "hello"},
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
    build_parts([HELLO], base, lines.append)
    binary = HELLO.directory(base) / "bin" / "hello"
    done = subprocess.run(
        [str(binary), "-r", "dscache"], capture_output=True, text=True, check=False
    )
    assert done.stdout == "olleH, ehcacsd!\n", done
    assert is_part_current(HELLO, base)
    assert not build_cache(base).exists()
    assert any("removing Go's build cache" in line for line in lines), lines
    assert not any(users_cache.iterdir())
    # A second build finds it current and compiles nothing.
    lines.clear()
    build_parts([HELLO], base, lines.append)
    assert lines == [
        f"hello v0.0.0-20250915201037-7f05d217867b: cached in {HELLO.directory(base) / 'bin'}"
    ]

"""Fixtures for sidecar tests: the real daemon (in-process or as a subprocess),
real gRPC over a unix socket, real LMDB and segment files in a temp dir."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sidecar_helpers import DaemonProcess, Sidecar


@pytest.fixture
def make_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    made: list[Sidecar] = []

    def make(**kw: Any) -> Sidecar:
        s = Sidecar(tmp_path / f"store{len(made)}", **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.stop()


@pytest.fixture
def sidecar(make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    return make_sidecar()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    procs: list[DaemonProcess] = []

    def make(data_dir: Path | None = None, *extra: str) -> DaemonProcess:
        d = DaemonProcess(data_dir or tmp_path / f"d{len(procs)}", *extra)
        procs.append(d)
        return d

    yield make
    for d in procs:
        d.kill()

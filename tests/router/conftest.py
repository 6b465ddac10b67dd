"""Fixtures of the router tests: real NGINX on a loopback port, and stand-in pods."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from needs import need_nginx
from router_helpers import Nginx, Pod


@pytest.fixture
def nginx(tmp_path: Path) -> Iterator[Nginx]:
    binary = need_nginx()
    os.chmod(tmp_path, 0o755)  # NGINX's workers may drop to 'nobody'
    n = Nginx(binary, tmp_path)
    yield n
    n.stop()


@pytest.fixture
def pods() -> Iterator[dict[str, Pod]]:
    ups = {n: Pod(n) for n in ("s0", "s1", "s2", "c0", "c1")}
    yield ups
    for u in ups.values():
        u.close()

"""What a test needs from the host, with one rule: in CI a missing part fails.

A developer without NGINX or Prometheus gets a skip naming the package to
install; under ``CI`` (``scripts/test.sh``, the README's test command, sets it after
installing every one of these) a missing part is a failure, so a skip can never
hide a gap in what the test command checks.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import NoReturn

import pytest
from dscache_tools.demo.stack import find_nginx
from dscache_tools.procs import StartError


def missing(message: str) -> NoReturn:
    """Skips the test, or fails it under CI."""
    if os.environ.get("CI"):
        pytest.fail(f"{message} (CI installs it: scripts/setup.sh)")
    pytest.skip(message)


def need_binary(binary: str, package: str) -> str:
    """Path of ``binary`` (on PATH or in /usr/bin, /usr/sbin); else :func:`missing`."""
    for candidate in (shutil.which(binary), f"/usr/bin/{binary}", f"/usr/sbin/{binary}"):
        if candidate and Path(candidate).exists():
            return candidate
    missing(f"needs `{binary}` (apt-get install {package})")


def need_nginx() -> str:
    """Path of an NGINX with the Lua module the router needs; else :func:`missing`."""
    try:
        return find_nginx()
    except StartError as exc:
        missing(str(exc))

"""The architecture map names only code that exists.

``docs/architecture.md`` (and the module tables of ``docs/operator.md`` and
``docs/model-server.md``) are where a newcomer starts; a module moved or renamed
without the map following sends them to a file that is not there. Every
backticked name there that looks like a file or folder of ours (``*.py``,
``*.lua``, ``*.j2``, ``name/``) must be the end of a path in the repository.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["docs/architecture.md", "docs/operator.md", "docs/model-server.md"]
_NAME = re.compile(r"`([A-Za-z0-9_./-]+(?:\.py|\.lua|\.j2|/))`")


def _paths() -> list[str]:
    """Every file and folder of the repository (hidden ones and caches left out), as
    ``/relative/path`` (folders with a trailing slash)."""
    found: list[str] = []
    for top, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        rel = "/" + str(Path(top).relative_to(REPO)) + "/"
        found.append(rel)
        found += [rel + f for f in files]
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_the_map_names_exists(doc: str) -> None:
    paths = _paths()
    names = sorted(set(_NAME.findall((REPO / doc).read_text())))
    assert names, f"{doc} names no file"
    missing = [n for n in names if not any(p.endswith("/" + n.lstrip("/")) for p in paths)]
    assert not missing, f"{doc} names files the repository does not have: {missing}"

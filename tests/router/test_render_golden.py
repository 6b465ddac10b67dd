"""The router's nginx.conf stays byte for byte what it was (see ``golden_confs``)."""

from __future__ import annotations

import json

import pytest
from golden_confs import CASES, DATA, render

GOLDEN = json.loads(DATA.read_text())


def test_every_case_has_its_kept_text() -> None:
    assert set(GOLDEN["confs"]) == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_rendered_conf_is_unchanged(name: str) -> None:
    got = render(name)
    want = GOLDEN["confs"][name]
    assert got == want, (
        f"{name}: the router's nginx.conf changed from what commit {GOLDEN['commit']} "
        "rendered; every router pod would reload. If the change is on purpose, rewrite "
        "tests/router/data/nginx_conf_golden.json with `python tests/router/golden_confs.py`"
    )

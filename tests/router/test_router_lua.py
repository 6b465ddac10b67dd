"""The router's Lua files: filled in exactly, sections kept or dropped, and the
placeholders luacheck is told about are the ones the files use."""

from __future__ import annotations

import re
from importlib import resources

import pytest
from dscache_router.nginx.lua import fill, read

LUA = resources.files("dscache_router.nginx").joinpath("lua")
FILES = sorted(p.name for p in LUA.iterdir() if p.name.endswith(".lua"))
MEMORY = {"LIVE": '{["blue"] = true}', "TTL": "600"}


def test_the_placeholders_are_the_globals_luacheck_allows() -> None:
    declared = set(re.findall(r'"(DSCACHE_[A-Z_]+)"', LUA.joinpath(".luacheckrc").read_text()))
    used = {m for name in FILES for m in re.findall(r"\bDSCACHE_[A-Z_]+\b", read(name))}
    assert used == declared


def test_values_replace_the_placeholders_and_lines_are_indented() -> None:
    text = fill("watch.lua", {"PATH": '"/etc/x.conf"', "ID": '"ab12"', "INTERVAL": "2"}, indent=8)
    assert 'local path, loaded, signalled = "/etc/x.conf", "ab12", nil' in text
    assert "ngx.timer.every(2, check)" in text
    assert "DSCACHE_" not in text
    assert all(line.startswith(" " * 8) for line in text.split("\n") if line)
    assert not text.endswith("\n")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"PATH": '"/x"', "ID": '"a"'}, "placeholders"),  # INTERVAL has no value
        ({"PATH": '"/x"', "ID": '"a"', "INTERVAL": "1", "TTL": "5"}, "placeholders"),
    ],
)
def test_placeholders_and_values_must_match(values: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        fill("watch.lua", values, indent=0)


def test_a_section_is_kept_or_dropped_and_never_left_unnamed() -> None:
    with_picker = fill("session_memory.lua", MEMORY, indent=0, sections={"picker": True})
    without = fill("session_memory.lua", MEMORY, indent=0, sections={"picker": False})
    assert 'require("dscache_router").locate(key)' in with_picker
    assert "locate" not in without
    assert "-- {picker" not in with_picker and "-- picker}" not in with_picker
    assert set(without.split("\n")) < set(with_picker.split("\n"))
    with pytest.raises(ValueError, match="section 'picker' is not named"):
        fill("session_memory.lua", MEMORY, indent=0)

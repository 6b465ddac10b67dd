"""A command whose extra is not installed says which ``pip install`` brings it,
never a traceback. A missing dependency is simulated by blocking its import in a
fresh interpreter (``sys.modules[name] = None``), exactly what Python raises when
the package is not installed (``ModuleNotFoundError``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def _dscache(blocked: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "from dscache.cli import main\n"
        f"sys.exit(main({list(argv)!r}))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    ("blocked", "argv", "says"),
    [
        (
            ["grpc", "lmdb"],
            ["sidecar", "--data-dir", "{tmp}"],
            "dscache sidecar needs the 'sidecar'",
        ),
        (["torch"], ["bench", "ttft"], "dscache bench ttft needs the 'bench'"),
        (["kopf"], ["operator"], "dscache operator needs the 'operator'"),
        (["vllm"], ["vllm", "serve", "/models/m"], "dscache vllm needs the 'vllm'"),
    ],
)
def test_a_missing_extra_is_named_with_its_pip_install(
    tmp_path: Path, blocked: list[str], argv: list[str], says: str
) -> None:
    done = _dscache(blocked, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert done.returncode == 2, done.stderr
    assert says in done.stderr and "pip install 'dscache[" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir())  # nothing was started or written


def test_help_lists_a_component_that_cannot_load() -> None:
    done = _dscache(["dscache_tools.chaoscli"], "--help")
    assert done.returncode == 0
    assert "not installed:" in done.stdout and "pip install 'dscache[all]'" in done.stdout


def test_commands_come_from_entry_points_runtime_and_tooling_apart() -> None:
    """The core names no component: the runtime distribution brings the runtime
    commands, the dscache-tools distribution the benches, demo and dev cluster."""
    from importlib.metadata import distribution

    from dscache.cli import COMMANDS_GROUP, build_parser, components

    def modules(dist: str) -> set[str]:
        return {ep.module for ep in distribution(dist).entry_points if ep.group == COMMANDS_GROUP}

    runtime, tooling = modules("dscache"), modules("dscache-tools")
    assert runtime == {
        "dscache_sidecar.cli",
        "dscache_server.cli",
        "dscache_operator.cli",
        "dscache_router.cli",
        "dscache_vllm.cli",
    }
    assert "dscache_tools.benchcli" in tooling and "dscache_tools.democli" in tooling
    assert all(m.startswith("dscache_tools.") for m in tooling)
    assert {m for m, _ in components()} == runtime | tooling
    commands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for name in ("sidecar", "server", "operator", "vllm", "prewarm", "picker", "load", "demo"):
        assert name in commands, name

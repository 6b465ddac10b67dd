"""``scripts/gpu-check.sh``: the parts a machine without an NVIDIA GPU can check.

The check itself needs a GPU (vLLM's CUDA build); here: bash parses it, without a
GPU it stops at once with exit 3 and a message saying why, installing nothing,
and ``--dry-run`` shows every step it would take, with the GPU an (explicitly
fake) ``nvidia-smi`` reports or without one.
"""

from __future__ import annotations

import os
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
FAKE_BIN = ROOT / "tests" / "fakes" / "bin"


def _no_gpu_path(tmp_path: Path) -> str:
    """PATH without any nvidia-smi: python3 and the coreutils the script calls only."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("python3", "sed", "grep", "wc", "env", "mkdir", "touch", "dirname"):
        for directory in os.environ["PATH"].split(os.pathsep):
            found = Path(directory) / tool
            if found.is_file() and os.access(found, os.X_OK):
                (bin_dir / tool).symlink_to(found)
                break
    return str(bin_dir)


def _run(path: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": path, "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    return subprocess.run(
        ["/bin/bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def _vllm_pin() -> str:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["vllm"]
    return next(r for r in extra if r.startswith("vllm=="))


def test_bash_parses_it() -> None:
    done = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_without_a_gpu_it_stops_at_once_and_installs_nothing(tmp_path: Path) -> None:
    existed = (ROOT / ".venv-gpu").exists()
    done = _run(_no_gpu_path(tmp_path), tmp_path=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no NVIDIA GPU here" in done.stderr and "nothing was installed" in done.stderr
    assert "would run" not in done.stdout
    assert (ROOT / ".venv-gpu").exists() == existed


def test_a_dry_run_without_a_gpu_lists_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(_no_gpu_path(tmp_path), "--dry-run", "--out", str(out), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert "no NVIDIA GPU here" in text
    assert f"{_vllm_pin()} (pyproject.toml's vllm extra)" in text
    steps = [line for line in text.splitlines() if "would run:" in line]
    # The step as the shell would run it (printf %q quotes the brackets).
    assert any("uv pip install" in s and ".venv-gpu" in s and r"-e .\[vllm\]" in s for s in steps)
    assert any("torch.cuda.is_available()" in s for s in steps)
    assert any("pytest" in s and "-m vllm tests/vllm" in s and "CI=1" in s for s in steps)
    assert any("dscache bench vllm" in s and str(out / "bench-vllm-gpu.json") in s for s in steps)
    assert not out.exists(), "a dry run creates nothing"


def test_a_dry_run_names_the_gpu_nvidia_smi_reports(tmp_path: Path) -> None:
    path = f"{FAKE_BIN}{os.pathsep}{_no_gpu_path(tmp_path)}"
    done = _run(path, "--dry-run", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 NVIDIA GPU(s)" in done.stdout and "NVIDIA H200" in done.stdout
    assert "no NVIDIA GPU" not in done.stdout


def test_unknown_arguments_are_refused(tmp_path: Path) -> None:
    done = _run(_no_gpu_path(tmp_path), "--gpu", tmp_path=tmp_path)
    assert done.returncode == 2 and "unknown argument: --gpu" in done.stderr

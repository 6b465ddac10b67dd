"""Fixtures for the dev cluster's own tests: a fresh namespace per test."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator

import pytest
from dscache_tools.devcluster import DevCluster

_counter = itertools.count()


@pytest.fixture
def namespace(dev_cluster: DevCluster) -> Iterator[str]:
    """A namespace of its own for one test, deleted afterwards (without waiting)."""
    name = f"t{os.getpid()}-{next(_counter)}"
    dev_cluster.kubectl("create", "namespace", name)
    yield name
    dev_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)

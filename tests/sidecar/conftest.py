"""Fixtures for sidecar tests: the real daemon (in-process or as a subprocess),
real gRPC over a unix socket, real LMDB and segment files in a temp dir."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from dscache_tools.rediscluster import LocalRedisCluster
from factories import stopped_after
from needs import need_binary
from sidecar_helpers import DaemonProcess, Sidecar


@pytest.fixture
def make_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    count = itertools.count()
    with stopped_after(lambda **kw: Sidecar(tmp_path / f"store{next(count)}", **kw)) as make:
        yield make


@pytest.fixture
def sidecar(make_sidecar: Callable[..., Sidecar]) -> Sidecar:
    return make_sidecar()


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    count = itertools.count()

    def build(data_dir: Path | None = None, *extra: str) -> DaemonProcess:
        return DaemonProcess(data_dir or tmp_path / f"d{next(count)}", *extra)

    with stopped_after(build) as make:
        yield make


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """One real Redis Cluster (3 masters on loopback) for every shared-tier test."""
    need_binary("redis-server", "redis-server")
    with LocalRedisCluster(tmp_path_factory.mktemp("redis")) as c:
        yield c


@pytest.fixture
def shared(cluster: LocalRedisCluster) -> LocalRedisCluster:
    """The session's cluster, emptied before the test."""
    for port in cluster.ports:
        redis.Redis(host="127.0.0.1", port=port).flushall()
    return cluster

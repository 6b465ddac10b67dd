"""The router reloads itself: real NGINX, a ConfigMap-style volume, no shell, no restart.

NGINX runs as its container runs it (``nginx -p DIR -e stderr -c CONF -g 'daemon
off;'``, master and workers under one non-root user) on a config rendered with
``watch_config``. The test swaps the config the way the kubelet updates a
ConfigMap volume (a new timestamped directory, then an atomic rename of the
``..data`` symlink) and checks what a user would notice: the new canary weight
is served within seconds, an invalid file leaves the router serving the last
good config, and the next good one is picked up again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dscache_router.nginx import DEBIAN_LUA_MODULES, RouterConfig, render_nginx_conf
from dscache_tools.net import free_port
from needs import need_binary, need_nginx
from router_helpers import Pod, call, stop, wait_for

NOBODY = 65534
PICKUP_S = 10.0  # what a user may wait for a weight change; the watcher looks every second


class _ConfigMapVolume:
    """``<dir>/nginx.conf -> ..data/nginx.conf``, ``..data -> ..<n>``, as the kubelet lays it out."""

    def __init__(self, root: Path, owner: int | None) -> None:
        self.root = root
        self.owner = owner
        self.version = 0
        root.mkdir()
        self._chown(root)

    @property
    def path(self) -> Path:
        return self.root / "nginx.conf"

    def _chown(self, path: Path) -> None:
        if self.owner is not None:
            os.chown(path, self.owner, self.owner, follow_symlinks=False)

    def publish(self, text: str) -> None:
        self.version += 1
        version = self.root / f"..2026_11_30_12_00_{self.version:02d}"
        version.mkdir()
        (version / "nginx.conf").write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(version.name)
        for p in (version, version / "nginx.conf", tmp):
            self._chown(p)
        os.replace(tmp, self.root / "..data")  # the atomic swap
        if not self.path.is_symlink():
            self.path.symlink_to("..data/nginx.conf")
            self._chown(self.path)


class _Router:
    def __init__(self, nginx: str, workdir: Path, stable: str, canary: str) -> None:
        self.nginx = nginx
        root = os.geteuid() == 0
        # Master and workers under one user, as in the container: a worker may signal
        # its master only then (as root, NGINX's workers would drop to nobody).
        self.owner = NOBODY if root else None
        self.workdir = workdir
        if self.owner is not None:
            os.chown(workdir, NOBODY, NOBODY)
        self.volume = _ConfigMapVolume(workdir / "config", self.owner)
        self.port = free_port()
        self.stable, self.canary = stable, canary
        self.log = workdir / "stderr.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def render(self, weight: float, **tracks: Any) -> str:
        """The config at ``weight``; ``tracks`` override the tracks (names, pods, memory)."""
        return render_nginx_conf(
            RouterConfig(
                listen=f"127.0.0.1:{self.port}",
                **{"stable": (self.stable,), "canary": (self.canary,), **tracks},
                canary_weight=weight,
                load_modules=DEBIAN_LUA_MODULES,
                pid_file=str(self.workdir / "nginx.pid"),
                temp_dir=str(self.workdir),
                error_log="stderr",
                debug_headers=True,
                watch_config=True,
                config_path=str(self.volume.path),
            )
        )

    def start(self, weight: float) -> None:
        self.volume.publish(self.render(weight))
        cmd = [self.nginx, "-p", str(self.workdir), "-e", "stderr", "-c", str(self.volume.path)]
        cmd += ["-g", "daemon off;"]
        if self.owner is not None:
            cmd = [
                "setpriv",
                f"--reuid={self.owner}",
                f"--regid={self.owner}",
                "--clear-groups",
                *cmd,
            ]
        with self.log.open("wb") as err:
            self.proc = subprocess.Popen(cmd, stderr=err)
        proc = self.proc

        def serving() -> bool:
            assert proc.poll() is None, self.log.read_text()
            return self.track("probe") is not None

        wait_for("the router serving", serving, 15, self.log)

    def _header(self, session: str, header: str) -> str | None:
        resp = call(self.port, "/v1/models", {"X-Session-ID": session})
        return resp.headers.get(header) if resp is not None and resp.status_code == 200 else None

    def track(self, session: str) -> str | None:
        """The track the router sends ``session`` to; None if it does not answer."""
        return self._header(session, "X-Dscache-Track")

    def upstream(self, session: str) -> str | None:
        """The pod address the router sends ``session`` to (None: no answer)."""
        return self._header(session, "X-Dscache-Upstream")

    def status(self) -> dict[str, Any] | None:
        """What ``/dscache/router/status`` says the running config is."""
        resp = call(self.port, "/dscache/router/status")
        if resp is None or resp.status_code != 200:
            return None
        out: dict[str, Any] = resp.json()
        return out

    def publish_and_wait(self, weight: float, **tracks: Any) -> None:
        """Publishes a config and returns once only workers with it serve.

        For a moment after a reload an old worker still accepts connections with
        the old config: wait until every worker that ran before has exited.
        """
        text = self.render(weight, **tracks)
        want = json.loads(text.split("return 200 '", 1)[1].split("\\n'", 1)[0])
        before = self.workers()
        self.volume.publish(text)
        wait_for(
            f"only workers serving {want}",
            lambda: self.status() == want and not self.workers() & before,
            PICKUP_S,
            self.log,
        )

    def tracks(self) -> set[str | None]:
        return {self.track(f"session-{i}") for i in range(40)}

    def wait_all_on(self, track: str) -> float:
        """Seconds until every session goes to ``track`` (fails past :data:`PICKUP_S`)."""
        start = time.monotonic()
        wait_for(f"every session on {track}", lambda: self.tracks() == {track}, PICKUP_S, self.log)
        return time.monotonic() - start

    def workers(self) -> set[int]:
        """PIDs of the master's children (NGINX's workers); a reload replaces them."""
        assert self.proc is not None
        out: set[int] = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid:
                out.add(int(stat.parent.name))
        return out

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


@pytest.fixture
def router() -> Iterator[_Router]:
    nginx = need_nginx()
    if os.geteuid() == 0:  # to run NGINX's master and workers as one user
        need_binary("setpriv", "util-linux")
    # Not under pytest's tmp_path: its parents are private to root, and NGINX runs as nobody.
    workdir = Path(tempfile.mkdtemp(prefix="dscache-router-watch-"))
    os.chmod(workdir, 0o755)
    stable, canary = Pod("stable"), Pod("canary")
    r = _Router(nginx, workdir, stable.address, canary.address)
    yield r
    r.stop()
    for pod in (stable, canary):
        pod.close()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.slow
def test_a_new_weight_is_served_within_seconds_without_a_restart(router: _Router) -> None:
    router.start(weight=0)
    assert router.tracks() == {"stable"}
    assert router.proc is not None
    master = router.proc.pid

    workers = router.workers()
    router.volume.publish(router.render(100))
    took = router.wait_all_on("canary")
    assert took < PICKUP_S
    # Reloaded, not restarted: the same master, new workers.
    assert router.proc.poll() is None and router.proc.pid == master
    assert router.workers().isdisjoint(workers)

    # An invalid file (a new id, so the watcher does signal): the master rejects it
    # and keeps serving the last good config.
    router.volume.publish("# dscache-config-id: 00000000deadbeef\nthis is not nginx {\n")
    wait_for(
        "the master rejecting it",
        lambda: "unknown directive" in router.log.read_text(),
        PICKUP_S,
        router.log,
    )
    assert router.proc.poll() is None
    assert router.tracks() == {"canary"}

    # The next good config is picked up as usual.
    router.volume.publish(router.render(0))
    assert router.wait_all_on("stable") < PICKUP_S
    assert router.proc.poll() is None


@pytest.mark.slow
def test_an_unchanged_file_causes_no_reload(router: _Router) -> None:
    router.start(weight=0)
    workers = router.workers()
    router.volume.publish(router.volume.path.read_text())  # a resync that rewrote the same bytes
    time.sleep(3)  # three looks by the watcher
    assert router.workers() == workers  # no reload: the same worker processes
    assert router.tracks() == {"stable"}


# ----------------------------------------------------------------------------- session memory

MEMORY = 600  # seconds a session is remembered after its last request


#: Blue stable, green canary, sessions remembered.
NAMES = {"stable_name": "blue", "canary_name": "green", "session_memory_s": MEMORY}


def _where(router: _Router, sessions: list[str]) -> dict[str, str | None]:
    return {s: router.upstream(s) for s in sessions}


def _pods(router: _Router, sessions: list[str]) -> set[str | None]:
    """The pods serving ``sessions``."""
    return set(_where(router, sessions).values())


def _remembering(router: _Router, weight: float) -> None:
    """Starts the router, then serves :data:`NAMES` at ``weight``."""
    router.start(weight=0)
    router.publish_and_wait(weight, **NAMES)


def _only(router: _Router, pod: str, name: str) -> None:
    """Serves one track, ``pod`` named ``name``: the other tracks left the config."""
    router.publish_and_wait(0, stable=(pod,), stable_name=name, canary=(), session_memory_s=MEMORY)


@pytest.mark.slow
def test_a_live_session_keeps_its_track_through_a_whole_rollout(router: _Router) -> None:
    """New sessions follow the weight; a session already running finishes where it started."""
    blue, green = router.stable, router.canary
    _remembering(router, 0)
    old = [f"old-{i}" for i in range(60)]
    assert _pods(router, old) == {blue}

    # The canary takes every new session; the running ones stay on stable.
    router.publish_and_wait(100, **NAMES)
    assert _pods(router, old) == {blue}
    new = [f"new-{i}" for i in range(30)]
    assert _pods(router, new) == {green}

    # Promoted: green is stable, blue is the warm previous track. It takes no new
    # session, but keeps those it has; green keeps its own.
    promoted = {
        "stable": (green,),
        "stable_name": "green",
        "canary": (),
        "canary_name": "blue-next",
        "previous": (blue,),
        "previous_name": "blue",
        "session_memory_s": MEMORY,
    }
    router.publish_and_wait(0, **promoted)
    assert _pods(router, old) == {blue}
    assert _pods(router, new) == {green}
    assert _pods(router, [f"later-{i}" for i in range(30)]) == {green}
    assert router.track("old-1") == "previous" and router.track("new-1") == "stable"

    # The previous track retired: its sessions move, once, to the stable track.
    _only(router, green, "green")
    assert _pods(router, old + new) == {green}


@pytest.mark.slow
def test_an_aborted_canary_hands_its_sessions_back(router: _Router) -> None:
    blue, green = router.stable, router.canary
    _remembering(router, 50)
    sessions = [f"s-{i}" for i in range(80)]
    first = _where(router, sessions)
    on_green = {s for s, pod in first.items() if pod == green}
    assert 15 <= len(on_green) <= 65  # about half
    # Abort: the canary leaves the config; its sessions go to stable at once.
    _only(router, blue, "blue")
    assert _pods(router, sessions) == {blue}


@pytest.mark.slow
def test_without_memory_a_session_follows_the_weight(router: _Router) -> None:
    blue, green = router.stable, router.canary
    router.start(weight=0)
    sessions = [f"f-{i}" for i in range(40)]
    assert _pods(router, sessions) == {blue}
    router.publish_and_wait(100)
    assert _pods(router, sessions) == {green}


@pytest.mark.slow
def test_the_status_endpoint_says_what_is_served(router: _Router) -> None:
    router.start(weight=0)
    router.publish_and_wait(25, stable_name="blue", canary_name="green", session_memory_s=60)
    assert router.status() == {
        "canary": "green",
        "canary_weight": 25.0,
        "previous": None,
        "session_memory_s": 60,
        "stable": "blue",
    }

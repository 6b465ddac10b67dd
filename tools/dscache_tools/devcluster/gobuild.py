"""Builds the dev cluster's binaries from Go modules, once, into a versioned cache.

Contract:
    * ``ensure_built()`` returns paths to kube-apiserver, kube-controller-manager,
      kube-scheduler, kubectl, kubelet, kube-proxy, etcd, kwok and helm at the
      versions pinned in
      :mod:`dscache_tools.devcluster.versions`, building whatever is missing.
    * Each part is built in a small generated wrapper module under
      ``<cache>/<part>/<version>/src`` that requires the upstream module. For
      Kubernetes the wrapper ``replace``s every staging module that
      ``k8s.io/kubernetes``'s own go.mod points at ``./staging/...`` with its
      published ``v0.X.Y`` of the same release, because a dependency's local
      ``replace`` directives are ignored.
    * Release versions are stamped through ``-ldflags -X`` (component-base and
      client-go for Kubernetes, helm's internal version and its Kubernetes
      capability defaults), so kubectl and helm see the real server version.
    * Idempotent: a part whose ``bin/.dscache-build.json`` stamp matches its
      recipe and whose binaries exist is not touched, so a second run takes
      well under a second. Binaries are moved into ``bin/`` only after a whole
      part built, and the stamp is written last.
    * Builds run under ``nice -n 19`` with the standard GOMODCACHE and GOCACHE,
      so the machine stays usable and later builds reuse the caches. A file
      lock serialises concurrent builders (CI's background build and a test
      fixture); the second waits and then finds everything built.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import resource
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.devcluster.versions import PINNED, Versions, cache_root

logger = logging.getLogger(__name__)

#: Called with one line of human-readable progress.
Progress = Callable[[str], None]

_STAMP = ".dscache-build.json"
#: Seconds between "still building" messages.
_HEARTBEAT_S = 60.0
#: Oldest Go that builds every pinned part (etcd and kwok declare go 1.26.0).
_MIN_GO = (1, 26)


class BuildError(RuntimeError):
    """A part could not be built; the message names the log with Go's output."""


@dataclass(frozen=True)
class Binaries:
    """Absolute paths of every executable the dev cluster runs."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    kubectl: Path
    etcd: Path
    kwok: Path
    helm: Path
    #: Directory with KWOK's Stage manifests of the same KWOK version.
    kwok_stages: Path
    #: The node agents of real (not simulated) nodes.
    kubelet: Path
    kube_proxy: Path

    @property
    def tool_dirs(self) -> tuple[Path, ...]:
        """Directories to put first on PATH for the matching kubectl and helm."""
        return (self.kubectl.parent, self.helm.parent)

    def all_executables(self) -> tuple[Path, ...]:
        """Every executable, for existence checks."""
        return (
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kubectl,
            self.etcd,
            self.kwok,
            self.helm,
            self.kubelet,
            self.kube_proxy,
        )


@dataclass(frozen=True)
class _Part:
    """How to build one part: a wrapper module around ``module@version``."""

    name: str
    version: str
    module: str
    #: main package import path -> output binary name
    packages: dict[str, str]
    ldflags: tuple[str, ...] = ()
    #: ``go.mod`` of ``module`` points these modules at local paths
    replace_staging: bool = False
    #: files copied from the module's source tree into ``<dir>/<dest>``
    copy_globs: tuple[tuple[str, str], ...] = ()

    def directory(self, root: Path) -> Path:
        return root / self.name / self.version

    def recipe(self) -> str:
        """A digest of everything that decides the output, stored in the stamp."""
        payload = json.dumps(
            {
                "module": self.module,
                "version": self.version,
                "packages": self.packages,
                "ldflags": self.ldflags,
                "replace_staging": self.replace_staging,
                "copy": self.copy_globs,
                "goflags": _GOFLAGS,
            },
            sort_keys=True,
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


_GOFLAGS = "-trimpath -buildvcs=false -mod=mod"


def _parts(versions: Versions) -> list[_Part]:
    major, minor = versions.kubernetes_minor
    k8s_ldflags: list[str] = ["-s", "-w"]
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        k8s_ldflags += [
            f"-X {pkg}.gitVersion={versions.kubernetes}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
        ]
    helm_ldflags = [
        "-s",
        "-w",
        f"-X helm.sh/helm/v3/internal/version.version={versions.helm}",
        "-X helm.sh/helm/v3/internal/version.gitTreeState=clean",
        f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor={major}",
        f"-X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor={minor}",
        f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor={major}",
        f"-X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor={minor}",
    ]
    return [
        _Part(
            name="k8s",
            version=versions.kubernetes,
            module="k8s.io/kubernetes",
            packages={
                "k8s.io/kubernetes/cmd/kube-apiserver": "kube-apiserver",
                "k8s.io/kubernetes/cmd/kube-controller-manager": "kube-controller-manager",
                "k8s.io/kubernetes/cmd/kube-scheduler": "kube-scheduler",
                "k8s.io/kubernetes/cmd/kubectl": "kubectl",
            },
            ldflags=tuple(k8s_ldflags),
            replace_staging=True,
        ),
        # The node agents, from the same wrapper module: a part of their own, so adding
        # them never relinks the control plane's binaries.
        _Part(
            name="k8s-node",
            version=versions.kubernetes,
            module="k8s.io/kubernetes",
            packages={
                "k8s.io/kubernetes/cmd/kubelet": "kubelet",
                "k8s.io/kubernetes/cmd/kube-proxy": "kube-proxy",
            },
            ldflags=tuple(k8s_ldflags),
            replace_staging=True,
        ),
        _Part(
            name="etcd",
            version=versions.etcd,
            module="go.etcd.io/etcd/server/v3",
            packages={"go.etcd.io/etcd/server/v3": "etcd"},
            ldflags=("-s", "-w"),
        ),
        _Part(
            name="kwok",
            version=versions.kwok,
            module="sigs.k8s.io/kwok",
            packages={"sigs.k8s.io/kwok/cmd/kwok": "kwok"},
            ldflags=(
                "-s",
                "-w",
                f"-X sigs.k8s.io/kwok/pkg/consts.Version={versions.kwok.removeprefix('v')}",
            ),
            # kwokctl's default stages: fast node start, lease heartbeats, fast pods.
            copy_globs=(
                ("kustomize/stage/node/fast/*.yaml", "stages"),
                ("kustomize/stage/node/heartbeat-with-lease/*.yaml", "stages"),
                ("kustomize/stage/pod/fast/*.yaml", "stages"),
            ),
        ),
        _Part(
            name="helm",
            version=versions.helm,
            module="helm.sh/helm/v3",
            packages={"helm.sh/helm/v3/cmd/helm": "helm"},
            ldflags=tuple(helm_ldflags),
        ),
    ]


def locate(versions: Versions = PINNED, root: Path | None = None) -> Binaries:
    """Where the binaries of ``versions`` are (or will be) in the cache; builds nothing."""
    base = root or cache_root()
    k8s = base / "k8s" / versions.kubernetes / "bin"
    node = base / "k8s-node" / versions.kubernetes / "bin"
    return Binaries(
        kube_apiserver=k8s / "kube-apiserver",
        kube_controller_manager=k8s / "kube-controller-manager",
        kube_scheduler=k8s / "kube-scheduler",
        kubectl=k8s / "kubectl",
        etcd=base / "etcd" / versions.etcd / "bin" / "etcd",
        kwok=base / "kwok" / versions.kwok / "bin" / "kwok",
        helm=base / "helm" / versions.helm / "bin" / "helm",
        kwok_stages=base / "kwok" / versions.kwok / "stages",
        kubelet=node / "kubelet",
        kube_proxy=node / "kube-proxy",
    )


def is_built(versions: Versions = PINNED, root: Path | None = None) -> bool:
    """True when every part's stamp matches its recipe and its binaries exist."""
    base = root or cache_root()
    return all(_is_current(part, base) for part in _parts(versions))


def ensure_built(
    versions: Versions = PINNED,
    root: Path | None = None,
    progress: Progress | None = None,
) -> Binaries:
    """Builds every missing part and returns the binaries' paths.

    Args:
        versions: Component versions to build.
        root: Cache root; defaults to :func:`dscache_tools.devcluster.versions.cache_root`.
        progress: Receives one line per step; defaults to the module logger.

    Raises:
        BuildError: Go is missing or too old, or a build failed (the message
            names the log file with Go's output).
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    base = root or cache_root()
    parts = _parts(versions)
    if all(_is_current(part, base) for part in parts):
        say(f"all binaries present in {base}")
        return locate(versions, base)
    base.mkdir(parents=True, exist_ok=True)
    with _build_lock(base / ".build.lock", say):
        go = _find_go()
        for part in parts:
            if _is_current(part, base):
                say(f"{part.name} {part.version}: cached in {part.directory(base) / 'bin'}")
                continue
            _build_part(part, versions, base, go, say)
    return locate(versions, base)


def _is_current(part: _Part, base: Path) -> bool:
    bindir = part.directory(base) / "bin"
    try:
        stamp = json.loads((bindir / _STAMP).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(stamp, dict) or stamp.get("recipe") != part.recipe():
        return False
    copied = all(any((part.directory(base) / dest).glob("*")) for _glob, dest in part.copy_globs)
    return copied and all(os.access(bindir / name, os.X_OK) for name in part.packages.values())


@contextmanager
def _build_lock(path: Path, say: Progress) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another build holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _find_go() -> Path:
    found = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if found is None:
        raise BuildError(
            "the Go toolchain is needed to build the dev cluster "
            f"(go >= {_MIN_GO[0]}.{_MIN_GO[1]} on PATH or in /usr/local/go/bin)"
        )
    out = subprocess.run(
        [found, "env", "GOVERSION"], capture_output=True, text=True, env=_go_env(), check=False
    ).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", out)
    if match is None or (int(match[1]), int(match[2])) < _MIN_GO:
        raise BuildError(f"{found} reports {out or 'no version'}; go >= 1.26 is needed")
    return Path(found)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        {
            "CGO_ENABLED": "0",
            "GOFLAGS": _GOFLAGS,
            # Never download another toolchain: the pinned parts build with local Go.
            "GOTOOLCHAIN": "local",
        }
    )
    return env


def _module_download(go: Path, module: str, version: str, cwd: Path) -> dict[str, str]:
    done = subprocess.run(
        [str(go), "mod", "download", "-json", f"{module}@{version}"],
        cwd=cwd,
        env=_go_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        info: dict[str, str] = json.loads(done.stdout)
    except ValueError:
        info = {}
    if done.returncode != 0 or "Dir" not in info:
        raise BuildError(
            f"go mod download {module}@{version} failed:\n"
            f"{done.stderr.strip()}\n{done.stdout.strip()}"
        )
    return info


def staging_replacements(kubernetes_gomod: str, staging_version: str) -> dict[str, str]:
    """Maps each module that Kubernetes replaces with ``./staging/...`` to its published version.

    Args:
        kubernetes_gomod: Text of ``k8s.io/kubernetes``'s go.mod.
        staging_version: ``v0.X.Y`` matching the Kubernetes release.

    Returns:
        ``{"k8s.io/api": "v0.35.8", ...}`` for every local staging replace.
    """
    found = re.findall(
        r"^\s*(?:replace\s+)?(\S+)\s+=>\s+\./staging/\S+\s*$", kubernetes_gomod, re.M
    )
    return dict.fromkeys(sorted(found), staging_version)


def _release_date(info_file: str) -> str | None:
    try:
        info = json.loads(Path(info_file).read_text())
    except (OSError, ValueError):
        return None
    stamp = info.get("Time") if isinstance(info, dict) else None
    return stamp if isinstance(stamp, str) else None


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _build_part(part: _Part, versions: Versions, base: Path, go: Path, say: Progress) -> None:
    directory = part.directory(base)
    src = directory / "src"
    bindir = directory / "bin"
    src.mkdir(parents=True, exist_ok=True)
    log_path = directory / "build.log"
    started = time.monotonic()
    say(f"{part.name} {part.version}: fetching {part.module} through the Go module proxy")
    info = _module_download(go, part.module, part.version, src)

    ldflags = list(part.ldflags)
    replaces: dict[str, str] = {}
    if part.replace_staging:
        replaces = staging_replacements(Path(info["GoMod"]).read_text(), versions.staging)
        if not replaces:
            raise BuildError(f"no staging replace directives found in {info['GoMod']}")
        date = _release_date(info.get("Info", ""))
        if date:
            for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
                ldflags.append(f"-X {pkg}.buildDate={date}")

    # The wrapper declares the upstream module's own go version, so the
    # language version and GODEBUG defaults are the ones upstream builds with.
    upstream_go = re.search(r"^go\s+(\S+)", Path(info["GoMod"]).read_text(), re.M)
    go_line = upstream_go[1] if upstream_go else "1.25.0"
    lines = [f"module dscache.local/devcluster/{part.name}", "", f"go {go_line}", ""]
    lines.append(f"require {part.module} {part.version}")
    if replaces:
        lines += ["", "replace ("]
        lines += [f"\t{mod} => {mod} {ver}" for mod, ver in replaces.items()]
        lines.append(")")
    (src / "go.mod").write_text("\n".join(lines) + "\n")

    out_tmp = directory / "bin.partial"
    shutil.rmtree(out_tmp, ignore_errors=True)
    out_tmp.mkdir()
    names = ", ".join(part.packages.values())
    say(f"{part.name} {part.version}: compiling {names} (nice -n 19; log {log_path})")
    command = [
        "nice",
        "-n",
        "19",
        str(go),
        "build",
        "-ldflags",
        " ".join(ldflags),
        "-o",
        # One package: name the file (go would call go.etcd.io/etcd/server/v3 "server").
        # Several: a directory, where each binary is named after its package path.
        str(out_tmp / next(iter(part.packages.values())))
        if len(part.packages) == 1
        else str(out_tmp) + "/",
        *part.packages,
    ]
    cpu_before = _children_cpu_seconds()
    with log_path.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        # Own process group, so an interruption can stop go and its compilers at once.
        proc = subprocess.Popen(
            command,
            cwd=src,
            env=_go_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            while True:
                try:
                    code = proc.wait(timeout=_HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    say(f"{part.name}: still compiling ({time.monotonic() - started:.0f} s so far)")
        except BaseException:
            # Interrupted (Ctrl-C, a test timeout): leave no compiler running.
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    if code != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-40:])
        raise BuildError(
            f"building {part.name} {part.version} failed (exit {code}); {log_path}:\n{tail}"
        )

    bindir.mkdir(exist_ok=True)
    (bindir / _STAMP).unlink(missing_ok=True)
    for name in part.packages.values():
        os.replace(out_tmp / name, bindir / name)
    out_tmp.rmdir()
    module_dir = Path(info["Dir"])
    for pattern, dest in part.copy_globs:
        target = directory / dest
        target.mkdir(exist_ok=True)
        for file in sorted(module_dir.glob(pattern)):
            if file.name != "kustomization.yaml":
                shutil.copyfile(file, target / file.name)
    cpu = _children_cpu_seconds() - cpu_before
    stamp = {
        "recipe": part.recipe(),
        "module": part.module,
        "version": part.version,
        "built_seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(cpu, 1),
    }
    (bindir / _STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    say(
        f"{part.name} {part.version}: built in {time.monotonic() - started:.0f} s "
        f"({cpu:.0f} CPU s) -> {bindir}"
    )


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main() -> int:
    """``python -m dscache_tools.devcluster``: build or reuse everything, list the binaries.

    Needs only the standard library and Go, so CI can run it before the
    project's Python dependencies are installed.
    """
    logging.basicConfig(level=logging.INFO, format="[dev cluster build] %(message)s")
    # CI may stop a background build with SIGTERM: unwind, so go is stopped too.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    try:
        binaries = ensure_built()
    except BuildError as exc:
        logger.error("%s", exc)
        return 1
    logger.info("done in %.1f s", time.monotonic() - started)
    for path in binaries.all_executables():
        logger.info("  %s", path)
    return 0

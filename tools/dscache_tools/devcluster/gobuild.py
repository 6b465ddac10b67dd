"""Builds one part of the dev cluster from a Go module: the Go side of :mod:`.build`.

Contract:
    * A :class:`Part` is a wrapper module under ``<cache>/<part>/<version>/src``
      that requires ``module@version``; :func:`build_part` fetches it through
      the Go module proxy, compiles its main packages under ``nice -n 19`` with
      ``CGO_ENABLED=0`` and the local toolchain only (``GOTOOLCHAIN=local``),
      moves the binaries into ``bin/`` once all of them built, and writes the
      stamp (:meth:`Part.recipe`) last.
    * For Kubernetes (``replace_staging``) the wrapper ``replace``s every
      staging module that ``k8s.io/kubernetes``'s own go.mod points at
      ``./staging/...`` with its published ``v0.X.Y`` of the same release
      (:func:`staging_replacements`), because a dependency's local
      ``replace`` directives are ignored; the release date is stamped too.
    * A failed build raises :class:`BuildError` with the tail of its log; an
      interrupted one leaves no compiler running.
    * Standard library only (see :mod:`.procs`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from dscache_tools.devcluster.procs import Progress, tail, wait_with_heartbeat
from dscache_tools.devcluster.versions import Versions

#: Seconds between "still building" messages.
_HEARTBEAT_S = 60.0
#: Oldest Go that builds every pinned part (etcd and kwok declare go 1.26.0).
MIN_GO = (1, 26)
STAMP = ".dscache-build.json"
_GOFLAGS = "-trimpath -buildvcs=false -mod=mod"
#: The packages whose version variables Kubernetes binaries report.
K8S_VERSION_PACKAGES = ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")


class BuildError(RuntimeError):
    """A part could not be built; the message names the log with Go's output."""


@dataclass(frozen=True)
class Part:
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
        """``<root>/<name>/<version>``: source, binaries and log of this part."""
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


def find_go() -> Path:
    """The local Go toolchain, checked to be new enough.

    Raises:
        BuildError: Go is missing or older than :data:`MIN_GO`.
    """
    found = shutil.which("go") or (
        "/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None
    )
    if found is None:
        raise BuildError(
            "the Go toolchain is needed to build the dev cluster "
            f"(go >= {MIN_GO[0]}.{MIN_GO[1]} on PATH or in /usr/local/go/bin)"
        )
    out = subprocess.run(
        [found, "env", "GOVERSION"], capture_output=True, text=True, env=go_env(), check=False
    ).stdout.strip()
    match = re.match(r"go(\d+)\.(\d+)", out)
    if match is None or (int(match[1]), int(match[2])) < MIN_GO:
        raise BuildError(f"{found} reports {out or 'no version'}; go >= 1.26 is needed")
    return Path(found)


def go_env(gocache: Path | None = None, goflags: str = _GOFLAGS) -> dict[str, str]:
    """Go's environment; ``gocache`` replaces the user's build cache (GOCACHE),
    ``goflags`` the pinned parts' GOFLAGS (a module of our own builds read-only)."""
    env = dict(os.environ)
    if gocache is not None:
        env["GOCACHE"] = str(gocache)
    env.update(
        {
            "CGO_ENABLED": "0",
            "GOFLAGS": goflags,
            # Never download another toolchain: the pinned parts build with local Go.
            "GOTOOLCHAIN": "local",
        }
    )
    return env


def module_download(go: Path, module: str, version: str, cwd: Path) -> dict[str, str]:
    """``go mod download -json module@version`` run in ``cwd``: its answer (``Dir``,
    ``GoMod``, ``Info``, ...).

    Raises:
        BuildError: The download failed (the message carries Go's output).
    """
    done = subprocess.run(
        [str(go), "mod", "download", "-json", f"{module}@{version}"],
        cwd=cwd,
        env=go_env(),
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


def build_cache(base: Path) -> Path:
    """Go's build cache for the parts built under ``base``: several GiB of compiled
    packages, worth keeping only until every part is built (a new pin rebuilds
    nearly everything anyway), so the user's own GOCACHE is not filled."""
    return base / "go-build"


def build_part(part: Part, base: Path, go: Path, say: Progress) -> None:
    """Fetches, compiles and installs ``part`` under ``part.directory(base)``.

    Go's build cache is :func:`build_cache` (``base/go-build``), shared by the
    parts of one build and removed by the caller when every part is built.

    Raises:
        BuildError: The download or the compilation failed.
    """
    directory = part.directory(base)
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"{part.name} {part.version}: fetching {part.module} through the Go module proxy")
    info = module_download(go, part.module, part.version, src)
    ldflags = _write_wrapper(part, info, src)
    cpu_before = _children_cpu_seconds()
    out_tmp = _compile(
        part,
        go,
        ldflags=ldflags,
        directory=directory,
        gocache=build_cache(base),
        say=say,
        started=started,
    )
    _install(part, directory, out_tmp, Path(info["Dir"]))
    cpu = _children_cpu_seconds() - cpu_before
    bindir = directory / "bin"
    stamp = {
        "recipe": part.recipe(),
        "module": part.module,
        "version": part.version,
        "built_seconds": round(time.monotonic() - started, 1),
        "cpu_seconds": round(cpu, 1),
    }
    (bindir / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
    say(
        f"{part.name} {part.version}: built in {time.monotonic() - started:.0f} s "
        f"({cpu:.0f} CPU s) -> {bindir}"
    )


def _write_wrapper(part: Part, info: dict[str, str], src: Path) -> list[str]:
    """Writes the wrapper's go.mod; returns the ldflags (with the release date stamped)."""
    upstream_gomod = Path(info["GoMod"]).read_text()
    ldflags = list(part.ldflags)
    replaces: dict[str, str] = {}
    if part.replace_staging:
        replaces = staging_replacements(upstream_gomod, Versions(kubernetes=part.version).staging)
        if not replaces:
            raise BuildError(f"no staging replace directives found in {info['GoMod']}")
        date = _release_date(info.get("Info", ""))
        if date:
            ldflags += [f"-X {pkg}.buildDate={date}" for pkg in K8S_VERSION_PACKAGES]
    # The wrapper declares the upstream module's own go version, so the
    # language version and GODEBUG defaults are the ones upstream builds with.
    upstream_go = re.search(r"^go\s+(\S+)", upstream_gomod, re.M)
    go_line = upstream_go[1] if upstream_go else "1.25.0"
    lines = [f"module dscache.local/devcluster/{part.name}", "", f"go {go_line}", ""]
    lines.append(f"require {part.module} {part.version}")
    if replaces:
        lines += ["", "replace ("]
        lines += [f"\t{mod} => {mod} {ver}" for mod, ver in replaces.items()]
        lines.append(")")
    (src / "go.mod").write_text("\n".join(lines) + "\n")
    return ldflags


def _compile(
    part: Part,
    go: Path,
    *,
    ldflags: list[str],
    directory: Path,
    gocache: Path,
    started: float,
    say: Progress,
) -> Path:
    """Runs ``go build`` into ``<directory>/bin.partial``; returns that directory."""
    log_path = directory / "build.log"
    out_tmp = directory / "bin.partial"
    shutil.rmtree(out_tmp, ignore_errors=True)
    out_tmp.mkdir()
    names = ", ".join(part.packages.values())
    say(f"{part.name} {part.version}: compiling {names} (nice -n 19; log {log_path})")
    # One package: name the file (go would call go.etcd.io/etcd/server/v3 "server").
    # Several: a directory, where each binary is named after its package path.
    output = (
        str(out_tmp / next(iter(part.packages.values())))
        if len(part.packages) == 1
        else str(out_tmp) + "/"
    )
    command = ["nice", "-n", "19", str(go), "build", "-ldflags", " ".join(ldflags)]
    command += ["-o", output, *part.packages]
    with log_path.open("w") as log:
        log.write(" ".join(command) + "\n")
        log.flush()
        # Own process group, so an interruption can stop go and its compilers at once.
        proc = subprocess.Popen(
            command,
            cwd=directory / "src",
            env=go_env(gocache),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        code = wait_with_heartbeat(
            proc,
            _HEARTBEAT_S,
            lambda: say(
                f"{part.name}: still compiling ({time.monotonic() - started:.0f} s so far)"
            ),
        )
    if code != 0:
        raise BuildError(
            f"building {part.name} {part.version} failed (exit {code}); "
            f"{log_path}:\n{tail(log_path, 40)}"
        )
    return out_tmp


def _install(part: Part, directory: Path, out_tmp: Path, module_dir: Path) -> None:
    """Moves the binaries into ``bin/`` (stamp removed first) and copies the extra files."""
    bindir = directory / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / STAMP).unlink(missing_ok=True)
    for name in part.packages.values():
        os.replace(out_tmp / name, bindir / name)
    out_tmp.rmdir()
    for pattern, dest in part.copy_globs:
        target = directory / dest
        target.mkdir(exist_ok=True)
        for file in sorted(module_dir.glob(pattern)):
            if file.name != "kustomization.yaml":
                shutil.copyfile(file, target / file.name)

"""Builds dscache's container images without any registry and caches them as archives.

Contract:
    * ``ensure_images()`` returns, for each of ``server``, ``core``, ``router``
      and ``pause`` (:data:`IMAGES`), an :class:`ImageArchive`: a ``docker
      save`` archive under ``<cache>/images/archives/`` (``<cache>`` is
      :func:`dscache_tools.devcluster.versions.cache_root`, so
      ``DSCACHE_DEVCLUSTER_CACHE`` moves it), building what is missing or stale.
    * Staleness is a content hash of an image's build inputs: every file under
      ``images/`` and, for the Python images, ``pyproject.toml``,
      ``README.md`` and every file of ``dscache/``, ``sidecar/``,
      ``model-server/`` and ``operator/`` that exists (``__pycache__``,
      ``*.pyc`` and tool caches excluded, as in ``.dockerignore``), plus the
      reference, target, base image and build arguments. The hash and the
      archive's size are kept in a stamp next to the archive and written last;
      when every stamp matches, no Docker process is started at all and the
      call takes well under a second.
    * The images are built from ``images/Dockerfile`` by a private Docker
      engine that exists only for the build: ``dockerd`` with its own
      ``containerd``, both with every file (data root, exec root, pid files,
      sockets, logs) under ``<cache>/images/docker/``; no bridge, no iptables
      rules, no IP forwarding or masquerading, and the client config is private
      too. Its data root persists, so rebuilds reuse Docker's layer cache: a
      source change rebuilds the last layer of ``core`` and ``server`` only. It
      is stopped before ``ensure_images`` returns, also on errors, and gets
      SIGTERM if the builder dies (PR_SET_PDEATHSIG); a later build stops
      any leftover first. The daemons run under ``nice -n 19``, and so do the
      build steps they start.
    * Without a registry, the base is ``debootstrap --variant=minbase bookworm``
      from deb.debian.org, trimmed like ``debian:bookworm-slim``, cached as a
      tarball under ``<cache>/images/base/`` and ``docker import``-ed as
      :data:`LOCAL_BASE`; ``DSCACHE_IMAGES_BASE=debian:bookworm-slim`` builds
      from a registry image instead. Builds use the host network; pip gets the
      host's CA bundle as a BuildKit secret, so a TLS-intercepting proxy works
      and the CA never lands in a layer. Debian packages stay as of the first
      build; deleting ``<cache>/images/base/`` refreshes them (a new
      debootstrap changes every image's hash, so everything is rebuilt on it).
    * A file lock serialises builders; the second waits and then finds the
      images built. An image rebuilt to the same image id keeps its archive.
    * ``load_images()`` imports archives into a containerd's ``k8s.io``
      namespace with ``ctr``, skipping images already present with the same
      reference and image id, so kubelets use them with ``imagePullPolicy:
      IfNotPresent`` and never pull. ``image_loader()`` builds first and
      returns that import as the dev cluster's per-node loader. Failures raise
      :class:`ImageError` naming what is missing or the log to read.

Standard library only, so the dev cluster can call it before the project's
dependencies are installed. Needs root (dockerd, debootstrap) and Debian's
``docker.io`` (dockerd, containerd, runc and a client with BuildKit built in)
and ``debootstrap``; ``scripts/build-images.sh`` installs both.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from dscache import __version__
from dscache_tools.devcluster.versions import cache_root

logger = logging.getLogger(__name__)

#: Called with one line of human-readable progress.
Progress = Callable[[str], None]

#: The base image ``docker import``-ed from the debootstrapped rootfs.
LOCAL_BASE = "dscache.local/debian-base:bookworm"
#: Environment variable naming a registry base image to use instead (e.g. debian:bookworm-slim).
BASE_ENV = "DSCACHE_IMAGES_BASE"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SECURITY_MIRROR = "http://deb.debian.org/debian-security"

#: Bump when the build procedure changes in a way the input files do not show.
_RECIPE = 1
_STAMP_SUFFIX = ".json"
#: Seconds between "still building" messages.
_HEARTBEAT_S = 60.0
#: Label on the imported base image: the sha256 of the rootfs tarball it came from.
_ROOTFS_LABEL = "io.dscache.rootfs-sha256"
#: Files and folders left out of the build context (.dockerignore) and of the hash.
_EXCLUDED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_PYTHON_INPUTS = (
    "pyproject.toml",
    "README.md",
    "dscache",
    "sidecar",
    "model-server",
    "operator",
    "tools",
)
#: Below this much free space a build warns: a cold build of all four takes about 17 GiB.
_LOW_DISK_BYTES = 12 * 2**30
#: Longest unix socket path (sun_path is 108 bytes with the terminating NUL).
_MAX_SOCKET_PATH = 100


class ImageError(RuntimeError):
    """An image could not be built or loaded; the message names what is missing or the log."""


@dataclass(frozen=True)
class ImageSpec:
    """One image: a target of ``images/Dockerfile`` and the reference it is tagged with."""

    name: str
    target: str
    ref: str
    #: Paths relative to the repository root whose files are build inputs.
    inputs: tuple[str, ...]


@dataclass(frozen=True)
class ImageArchive:
    """A built image saved with ``docker save``.

    Attributes:
        ref: The image reference the archive is tagged with.
        path: The archive (an uncompressed tar, ``docker load`` and ``ctr
            images import`` read it).
        image_id: Docker's image id, ``sha256:`` + the digest of the image config.
        size_bytes: Size of the archive file.
    """

    ref: str
    path: Path
    image_id: str
    size_bytes: int


#: Every image, in build order (each later one reuses the earlier ones' layers).
IMAGES: dict[str, ImageSpec] = {
    spec.name: spec
    for spec in (
        ImageSpec("pause", "pause", "dscache.local/pause:1.0", ("images",)),
        ImageSpec("router", "router", f"ghcr.io/dscache/dscache-router:{__version__}", ("images",)),
        ImageSpec(
            "core",
            "core",
            f"ghcr.io/dscache/dscache-core:{__version__}",
            ("images", *_PYTHON_INPUTS),
        ),
        ImageSpec(
            "server",
            "server",
            f"ghcr.io/dscache/dscache:{__version__}",
            ("images", *_PYTHON_INPUTS),
        ),
    )
}


def repo_root() -> Path:
    """The source checkout this module belongs to (where ``images/Dockerfile`` is)."""
    return Path(__file__).resolve().parents[2]


def images_dir(root: Path | None = None) -> Path:
    """``<cache>/images``: archives, the base tarball, the private Docker engine."""
    return (root or cache_root()) / "images"


# -- inputs -------------------------------------------------------------------------------------


def input_files(repo: Path, spec: ImageSpec) -> list[Path]:
    """The files that are build inputs of ``spec``, relative to ``repo``, sorted.

    Every existing file under the spec's input paths counts, tracked by git or
    not (the build context holds it either way), except caches that
    ``.dockerignore`` leaves out.
    """
    found: list[Path] = []
    for entry in spec.inputs:
        top = repo / entry
        if top.is_file() or top.is_symlink():
            found.append(Path(entry))
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [
                d for d in dirnames if d not in _EXCLUDED_DIRS and not d.endswith(".egg-info")
            ]
            for filename in filenames:
                if not filename.endswith(_EXCLUDED_SUFFIXES):
                    found.append(Path(dirpath, filename).relative_to(repo))
    return sorted(set(found))


def inputs_digest(repo: Path, spec: ImageSpec, base: str) -> str:
    """A hex digest of everything that decides ``spec``'s image.

    Args:
        repo: The repository root (the build context).
        spec: Which image.
        base: The ``BASE`` build argument with its identity (the rootfs sha256
            for the local base).

    Returns:
        The sha256 over the recipe, the reference, target and base, and each
        input file's path, executable bit and contents.
    """
    digest = hashlib.sha256()
    header = {
        "recipe": _RECIPE,
        "ref": spec.ref,
        "target": spec.target,
        "base": base,
        "version": __version__,
    }
    digest.update(json.dumps(header, sort_keys=True).encode())
    for rel in input_files(repo, spec):
        path = repo / rel
        digest.update(b"\0path\0" + str(rel).encode())
        if path.is_symlink():
            digest.update(b"\0link\0" + os.readlink(path).encode())
            continue
        digest.update(b"\0x" if os.access(path, os.X_OK) else b"\0-")
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


# -- stamps -------------------------------------------------------------------------------------


def _stamp_path(root: Path, name: str) -> Path:
    return images_dir(root) / "archives" / f"{name}{_STAMP_SUFFIX}"


def _archive_path(root: Path, name: str) -> Path:
    return images_dir(root) / "archives" / f"{name}.tar"


def _read_stamp(root: Path, name: str) -> dict[str, object] | None:
    try:
        stamp = json.loads(_stamp_path(root, name).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _archive_from_stamp(root: Path, name: str, stamp: Mapping[str, object]) -> ImageArchive | None:
    """The archive a stamp describes, or None when the file is gone or changed size."""
    path = _archive_path(root, name)
    ref, image_id, size = stamp.get("ref"), stamp.get("image_id"), stamp.get("size_bytes")
    if not (isinstance(ref, str) and isinstance(image_id, str) and isinstance(size, int)):
        return None
    try:
        if path.stat().st_size != size:
            return None
    except OSError:
        return None
    return ImageArchive(ref=ref, path=path, image_id=image_id, size_bytes=size)


def cached_archives(
    names: Iterable[str] | None = None, root: Path | None = None
) -> dict[str, ImageArchive]:
    """The archives present in the cache, current or not; builds nothing, starts nothing."""
    base = root or cache_root()
    found: dict[str, ImageArchive] = {}
    for name in names or IMAGES:
        stamp = _read_stamp(base, name)
        archive = _archive_from_stamp(base, name, stamp) if stamp else None
        if archive is not None:
            found[name] = archive
    return found


def _base_identity(root: Path) -> str:
    """``BASE`` plus what identifies its content, for the inputs hash; cheap (reads a stamp)."""
    override = os.environ.get(BASE_ENV)
    if override:
        return override
    stamp = _read_json(_rootfs_stamp(root))
    sha = stamp.get("sha256") if stamp else None
    return f"{LOCAL_BASE}@rootfs:{sha if isinstance(sha, str) else 'missing'}"


def _read_json(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _current(root: Path, repo: Path, spec: ImageSpec) -> ImageArchive | None:
    stamp = _read_stamp(root, spec.name)
    if stamp is None or stamp.get("inputs") != inputs_digest(repo, spec, _base_identity(root)):
        return None
    return _archive_from_stamp(root, spec.name, stamp)


# -- the entry point ----------------------------------------------------------------------------


def ensure_images(
    progress: Progress | None = None,
    names: Iterable[str] | None = None,
    *,
    root: Path | None = None,
    repo: Path | None = None,
    force: bool = False,
) -> dict[str, ImageArchive]:
    """Builds every missing or stale image and returns the archives.

    Args:
        progress: Receives one line per step; defaults to the module logger.
        names: Which images (keys of :data:`IMAGES`); default all.
        root: Cache root; defaults to :func:`dscache_tools.devcluster.versions.cache_root`.
        repo: Source checkout with ``images/Dockerfile``; defaults to this one.
        force: Run ``docker build`` even when the stamps match (Docker's
            layer cache still applies; an unchanged image keeps its archive).

    Returns:
        ``{name: ImageArchive}`` for each requested image.

    Raises:
        ImageError: An unknown name, a missing tool (dockerd, debootstrap,
            root), or a failed build (the message names the log).
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    base_root = root or cache_root()
    source = repo or repo_root()
    wanted = _specs(names)
    if not force:
        done = {spec.name: _current(base_root, source, spec) for spec in wanted}
        if all(done.values()):
            return {name: archive for name, archive in done.items() if archive is not None}
    if not (source / "images" / "Dockerfile").is_file():
        raise ImageError(
            f"{source / 'images' / 'Dockerfile'} not found: images are built from a source checkout"
        )
    work = images_dir(base_root)
    (work / "archives").mkdir(parents=True, exist_ok=True)
    with _build_lock(work / ".build.lock", say):
        results: dict[str, ImageArchive] = {}
        stale: list[ImageSpec] = []
        for spec in wanted:
            archive = None if force else _current(base_root, source, spec)
            if archive is None:
                stale.append(spec)
            else:
                results[spec.name] = archive
        if not stale:
            say("all images were built meanwhile by another builder")
            return results
        say(f"building {', '.join(s.name for s in stale)} (private dockerd in {work / 'docker'})")
        free = shutil.disk_usage(work).free
        if free < _LOW_DISK_BYTES:
            # A rebuilt server archive is written next to the old one before replacing it.
            say(
                f"warning: {_mib(free)} free in {work}; building the server image can "
                f"take {_mib(_LOW_DISK_BYTES)} (layers, pip cache, a second archive meanwhile)"
            )
        base_arg = os.environ.get(BASE_ENV) or None
        tarball = None if base_arg else _ensure_rootfs(base_root, say)
        with PrivateDocker(work / "docker", say) as docker:
            if tarball is not None:
                _ensure_base_image(docker, tarball, say)
            identity = _base_identity(base_root)
            for spec in stale:
                results[spec.name] = _build_one(
                    docker,
                    spec,
                    repo=source,
                    root=base_root,
                    base_arg=base_arg or LOCAL_BASE,
                    base_identity=identity,
                    say=say,
                )
            # Old tags' images, and build cache beyond what a warm rebuild of
            # every image uses (pip's cache mount included), least recently used first.
            docker.run(["image", "prune", "--force"], check=False)
            docker.run(["builder", "prune", "--force", "--keep-storage", "10GB"], check=False)
    return {spec.name: results[spec.name] for spec in wanted}


@contextlib.contextmanager
def docker_engine(
    root: Path | None = None, progress: Progress | None = None
) -> Iterator[PrivateDocker]:
    """The image cache's private Docker engine, running for the ``with`` block.

    Holds the build lock meanwhile, so no builder starts a second engine on
    the same data root. Tests use it to run the images.
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    work = images_dir(root)
    work.mkdir(parents=True, exist_ok=True)
    with _build_lock(work / ".build.lock", say), PrivateDocker(work / "docker", say) as docker:
        yield docker


def _specs(names: Iterable[str] | None) -> list[ImageSpec]:
    if names is None:
        return list(IMAGES.values())
    chosen = list(dict.fromkeys(names))
    unknown = [n for n in chosen if n not in IMAGES]
    if unknown:
        raise ImageError(f"unknown image(s) {unknown}; known: {', '.join(IMAGES)}")
    return [IMAGES[n] for n in chosen]


@contextlib.contextmanager
def _build_lock(path: Path, say: Progress) -> Iterator[None]:
    with path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"another image build holds {path}; waiting for it")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _ca_bundle() -> Path | None:
    """The CA bundle pip gets as a build secret (a TLS-intercepting proxy needs it)."""
    for candidate in (
        os.environ.get("PIP_CERT"),
        os.environ.get("SSL_CERT_FILE"),
        "/etc/ssl/certs/ca-certificates.crt",
    ):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def _build_one(
    docker: PrivateDocker,
    spec: ImageSpec,
    *,
    repo: Path,
    root: Path,
    base_arg: str,
    base_identity: str,
    say: Progress,
) -> ImageArchive:
    work = images_dir(root)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"{spec.name}.log"
    iid_file = logs / f"{spec.name}.iid"
    iid_file.unlink(missing_ok=True)
    digest = inputs_digest(repo, spec, base_identity)
    command = [
        "build",
        "--progress=plain",
        "--network=host",
        "--file",
        str(repo / "images" / "Dockerfile"),
        "--target",
        spec.target,
        "--tag",
        spec.ref,
        "--iidfile",
        str(iid_file),
        "--build-arg",
        f"BASE={base_arg}",
        "--build-arg",
        f"DSCACHE_VERSION={__version__}",
    ]
    ca = _ca_bundle()
    if ca is not None:
        command += ["--secret", f"id=ca,src={ca}"]
    command.append(str(repo))
    say(f"{spec.name}: docker build --target {spec.target} -> {spec.ref} (log {log_path})")
    started = time.monotonic()
    docker.run_logged(command, log_path, spec.name, say)
    image_id = iid_file.read_text().strip()
    seconds = time.monotonic() - started
    image_size = int(docker.run(["image", "inspect", "--format", "{{.Size}}", spec.ref]).strip())

    old = _read_stamp(root, spec.name)
    previous = _archive_from_stamp(root, spec.name, old) if old else None
    archive_path = _archive_path(root, spec.name)
    if previous is not None and previous.image_id == image_id and previous.ref == spec.ref:
        say(f"{spec.name}: unchanged image {image_id[:19]}; keeping {archive_path.name}")
        save_seconds = 0.0
    else:
        say(f"{spec.name}: docker save -> {archive_path}")
        _stamp_path(root, spec.name).unlink(missing_ok=True)
        partial = archive_path.with_suffix(".tar.partial")
        partial.unlink(missing_ok=True)
        t0 = time.monotonic()
        docker.run(["save", "--output", str(partial), spec.ref])
        os.replace(partial, archive_path)
        save_seconds = time.monotonic() - t0
    size = archive_path.stat().st_size
    stamp = {
        "inputs": digest,
        "ref": spec.ref,
        "image_id": image_id,
        "size_bytes": size,
        "image_size_bytes": image_size,
        "build_seconds": round(seconds, 1),
        "save_seconds": round(save_seconds, 1),
        "base": base_identity,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _stamp_path(root, spec.name).write_text(json.dumps(stamp, indent=2) + "\n")
    say(
        f"{spec.name}: {spec.ref} {image_id[:19]} built in {seconds:.0f} s, "
        f"image {_mib(image_size)}, archive {_mib(size)}"
    )
    return ImageArchive(ref=spec.ref, path=archive_path, image_id=image_id, size_bytes=size)


def _mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"


# -- the Debian base ----------------------------------------------------------------------------


def _rootfs_tarball(root: Path) -> Path:
    return images_dir(root) / "base" / f"debian-{DEBIAN_SUITE}-minbase.tar.gz"


def _rootfs_stamp(root: Path) -> Path:
    return _rootfs_tarball(root).with_suffix("").with_suffix(".json")


#: Left out of the base like debian:bookworm-slim does (dpkg path-exclude), copyrights kept.
_SLIM_DPKG_CONFIG = """\
# Like debian:bookworm-slim: no documentation, manual pages or translations.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-exclude /usr/share/man/*
"""

_SOURCES = f"""\
Types: deb
URIs: {DEBIAN_MIRROR}
Suites: {DEBIAN_SUITE} {DEBIAN_SUITE}-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: {DEBIAN_SECURITY_MIRROR}
Suites: {DEBIAN_SUITE}-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def _ensure_rootfs(root: Path, say: Progress) -> Path:
    """The cached minbase rootfs tarball; runs debootstrap (about a minute) when missing."""
    tarball = _rootfs_tarball(root)
    stamp = _read_json(_rootfs_stamp(root))
    if tarball.is_file() and stamp and stamp.get("size_bytes") == tarball.stat().st_size:
        return tarball
    debootstrap = shutil.which("debootstrap") or _existing("/usr/sbin/debootstrap")
    if debootstrap is None:
        raise ImageError(
            "debootstrap is needed for the base image without a registry: "
            "apt-get install debootstrap (scripts/build-images.sh does), "
            f"or set {BASE_ENV}=debian:bookworm-slim to pull the base instead"
        )
    _need_root("debootstrap")
    tarball.parent.mkdir(parents=True, exist_ok=True)
    log_path = tarball.parent / "debootstrap.log"
    started = time.monotonic()
    say(f"base: debootstrap --variant=minbase {DEBIAN_SUITE} from {DEBIAN_MIRROR} (log {log_path})")
    with tempfile.TemporaryDirectory(dir=tarball.parent, prefix="rootfs.") as scratch:
        target = Path(scratch) / "rootfs"
        with log_path.open("w") as log:
            done = subprocess.run(
                [
                    "nice",
                    "-n",
                    "19",
                    debootstrap,
                    "--variant=minbase",
                    DEBIAN_SUITE,
                    str(target),
                    DEBIAN_MIRROR,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                check=False,
            )
        if done.returncode != 0:
            raise ImageError(
                f"debootstrap failed (exit {done.returncode}); {log_path}:\n{_tail(log_path)}"
            )
        _slim_rootfs(target)
        partial = tarball.with_suffix(".partial")
        subprocess.run(
            [
                "tar",
                "--numeric-owner",
                "--xattrs",
                "--sort=name",
                "-czf",
                str(partial),
                "-C",
                str(target),
                ".",
            ],
            check=True,
        )
        os.replace(partial, tarball)
    sha = _sha256_file(tarball)
    size = tarball.stat().st_size
    info = {
        "sha256": sha,
        "size_bytes": size,
        "suite": DEBIAN_SUITE,
        "mirror": DEBIAN_MIRROR,
        "variant": "minbase",
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    _rootfs_stamp(root).write_text(json.dumps(info, indent=2) + "\n")
    say(f"base: {tarball} ({_mib(size)}) in {time.monotonic() - started:.0f} s")
    return tarball


def _slim_rootfs(target: Path) -> None:
    """Trims a fresh debootstrap tree like the debian:*-slim images and empties host leftovers."""
    (target / "etc/dpkg/dpkg.cfg.d").mkdir(parents=True, exist_ok=True)
    (target / "etc/dpkg/dpkg.cfg.d/docker").write_text(_SLIM_DPKG_CONFIG)
    (target / "etc/apt/sources.list").unlink(missing_ok=True)
    (target / "etc/apt/sources.list.d").mkdir(parents=True, exist_ok=True)
    (target / "etc/apt/sources.list.d/debian.sources").write_text(_SOURCES)
    for pattern in ("usr/share/doc/*", "usr/share/man/*", "usr/share/info/*", "usr/share/locale/*"):
        for path in target.glob(pattern):
            if pattern.startswith("usr/share/doc/") and path.is_dir():
                for item in path.iterdir():
                    if item.name != "copyright":
                        _remove(item)
                continue
            _remove(path)
    for pattern in (
        "var/cache/apt/*.bin",
        "var/cache/apt/archives/*.deb",
        "var/lib/apt/lists/*_*",
        "var/log/*.log",
        "var/log/apt/*",
        "dev/*",
        "proc/*",
        "sys/*",
        "tmp/*",
    ):
        for path in target.glob(pattern):
            _remove(path)
    # Docker provides these per container; the host's must not ship in the image.
    for name in ("etc/resolv.conf", "etc/hostname", "etc/machine-id"):
        path = target / name
        if path.exists() or path.is_symlink():
            path.unlink()
            path.write_text("")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _ensure_base_image(docker: PrivateDocker, tarball: Path, say: Progress) -> None:
    """Imports the rootfs tarball as :data:`LOCAL_BASE` unless that image came from it."""
    stamp = _read_json(tarball.with_suffix("").with_suffix(".json")) or {}
    sha = stamp.get("sha256")
    label = docker.run(
        [
            "image",
            "inspect",
            "--format",
            f'{{{{index .Config.Labels "{_ROOTFS_LABEL}"}}}}',
            LOCAL_BASE,
        ],
        check=False,
    ).strip()
    if label and label == sha:
        return
    say(f"base: docker import {tarball.name} as {LOCAL_BASE}")
    docker.run(
        [
            "import",
            "--change",
            f"LABEL {_ROOTFS_LABEL}={sha}",
            "--change",
            "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "--change",
            'CMD ["bash"]',
            str(tarball),
            LOCAL_BASE,
        ]
    )


# -- the private Docker engine ------------------------------------------------------------------


def _existing(path: str) -> str | None:
    return path if os.access(path, os.X_OK) else None


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        raise ImageError(f"{what} needs root: run as root (or through sudo)")


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    except OSError:
        return ""


def _docker_client() -> str:
    """A docker client with BuildKit built in.

    Debian's docker.io client (``/usr/bin/docker``, 20.10) builds with BuildKit
    itself; clients from 23.0 on hand ``docker build`` to the buildx plugin.
    """
    override = os.environ.get("DSCACHE_DOCKER")
    if override:
        return override
    found = _existing("/usr/bin/docker") or shutil.which("docker")
    if found is None:
        raise ImageError(
            "no docker client: apt-get install docker.io (scripts/build-images.sh does)"
        )
    return found


class PrivateDocker:
    """A ``dockerd`` and ``containerd`` of our own under one directory, for building images.

    ``with PrivateDocker(directory, say) as docker:`` starts both (stopping
    leftovers of a killed earlier run first) and stops both on exit.
    ``docker.run([...])`` runs the docker client against it. Nothing outside
    ``directory`` changes except what containerd's runc shims need while
    containers run (their sockets under /run/containerd/s, runc state under
    /run/containerd/runc/moby); the mounts dockerd leaves behind (its data
    root bound onto itself, the default network namespace) are unmounted
    once it has stopped.
    """

    def __init__(self, directory: Path, say: Progress | None = None) -> None:
        self.directory = directory
        self._say: Progress = say or (lambda line: logger.info("%s", line))
        self._client = _docker_client()
        runtime = directory / "run"
        if len(str(runtime / "containerd" / "containerd.sock.ttrpc")) > _MAX_SOCKET_PATH:
            # A long cache path would overflow sun_path: keep sockets in a short private dir.
            key = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
            runtime = Path(tempfile.gettempdir()) / f"dscache-docker-{key}"
        self.runtime = runtime
        self.socket = runtime / "docker.sock"
        self.containerd_socket = runtime / "containerd" / "containerd.sock"
        self._dockerd: subprocess.Popen[bytes] | None = None
        self._containerd: subprocess.Popen[bytes] | None = None

    # paths
    @property
    def _dockerd_pidfile(self) -> Path:
        return self.runtime / "docker.pid"

    @property
    def _containerd_pidfile(self) -> Path:
        return self.runtime / "containerd.pid"

    def env(self) -> dict[str, str]:
        """Environment for a docker client talking to this engine (BuildKit on, private config)."""
        env = dict(os.environ)
        env.update(
            {
                "DOCKER_HOST": f"unix://{self.socket}",
                "DOCKER_BUILDKIT": "1",
                "DOCKER_CONFIG": str(self.directory / "client"),
            }
        )
        env.pop("DOCKER_CONTEXT", None)
        env.pop("DOCKER_TLS_VERIFY", None)
        return env

    def __enter__(self) -> PrivateDocker:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        """Starts containerd, then dockerd; returns once the engine answers.

        Raises:
            ImageError: A tool is missing, or a daemon did not come up (the
                message has its log's tail); nothing is left running then.
        """
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        _need_root("the private dockerd")
        dockerd = shutil.which("dockerd") or _existing("/usr/sbin/dockerd")
        containerd = shutil.which("containerd") or _existing("/usr/bin/containerd")
        missing = [
            name
            for name, found in (
                ("dockerd", dockerd),
                ("containerd", containerd),
                ("runc", shutil.which("runc") or _existing("/usr/sbin/runc")),
            )
            if found is None
        ]
        if missing or dockerd is None or containerd is None:
            raise ImageError(
                f"{', '.join(missing)} not found: apt-get install docker.io "
                "(Debian's package brings dockerd, containerd and runc; "
                "scripts/build-images.sh installs it)"
            )
        for path in (self.directory, self.runtime, self.directory / "client"):
            path.mkdir(parents=True, exist_ok=True)
        self._stop_leftover(self._dockerd_pidfile, "dockerd")
        self._stop_leftover(self._containerd_pidfile, "containerd")
        ctr_dir = self.directory / "containerd"
        ctr_dir.mkdir(exist_ok=True)
        self.containerd_socket.parent.mkdir(parents=True, exist_ok=True)
        config = ctr_dir / "config.toml"
        config.write_text(
            "\n".join(
                [
                    "# containerd of dscache's image builder (dscache_tools.devcluster.images)",
                    "version = 2",
                    f'root = "{ctr_dir / "root"}"',
                    f'state = "{self.runtime / "containerd" / "state"}"',
                    'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
                    "",
                    "[grpc]",
                    f'  address = "{self.containerd_socket}"',
                    "",
                    "[ttrpc]",
                    f'  address = "{self.containerd_socket}.ttrpc"',
                    "",
                    '[plugins."io.containerd.internal.v1.opt"]',
                    f'  path = "{ctr_dir / "opt"}"',
                    "",
                ]
            )
        )
        self._containerd = self._spawn(
            [containerd, "--config", str(config), "--log-level", "warn"],
            ctr_dir / "containerd.log",
        )
        self._containerd_pidfile.write_text(f"{self._containerd.pid}\n")
        self._wait_for_socket(
            self.containerd_socket, self._containerd, ctr_dir / "containerd.log", 30.0
        )

        daemon_json = self.directory / "daemon.json"
        # dockerd 20.10 writes a trust key to /etc/docker/key.json unless told otherwise.
        daemon_json.write_text(
            json.dumps({"deprecated-key-path": str(self.directory / "key.json")}, indent=2) + "\n"
        )
        self._dockerd = self._spawn(
            [
                dockerd,
                "--config-file",
                str(daemon_json),
                "--data-root",
                str(self.directory / "data"),
                "--exec-root",
                str(self.runtime / "exec"),
                "--pidfile",
                str(self._dockerd_pidfile),
                "--host",
                f"unix://{self.socket}",
                "--containerd",
                str(self.containerd_socket),
                "--bridge=none",
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--log-level=warn",
            ],
            self.directory / "dockerd.log",
        )
        deadline = time.monotonic() + 60.0
        while True:
            if self._dockerd.poll() is not None:
                log = self.directory / "dockerd.log"
                raise ImageError(
                    f"dockerd exited with {self._exit_code()} at start; {log}:\n{_tail(log)}"
                )
            probe = subprocess.run(
                [self._client, "version", "--format", "{{.Server.Version}}"],
                env=self.env(),
                capture_output=True,
                text=True,
                check=False,
            )
            if probe.returncode == 0:
                break
            if time.monotonic() > deadline:
                raise ImageError(
                    f"dockerd did not answer on {self.socket} within 60 s: {probe.stderr.strip()}"
                )
            time.sleep(0.3)
        driver = self.run(["info", "--format", "{{.Driver}}"]).strip()
        self._say(f"private dockerd {probe.stdout.strip()} up ({driver}) on {self.socket}")
        if driver != "overlay2":
            self._say(f"warning: storage driver {driver}: layers are full copies (slow, large)")
        self._check_client()

    def _exit_code(self) -> int | None:
        return self._dockerd.returncode if self._dockerd else None

    def _check_client(self) -> None:
        version = self.run(["version", "--format", "{{.Client.Version}}"]).strip()
        match = re.match(r"(\d+)\.", version)
        if match and int(match[1]) >= 23:
            buildx = subprocess.run(
                [self._client, "buildx", "version"],
                env=self.env(),
                capture_output=True,
                check=False,
            )
            if buildx.returncode != 0:
                raise ImageError(
                    f"{self._client} {version} builds only through the buildx plugin, which is "
                    "missing: use Debian's /usr/bin/docker (docker.io) or set DSCACHE_DOCKER"
                )

    def _spawn(self, command: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as log:
            return subprocess.Popen(
                ["nice", "-n", "19", *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_stop_with_parent,  # noqa: PLW1509 (one prctl call, like cluster.py)
            )

    @staticmethod
    def _wait_for_socket(
        path: Path, proc: subprocess.Popen[bytes], log: Path, timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ImageError(
                    f"containerd exited with {proc.returncode} at start; {log}:\n{_tail(log)}"
                )
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as sock:
                sock.connect(str(path))
                return
            time.sleep(0.1)
        raise ImageError(f"containerd did not listen on {path} within {timeout:.0f} s; see {log}")

    def _stop_leftover(self, pidfile: Path, name: str) -> None:
        """Stops a daemon a killed earlier run left behind (we hold the build lock)."""
        pid = self._alive_pidfile(pidfile, name)
        if pid is not None:
            self._say(f"stopping leftover {name} (pid {pid}) of an interrupted build")
            _terminate(pid, 30.0)
        pidfile.unlink(missing_ok=True)

    def stop(self) -> None:
        """Stops dockerd (its containers first), then containerd; idempotent."""
        for proc, pidfile in (
            (self._dockerd, self._dockerd_pidfile),
            (self._containerd, self._containerd_pidfile),
        ):
            if proc is None:
                continue
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=45.0)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            pidfile.unlink(missing_ok=True)
        self._dockerd = None
        self._containerd = None
        self._unmount_leftovers()

    def _unmount_leftovers(self) -> None:
        """Unmounts what dockerd leaves mounted after it exits.

        dockerd bind-mounts its data root onto itself (to make it a private
        mount) and keeps the default network namespace mounted under its exec
        root; neither is undone at shutdown, so the host would keep them.
        """
        if self._alive_pidfile(self._dockerd_pidfile, "dockerd") is not None:
            return  # not ours to undo while some dockerd still runs on them
        for point in sorted(_mount_points(self.directory, self.runtime), reverse=True):
            subprocess.run(["umount", point], capture_output=True, check=False)

    def _alive_pidfile(self, pidfile: Path, name: str) -> int | None:
        """The pid in ``pidfile`` when it is a live ``name`` working in our directory."""
        try:
            pid = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        alive = _process_name(pid) == name and str(self.directory) in _cmdline(pid)
        return pid if alive else None

    def run(self, args: Sequence[str], check: bool = True, timeout: float | None = None) -> str:
        """Runs ``docker <args>`` against this engine and returns its stdout.

        Raises:
            ImageError: The command failed and ``check`` is set.
        """
        done = subprocess.run(
            [self._client, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
        )
        if check and done.returncode != 0:
            raise ImageError(
                f"docker {' '.join(args[:3])} failed (exit {done.returncode}): "
                f"{done.stderr.strip()[-2000:]}"
            )
        return done.stdout

    def ensure_loaded(self, archive: ImageArchive) -> None:
        """Makes ``archive.ref`` name the archive's image here (``docker load`` when not)."""
        present = self.run(
            ["image", "inspect", "--format", "{{.Id}}", archive.ref], check=False
        ).strip()
        if present != archive.image_id:
            self._say(f"docker load {archive.path}")
            self.run(["load", "--input", str(archive.path)])

    def run_logged(self, args: Sequence[str], log_path: Path, what: str, say: Progress) -> None:
        """Runs a long docker command with its output in ``log_path`` and a heartbeat."""
        started = time.monotonic()
        with log_path.open("w") as log:
            log.write(" ".join([self._client, *args]) + "\n")
            log.flush()
            proc = subprocess.Popen(
                [self._client, *args],
                env=self.env(),
                stdin=subprocess.DEVNULL,
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
                        step = _last_step(log_path)
                        say(
                            f"{what}: still building ({time.monotonic() - started:.0f} s)"
                            + (f": {step}" if step else "")
                        )
            except BaseException:
                # Interrupted: the client's end of the build goes; dockerd cancels the solve.
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        if code != 0:
            raise ImageError(
                f"{what}: docker {args[0]} failed (exit {code}); {log_path}:\n{_tail(log_path)}"
            )


_PR_SET_PDEATHSIG = 1


def _stop_with_parent() -> None:
    """In the child before exec: SIGTERM when the builder dies, even by SIGKILL.

    The daemons then shut down cleanly instead of holding the data root until
    the next build stops them as leftovers.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


_STEP_RE = re.compile(r"^#\d+ \[[^\]]+\] .*$")


def _last_step(log_path: Path) -> str:
    """The last ``#N [stage k/n] INSTRUCTION`` line of a plain-progress build log, shortened."""
    steps = [line for line in _tail(log_path, 400).splitlines() if _STEP_RE.match(line)]
    return steps[-1][:120] if steps else ""


def _mount_points(*roots: Path) -> list[str]:
    """Mount points at or under any of ``roots``, from /proc/self/mountinfo."""
    prefixes = [str(root) for root in roots]
    found: list[str] = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 5:
            continue
        # Field 5 is the mount point, with space, tab, newline and backslash octal-escaped.
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[4])
        if any(point == p or point.startswith(p + "/") for p in prefixes):
            found.append(point)
    return found


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _terminate(pid: int, grace: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists() or _process_state(pid) == "Z":
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _process_state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[0]


# -- loading into containerd --------------------------------------------------------------------


def archive_image_id(path: Path) -> str:
    """The image id (``sha256:`` + config digest) inside a ``docker save`` archive."""
    with tarfile.open(path) as tar:
        member = tar.extractfile("manifest.json")
        if member is None:
            raise ImageError(f"{path} has no manifest.json: not a docker save archive")
        manifest = json.load(member)
    config = str(manifest[0]["Config"])
    # "blobs/sha256/<hex>" (Docker 25+) or "<hex>.json" (earlier).
    return "sha256:" + Path(config).name.removesuffix(".json")


def load_images(
    archives: Iterable[ImageArchive],
    containerd_address: Path,
    ctr: str = "ctr",
    *,
    namespace: str = "k8s.io",
    snapshotter: str | None = None,
    progress: Progress | None = None,
) -> None:
    """Imports image archives into a containerd, where kubelets find them without pulling.

    An archive whose reference already names an image with the same image id
    (config digest) in ``namespace`` is skipped.

    Args:
        archives: From :func:`ensure_images`.
        containerd_address: The containerd's gRPC socket.
        ctr: containerd's ``ctr`` client (Debian's ``containerd`` package has it).
        namespace: containerd namespace; the CRI plugin (kubelet) uses ``k8s.io``.
        snapshotter: Unpack for this snapshotter (default: ctr's, overlayfs);
            must be the one the CRI plugin uses.
        progress: Receives one line per import; defaults to the module logger.

    Raises:
        ImageError: ``ctr`` failed (the message has its output).
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    base = [ctr, "--address", str(containerd_address), "--namespace", namespace]
    for archive in archives:
        if _present_config(base, archive.ref) == archive.image_id:
            say(f"{archive.ref}: already in {containerd_address} ({namespace})")
            continue
        command = [*base, "images", "import"]
        if snapshotter:
            command += ["--snapshotter", snapshotter]
        command.append(str(archive.path))
        started = time.monotonic()
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise ImageError(
                f"ctr images import {archive.path} failed (exit {done.returncode}): "
                f"{(done.stderr or done.stdout).strip()[-2000:]}"
            )
        say(f"{archive.ref}: imported in {time.monotonic() - started:.1f} s")


def image_loader(
    progress: Progress | None = None,
    names: Iterable[str] | None = None,
    *,
    root: Path | None = None,
    ctr: str = "ctr",
) -> Callable[[Path], None]:
    """Builds the images now and returns a loader for each node's containerd.

    The dev cluster (``DevCluster.start(load_images=...)``) calls the loader
    with a node's containerd socket; building first means a missing tool or a
    failed build shows before any node starts.

    Raises:
        ImageError: As :func:`ensure_images`.
    """
    archives = list(ensure_images(progress, names, root=root).values())

    def load(containerd_address: Path) -> None:
        load_images(archives, containerd_address, ctr, progress=progress)

    return load


def _present_config(base: list[str], ref: str) -> str | None:
    """The config digest of the image ``ref`` in containerd, or None when absent.

    An image whose record exists but whose content is not complete and unpacked
    (a store cut short by a full disk, say) counts as absent, so it is imported
    again rather than failing every pod sandbox later.
    """
    name = _containerd_name(ref)
    listed = subprocess.run(
        [*base, "images", "list", f"name=={name}"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = listed.stdout.splitlines()[1:] if listed.returncode == 0 else []
    if not rows:
        return None
    checked = subprocess.run(
        [*base, "images", "check", f"name=={name}"], capture_output=True, text=True, check=False
    )
    row = next((r for r in checked.stdout.splitlines()[1:] if r.split()[:1] == [name]), "")
    if "complete" not in row.split() or not row.rstrip().endswith("true"):
        return None
    target = rows[0].split()[2]
    return _config_of(base, target)


def _config_of(base: list[str], digest: str) -> str | None:
    """Follows an index (first linux/amd64 or only entry) or manifest to its config digest."""
    for _ in range(3):
        got = subprocess.run(
            [*base, "content", "get", digest], capture_output=True, text=True, check=False
        )
        if got.returncode != 0:
            return None
        try:
            doc = json.loads(got.stdout)
        except ValueError:
            return None
        config = doc.get("config")
        if isinstance(config, dict) and isinstance(config.get("digest"), str):
            return str(config["digest"])
        manifests = doc.get("manifests")
        if not isinstance(manifests, list) or not manifests:
            return None
        chosen = next(
            (
                m
                for m in manifests
                if isinstance(m, dict)
                and m.get("platform", {}).get("architecture") in (None, "amd64")
            ),
            manifests[0],
        )
        digest = str(chosen.get("digest"))
    return None


def _containerd_name(ref: str) -> str:
    """How containerd names an image Docker calls ``ref`` (short names get docker.io/library/)."""
    name = ref
    first = name.split("/", 1)[0]
    if "/" not in name or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name if '/' in name else 'library/' + name}"
    return name


# -- command line -------------------------------------------------------------------------------


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m dscache_tools.devcluster.images``: build or reuse the images, print a table."""
    parser = argparse.ArgumentParser(
        prog="python -m dscache_tools.devcluster.images",
        description="Build dscache's container images (no registry needed) into "
        f"{images_dir()}/archives.",
    )
    parser.add_argument("names", nargs="*", help=f"images: {', '.join(IMAGES)} (default: all)")
    parser.add_argument(
        "--force", action="store_true", help="run docker build even when the stamps match"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[images] %(message)s")
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    started = time.monotonic()
    before = {name: _read_stamp(cache_root(), name) for name in IMAGES}
    try:
        archives = ensure_images(names=args.names or None, force=args.force)
    except ImageError as exc:
        logger.error("%s", exc)
        return 1
    rows = [("image", "ref", "image size", "archive", "build s", "image id")]
    for name, archive in archives.items():
        stamp = _read_stamp(cache_root(), name) or {}
        built = "cached" if stamp == before.get(name) else f"{stamp.get('build_seconds', '?')}"
        image_size = stamp.get("image_size_bytes")
        rows.append(
            (
                name,
                archive.ref,
                _mib(image_size) if isinstance(image_size, int) else "?",
                _mib(archive.size_bytes),
                built,
                archive.image_id.removeprefix("sha256:")[:12],
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))
    print(f"done in {time.monotonic() - started:.1f} s; archives in {images_dir() / 'archives'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

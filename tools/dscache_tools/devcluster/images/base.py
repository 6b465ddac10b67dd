"""The Debian base of every image, made without a registry.

Contract:
    * Without a registry, the base is ``debootstrap --variant=minbase
      bookworm`` from deb.debian.org, trimmed like ``debian:bookworm-slim``,
      cached as a tarball under ``<cache>/images/base/`` with a stamp (sha256,
      size) and ``docker import``-ed as :data:`LOCAL_BASE`, labelled with the
      tarball's sha256 so it is imported again only when the tarball changes.
    * ``DSCACHE_IMAGES_BASE=debian:bookworm-slim`` builds from a registry
      image instead (:data:`BASE_ENV`).
    * Debian packages stay as of the first build; deleting
      ``<cache>/images/base/`` refreshes them (a new debootstrap changes every
      image's hash, so everything is rebuilt on it).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from dscache_tools.devcluster.images.client import existing, need_root
from dscache_tools.devcluster.images.engine import PrivateDocker
from dscache_tools.devcluster.images.specs import ImageError, images_dir, mib, read_json
from dscache_tools.devcluster.procs import Progress, tail

#: The base image ``docker import``-ed from the debootstrapped rootfs.
LOCAL_BASE = "dscache.local/debian-base:bookworm"
#: Environment variable naming a registry base image to use instead (e.g. debian:bookworm-slim).
BASE_ENV = "DSCACHE_IMAGES_BASE"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
DEBIAN_SECURITY_MIRROR = "http://deb.debian.org/debian-security"

#: Label on the imported base image: the sha256 of the rootfs tarball it came from.
_ROOTFS_LABEL = "io.dscache.rootfs-sha256"


def base_identity(root: Path) -> str:
    """``BASE`` plus what identifies its content, for the inputs hash; cheap (reads a stamp)."""
    override = os.environ.get(BASE_ENV)
    if override:
        return override
    stamp = read_json(_rootfs_stamp(root))
    sha = stamp.get("sha256") if stamp else None
    return f"{LOCAL_BASE}@rootfs:{sha if isinstance(sha, str) else 'missing'}"


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


def ensure_rootfs(root: Path, say: Progress) -> Path:
    """The cached minbase rootfs tarball; runs debootstrap (about a minute) when missing."""
    tarball = _rootfs_tarball(root)
    stamp = read_json(_rootfs_stamp(root))
    if tarball.is_file() and stamp and stamp.get("size_bytes") == tarball.stat().st_size:
        return tarball
    debootstrap = shutil.which("debootstrap") or existing("/usr/sbin/debootstrap")
    if debootstrap is None:
        raise ImageError(
            "debootstrap is needed for the base image without a registry: "
            "apt-get install debootstrap (scripts/build-images.sh does), "
            f"or set {BASE_ENV}=debian:bookworm-slim to pull the base instead"
        )
    need_root("debootstrap")
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
                f"debootstrap failed (exit {done.returncode}); {log_path}:\n{tail(log_path, 40)}"
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
    say(f"base: {tarball} ({mib(size)}) in {time.monotonic() - started:.0f} s")
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


def ensure_base_image(docker: PrivateDocker, tarball: Path, say: Progress) -> None:
    """Imports the rootfs tarball as :data:`LOCAL_BASE` unless that image came from it."""
    stamp = read_json(tarball.with_suffix("").with_suffix(".json")) or {}
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

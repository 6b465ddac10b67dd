"""Building the images with the private Docker engine, and keeping their archives current.

Contract:
    * ``ensure_images()`` returns, for each requested image, an
      :class:`.specs.ImageArchive` (a ``docker save`` archive under
      ``<cache>/images/archives/``), building what is missing or stale. When
      every stamp matches, no Docker process is started at all and the call
      takes well under a second.
    * Builds run in a :class:`.engine.PrivateDocker` that exists only for the
      build, with the host network; pip gets the host's CA bundle as a
      BuildKit secret, so a TLS-intercepting proxy works and the CA never
      lands in a layer.
    * A file lock serialises builders; the second waits and then finds the
      images built. An image rebuilt to the same image id keeps its archive.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from dscache import __version__
from dscache_tools.devcluster.images.base import (
    BASE_ENV,
    LOCAL_BASE,
    base_identity,
    ensure_base_image,
    ensure_rootfs,
)
from dscache_tools.devcluster.images.engine import PrivateDocker
from dscache_tools.devcluster.images.specs import (
    IMAGES,
    ImageArchive,
    ImageError,
    ImageSpec,
    archive_from_stamp,
    archive_path,
    images_dir,
    inputs_digest,
    mib,
    read_stamp,
    repo_root,
    stamp_path,
)
from dscache_tools.devcluster.procs import Progress, exclusive_lock
from dscache_tools.devcluster.versions import cache_root

logger = logging.getLogger(__name__)

#: Below this much free space a build warns: a cold build of all five takes about 25 GiB.
_LOW_DISK_BYTES = 12 * 2**30


def current(root: Path, repo: Path, spec: ImageSpec) -> ImageArchive | None:
    stamp = read_stamp(root, spec.name)
    if stamp is None or stamp.get("inputs") != inputs_digest(repo, spec, base_identity(root)):
        return None
    return archive_from_stamp(root, spec.name, stamp)


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
        done = {spec.name: current(base_root, source, spec) for spec in wanted}
        if all(done.values()):
            return {name: archive for name, archive in done.items() if archive is not None}
    if not (source / "images" / "Dockerfile").is_file():
        raise ImageError(
            f"{source / 'images' / 'Dockerfile'} not found: images are built from a source checkout"
        )
    work = images_dir(base_root)
    (work / "archives").mkdir(parents=True, exist_ok=True)
    with exclusive_lock(work / ".build.lock", say):
        results: dict[str, ImageArchive] = {}
        stale: list[ImageSpec] = []
        for spec in wanted:
            archive = None if force else current(base_root, source, spec)
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
            say(
                f"warning: {mib(free)} free in {work}; building the server image can "
                f"take {mib(_LOW_DISK_BYTES)} (layers, pip cache, its archive)"
            )
        base_arg = os.environ.get(BASE_ENV) or None
        tarball = None if base_arg else ensure_rootfs(base_root, say)
        with PrivateDocker(work / "docker", say) as docker:
            if tarball is not None:
                ensure_base_image(docker, tarball, say)
            identity = base_identity(base_root)
            for spec in stale:
                results[spec.name] = _build_one(
                    docker,
                    spec,
                    repo=source,
                    root=base_root,
                    base_arg=base_arg or LOCAL_BASE,
                    base_id=identity,
                    say=say,
                )
            # Containers a killed test run left (they pin old images), old tags'
            # images, and build cache beyond what a warm rebuild of every image
            # uses (pip's cache mount included), least recently used first.
            docker.run(["container", "prune", "--force"], check=False)
            docker.run(["image", "prune", "--force"], check=False)
            docker.run(["builder", "prune", "--force", "--keep-storage", "10GB"], check=False)
    return {spec.name: results[spec.name] for spec in wanted}


@contextlib.contextmanager
def docker_engine(
    root: Path | None = None, progress: Progress | None = None
) -> Iterator[PrivateDocker]:
    """The image cache's private Docker engine, running for the ``with`` block.

    Holds the build lock meanwhile, so no builder starts a second engine on
    the same data root. Tests use it to run the images: at normal priority
    (a build's engine runs at ``nice 19``), as a kubelet runs pods.
    """
    say: Progress = progress or (lambda line: logger.info("%s", line))
    work = images_dir(root)
    work.mkdir(parents=True, exist_ok=True)
    engine = PrivateDocker(work / "docker", say, nice=0)
    with exclusive_lock(work / ".build.lock", say), engine as docker:
        yield docker


def _specs(names: Iterable[str] | None) -> list[ImageSpec]:
    if names is None:
        return list(IMAGES.values())
    chosen = list(dict.fromkeys(names))
    unknown = [n for n in chosen if n not in IMAGES]
    if unknown:
        raise ImageError(f"unknown image(s) {unknown}; known: {', '.join(IMAGES)}")
    return [IMAGES[n] for n in chosen]


def ca_bundle() -> Path | None:
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
    base_id: str,
    say: Progress,
) -> ImageArchive:
    work = images_dir(root)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    log_path = logs / f"{spec.name}.log"
    iid_file = logs / f"{spec.name}.iid"
    iid_file.unlink(missing_ok=True)
    digest = inputs_digest(repo, spec, base_id)
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
    ca = ca_bundle()
    if ca is not None:
        command += ["--secret", f"id=ca,src={ca}"]
    command.append(str(repo))
    say(f"{spec.name}: docker build --target {spec.target} -> {spec.ref} (log {log_path})")
    started = time.monotonic()
    docker.run_logged(command, log_path, spec.name, say)
    image_id = iid_file.read_text().strip()
    seconds = time.monotonic() - started
    image_size = int(docker.run(["image", "inspect", "--format", "{{.Size}}", spec.ref]).strip())

    old = read_stamp(root, spec.name)
    previous = archive_from_stamp(root, spec.name, old) if old else None
    target = archive_path(root, spec.name)
    if previous is not None and previous.image_id == image_id and previous.ref == spec.ref:
        say(f"{spec.name}: unchanged image {image_id[:19]}; keeping {target.name}")
        save_seconds = 0.0
    else:
        say(f"{spec.name}: docker save -> {target}")
        stamp_path(root, spec.name).unlink(missing_ok=True)
        # The stale archive goes first: the server's and vllm's are 5-6 GiB each,
        # and a second copy beside the first is what filled small disks.
        target.unlink(missing_ok=True)
        partial = target.with_suffix(".tar.partial")
        partial.unlink(missing_ok=True)
        t0 = time.monotonic()
        docker.run(["save", "--output", str(partial), spec.ref])
        os.replace(partial, target)
        save_seconds = time.monotonic() - t0
    size = target.stat().st_size
    stamp = {
        "inputs": digest,
        "ref": spec.ref,
        "image_id": image_id,
        "size_bytes": size,
        "image_size_bytes": image_size,
        "build_seconds": round(seconds, 1),
        "save_seconds": round(save_seconds, 1),
        "base": base_id,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    stamp_path(root, spec.name).write_text(json.dumps(stamp, indent=2) + "\n")
    say(
        f"{spec.name}: {spec.ref} {image_id[:19]} built in {seconds:.0f} s, "
        f"image {mib(image_size)}, archive {mib(size)}"
    )
    return ImageArchive(ref=spec.ref, path=target, image_id=image_id, size_bytes=size)

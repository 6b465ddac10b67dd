"""Which images exist, what their build inputs are, and the stamps of built archives.

Contract:
    * :data:`IMAGES` lists every image in build order; each is a target of
      ``images/Dockerfile`` tagged with a fixed reference.
    * Staleness is a content hash of an image's build inputs
      (:func:`inputs_digest`): every file under ``images/`` and, for the
      Python images, ``pyproject.toml`` and every file of
      ``dscache/``, ``sidecar/``, ``model-server/``, ``operator/``, ``router/`` and
      ``vllm-connector/`` that exists (``__pycache__``, ``*.pyc`` and tool caches
      excluded, as in ``.dockerignore``; the tooling, ``tools/``, is no image's
      input, nor is ``README.md``: the image writes the wheel's long description
      itself), plus the reference, target, base
      image and build arguments.
    * A stamp (``<cache>/images/archives/<name>.json``) holds the hash, the
      image id and the archive's size; it is written after the archive, and an
      archive whose size differs from its stamp does not count.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dscache import __version__
from dscache_tools.devcluster.versions import cache_root

#: Bump when the build procedure changes in a way the input files do not show.
_RECIPE = 1
_STAMP_SUFFIX = ".json"
#: Files and folders left out of the build context (.dockerignore) and of the hash.
_EXCLUDED_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"})
_EXCLUDED_SUFFIXES = (".pyc", ".pyo")
_PYTHON_INPUTS = (
    "pyproject.toml",
    "dscache",
    "sidecar",
    "model-server",
    "operator",
    "router",
    "vllm-connector",
)


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
        # vLLM's CPU build with the connector (spec.engine: vllm); the operator's
        # default spec.vllm.image.
        ImageSpec(
            "vllm",
            "vllm",
            f"ghcr.io/dscache/dscache-vllm:{__version__}",
            ("images", *_PYTHON_INPUTS),
        ),
    )
}


def repo_root() -> Path:
    """The source checkout this module belongs to (where ``images/Dockerfile`` is)."""
    # tools/dscache_tools/devcluster/images/specs.py -> the checkout.
    return Path(__file__).resolve().parents[4]


def images_dir(root: Path | None = None) -> Path:
    """``<cache>/images``: archives, the base tarball, the private Docker engine."""
    return (root or cache_root()) / "images"


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


def stamp_path(root: Path, name: str) -> Path:
    return images_dir(root) / "archives" / f"{name}{_STAMP_SUFFIX}"


def archive_path(root: Path, name: str) -> Path:
    return images_dir(root) / "archives" / f"{name}.tar"


def read_stamp(root: Path, name: str) -> dict[str, object] | None:
    try:
        stamp = json.loads(stamp_path(root, name).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def archive_from_stamp(root: Path, name: str, stamp: Mapping[str, object]) -> ImageArchive | None:
    """The archive a stamp describes, or None when the file is gone or changed size."""
    path = archive_path(root, name)
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
        stamp = read_stamp(base, name)
        archive = archive_from_stamp(base, name, stamp) if stamp else None
        if archive is not None:
            found[name] = archive
    return found


def read_json(path: Path) -> dict[str, object] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def mib(size: int) -> str:
    return f"{size / 2**20:,.0f} MiB" if size >= 2**20 else f"{size / 2**10:,.0f} KiB"

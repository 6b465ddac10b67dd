"""Builds dscache's container images without any registry and caches them as archives.

``ensure_images()`` returns, for each of ``server``, ``core``, ``router``,
``pause`` and ``vllm`` (:data:`IMAGES`), an :class:`ImageArchive`: a ``docker save``
archive under ``<cache>/images/archives/`` (``<cache>`` is
:func:`dscache_tools.devcluster.versions.cache_root`, so
``DSCACHE_DEVCLUSTER_CACHE`` moves it), building what is missing or stale;
``load_images()`` imports archives into a node's containerd and
``image_loader()`` is that import as the dev cluster's per-node loader.

Where to look:
    * :mod:`.specs`: the images, their build inputs and hash, the stamps.
    * :mod:`.builder`: ``ensure_images``: what is stale, ``docker build``, ``docker save``.
    * :mod:`.engine`: :class:`PrivateDocker`, the engine that exists only for the build.
    * :mod:`.base`: the debootstrapped Debian base (no registry needed).
    * :mod:`.load`: archives into a containerd (``ctr images import``).
    * ``python -m dscache_tools.devcluster.images`` (:mod:`.__main__`): the CLI
      that ``scripts/build-images.sh`` runs.

Contract:
    * Staleness is a content hash of an image's build inputs; when every stamp
      matches, no Docker process is started at all and the call takes well
      under a second (:mod:`.specs`, :mod:`.builder`).
    * The private Docker engine changes nothing on the host outside its
      directory and is stopped before ``ensure_images`` returns, also on
      errors (:mod:`.engine`).
    * Failures raise :class:`ImageError` naming what is missing or the log to read.

Standard library only, so the dev cluster can call it before the project's
dependencies are installed. Needs root (dockerd, debootstrap) and Debian's
``docker.io`` and ``debootstrap``; ``scripts/build-images.sh`` installs both.
"""

from dscache_tools.devcluster.images.builder import docker_engine, ensure_images
from dscache_tools.devcluster.images.engine import PrivateDocker
from dscache_tools.devcluster.images.load import archive_image_id, image_loader, load_images
from dscache_tools.devcluster.images.specs import (
    IMAGES,
    ImageArchive,
    ImageError,
    ImageSpec,
    cached_archives,
    inputs_digest,
)

__all__ = [
    "IMAGES",
    "ImageArchive",
    "ImageError",
    "ImageSpec",
    "PrivateDocker",
    "archive_image_id",
    "cached_archives",
    "docker_engine",
    "ensure_images",
    "image_loader",
    "inputs_digest",
    "load_images",
]

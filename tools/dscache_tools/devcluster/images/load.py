"""Loading image archives into a containerd, where kubelets find them without pulling.

Contract:
    * :func:`load_images` imports archives into a containerd's ``k8s.io``
      namespace with ``ctr``, skipping images already present with the same
      reference and image id (and complete), so kubelets use them with
      ``imagePullPolicy: IfNotPresent`` and never pull.
    * Once an image is imported and unpacked, its layer blobs are deleted from
      the content store: containers run from the unpacked snapshots, which the
      image's config still holds against the collector, so a node keeps each
      image once, not twice (the four images took 22 GiB there, 11 without the
      blobs). What the CRI plugin does with ``discard_unpacked_layers`` for the
      images it pulls; "present" therefore means the manifest, the config and
      the top snapshot are there (``ctr images check`` would call such an image
      incomplete).
    * While a new build is imported, a tag holds the previous one, so the
      collector cannot take a snapshot the two share between the unpacker
      finding it and stacking the next layer on it; an import that loses a
      snapshot all the same (to the collector, after the kubelet removed an
      image) is run again, up to three times in all. The tags a load adds for
      a moment carry its pid; a later load removes those of a load that was
      killed half way (each would hold a build for good).
    * When a new build replaces an image, the previous build's config and
      unpacked snapshots that the new one does not share are collected right
      after the import (a ``--sync`` delete of a throwaway tag runs containerd's
      collector), so a node's store holds one version of each image, not every
      build since its last restart.
    * :func:`image_loader` builds first (a missing tool or failed build shows
      before any node starts) and returns that import as the dev cluster's
      per-node loader.
    * Failures raise :class:`.specs.ImageError` with ``ctr``'s output.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from dscache_tools.devcluster.images.builder import ensure_images
from dscache_tools.devcluster.images.specs import ImageArchive, ImageError
from dscache_tools.devcluster.procs import Progress

logger = logging.getLogger(__name__)


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
    _drop_stale_tags(base, say)
    for archive in archives:
        manifest = _manifest(base, archive.ref)
        previous = _config_digest(manifest)
        if previous == archive.image_id and _unpacked(base, previous, snapshotter or "overlayfs"):
            say(f"{archive.ref}: already in {containerd_address} ({namespace})")
            # A store filled before layer blobs were deleted still holds them.
            _discard_layers(base, archive.ref, manifest, say)
            continue
        replacing = previous is not None or _has_record(base, containerd_name(archive.ref))
        started = time.monotonic()
        # The import moves the name to the new build at once, before unpacking; the
        # previous build's snapshots that the new one shares are then held by nothing,
        # and the collector (which containerd runs on its own every hundred or so
        # writes, as the import makes) could take one between the unpacker finding it
        # and stacking the next layer on it. A tag holds the previous build meanwhile.
        keep = f"{_KEEP_TAG}:{os.getpid()}" if previous is not None else None
        if keep is not None:
            _ctr(base, "images", "tag", "--force", containerd_name(archive.ref), keep)
        try:
            _import(base, archive, snapshotter, say)
        finally:
            if keep is not None:
                _ctr(base, "images", "rm", keep)
        say(f"{archive.ref}: imported in {time.monotonic() - started:.1f} s")
        _discard_layers(base, archive.ref, _manifest(base, archive.ref), say)
        if previous is not None and previous != archive.image_id and _has_record(base, previous):
            # The CRI plugin names every image it has seen by its id as well: that
            # record would keep the previous build (snapshots and all) for good.
            _ctr(base, "images", "rm", previous)
        if replacing:
            _collect(base, archive.ref, say)


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


def _ctr(base: list[str], *args: str, what: str = "") -> subprocess.CompletedProcess[str]:
    """Runs ``ctr`` (``base`` then ``args``).

    Raises:
        ImageError: It failed; the message names ``what`` (default: the arguments)
            and has ``ctr``'s output.
    """
    done = subprocess.run([*base, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ImageError(
            f"ctr {what or ' '.join(args)} failed (exit {done.returncode}): "
            f"{(done.stderr or done.stdout).strip()[-2000:]}"
        )
    return done


# What ``ctr images import`` says when a snapshot it found went before it stacked the
# next layer on it (the collector took something no image held: an image the kubelet
# removed, say). Importing again unpacks what is missing.
_SNAPSHOT_GONE = re.compile(r"snapshot \S+ does not exist")
_IMPORT_TRIES = 3


def _import(base: list[str], archive: ImageArchive, snapshotter: str | None, say: Progress) -> None:
    """``ctr images import`` of ``archive``, again (up to :data:`_IMPORT_TRIES` in all)
    when a snapshot the unpacker found went before it was used.

    Raises:
        ImageError: ``ctr`` failed otherwise, or every try did.
    """
    snap = ["--snapshotter", snapshotter] if snapshotter else []
    for attempt in range(1, _IMPORT_TRIES + 1):
        try:
            _ctr(base, "images", "import", *snap, str(archive.path))
            return
        except ImageError as error:
            if attempt == _IMPORT_TRIES or not _SNAPSHOT_GONE.search(str(error)):
                raise
            say(f"{archive.ref}: a snapshot went while unpacking ({error}); importing again")


#: The tags a load adds for a moment, each named with the loading process's pid: one
#: holds the previous build while its rebuild unpacks, one runs the collector.
_KEEP_TAG = "dscache.local/keep-previous"
_TRIGGER_TAG = "dscache.local/gc-trigger"


def _drop_stale_tags(base: list[str], say: Progress) -> None:
    """Removes the tags of :data:`_KEEP_TAG` and :data:`_TRIGGER_TAG` that a load killed
    half way left (its pid no longer runs): each would hold a build for good."""
    listed = subprocess.run(
        [*base, "images", "list", "--quiet"], capture_output=True, text=True, check=False
    )
    for name in listed.stdout.split() if listed.returncode == 0 else []:
        repo, _, pid = name.rpartition(":")
        if repo not in (_KEEP_TAG, _TRIGGER_TAG) or not pid.isdigit() or _alive(int(pid)):
            continue
        _ctr(base, "images", "rm", name)
        say(f"{name}: removed (left by a load that did not finish)")


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _has_record(base: list[str], name: str) -> bool:
    """Whether containerd has an image record named ``name`` (as containerd spells it),
    complete or not."""
    listed = subprocess.run(
        [*base, "images", "list", "--quiet", f"name=={name}"],
        capture_output=True,
        text=True,
        check=False,
    )
    return listed.returncode == 0 and bool(listed.stdout.strip())


def _collect(base: list[str], ref: str, say: Progress) -> None:
    """Runs containerd's garbage collector now, keeping ``ref``.

    Replacing an image leaves the old build's content unreferenced, but the
    collector runs on its own only after many changes or at a restart. Deleting
    a throwaway tag of ``ref`` with ``--sync`` runs it and waits: everything no
    image, container or lease needs goes (a running container keeps its snapshot).
    """
    trigger = f"{_TRIGGER_TAG}:{os.getpid()}"
    _ctr(base, "images", "tag", "--force", containerd_name(ref), trigger)
    _ctr(base, "images", "rm", "--sync", trigger)
    say(f"{ref}: the previous build's unshared layers collected")


def _unpacked(base: list[str], config_digest: str, snapshotter: str) -> bool:
    """Whether the image whose config is ``config_digest`` is there to run: its config
    in the content store and its top snapshot unpacked. An image missing either (a
    store cut short by a full disk, say) is imported again rather than failing every
    pod sandbox later. Its layer blobs are not asked for: :func:`_discard_layers`
    deleted them (``ctr images check`` would call such an image incomplete)."""
    diff_ids = (_blob_json(base, config_digest) or {}).get("rootfs", {}).get("diff_ids")
    if not isinstance(diff_ids, list) or not diff_ids:
        return False
    top = subprocess.run(
        [*base, "snapshots", "--snapshotter", snapshotter, "info", chain_id(diff_ids)],
        capture_output=True,
        text=True,
        check=False,
    )
    return top.returncode == 0


def _config_digest(manifest: dict[str, Any] | None) -> str | None:
    """The config digest (the image id) ``manifest`` names, or None without one."""
    config = (manifest or {}).get("config")
    return str(config["digest"]) if isinstance(config, dict) and "digest" in config else None


def _manifest(base: list[str], ref: str) -> dict[str, Any] | None:
    """The image manifest the record ``ref`` names, or None."""
    listed = subprocess.run(
        [*base, "images", "list", f"name=={containerd_name(ref)}"],
        capture_output=True,
        text=True,
        check=False,
    )
    rows = listed.stdout.splitlines()[1:] if listed.returncode == 0 else []
    return _manifest_of(base, rows[0].split()[2]) if rows else None


def chain_id(diff_ids: Sequence[str]) -> str:
    """The OCI ChainID of a layer stack: the key containerd unpacks its top snapshot
    under (the first diff id, then sha256 of "<chain> <next diff id>" for each next)."""
    chain = str(diff_ids[0])
    for diff_id in diff_ids[1:]:
        chain = "sha256:" + hashlib.sha256(f"{chain} {diff_id}".encode()).hexdigest()
    return chain


def _discard_layers(
    base: list[str], ref: str, manifest: dict[str, Any] | None, say: Progress
) -> None:
    """Deletes the layer blobs of the unpacked image ``ref`` (its ``manifest``) that
    the content store still has.

    The unpacked snapshots are what containers run from; the manifest and the
    config stay (the config's label keeps the snapshots from the collector, and
    the kubelet reads the image's id and size from them).
    """
    name = containerd_name(ref)
    layers = (manifest or {}).get("layers")
    if not isinstance(layers, list):
        raise ImageError(f"{name}: no manifest with layers in containerd after its import")
    blobs = subprocess.run(
        [*base, "content", "list", "--quiet"], capture_output=True, text=True, check=False
    )
    held = set(blobs.stdout.split())
    stored = [
        layer for layer in layers if isinstance(layer, dict) and str(layer.get("digest")) in held
    ]
    if not stored:
        return
    digests = [str(layer["digest"]) for layer in stored]
    _ctr(base, "content", "rm", *digests, what=f"content rm (the layers of {name})")
    size = sum(int(layer.get("size", 0)) for layer in stored)
    say(f"{ref}: {len(stored)} layer blobs deleted once unpacked ({size / 2**30:.2f} GiB)")


def _blob_json(base: list[str], digest: str) -> dict[str, Any] | None:
    """The JSON blob ``digest`` from the content store, or None when absent or not JSON."""
    got = subprocess.run(
        [*base, "content", "get", digest], capture_output=True, text=True, check=False
    )
    if got.returncode != 0:
        return None
    try:
        doc = json.loads(got.stdout)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _manifest_of(base: list[str], digest: str) -> dict[str, Any] | None:
    """Follows an index (first linux/amd64 or only entry) to the image manifest."""
    for _ in range(3):
        doc = _blob_json(base, digest)
        if doc is None:
            return None
        if isinstance(doc.get("config"), dict):
            return doc
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


def containerd_name(ref: str) -> str:
    """How containerd names an image Docker calls ``ref`` (short names get docker.io/library/)."""
    name = ref
    first = name.split("/", 1)[0]
    if "/" not in name or ("." not in first and ":" not in first and first != "localhost"):
        name = f"docker.io/{name if '/' in name else 'library/' + name}"
    return name

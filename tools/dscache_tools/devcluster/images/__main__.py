"""``python -m dscache_tools.devcluster.images``: build or reuse the images, print a table.

Standard library only: ``scripts/build-images.sh`` runs it before (or
without) the project's own install.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

from dscache_tools.devcluster.images.builder import ensure_images
from dscache_tools.devcluster.images.specs import IMAGES, ImageError, images_dir, mib, read_stamp
from dscache_tools.devcluster.procs import exit_on_sigterm
from dscache_tools.devcluster.versions import cache_root

logger = logging.getLogger("dscache_tools.devcluster.images")


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
    exit_on_sigterm()
    started = time.monotonic()
    before = {name: read_stamp(cache_root(), name) for name in IMAGES}
    try:
        archives = ensure_images(names=args.names or None, force=args.force)
    except ImageError as exc:
        logger.error("%s", exc)
        return 1
    rows = [("image", "ref", "image size", "archive", "build s", "image id")]
    for name, archive in archives.items():
        stamp = read_stamp(cache_root(), name) or {}
        built = "cached" if stamp == before.get(name) else f"{stamp.get('build_seconds', '?')}"
        image_size = stamp.get("image_size_bytes")
        rows.append(
            (
                name,
                archive.ref,
                mib(image_size) if isinstance(image_size, int) else "?",
                mib(archive.size_bytes),
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

"""An endpoint picker checked against the Gateway API Inference Extension's own.

Contract:
    * :func:`build` compiles ``tools/eppcheck`` (a Go module that pins
      ``sigs.k8s.io/gateway-api-inference-extension``) into
      ``<cache>/eppcheck/<digest>/eppcheck``, the digest taken over its go.mod,
      go.sum and Go files, so a changed driver is rebuilt (the drivers of
      earlier sources removed) and an unchanged one is reused at once. Go's
      build cache for it lives in a temporary directory removed afterwards (a
      GiB the user's GOCACHE need not keep). One build at a time (a lock beside
      the drivers): a second caller waits and reuses the first one's binary.
    * :func:`check` runs the driver against an endpoint picker and returns its
      exit code and JSON report: the extension's reference picker (lwepp),
      served inside the driver on the same endpoints, answers the same ext_proc
      streams, and the report says per check whether the target keeps the
      protocol and the reference's message order, and dscache's promises
      (a conversation's turns on one endpoint; 503 for a subset outside the
      pool). With ``forward`` the driver is also the gateway's data path: each
      turn goes to the endpoint picked and must find its conversation's KV.
    * ``dscache dev eppcheck --target HOST:PORT --endpoints IP:PORT,...
      [--forward]`` builds if needed, prints the report and exits with the
      driver's code (0 all checks hold, 1 one failed, 2 no report).
    * :func:`inference_pool_crd` is the extension's own InferencePool CRD, read
      from the pinned module (tests install it: the API's real schema);
      :func:`inference_objective_crd` its InferenceObjective CRD, from
      :data:`OBJECTIVE_VERSION`, the last release that carried it (the API moved to
      llm-d's router with the endpoint picker, unchanged).
    * Standard library only (like :mod:`.devcluster.gobuild`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dscache_tools.devcluster.gobuild import BuildError, find_go, go_env, module_download
from dscache_tools.devcluster.procs import exclusive_lock
from dscache_tools.devcluster.versions import cache_root

#: The Go module of the driver, beside this package in the source tree.
SOURCE = Path(__file__).resolve().parents[1] / "eppcheck"
_GOFLAGS = "-trimpath -buildvcs=false -mod=readonly"
#: The Gateway API Inference Extension's module (its version is go.mod's).
MODULE = "sigs.k8s.io/gateway-api-inference-extension"


def digest(source: Path = SOURCE) -> str:
    """What decides the binary: its Go files, go.mod and go.sum, and the flags."""
    h = hashlib.sha256(_GOFLAGS.encode())
    for path in sorted(source.iterdir()):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def build(source: Path = SOURCE, root: Path | None = None) -> Path:
    """The driver's binary, compiled now unless one of this digest exists.

    Raises:
        BuildError: No source tree (an installed wheel carries none), no Go, or
            the build failed (the message carries Go's output).
    """
    if not (source / "go.mod").is_file():
        raise BuildError(f"{source} holds no go.mod: eppcheck builds from a dscache source tree")
    binary = (root or cache_root()) / "eppcheck" / digest(source) / "eppcheck"
    if binary.is_file():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    # Two test lanes may ask at once: the second waits for the first's binary.
    with exclusive_lock(binary.parent.parent / ".lock", say=_stderr, what="eppcheck build"):
        if not binary.is_file():
            _compile(source, binary)
            for old in binary.parent.parent.iterdir():  # drivers of earlier sources
                if old.is_dir() and old != binary.parent:
                    shutil.rmtree(old, ignore_errors=True)
    return binary


def _stderr(line: str) -> None:
    print(f"[eppcheck] {line}", file=sys.stderr)


def _compile(source: Path, binary: Path) -> None:
    go = find_go()
    partial = binary.with_name("eppcheck.partial")
    with tempfile.TemporaryDirectory(prefix="eppcheck-gocache-") as gocache:
        done = subprocess.run(
            ["nice", "-n", "19", str(go), "build", "-o", str(partial), "."],
            cwd=source,
            env=go_env(Path(gocache), _GOFLAGS),
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BuildError(
            f"building eppcheck failed (exit {done.returncode}):\n{done.stderr[-4000:]}"
        )
    os.replace(partial, binary)


#: The extension's last release with the InferenceObjective CRD (v1alpha2).
OBJECTIVE_VERSION = "v1.1.0"


def _module_crd(source: Path, version: str | None, name: str) -> Path:
    """The CRD file ``name`` of the extension's module at ``version`` (None: the version
    ``source``'s go.mod pins), fetched through the Go module proxy into Go's module
    cache (read-only there).

    Raises:
        BuildError: No source tree, no Go, or the module could not be fetched.
    """
    gomod = source / "go.mod"
    if not gomod.is_file():
        raise BuildError(f"{source} holds no go.mod: the CRD comes from a dscache source tree")
    if version is None:
        pinned = re.search(
            rf"^\s*(?:require\s+)?{re.escape(MODULE)}\s+(v\S+)", gomod.read_text(), re.M
        )
        if pinned is None:
            raise BuildError(f"{gomod} requires no {MODULE}")
        version = pinned[1]
    info = module_download(find_go(), MODULE, version, source)
    return Path(info["Dir"]) / "config" / "crd" / "bases" / name


def inference_objective_crd(source: Path = SOURCE) -> Path:
    """The extension's InferenceObjective CRD (``inference.networking.x-k8s.io/v1alpha2``)
    from its :data:`OBJECTIVE_VERSION` module."""
    name = "inference.networking.x-k8s.io_inferenceobjectives.yaml"
    return _module_crd(source, OBJECTIVE_VERSION, name)


def inference_pool_crd(source: Path = SOURCE) -> Path:
    """The extension's own InferencePool CRD, from the module the driver pins."""
    return _module_crd(source, None, "inference.networking.k8s.io_inferencepools.yaml")


def check(
    binary: Path,
    target: str,
    endpoints: list[str],
    *,
    session_header: str = "x-session-id",
    conversations: int = 6,
    forward: bool = False,
    pad: int = 40,
    timeout_s: float = 600.0,
) -> tuple[int, dict[str, Any]]:
    """Runs the driver against ``target``; returns its exit code and report.

    ``forward``: the driver is the gateway's data path too: each conversation turn
    goes to the endpoint picked, its answer back through the picker, and a later
    turn must find its conversation's KV there (``pad`` makes a turn long enough
    to fill KV blocks).

    Raises:
        BuildError: The driver printed no report (usage or connection error).
    """
    done = subprocess.run(
        [
            str(binary),
            "--target",
            target,
            "--endpoints",
            ",".join(endpoints),
            "--session-header",
            session_header,
            "--conversations",
            str(conversations),
            "--pad",
            str(pad),
            *(["--forward"] if forward else []),
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    try:
        report: dict[str, Any] = json.loads(done.stdout)
    except ValueError:
        raise BuildError(
            f"eppcheck printed no report (exit {done.returncode}): {done.stderr[-2000:]}"
        ) from None
    return done.returncode, report


def run_cli(
    target: str,
    endpoints: list[str],
    *,
    session_header: str,
    conversations: int,
    forward: bool,
    pad: int,
) -> int:
    """``dscache dev eppcheck``: builds if needed, prints the report, returns the exit code."""
    try:
        code, report = check(
            build(),
            target,
            endpoints,
            session_header=session_header,
            conversations=conversations,
            forward=forward,
            pad=pad,
        )
    except BuildError as exc:
        print(f"dscache dev eppcheck: {exc}", file=sys.stderr)
        return 2
    json.dump(report, sys.stdout, indent=2)
    print()
    for c in report.get("checks", []):
        if not c["ok"]:
            print(f"FAILED {c['name']}: {c.get('detail', '')}", file=sys.stderr)
    return code

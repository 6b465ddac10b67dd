"""The picker's endpoint-picker face (``dscache picker --epp``), measured as a gateway meets it.

Part of ``dscache bench router``. A real ``dscache picker --epp`` child, with the
router bench's stand-in pods as its pool, is driven over gRPC (Envoy's ext_proc
API) as a gateway in ``FULL_DUPLEX_STREAMED`` mode drives it: request headers and
body in, the pick out, the served pod reported on the response headers.

* ``latency``: the time from the first message of a request's stream to the pick
  in hand, through the picker and through a **null processor** child (the same
  gRPC stack, protobuf and body echo, answering the first pod without deciding:
  ``python -m dscache_tools.bench.eppbench null``), in alternating rounds over the
  same requests; ``added`` is picker - null, what the decision adds per request.
* ``hits``: the token hit ratio of the varied-openings workload (ids dropped as
  the workload says) when each request goes where the picker says, against
  where a hash of its key on the ring says and against the ideal (one infinite
  cache). Each pod's cache is simulated as infinite (a block a pod prefilled
  stays there), and the stand-ins publish empty filters, so the picker knows
  only what it routed itself (its placement memory and the served reports):
  the figure is the face's routing quality, not a model server's.

JSON (``epp`` in the router bench's): ``latency`` (``requests``, ``rounds``,
``epp_p50_ms``, ``epp_p99_ms``, ``null_p50_ms``, ``null_p99_ms``,
``added_p50_ms``, ``added_p99_ms``, ``p99_ratio``), ``hits`` (``requests``,
``ideal``, ``epp``, ``hash``, ``epp_of_ideal``, ``hash_of_ideal``), ``picks``
(the picker's decisions by reason over the hit run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from dscache_router.epp import BODY_CHUNK, DESTINATION, LB_NAMESPACE, SERVED, body_back
from dscache_router.ring import Ring, prompt_key
from dscache_sidecar.holdings import HoldingsFilter
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from dscache.keys import block_keys
from dscache_tools.bench import Doc, ratio
from dscache_tools.demo.parts import child_env
from dscache_tools.loadgen.report import percentile
from dscache_tools.net import free_port
from dscache_tools.procs import Child, ProcessGroup
from dscache_tools.workload import (
    ChatRequest,
    WorkloadConfig,
    generate,
    load_server_tokenizer,
    prompt_ids,
)

#: This module, run as the null processor by ``python -m``.
NULL_MODULE = "dscache_tools.bench.eppbench"
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


# -- a gateway's side of one stream ---------------------------------------------------


def _messages(body: bytes, session: str | None) -> list[pb.ProcessingRequest]:
    hs = [(":method", "POST"), (":path", "/v1/chat/completions")]
    hs += [("content-type", "application/json")]
    if session:
        hs.append(("x-session-id", session))
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hs]
            )
        )
    )
    first.protocol_config.request_body_mode = _DUPLEX
    first.protocol_config.response_body_mode = _DUPLEX
    parts = [body[i : i + BODY_CHUNK] for i in range(0, len(body), BODY_CHUNK)] or [b""]
    return [first] + [
        pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
        for i, p in enumerate(parts)
    ]


def _destination(resp: pb.ProcessingResponse) -> list[str]:
    for opt in resp.request_headers.response.header_mutation.set_headers:
        if opt.header.key == DESTINATION:
            return bytes(opt.header.raw_value).decode().split(",")
    raise RuntimeError(f"the picker answered without a destination: {resp}")


def one_request(
    stub: pb_grpc.ExternalProcessorStub, body: bytes, session: str | None
) -> tuple[list[str], float]:
    """One request's stream: the pods picked and the milliseconds to the pick; the
    first pod is reported back as the one that served."""
    sent: queue.Queue[pb.ProcessingRequest | None] = queue.Queue()
    for m in _messages(body, session):
        sent.put(m)

    def feed() -> Iterator[pb.ProcessingRequest]:
        while (item := sent.get()) is not None:
            yield item

    started = time.perf_counter()
    stream = stub.Process(feed(), timeout=30)
    first = next(stream)
    elapsed_ms = 1000 * (time.perf_counter() - started)
    pods = _destination(first)
    served = pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True))
    lb = struct_pb2.Struct()
    lb.update({SERVED: pods[0]})
    served.metadata_context.filter_metadata[LB_NAMESPACE].CopyFrom(lb)
    sent.put(served)
    sent.put(None)
    for _ in stream:  # the body echo and the response headers' answer
        pass
    return pods, elapsed_ms


# -- the children ---------------------------------------------------------------------


def start_epp(
    procs: ProcessGroup, name: str, pods: Sequence[str], holdings: dict[str, str]
) -> tuple[str, Child]:
    """Starts ``dscache picker --epp`` with ``pods`` as its pool; its ext_proc address."""
    port, epp_port = free_port(), free_port()
    args = ["picker", "--host", "127.0.0.1", "--port", str(port), "--refresh", "0.5"]
    args += ["--epp", "--epp-port", str(epp_port)]
    for pod in pods:
        args += ["--epp-endpoint", f"{pod}=stable", "--holdings", f"{pod}={holdings[pod]}"]
    argv = [sys.executable, "-m", "dscache.cli", "--log-level", "WARNING", *args]
    child = procs.start(name, argv, env=child_env())
    return f"127.0.0.1:{epp_port}", child


def start_null(procs: ProcessGroup, pods: Sequence[str]) -> tuple[str, Child]:
    port = free_port()
    argv = [sys.executable, "-m", NULL_MODULE, "null", "--port", str(port)]
    child = procs.start("epp-null", [*argv, "--endpoint", pods[0]], env=child_env())
    return f"127.0.0.1:{port}", child


def wait_serving(address: str, timeout_s: float = 60.0) -> grpc.Channel:
    """A channel to ``address`` once it accepts connections."""
    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise RuntimeError(f"no ext_proc server at {address} after {timeout_s:.0f} s") from None
    return channel


# -- the measurements -------------------------------------------------------------------


def measure_latency(
    stubs: dict[str, pb_grpc.ExternalProcessorStub],
    requests: Sequence[tuple[bytes, str | None]],
    rounds: int,
) -> Doc:
    """Alternating rounds of the same requests through the picker and the null one."""
    times: dict[str, list[float]] = {name: [] for name in stubs}
    for _ in range(rounds):
        for name, stub in stubs.items():
            for body, session in requests:
                times[name].append(one_request(stub, body, session)[1])
    out: Doc = {"requests": len(requests) * rounds, "rounds": rounds}
    for name, ts in times.items():
        out[f"{name}_p50_ms"] = percentile(ts, 50)
        out[f"{name}_p99_ms"] = percentile(ts, 99)
    out["added_p50_ms"] = out["epp_p50_ms"] - out["null_p50_ms"]
    out["added_p99_ms"] = out["epp_p99_ms"] - out["null_p99_ms"]
    out["p99_ratio"] = ratio(out["epp_p99_ms"], out["null_p99_ms"])
    return out


def measure_hits(
    stub: pb_grpc.ExternalProcessorStub,
    requests: Sequence[ChatRequest],
    bodies: Sequence[bytes],
    *,
    pods: Sequence[str],
    root: bytes,
    block_tokens: int,
) -> Doc:
    """Token hits through the picker, by the ring's hash, and in one infinite cache."""
    tokenizer = load_server_tokenizer()
    ring = Ring(pods)
    caches: dict[str, dict[str, set[bytes]]] = {
        "epp": {p: set() for p in pods},
        "hash": {p: set() for p in pods},
    }
    ideal: set[bytes] = set()
    hits = {"epp": 0, "hash": 0, "ideal": 0}
    total = 0
    for req, body in zip(requests, bodies, strict=True):
        ids = prompt_ids(tokenizer, req)
        keys = block_keys(root, ids, block_tokens)
        total += len(ids)
        key = req.session_id or prompt_key(body)
        chosen = {"epp": one_request(stub, body, req.session_id)[0][0], "hash": ring.walk(key)[0]}
        for how, pod in chosen.items():
            hits[how] += _reused(caches[how][pod], keys, block_tokens, len(ids))
            caches[how][pod].update(keys)
        hits["ideal"] += _reused(ideal, keys, block_tokens, len(ids))
        ideal.update(keys)
    ratios = {how: n / total if total else 0.0 for how, n in hits.items()}
    return {
        "requests": len(requests),
        **ratios,
        "epp_of_ideal": ratio(ratios["epp"], ratios["ideal"]),
        "hash_of_ideal": ratio(ratios["hash"], ratios["ideal"]),
    }


def _reused(held: set[bytes], keys: Sequence[bytes], block_tokens: int, tokens: int) -> int:
    leading = 0
    for k in keys:
        if k not in held:
            break
        leading += 1
    return min(leading * block_tokens, tokens - 1)  # the last token is always computed


def varied_workload(quick: bool, seed: int, limit: int | None) -> list[ChatRequest]:
    """The varied-openings finance workload the hit ratios are measured on."""
    varied = generate(
        WorkloadConfig(
            sessions=16 if quick else 40,
            seed=seed,
            companies=4,
            min_turns=2,
            max_turns=5,
            max_tokens=8,
            variant="varied",
        )
    )
    return varied[: max(limit * 2, 20)] if limit is not None else varied


def run_epp(procs: ProcessGroup, work: Path, start_pods: Any, args: Sequence[str]) -> Doc:
    """Starts two stand-in pods with empty filters (``start_pods(procs, dir, filters)``,
    the router bench's), two endpoint pickers and the null processor, then measures
    from a driver child (``args``: the router bench's ``--quick``, ``--seed``,
    ``--requests``).

    gRPC stays out of the calling process: a fork (the children's ``preexec_fn``)
    after gRPC has started its threads can abort the forked child.
    """
    empty = HoldingsFilter.of([], 2).to_bytes()
    (work / "epp").mkdir()
    pods = start_pods(procs, work / "epp", [empty, empty])
    addresses = [p.address for p in pods]
    holdings = {p.address: p.holdings_url for p in pods}
    epp, _ = start_epp(procs, "epp-picker", addresses, holdings)
    hits, _ = start_epp(procs, "epp-hits", addresses, holdings)  # fresh: remembers nothing
    null, _ = start_null(procs, addresses)
    out = work / "epp.json"
    argv = [sys.executable, "-m", NULL_MODULE, "drive", "--epp", epp, "--hits", hits]
    argv += ["--null", null, "--pods", ",".join(addresses), "--out", str(out), *args]
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the endpoint picker bench failed:\n{done.stdout}{done.stderr}")
    doc: Doc = json.loads(out.read_text())
    return doc


def drive(args: argparse.Namespace) -> Doc:
    """The driver child's measurements (see the module docstring)."""
    from dscache_tools.bench.router import (
        BLOCK_TOKENS,
        FULL,
        QUICK,
        STAND_IN_ROOT,
        body,
        workload,
    )

    requests = workload(QUICK if args.quick else FULL, args.seed, args.requests)
    latency_requests = [(body(r), r.session_id) for r in requests]
    varied = varied_workload(args.quick, args.seed, args.requests)
    pods = args.pods.split(",")
    channels = [wait_serving(a) for a in (args.epp, args.null, args.hits)]
    try:
        stubs = {
            "epp": pb_grpc.ExternalProcessorStub(channels[0]),
            "null": pb_grpc.ExternalProcessorStub(channels[1]),
        }
        for body_bytes, session in latency_requests[:8]:  # warm-up: connections, tokenizer
            for stub in stubs.values():
                one_request(stub, body_bytes, session)
        latency = measure_latency(stubs, latency_requests, 2 if args.quick else 3)
        hits = measure_hits(
            pb_grpc.ExternalProcessorStub(channels[2]),
            varied,
            [body(r) for r in varied],
            pods=pods,
            root=STAND_IN_ROOT,
            block_tokens=BLOCK_TOKENS,
        )
    finally:
        for ch in channels:
            ch.close()
    return {"latency": latency, "hits": hits}


def epp_table(doc: Doc) -> str:
    lat, hits = doc["latency"], doc["hits"]
    return "\n".join(
        [
            "endpoint picker (ext_proc over gRPC), time to the pick (ms):",
            f"  picker P50 {lat['epp_p50_ms']:.2f} P99 {lat['epp_p99_ms']:.2f}; null processor "
            f"P50 {lat['null_p50_ms']:.2f} P99 {lat['null_p99_ms']:.2f}; added P50 "
            f"{lat['added_p50_ms']:+.2f} P99 {lat['added_p99_ms']:+.2f} ({lat['requests']} "
            "requests each)",
            f"  token hit ratio, varied openings ({hits['requests']} requests): ideal "
            f"{hits['ideal']:.3f}, through the picker {hits['epp']:.3f} "
            f"({hits['epp_of_ideal']:.1%} of ideal), ring hash {hits['hash']:.3f} "
            f"({hits['hash_of_ideal']:.1%})",
        ]
    )


# -- the null processor (a child process) ----------------------------------------------


class NullProcessor:
    """ext_proc that answers the first pod after the body, deciding nothing (a baseline)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint

    async def Process(  # noqa: N802 - the gRPC method's name
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        async for req in request_iterator:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                body += req.request_body.body
                if not req.request_body.end_of_stream:
                    continue
                common = pb.CommonResponse(clear_route_cache=True)
                header = base_pb2.HeaderValue(key=DESTINATION, raw_value=self.endpoint.encode())
                common.header_mutation.set_headers.append(base_pb2.HeaderValueOption(header=header))
                meta = struct_pb2.Struct()
                meta.update({LB_NAMESPACE: {DESTINATION: self.endpoint}})
                yield pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
                )
                for resp in body_back(bytes(body), True):
                    yield resp
            elif kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def main(argv: Sequence[str]) -> int:
    """``null``: serves :class:`NullProcessor` until killed; ``drive``: measures and
    writes the JSON (the bench's children)."""
    p = argparse.ArgumentParser(prog="dscache bench router, endpoint picker part")
    sub = p.add_subparsers(dest="what", required=True)
    null = sub.add_parser("null")
    null.add_argument("--port", type=int, required=True)
    null.add_argument("--endpoint", required=True)
    d = sub.add_parser("drive")
    for flag in ("--epp", "--null", "--hits", "--pods"):
        d.add_argument(flag, required=True)
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--quick", action="store_true")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--requests", type=int, default=None)
    args = p.parse_args(argv)
    if args.what == "drive":
        args.out.write_text(json.dumps(drive(args)))
        return 0

    async def run() -> None:
        server = grpc.aio.server()
        pb_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(args.endpoint), server)
        server.add_insecure_port(f"127.0.0.1:{args.port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The endpoint picker beside the Gateway API Inference Extension's reference picker.

``tools/eppcheck`` (Go, built from the extension's v1.6.2 module and Envoy's
go-control-plane types: the gateway side's encoder, not ours) sends the streams a
gateway sends to our picker and to the extension's reference picker (lwepp),
served inside the driver on the same endpoints, and checks both: the pick as
header and ``envoy.lb`` metadata, bodies handed back whole in the extension's
chunks, and our message order equal to the reference's. No gateway builds on
this machine (the README's "Checked against the extension's own picker" says
why); this is the extension's own tooling instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from dscache_router.epp import DESTINATION, LB_NAMESPACE, body_back
from dscache_server.tokenizer import DeepSeekTokenizer
from dscache_tools.demo.stack import LocalStack, StackOptions
from dscache_tools.eppcheck import build, check
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from test_epp import make
from test_picker import A, B, C

# Builds a Go program the first time, cached after: about 90 s on two idle cores, and
# over 600 s (the default timeout) at nice 19 beside the cluster lane of a cold run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def eppcheck() -> Path:
    return build()


@pytest.fixture(scope="module")
def tokenizer() -> DeepSeekTokenizer:
    return DeepSeekTokenizer()


def test_our_picker_answers_as_the_reference_picker_does_and_keeps_conversations_through_a_canary(
    eppcheck: Path, tokenizer: DeepSeekTokenizer
) -> None:
    endpoints = {A: "stable", B: "stable", C: "canary"}
    served = make(tokenizer, endpoints=endpoints, track_weights={"canary": 50.0})
    try:
        code, report = check(eppcheck, f"127.0.0.1:{served.port}", list(endpoints), conversations=8)
    finally:
        served.close()
    failed = [c for c in report["checks"] if not c["ok"]]
    assert failed == [] and code == 0 and report["ok"]
    names = {c["name"] for c in report["checks"]}
    for scenario in (
        "duplex_one_chunk",
        "duplex_chunked_body",
        "no_protocol_config",
        "headers_only",
        "request_and_response",
        "subset_hint",
    ):
        # The reference passes the same protocol checks (they are not written to
        # fit our picker), and ours sends its messages in the reference's order.
        assert f"reference/{scenario}/metadata_matches_header" in names
        assert f"target/{scenario}/same_message_order_as_reference" in names
    assert "target/request_and_response/response_body_whole" in names
    assert "target/duplex_chunked_body/request_body_chunks_fit" in names
    # Sixteen conversations of three turns, with and without a session id, through
    # a 50% canary: each stayed on one pod, and both tracks took some.
    conversations = report["conversations"]
    assert len(conversations) == 16
    assert all(len(set(picks)) == 1 for picks in conversations.values())
    assert {endpoints[picks[0]] for picks in conversations.values()} == {"stable", "canary"}


def test_through_the_picker_each_turn_reaches_the_pod_holding_its_conversations_kv(
    eppcheck: Path, tmp_path: Path
) -> None:
    """Real model servers with their sidecars, ``dscache picker --epp`` over them
    (two stable pods, a canary at 50%), and the driver as the gateway's data path
    (the stand-in for Envoy here: pick, send to the pod picked, report the served
    endpoint): every conversation's later turns hit the KV its earlier turns left
    on its pod, with a session id and without one, on both tracks."""
    # Stores sized for the test: a few hundred blocks of the mini model.
    options = StackOptions(sidecar_capacity="64MiB", sidecar_segment_size="16MiB")
    with LocalStack(tmp_path, options) as stack:
        stable = stack.start_servers(2, cache=True, prefix="stable")
        canary = stack.start_servers(1, cache=True, track="canary", prefix="canary")
        pods = stable + canary
        target = stack.start_endpoint_picker(pods, {"canary": 50.0})
        code, report = check(
            eppcheck,
            target,
            [p.address for p in pods],
            conversations=4,
            forward=True,
            pad=150,  # a turn of about 470 tokens: whole 256-token KV blocks to reuse
        )
    failed = [c for c in report["checks"] if not c["ok"]]
    assert failed == [] and code == 0
    turns = report["turns"]
    assert len(turns) == 8 and all(len(t) == 3 for t in turns.values())
    for name, conversation in turns.items():
        assert len({t["pick"] for t in conversation}) == 1, name
        # Turn 3 resends turns 1 and 2: about 940 tokens, three whole blocks held.
        assert conversation[2]["cached_tokens"] >= 512, (name, conversation)
    track = {p.address: p.track for p in pods}
    assert {track[t[0]["pick"]] for t in turns.values()} == {"stable", "canary"}


class BodyFirst(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """A picker with the bug a gateway tears streams down for: it echoes each body
    chunk at once and answers the headers only after the last one."""

    def Process(
        self, requests: Iterator[pb.ProcessingRequest], context: object
    ) -> Iterator[pb.ProcessingResponse]:
        for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_body":
                body = req.request_body
                yield from body_back(bytes(body.body), body.end_of_stream)
            if (kind == "request_body" and req.request_body.end_of_stream) or (
                kind == "request_headers" and req.request_headers.end_of_stream
            ):
                pick = pb.ProcessingResponse()
                common = pick.request_headers.response
                common.clear_route_cache = True
                common.header_mutation.set_headers.add(
                    header=base_pb2.HeaderValue(key=DESTINATION, raw_value=A.encode())
                )
                pick.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION: A}})
                yield pick
            if kind == "response_headers":
                yield pb.ProcessingResponse(response_headers=pb.HeadersResponse())
            if kind == "response_body":
                body = req.response_body
                yield from body_back(bytes(body.body), body.end_of_stream, "response_body")


def test_a_picker_answering_bodies_before_the_pick_fails_the_check(eppcheck: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_ExternalProcessorServicer_to_server(BodyFirst(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code, report = check(eppcheck, f"127.0.0.1:{port}", [A, B, C], conversations=1)
    finally:
        server.stop(0)
    failed = {c["name"] for c in report["checks"] if not c["ok"]}
    assert code == 1 and not report["ok"]
    assert "target/duplex_one_chunk/headers_answered_first" in failed
    assert "target/duplex_one_chunk/same_message_order_as_reference" in failed
    # It always names A: a subset naming C is not honoured, a foreign one not refused.
    assert "target/subset_hint/pick_in_subset" in failed
    assert "target/subset_outside_pool_is_503" in failed
    # Whatever it got wrong, the reference picker on the same streams did not.
    assert not {name for name in failed if name.startswith("reference/")}

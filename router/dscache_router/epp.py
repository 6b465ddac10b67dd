"""``dscache picker --epp``: the picker as a Gateway API Inference Extension endpoint picker.

A gateway (Envoy Gateway, Istio, kgateway, GKE, NGINX Gateway Fabric) sends each
request of an InferencePool to its endpoint picker over Envoy's external
processing protocol (``envoy.service.ext_proc.v3.ExternalProcessor/Process``, one
bidirectional gRPC stream a request) and routes it where the answer says. This
module is that answer, made by the same :class:`~dscache_router.picker.Picker`
that serves the NGINX router: the pod holding the request's longest prefix,
else a similar request's pod, else the ring's choice, under a load bound.

Contract (the endpoint picker protocol of the inference extension, proposal 004):
    * Modes, as ``protocol_config`` on the stream's first message tells:
      ``FULL_DUPLEX_STREAMED`` (what the extension's gateways configure, and what is
      assumed without a ``protocol_config``, as the extension's reference picker
      does: NGINX Gateway Fabric's shim sends none and reads the pick from the
      headers' answer): the headers are answered only once the whole body is in
      (the pick needs it), then the body is sent back unchanged in
      ``streamed_response`` chunks of at most :data:`BODY_CHUNK` bytes.
      ``BUFFERED`` (or any other mode with a body): the headers are answered at once
      and the pick rides on the body's answer. ``NONE`` (no body will come), or a
      request without a body: picked at its headers. Response bodies pass
      through unchanged (duplex: echoed).
    * The pick: header ``x-gateway-destination-endpoint`` and dynamic metadata
      ``envoy.lb`` / ``x-gateway-destination-endpoint``, the same value: the
      chosen pod, then the rest of its track in the ring's order for the
      request's key (the fallbacks a gateway retries in order), comma-separated
      ``ip:port``. ``clear_route_cache`` is set so the route sees the header.
    * Subset hint: a ``metadata_context`` entry ``envoy.lb.subset_hint`` /
      ``x-gateway-destination-endpoint-subset`` (a list) restricts the pick to
      those pods; none of them in the pool -> immediate 503.
    * Refusals (``ImmediateResponse``): 503 when the pool has no pod to offer,
      413 for a body over ``max_body``, and 429 when every candidate is at
      ``max_inflight`` and the request is sheddable: its objective (the
      ``x-gateway-inference-objective`` header, an InferenceObjective's name) has a
      negative priority (``objectives``; the operator copies the InferenceObjectives
      of the pool). A request of priority 0 or more (no objective: 0, as the
      extension has it) is never shed: it goes to the least loaded candidate, past
      the bound (``dscache_epp_saturated_requests_total{action}`` counts both).
    * Served endpoint: the gateway reports the pod that answered in the response
      headers' ``metadata_context`` (``envoy.lb`` /
      ``x-gateway-destination-endpoint-served``). When it is not the pod picked
      (a fallback took it), the session's placement and the blocks the picker
      counts as held move there. The response gets ``X-Dscache-Pick-Reason`` and
      ``X-Dscache-Track``.
    * Sessions and tracks: the key is the client's ``session_header``, else the
      router's prompt key (:func:`dscache_router.ring.prompt_key`). One pool holds
      every track (``stable``, ``canary``, ...); a new session takes a track by
      the configured weights (a hash of its key), and a known session keeps its
      track and its pod (``pinned``) while they are in the pool, so a weight
      change or a gateway's own split never moves a conversation off its KV.
      Bounded: ``max_sessions`` entries, least recent dropped first. A request
      keyed by its prompt (an opening many conversations share) or by an id this
      picker has not placed first goes to the pod holding its conversation past the
      opening, on that pod's track (reason ``pinned``), when one does
      (:meth:`~dscache_router.picker.Picker.holder`); where the blocks cannot
      tell, the pool's pods are asked which one served its previous turn (their
      conversation ledgers, ``dscache.routing.CONVERSATIONS_PATH``, within the
      picker's ``locate_timeout_s``).
    * In flight: counted per pod from the pick to the stream's end (the picker's
      load bound). Health: ``grpc.health.v1`` reports SERVING for ``""`` and the
      ext_proc service while the server runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
import httpx
from dscache_sidecar.holdings import INTERNAL_TOKEN_HEADER
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import Counter, Gauge

from dscache.routing import MAX_SESSION_ID
from dscache_router.locate import previous_pod
from dscache_router.picker import (
    MAX_HOLDER_PODS,
    REASON_HEADER,
    Candidate,
    HolderQuery,
    Picker,
    PickQuery,
)
from dscache_router.ring import Ring, prompt_key

log = logging.getLogger(__name__)

#: The header and metadata key naming the picked pods (the protocol's names).
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
#: The request header naming the request's InferenceObjective (the extension's name).
OBJECTIVE_HEADER = "x-gateway-inference-objective"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
TRACK_HEADER = "X-Dscache-Track"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"
#: Largest body chunk sent back in duplex mode (Envoy's limit is 64 KiB).
BODY_CHUNK = 62_000
_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_NO_BODY = processing_mode_pb2.ProcessingMode.NONE
OUTCOMES = ("routed", "unavailable", "overloaded", "too_large")
#: Track shares are kept in basis points: a canary weight of 2.5% is 250 of 10,000.
_BASIS = 10_000


@dataclass(frozen=True)
class EppSettings:
    """Knobs of the endpoint picker face.

    Attributes:
        endpoints: pod address (``ip:port``) -> its track.
        track_weights: percent of new sessions per track; tracks with pods and no
            weight share what is left of 100 equally.
        max_inflight: requests in flight per pod past which it is not picked; when
            every candidate is past it a sheddable request gets 429 and any other the
            least loaded pod (0: no bound).
        objectives: an InferenceObjective's name -> its priority (negative:
            sheddable); a request names its objective in ``x-gateway-inference-objective``.
        session_header: the client's session id header.
        max_sessions: sessions whose track and pod are remembered.
        max_body: largest request body read (413 past it).
        prompt_max_bytes, prompt_max_messages: the prompt key's bounds (as the router's).
    """

    endpoints: Mapping[str, str] = field(default_factory=dict)  # none: every request 503
    track_weights: Mapping[str, float] = field(default_factory=dict)
    max_inflight: int = 0
    objectives: Mapping[str, int] = field(default_factory=dict)
    session_header: str = "x-session-id"
    max_sessions: int = 200_000
    max_body: int = 16 << 20
    prompt_max_bytes: int = 4096
    prompt_max_messages: int = 2

    def __post_init__(self) -> None:
        for address in self.endpoints:
            Ring([address])  # raises for an address without a port
        if any(not 0 <= w <= 100 for w in self.track_weights.values()):
            raise ValueError("a track weight is a percent, 0..100")
        if sum(self.track_weights.values()) > 100.0001:
            raise ValueError("track weights add up to more than 100")
        if not all(
            isinstance(p, int) and not isinstance(p, bool) for p in self.objectives.values()
        ):
            raise ValueError("an objective's priority is a whole number")


@dataclass(frozen=True)
class Decision:
    """A pick: the pods in the order to try, and what the picker said."""

    endpoints: tuple[str, ...]
    reason: str
    track: str
    key: str
    keys: tuple[bytes, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class Refusal:
    """No pod: the HTTP status the gateway answers with, and why."""

    status: int
    outcome: str
    message: str


class EppMetrics:
    """The face's metrics, on the picker's registry."""

    def __init__(self, picker: Picker) -> None:
        reg = picker.metrics.registry
        self.requests = Counter(
            "dscache_epp_requests",
            "Requests the endpoint picker answered, by outcome (routed, unavailable: 503, "
            "overloaded: 429, too_large: 413).",
            ["outcome"],
            registry=reg,
        )
        for outcome in OUTCOMES:
            self.requests.labels(outcome)
        self.served_elsewhere = Counter(
            "dscache_epp_served_elsewhere",
            "Requests the gateway reported served by another pod than the one picked (a "
            "fallback); the session and its blocks moved there.",
            registry=reg,
        )
        self.streams = Gauge(
            "dscache_epp_streams", "ext_proc streams open (requests in flight).", registry=reg
        )
        self.endpoints = Gauge(
            "dscache_epp_endpoints", "Pods in the endpoint picker's pool.", registry=reg
        )
        self.saturated = Counter(
            "dscache_epp_saturated_requests",
            "Requests that found every candidate at its in-flight bound, by what was done: "
            "shed (429: a negative priority) or routed (to the least loaded pod).",
            ["action"],
            registry=reg,
        )
        for action in ("shed", "routed"):
            self.saturated.labels(action)
        self.pool_errors = Counter(
            "dscache_epp_pool_file_errors",
            "Pool files that could not be read or were invalid (the last good pool stays).",
            registry=reg,
        )


class Pool:
    """The pool's pods by track, sessions' tracks and pods, and in-flight counts."""

    def __init__(self, settings: EppSettings, before: Pool | None = None) -> None:
        """``before``: the pool this one replaces; its sessions and the in-flight
        counts of pods still in the pool carry over."""
        self.settings = settings
        self._lock = threading.Lock()
        self._tracks: dict[str, list[str]] = {}
        for address, track in settings.endpoints.items():
            self._tracks.setdefault(track, []).append(address)
        self._rings = {track: Ring(pods) for track, pods in self._tracks.items()}
        self._inflight: dict[str, int] = dict.fromkeys(settings.endpoints, 0)
        self._sessions: OrderedDict[str, tuple[str, str]] = OrderedDict()
        if before is not None:
            with before._lock:
                self._sessions = OrderedDict(before._sessions)
                for address, n in before._inflight.items():
                    if address in self._inflight:
                        self._inflight[address] = n
        self._shares = self._weights()

    def _weights(self) -> list[tuple[int, str]]:
        """Cumulative bounds of the tracks with pods in basis points (1/100 of a percent),
        in name order."""
        explicit = {
            t: round(w * 100) for t, w in self.settings.track_weights.items() if t in self._tracks
        }
        rest = [t for t in sorted(self._tracks) if t not in explicit]
        left = max(0, _BASIS - sum(explicit.values()))
        shares = dict(explicit)
        for i, track in enumerate(rest):
            shares[track] = left // len(rest) + (1 if i < left % len(rest) else 0)
        bounds, total = [], 0
        for track in sorted(shares):
            total += shares[track]
            bounds.append((total, track))
        return bounds

    def track_of(self, key: str) -> str | None:
        """The session's track: the one it started on, else one by the weights (None:
        the pool is empty)."""
        if not self._tracks:
            return None
        with self._lock:
            known = self._sessions.get(key)
            if known is not None and known[0] in self._tracks:
                return known[0]
        point = zlib.crc32(key.encode()) % _BASIS
        for bound, track in self._shares:
            if point < bound and self._tracks.get(track):
                return track
        return max(self._tracks, key=lambda t: len(self._tracks[t]))  # weights sum < 100

    def candidates(self, track: str, key: str, subset: Sequence[str] | None) -> list[Candidate]:
        """The track's pods in ring order for ``key`` with their in-flight counts;
        with a subset hint, only pods in it (of any track when none of the track's is)."""
        order = self._rings[track].walk(key)
        if subset is not None:
            allowed = set(subset)
            order = [a for a in order if a in allowed]
            if not order:
                order = [a for a in self.settings.endpoints if a in allowed]
        with self._lock:
            return [Candidate(a, self._inflight[a]) for a in order]

    def pinned(self, key: str) -> str | None:
        with self._lock:
            known = self._sessions.get(key)
            return known[1] if known else None

    def place(self, key: str, track: str, pod: str) -> None:
        """Remembers the session's track and pod (bounded, least recent dropped)."""
        if not key or len(key) > MAX_SESSION_ID:
            return
        with self._lock:
            self._sessions[key] = (track, pod)
            self._sessions.move_to_end(key)
            while len(self._sessions) > self.settings.max_sessions:
                self._sessions.popitem(last=False)

    def started(self, pod: str) -> None:
        with self._lock:
            if pod in self._inflight:
                self._inflight[pod] += 1

    def ended(self, pod: str) -> None:
        with self._lock:
            if self._inflight.get(pod, 0) > 0:
                self._inflight[pod] -= 1

    def inflight(self, pod: str) -> int:
        with self._lock:
            return self._inflight.get(pod, 0)


class EndpointPicker:
    """The ext_proc service (see the module contract)."""

    def __init__(self, picker: Picker, settings: EppSettings) -> None:
        self.picker = picker
        self.pool = Pool(settings)
        self.metrics = EppMetrics(picker)
        self.metrics.endpoints.set(len(settings.endpoints))
        picker.know(settings.endpoints)
        self._client: httpx.AsyncClient | None = None  # made on the serving loop

    @property
    def settings(self) -> EppSettings:
        """The settings of the pool in use (a pool file replaces its endpoints)."""
        return self.pool.settings

    # -- the decision (a worker thread: tokenizing is CPU work) --------------------

    def decide(
        self,
        headers: Mapping[str, str],
        body: bytes,
        subset: Sequence[str] | None,
        last_served: Callable[[Sequence[str]], str | None] | None = None,
    ) -> Decision | Refusal:
        """Picks the pods for one request, or says why not."""
        pool = self.pool  # one pool for the whole decision, even if the file changes
        s = pool.settings
        client_key = headers.get(s.session_header.lower(), "")
        if client_key and len(client_key) <= MAX_SESSION_ID:
            key, source = client_key, "header"
        else:
            key = prompt_key(body, max_bytes=s.prompt_max_bytes, max_messages=s.prompt_max_messages)
            source = "prompt"
        credentials = "authorization" in headers
        held = self._holder(
            pool, key, source, body, credentials=credentials, subset=subset, last_served=last_served
        )
        track = s.endpoints[held] if held else pool.track_of(key)
        if track is None:
            return Refusal(503, "unavailable", "the pool has no endpoint")
        cands = pool.candidates(track, key, subset)
        if not cands:
            return Refusal(503, "unavailable", "no endpoint of the pool is in the subset hint")
        addresses = [c.address for c in cands]
        pinned = held or pool.pinned(key)
        query = PickQuery(
            pods=tuple(cands),
            cap=s.max_inflight,
            key=key,
            source=source,
            pinned=pinned if pinned in addresses else None,
            body=body,
            credentials=credentials,
        )
        choice = self.picker.pick(query)
        pod = choice.pod
        if choice.reason == "overloaded":
            if s.objectives.get(headers.get(OBJECTIVE_HEADER, ""), 0) < 0:
                self.metrics.saturated.labels("shed").inc()
                return Refusal(429, "overloaded", "every endpoint is at its in-flight bound")
            self.metrics.saturated.labels("routed").inc()
            pod = min(cands, key=lambda c: c.inflight).address  # first of the least loaded
        track = s.endpoints.get(pod, track)
        pool.place(key, track, pod)
        order = (pod, *(a for a in addresses if a != pod))
        return Decision(order, choice.reason, track, key, choice.keys)

    def _holder(
        self,
        pool: Pool,
        key: str,
        source: str,
        body: bytes,
        *,
        credentials: bool,
        subset: Sequence[str] | None,
        last_served: Callable[[Sequence[str]], str | None] | None,
    ) -> str | None:
        """For a request no session of this picker places (keyed by its opening, or an
        id it has not placed): the pod holding its conversation past the opening
        (:meth:`~dscache_router.picker.Picker.holder`), whose track it then takes."""
        if source == "header" and pool.pinned(key) is not None:
            return None
        pods = tuple(a for a in pool.settings.endpoints if subset is None or a in subset)
        if not pods:
            return None
        lead = pool.settings.prompt_max_messages
        return self.picker.holder(HolderQuery(pods, lead, body, credentials), last_served)

    def _ledgers(self, loop: asyncio.AbstractEventLoop) -> Callable[[Sequence[str]], str | None]:
        """Which pool pod served a conversation's previous turn, asked from the
        decision's worker thread of the pods' conversation ledgers on ``loop``."""
        s = self.picker.settings
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=s.locate_timeout_s)
        client = self._client
        token = {INTERNAL_TOKEN_HEADER: s.internal_token} if s.internal_token else {}

        def last_served(keys: Sequence[str]) -> str | None:
            pods = tuple(self.pool.settings.endpoints)[:MAX_HOLDER_PODS]  # only when asked
            return previous_pod(
                loop, client, pods, keys, headers=token, timeout_s=s.locate_timeout_s
            )

        return last_served

    async def aclose(self) -> None:
        """Closes the client the ledger lookups use."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def set_pool(
        self,
        endpoints: Mapping[str, str],
        track_weights: Mapping[str, float],
        objectives: Mapping[str, int] | None = None,
    ) -> None:
        """A new pool (the pool file changed): sessions and in-flight counts carry over;
        ``objectives`` None keeps the ones in use."""
        settings = replace(
            self.settings,
            endpoints=dict(endpoints),
            track_weights=track_weights,
            objectives=self.settings.objectives if objectives is None else dict(objectives),
        )
        self.pool = Pool(settings, before=self.pool)
        self.picker.know(endpoints)
        self.metrics.endpoints.set(len(endpoints))

    def served(self, decision: Decision, pod: str) -> None:
        """The gateway says ``pod`` answered: a fallback moves the session there."""
        endpoints = self.pool.settings.endpoints
        if pod == decision.endpoints[0] or pod not in endpoints:
            return
        self.metrics.served_elsewhere.inc()
        self.pool.ended(decision.endpoints[0])
        self.pool.started(pod)
        self.pool.place(decision.key, endpoints[pod], pod)
        self.picker.moved(decision.key, decision.endpoints[0], pod, decision.keys)

    # -- the stream ------------------------------------------------------------------

    async def Process(  # noqa: N802 - the gRPC method's name
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream()
        self.metrics.streams.inc()
        try:
            async for req in request_iterator:
                for resp in await self._on(req, stream):
                    yield resp
        finally:
            self.metrics.streams.dec()
            if stream.decision is not None:
                self.pool.ended(stream.pod)

    async def _on(self, req: pb.ProcessingRequest, st: _Stream) -> list[pb.ProcessingResponse]:
        if req.HasField("protocol_config"):
            cfg = req.protocol_config
            st.duplex = cfg.request_body_mode == _DUPLEX
            st.duplex_response = cfg.response_body_mode == _DUPLEX
            st.no_body = cfg.request_body_mode == _NO_BODY
        kind = req.WhichOneof("request")
        if kind in ("request_headers", "request_body"):
            return await self._on_request(req, st, kind == "request_headers")
        if kind == "response_headers":
            served = _served(req)
            if served and st.decision is not None:
                self.served(st.decision, served)
                st.pod = served
            common = pb.CommonResponse()
            if st.decision is not None:
                _set(common, REASON_HEADER, st.decision.reason)
                _set(common, TRACK_HEADER, st.decision.track)
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))]
        if kind == "response_body":
            body = req.response_body
            if st.duplex_response:
                return body_back(bytes(body.body), body.end_of_stream, "response_body")
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "request_trailers":
            return [pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_trailers":
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    async def _on_request(
        self, req: pb.ProcessingRequest, st: _Stream, headers: bool
    ) -> list[pb.ProcessingResponse]:
        if headers:
            st.headers = _headers(req.request_headers.headers)
            st.subset = _subset(req)
            if req.request_headers.end_of_stream or st.no_body:
                return await self._answer(st, at_headers=True)
            if st.duplex:
                return []  # answered with the body's end
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if st.refused:
            return []
        st.body += req.request_body.body
        if len(st.body) > self.settings.max_body:
            st.refused = True
            self.metrics.requests.labels("too_large").inc()
            return [_immediate(413, "request body too large")]
        if not req.request_body.end_of_stream:
            return [] if st.duplex else [pb.ProcessingResponse(request_body=pb.BodyResponse())]
        return await self._answer(st, at_headers=False)

    async def _answer(self, st: _Stream, at_headers: bool) -> list[pb.ProcessingResponse]:
        loop = asyncio.get_running_loop()
        got = await loop.run_in_executor(
            None, self.decide, st.headers, bytes(st.body), st.subset, self._ledgers(loop)
        )
        if isinstance(got, Refusal):
            st.refused = True
            self.metrics.requests.labels(got.outcome).inc()
            return [_immediate(got.status, got.message)]
        self.metrics.requests.labels("routed").inc()
        st.decision, st.pod = got, got.endpoints[0]
        self.pool.started(st.pod)
        value = ",".join(got.endpoints)
        common = pb.CommonResponse(clear_route_cache=True)
        _set(common, DESTINATION, value)
        meta = struct_pb2.Struct()
        meta.update({LB_NAMESPACE: {DESTINATION: value}})
        if at_headers or st.duplex:
            out = [
                pb.ProcessingResponse(
                    request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
                )
            ]
            if st.duplex and not at_headers:
                out += body_back(bytes(st.body), True)
            return out
        return [
            pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common), dynamic_metadata=meta
            )
        ]


@dataclass
class _Stream:
    """One request's state on its ext_proc stream."""

    headers: dict[str, str] = field(default_factory=dict)
    body: bytearray = field(default_factory=bytearray)
    subset: list[str] | None = None
    duplex: bool = True  # until protocol_config says otherwise
    duplex_response: bool = True
    no_body: bool = False
    refused: bool = False
    decision: Decision | None = None
    pod: str = ""


def _headers(headers: base_pb2.HeaderMap) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in headers.headers:
        out[h.key.lower()] = h.value or h.raw_value.decode("utf-8", "replace")
    return out


def _subset(req: pb.ProcessingRequest) -> list[str] | None:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    value = ns.fields[SUBSET]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):
        return [a for a in value.string_value.split(",") if a]
    return []


def _served(req: pb.ProcessingRequest) -> str:
    ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is None or SERVED not in ns.fields:
        return ""
    return str(ns.fields[SERVED].string_value)


def _set(common: pb.CommonResponse, name: str, value: str) -> None:
    header = base_pb2.HeaderValue(key=name.lower(), raw_value=value.encode())
    common.header_mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            header=header,
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )


def body_back(data: bytes, end: bool, phase: str = "request_body") -> list[pb.ProcessingResponse]:
    """``data`` sent back unchanged (duplex mode) in chunks of at most :data:`BODY_CHUNK`
    bytes, the last marked ``end``, as the answer of ``phase`` (``request_body`` or
    ``response_body``: Envoy tears down a stream whose answer is for the other phase)."""
    out = []
    for i in range(0, max(len(data), 1), BODY_CHUNK):
        last = end and i + BODY_CHUNK >= len(data)
        streamed = pb.StreamedBodyResponse(body=data[i : i + BODY_CHUNK], end_of_stream=last)
        mutation = pb.BodyMutation(streamed_response=streamed)
        body = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
        out.append(pb.ProcessingResponse(**{phase: body}))
    return out


def _immediate(status: int, message: str) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            body=(message + "\n").encode(),
            details=message,
        )
    )


def read_pool_file(path: Path) -> tuple[dict[str, str], dict[str, float], dict[str, int]]:
    """The pool of a pool file: ``{"endpoints": {"ip:port": "track"}, "trackWeights":
    {"track": percent}, "objectives": {"name": priority}}`` (what the operator writes
    beside the router's config; ``objectives`` may be left out).

    Raises:
        ValueError: not that shape, or an invalid pool (OSError: unreadable).
    """
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not a JSON object")
    endpoints, weights = raw.get("endpoints", {}), raw.get("trackWeights", {})
    objectives = raw.get("objectives", {})
    if not isinstance(endpoints, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in endpoints.items()
    ):
        raise ValueError(f"{path}: endpoints must map ip:port to a track name")
    if not isinstance(weights, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in weights.values()
    ):
        raise ValueError(f"{path}: trackWeights must map a track to a percent")
    if not isinstance(objectives, dict) or not all(isinstance(k, str) for k in objectives):
        raise ValueError(f"{path}: objectives must map a name to a priority")
    # The same checks as flags.
    EppSettings(endpoints=endpoints, track_weights=weights, objectives=objectives)
    return endpoints, weights, objectives


class PoolFileWatcher:
    """Reloads the pool from its file when the file's content changes (every ``every_s``);
    an unreadable or invalid file keeps the last good pool and is counted."""

    def __init__(self, epp: EndpointPicker, path: Path, every_s: float = 1.0) -> None:
        self.epp, self.path, self.every_s = epp, path, every_s
        self._seen: bytes | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="epp-pool-file", daemon=True)

    def check(self) -> bool:
        """Loads the file if it changed; True when the pool was replaced."""
        try:
            data = self.path.read_bytes()
        except OSError as exc:
            if self._seen != b"":
                log.warning("endpoint picker: cannot read the pool file %s: %s", self.path, exc)
                self.epp.metrics.pool_errors.inc()
            self._seen = b""
            return False
        if data == self._seen:
            return False
        self._seen = data
        try:
            endpoints, weights, objectives = read_pool_file(self.path)
        except ValueError as exc:
            log.warning("endpoint picker: keeping the last good pool: %s", exc)
            self.epp.metrics.pool_errors.inc()
            return False
        self.epp.set_pool(endpoints, weights, objectives)
        log.info("endpoint picker: pool of %d pods from %s", len(endpoints), self.path)
        return True

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


async def serve(servicer: EndpointPicker, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Starts the ext_proc and health services on ``host:port`` (0: any free port)."""
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(servicer, server)
    # grpc_health's stubs lack its asyncio servicer (health.aio, in the package since 1.32).
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("endpoint picker (ext_proc) on %s:%d", host, bound)
    return server, bound

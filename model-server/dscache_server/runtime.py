"""Builds the server's objects from its settings and passes them down.

``build_runtime(settings, metrics)`` is the one place that wires engine, tokenizer,
sidecar store, cost model, prefix cache, batcher (the engine thread), authenticator
and live template miner together; nothing is global, so tests build as many
runtimes as they like.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from threading import Lock

from cachetools import LRUCache

from dscache.keys import KeyChain, ModelFingerprint, tenant_salt, with_kv_codec
from dscache_server.auth import Authenticator
from dscache_server.batcher import Batcher
from dscache_server.cache import PrefixCache
from dscache_server.calibrate import calibrate
from dscache_server.config import ServerSettings
from dscache_server.engine import TransformersEngine
from dscache_server.generate import COMPLETED, GenerationRequest, GenerationResult
from dscache_server.kvstore import KVBlockStore, SidecarBlockStore
from dscache_server.loading import load_engine
from dscache_server.metrics import ServerMetrics
from dscache_server.respell import Spelling
from dscache_server.storecodec import AdaptiveZstd, StorePolicy
from dscache_server.templatelog import TemplateLog, replayable
from dscache_server.tokenizer import Continuations, DeepSeekTokenizer, PieceCache

log = logging.getLogger(__name__)

#: Key chains kept (tenants are few but unbounded: an API key is a tenant).
CHAIN_CACHE_SIZE = 4096


@dataclass
class Runtime:
    """Everything a running server needs, built once.

    ``fingerprint`` is the engine's, plus the lossy codec if the store uses one:
    every cache key of this server derives from it.
    """

    settings: ServerSettings
    engine: TransformersEngine
    fingerprint: ModelFingerprint
    tokenizer: DeepSeekTokenizer
    cache: PrefixCache
    batcher: Batcher
    metrics: ServerMetrics
    auth: Authenticator
    templates: TemplateLog | None = None
    pieces: PieceCache = field(default_factory=PieceCache)
    continuations: Continuations = field(default_factory=Continuations)
    spelling: Spelling = field(init=False)
    _chains: LRUCache[str, KeyChain] = field(default_factory=lambda: LRUCache(CHAIN_CACHE_SIZE))
    _chains_lock: Lock = field(default_factory=Lock)

    def __post_init__(self) -> None:
        self.spelling = Spelling(self.tokenizer.backend)

    @property
    def max_context(self) -> int:
        """Longest prompt + completion accepted: the model's, capped by the settings."""
        cap = self.settings.max_context_tokens
        return min(self.engine.max_context, cap) if cap else self.engine.max_context

    def chain_for(self, tenant: str) -> KeyChain:
        """The key chain of one tenant (cached; tenants are few but unbounded)."""
        with self._chains_lock:
            chain = self._chains.get(tenant)
            if chain is None:
                secret = self.settings.tenant_secret.get_secret_value().encode()
                chain = KeyChain(self.fingerprint, tenant_salt(tenant, secret))
                self._chains[tenant] = chain
            return chain

    def respell(self, ids: list[int], tenant: str) -> list[int]:
        """A prompt encoded from text, with the tokenization its cached blocks were
        stored with followed (``PrefixCache.respell``)."""
        if not self.settings.respell:
            return ids
        chain = self.chain_for(tenant)
        return self.cache.respell(chain, ids, self.spelling, self.tokenizer.encode)

    def record_template(self, req: GenerationRequest, tenant: str) -> None:
        """Counts ``req``'s prompt prefixes in the live template miner, if it runs.

        The keys of its first ``max_blocks`` blocks are computed here, at most a few
        blocks' hashes: the cache computes its own later, on the engine thread, and
        only for the prompts it admits.
        """
        miner = self.templates
        if miner is None or not replayable(tenant):
            return
        blocks = min(len(req.token_ids) // miner.block_tokens, miner.max_blocks)
        if blocks == 0:
            return
        keys = req.chain.keys(req.token_ids[: blocks * miner.block_tokens])
        miner.record(tenant, req.session_id, req.token_ids, keys)
        self.metrics.templates_recorded.inc()
        self.metrics.templates_tracked.set(len(miner))

    async def generate(
        self, req: GenerationRequest, emit: Callable[[str], None] = lambda _delta: None
    ) -> GenerationResult:
        """Runs ``req`` on the engine thread; ``emit`` gets text deltas on that thread.

        Cancelling the caller (the client went away) tells the engine to stop the
        request at its next iteration and re-raises; a forward is never interrupted.
        """
        future = asyncio.wrap_future(self.batcher.submit(req, emit))
        try:
            result = await asyncio.shield(future)
        except asyncio.CancelledError:
            req.cancelled.set()
            raise
        scope = req.answer_scope
        if scope is not None:
            if req.prompt_text is None:
                self.remember_answer(scope, result)
            else:  # a decode of the whole text: off the event loop
                await asyncio.to_thread(self.remember_completion, req, scope, result)
        return result

    def remember_answer(self, scope: str, result: GenerationResult) -> None:
        """Remembers a chat answer's ids for the next turn's prompt
        (``PieceCache.remember_answer``): as many generated ids as spell the text
        exactly (``DeepSeekTokenizer.answer_ids``), so its cached KV matches."""
        ids = self._answer_ids(result)
        if ids is not None:
            self.pieces.remember_answer(scope, result.text, ids)

    def remember_completion(
        self, req: GenerationRequest, scope: str, result: GenerationResult
    ) -> None:
        """Remembers a text completion's prompt and answer as one text with the ids the
        model saw and generated (``Continuations``), once they spell it exactly."""
        ids = self._answer_ids(result)
        if ids is None or req.prompt_text is None:
            return
        text, spelled = req.prompt_text + result.text, [*req.token_ids, *ids]
        if self.tokenizer.decode(spelled, skip_special=False) == text:
            self.continuations.remember(scope, text, spelled)

    def _answer_ids(self, result: GenerationResult) -> list[int] | None:
        if result.finish_reason not in COMPLETED or not result.text:
            return None
        return self.tokenizer.answer_ids(result.text, result.token_ids)

    def close(self) -> None:
        """Stops the engine thread and closes the cache."""
        self.batcher.close()
        self.cache.close()


def build_auth(settings: ServerSettings) -> Authenticator:
    """The authenticator of ``settings`` (raises ``KeyFileError`` for a bad key file)."""
    return Authenticator(
        key_file=settings.api_keys_file,
        gateway_secret=settings.gateway_secret.get_secret_value(),
        internal_token=settings.internal_token.get_secret_value(),
        tenant_header=settings.tenant_header,
    )


def build_store(
    settings: ServerSettings, metrics: ServerMetrics | None = None
) -> KVBlockStore | None:
    """The sidecar store, or None when no socket is configured."""
    if not settings.sidecar_socket:
        log.warning("no sidecar socket configured: running without a KV cache")
        return None
    return SidecarBlockStore(
        settings.sidecar_socket,
        data_dir=settings.sidecar_data_dir,
        timeout_s=settings.sidecar_timeout_s,
        cooldown_s=settings.circuit_cooldown_s,
        lookups=metrics.lookups if metrics is not None else None,
    )


def build_runtime(
    settings: ServerSettings,
    metrics: ServerMetrics,
    *,
    engine: TransformersEngine | None = None,
    tokenizer: DeepSeekTokenizer | None = None,
    store: KVBlockStore | None = None,
) -> Runtime:
    """Wires a runtime; pre-built engine/tokenizer/store are used as given (tests)."""
    if engine is None:
        engine = load_engine(
            settings.model,
            seed=settings.seed,
            block_tokens=settings.block_tokens,
            max_context=settings.max_context_tokens,
            revision=settings.revision,
            threads=settings.threads,
            dtype=settings.dtype,
        )
    if tokenizer is None:
        path = settings.tokenizer_path
        local = Path(settings.model) / "tokenizer.json"
        if path is None and local.is_file():
            path = local
        tokenizer = DeepSeekTokenizer(path)
    if tokenizer.vocab_size > engine.vocab_size:
        raise ValueError(
            f"tokenizer has {tokenizer.vocab_size} ids but the model only {engine.vocab_size}"
        )
    auth = build_auth(settings)
    metrics.add_tenants(auth.known_labels())
    if store is None:
        store = build_store(settings, metrics)
    cost = calibrate(
        engine,
        store,
        prefill_tokens_per_s=settings.prefill_tokens_per_s,
        load_bytes_per_s=settings.load_bytes_per_s,
        lookup_overhead_s=settings.lookup_overhead_s,
        measure=settings.calibrate,
    )
    cache = PrefixCache(
        store,
        engine.adapter,
        metrics,
        cost,
        min_tokens=settings.min_cache_tokens,
        admission_refit_s=settings.admission_refit_s or None,
        admission_probe=settings.admission_probe,
        max_tokens=engine.max_context,
        lease_ttl_s=settings.lease_ttl_s,
        store_queue=settings.store_queue,
        background_verify=settings.verify_in_background,
        store_nice=settings.store_nice,
        store_policy=StorePolicy(
            settings.store_compress,
            adaptive=AdaptiveZstd(
                min_tokens=settings.zstd_min_tokens,
                min_repetition=settings.zstd_min_repetition,
            ),
            decisions=metrics.store_codec,
        ),
    )
    batcher = Batcher(engine, tokenizer, cache, metrics, prefill_chunk=settings.prefill_chunk)
    templates = None
    if settings.template_log:
        templates = TemplateLog(
            block_tokens=engine.fingerprint.block_tokens,
            capacity=settings.template_log_capacity,
            max_blocks=settings.template_log_max_blocks,
        )
    return Runtime(
        settings=settings,
        engine=engine,
        # A lossy codec's blocks live under their own keys: never served to an exact
        # deployment of the same model, nor the other way round.
        fingerprint=with_kv_codec(engine.fingerprint, settings.store_compress),
        tokenizer=tokenizer,
        cache=cache,
        batcher=batcher,
        metrics=metrics,
        auth=auth,
        templates=templates,
    )

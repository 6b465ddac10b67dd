"""``DscacheConnector``: dscache as a vLLM v1 KV connector.

Load it with::

    --kv-transfer-config '{"kv_connector": "DscacheConnector",
                           "kv_connector_module_path": "dscache_vllm.connector",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"socket": "...", "data_dir": "..."}}'

(``dscache vllm serve`` writes exactly this). The scheduler side
(:class:`~dscache_vllm.plan.Planner`) answers vLLM's "how many leading tokens are
cached" from the sidecar's index read in this process, and plans loads and saves;
the worker side (:class:`~dscache_vllm.worker.KVWorker`) copies stored blocks into
vLLM's pages before the forward and saves completed blocks after it.

Contract:
    * A cache failure never fails a request: a failed lookup is a miss; pages that
      cannot be loaded are reported through ``get_block_ids_with_load_errors`` and
      vLLM recomputes them (this needs ``kv_load_failure_policy: recompute``,
      which ``dscache vllm serve`` sets); a failed store is a future miss. Each is
      counted (``dscache_vllm_*`` metrics).
    * Loads are layer by layer: ``start_load_kv`` leases the blocks and starts the
      copies, ``wait_for_layer_load`` waits for one layer's pages; checksums are
      checked while the forward runs and a block that fails is reported through
      ``get_block_ids_with_load_errors`` in the same step, so vLLM drops that step's
      output for the request and recomputes the pages (see ``dscache_vllm.worker``).
      Saves copy each layer's completed blocks out after its attention
      (``save_kv_layer``) on a copier thread, and write in the background.
    * Tensor parallel: GQA/MHA ranks each load and store their own shard (rank and
      world size in the fingerprint); an MLA latent is the same on every rank, so it
      is stored once (by rank 0) and every rank loads that copy. Pipeline
      parallelism is refused at start-up.
    * A request's tenant is its ``cache_salt`` (vLLM's own prefix cache isolates
      salts the same way).
    * A block's key holds everything that changes its KV, as vLLM's own block hashes
      do: the tokens and their prefix, the request's LoRA adapter (name and a digest
      of its files) and the multimodal items over the block (vLLM's item hash and
      placeholder offset; ``dscache_vllm.extras``). A request with inputs the
      connector cannot key (prompt embeddings, an unknown kind of vLLM extra key) is
      not cached, counted in ``uncached_requests_total{reason}``.
    * Engines the connector cannot serve exactly are refused at start-up with the
      reason: encoder-decoder models (cross-attention KV), models with more than one
      KV cache group (sliding-window or hybrid layers), KV dtypes it cannot store.
    * The routing protocol: the scheduler side writes the key facts of requests
      without a ``cache_salt`` where ``DSCACHE_VLLM_KEYINFO_FILE`` says, for the API
      server's ``/dscache/keyinfo`` (``dscache_vllm.ledger``); a finished request
      whose ``kv_transfer_params`` carry a next-turn signal has it sent for the
      blocks stored for it (``dscache_vllm.signals``).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dscache_sidecar.client import SidecarClient
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from dscache.keys import KeyChain, ModelFingerprint, tenant_salt
from dscache_vllm.extras import RequestInputs, request_inputs
from dscache_vllm.ledger import KEYINFO_FILE_ENV, write_keyinfo
from dscache_vllm.metrics import ConnectorMetrics, export, merge
from dscache_vllm.paged import DTYPES, LayoutError, PagedKV
from dscache_vllm.plan import DEFAULT_TENANT, Planner, Scheduled, StepPlan
from dscache_vllm.settings import ConnectorSettings, fingerprint
from dscache_vllm.signals import NEXT_TURN_PARAM, NEXT_TURNS, DelayedSignals
from dscache_vllm.worker import KVWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_CHAINS = 1024  # tenants whose key chain stays cached


@dataclass
class DscacheStats(KVConnectorStats):  # type: ignore[misc]
    """Counter increments of one interval (``dscache_vllm.metrics``), shipped by vLLM
    from the scheduler and the workers to its API server."""

    def reset(self) -> None:
        self.data = dict[str, float]()

    def aggregate(self, other: KVConnectorStats) -> DscacheStats:
        merge(self.data, dict(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not self.data


class DscachePromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """The ``dscache_vllm_*`` counters on vLLM's own ``/metrics``."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._observe = export(self._counter_cls, labelnames, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        self._observe(transfer_stats_data, engine_idx)


@dataclass
class DscacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's plan, sent from the scheduler to the workers."""

    plan: StepPlan = field(default_factory=StepPlan)


def _page_layout(vllm_config: Any, dtype: Any) -> dict[str, str]:
    """What decides the bytes inside a page: vLLM's version, the page size, the device,
    and on the CPU the attention kernel's ISA (kernels of different ISAs may lay a
    page out differently)."""
    import vllm
    from vllm.platforms import current_platform

    page = int(vllm_config.cache_config.block_size)
    layout = {
        "vllm": str(vllm.__version__),
        "page_tokens": str(page),
        "device": str(current_platform.device_type),
    }
    if current_platform.is_cpu() and getattr(vllm_config.model_config, "use_mla", False):
        import torch

        # The platform's choice: AMX's MLA kernel where the CPU has AMX tiles, unless
        # the engine asked for the reference CPU one (the AMX kernel runs no float32).
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        asked_cpu = getattr(backend, "name", None) == "CPU_MLA"
        amx = bool(torch.cpu._is_amx_tile_supported()) and not asked_cpu
        layout["attn"] = "amx_mla" if amx else "cpu_mla"
    elif current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        head = int(vllm_config.model_config.get_head_size())
        layout["attn"] = str(_get_attn_isa(dtype, page, head, vllm_config.cache_config.cache_dtype))
    return layout


def _refuse_unsupported(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raises ``ValueError`` naming why this engine's KV cannot be cached exactly."""
    model = vllm_config.model_config
    if model is not None and getattr(model, "is_encoder_decoder", False):
        raise ValueError(
            f"dscache's vLLM connector does not cache encoder-decoder models ({model.model}): "
            "their cross-attention KV depends on the encoder input, not on the prompt's tokens"
        )
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        raise ValueError(
            f"dscache's vLLM connector needs one KV cache group; this model has {len(groups)} "
            f"({kinds}: sliding-window, hybrid or cross-attention layers), whose pages vLLM "
            "allocates and reuses separately"
        )


def _inputs(request: Any) -> RequestInputs:
    """What besides the tokens decides ``request``'s KV (``dscache_vllm.extras``)."""
    lora = request.lora_request
    features = request.mm_features or ()
    embeds = getattr(request, "prompt_embeds", None) is not None
    if lora is None and not features and not embeds:
        return _PLAIN_INPUTS
    kinds: list[str] = []
    if not embeds and all(f.identifier for f in features):
        from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

        # vLLM's own extra keys over the whole request: a kind this connector does
        # not know is an input it would not key, so the request is not cached.
        try:
            keys, _ = generate_block_hash_extra_keys(request, 0, request.num_tokens, 0)
        except Exception as exc:  # a shape of request this vLLM cannot hash
            log.debug("vLLM's extra keys failed (%s): not cached", exc)
            keys = (("unhashable",),)
        kinds = [str(k[0]) if isinstance(k, tuple) and k else repr(k) for k in keys or ()]
    return request_inputs(
        lora=(str(lora.lora_name), str(lora.lora_path)) if lora is not None else None,
        mm=[(f.identifier, int(f.mm_position.offset), int(f.mm_position.length)) for f in features],
        extra_kinds=kinds,
        prompt_embeds=embeds,
    )


_PLAIN_INPUTS = RequestInputs()


def _layer_order(name: str) -> tuple[int, ...]:
    """Natural order of layer names (``layers.10`` after ``layers.9``)."""
    return tuple(int(n) for n in re.findall(r"\d+", name))


class DscacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """The vLLM v1 connector; one instance per role (scheduler, worker)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.metrics = ConnectorMetrics.create()
        self.page_tokens = int(vllm_config.cache_config.block_size)
        _refuse_unsupported(vllm_config, kv_cache_config)
        self.mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        rank, world = self._tp_rank(role)
        # GQA/MHA: one fingerprint per tensor-parallel rank (each holds other heads).
        # MLA: the latent is the same on every rank, one fingerprint for all.
        shards = 1 if self.mla else world
        self.fingerprints = [self._fingerprint(vllm_config, tp_rank=r) for r in range(shards)]
        #: The shard whose blocks this process loads (and, when ``saves``, stores).
        self.shard = 0 if self.mla else rank
        #: Whether this worker stores blocks: every GQA shard; for MLA, rank 0 only.
        self.saves = rank == 0 or not self.mla
        self.fingerprint = self.fingerprints[self.shard]
        self._client = SidecarClient(
            self.settings.socket, data_dir=self.settings.data_dir, timeout_s=self.settings.timeout_s
        )
        self._secret = self.settings.tenant_secret()
        self._chains: OrderedDict[str, tuple[KeyChain, ...]] = OrderedDict()
        self.planner = Planner(
            self._chain_for, self._find, self.settings.block_tokens, self.page_tokens
        )
        self._requests: dict[str, Any] = {}
        self._pages: dict[str, list[int]] = {}
        self._worker: KVWorker | None = None
        self._layer_index: dict[str, int] = {}
        self._uncached: set[str] = set()
        self._signals = DelayedSignals(self._client, self.metrics)
        if role == KVConnectorRole.SCHEDULER:
            self._publish_keyinfo(vllm_config)
        log.info(
            "dscache connector (%s, TP rank %d of %d, %s): socket %s, data dir %s, %d-token "
            "blocks over %d-token pages, fingerprint %s",
            "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
            rank,
            world,
            "MLA, one copy for every rank" if self.mla else f"shard {self.shard}",
            self.settings.socket,
            self.settings.data_dir,
            self.settings.block_tokens,
            self.page_tokens,
            self.fingerprint.digest().hex()[:16],
        )

    def _publish_keyinfo(self, vllm_config: Any) -> None:
        """The key facts of requests without a ``cache_salt`` for the API server's
        ``/dscache/keyinfo`` (:mod:`dscache_vllm.ledger`), so the router's picker can
        route them by the prefix a pod holds; best effort, never fails the engine."""
        path = os.environ.get(KEYINFO_FILE_ENV)
        if not path:
            return
        model = vllm_config.model_config
        chain = self._chain_for(DEFAULT_TENANT)[0]
        try:
            write_keyinfo(
                path,
                model=str(getattr(model, "served_model_name", None) or model.model),
                block_tokens=self.settings.block_tokens,
                fingerprint=chain.fingerprint.digest().hex(),
                root=chain.root.hex(),
            )
        except OSError as exc:
            log.warning("dscache key info not written to %s (%s): no prefix routing", path, exc)

    def _tp_rank(self, role: Any) -> tuple[int, int]:
        """This process's tensor-parallel rank (0 for the scheduler) and world size."""
        world = int(self._vllm_config.parallel_config.tensor_parallel_size)
        if role == KVConnectorRole.SCHEDULER:
            return 0, world
        from vllm.distributed import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank()), world

    def _fingerprint(self, vllm_config: Any, tp_rank: int) -> ModelFingerprint:
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        cache_dtype = vllm_config.cache_config.cache_dtype
        if int(parallel.pipeline_parallel_size) > 1:
            # Each stage holds other layers: a stage's blocks are another shard, which
            # the planner could key like TP ranks, but no engine here can run it to
            # prove the copies exact, so it is refused rather than trusted.
            raise ValueError(
                "dscache's vLLM connector does not support pipeline parallelism "
                f"(pipeline_parallel_size={parallel.pipeline_parallel_size}); use tensor "
                "parallelism, whose shards it keys per rank"
            )
        torch_dtype = model.dtype if cache_dtype == "auto" else None
        if torch_dtype not in DTYPES:
            raise ValueError(
                f"dscache stores float32, float16 and bfloat16 KV; this engine's KV cache "
                f"dtype is {cache_dtype!r} ({model.dtype})"
            )
        mla = None
        if getattr(model, "use_mla", False):
            text = model.hf_text_config
            mla = (int(text.kv_lora_rank), int(text.qk_rope_head_dim))
        return fingerprint(
            model=str(model.model),
            revision=self.settings.revision or model.revision,
            num_layers=int(model.get_num_layers(parallel)),
            kv_heads=int(model.get_num_kv_heads(parallel)),
            head_size=int(model.get_head_size()),
            dtype=DTYPES[torch_dtype][0],
            block_tokens=self.settings.block_tokens,
            tp_size=int(parallel.tensor_parallel_size),
            tp_rank=tp_rank,
            page_layout=_page_layout(vllm_config, torch_dtype),
            mla=mla,
        )

    def _chain_for(self, tenant: str) -> tuple[KeyChain, ...]:
        """A tenant's key chains, one per shard (cached for the last tenants)."""
        chains = self._chains.get(tenant)
        if chains is None:
            salt = tenant_salt(tenant, self._secret)
            chains = tuple(KeyChain(fp, salt) for fp in self.fingerprints)
            self._chains[tenant] = chains
            if len(self._chains) > _CHAINS:
                self._chains.popitem(last=False)
        else:
            self._chains.move_to_end(tenant)
        return chains

    def _find(self, tenant: str, keys: Sequence[bytes]) -> int:
        return self._client.find(tenant, keys).found

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        start = time.perf_counter()
        failures = self.planner.lookup_failures
        inputs = _inputs(request)
        if inputs.uncacheable is not None:
            if request.request_id not in self._uncached:
                self._uncached.add(request.request_id)
                self.metrics.uncached(inputs.uncacheable)
            return 0, False
        n = self.planner.matched(
            request.request_id,
            request.all_token_ids,
            request.cache_salt,
            num_computed_tokens,
            inputs,
        )
        failed = self.planner.lookup_failures > failures
        self.metrics.lookup(
            "error" if failed else "hit" if n else "miss", time.perf_counter() - start
        )
        return n, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.planner.allocated(request.request_id, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        scheduled: list[Scheduled] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            pages = list(new.block_ids[0])
            self._pages[new.req_id] = pages
            scheduled.append(
                Scheduled(
                    new.req_id,
                    request.all_token_ids,
                    new.num_computed_tokens,
                    counts.get(new.req_id, 0),
                    pages,
                    first=True,
                )
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            if request is None:
                continue
            resumed = req_id in cached.resumed_req_ids
            new_ids = cached.new_block_ids[i]
            pages = self._pages.setdefault(req_id, [])
            if resumed:
                pages.clear()
            if new_ids is not None:
                pages.extend(new_ids[0])
            scheduled.append(
                Scheduled(
                    req_id,
                    request.all_token_ids,
                    cached.num_computed_tokens[i],
                    counts.get(req_id, 0),
                    pages,
                    first=resumed,
                )
            )
        return DscacheMetadata(self.planner.step(scheduled))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None)
        kind = params.get(NEXT_TURN_PARAM) if isinstance(params, dict) else None
        if kind in NEXT_TURNS:  # the client said whether its conversation goes on
            stored = self.planner.stored_keys(request.request_id)
            if stored is not None:
                self._signals.send(*stored, kind)
        self.planner.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        self._pages.pop(request.request_id, None)
        self._uncached.discard(request.request_id)
        return False, None

    # ------------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=_layer_order)
        self._layer_index = {name: i for i, name in enumerate(names)}
        layers = [kv_caches[name] for name in names]
        pages = int(self._kv_cache_config.num_blocks)
        paged = PagedKV(layers, self.settings.block_tokens, self.page_tokens, pages)
        g = paged.geometry
        want = self.fingerprint.layout
        per_token = want.elements_per_token_layer()
        if (g.num_layers, g.elements_per_token, paged.contract_dtype) != (
            want.num_layers,
            per_token,
            want.dtype,
        ):
            what = (
                f"latent {want.kv_lora_rank} + rope {want.qk_rope_head_dim}"
                if self.mla
                else f"2 x {want.num_kv_heads} heads x {want.head_dim}"
            )
            raise LayoutError(
                f"vLLM's KV tensors ({g.num_layers} layers, {g.elements_per_token} elements "
                f"per token, {paged.contract_dtype}) do not match the model config "
                f"({want.num_layers} layers, {what} = {per_token}, {want.dtype})"
            )
        self._worker = KVWorker(
            self._client,
            paged,
            self.metrics,
            verify=self.settings.verify,
            queue_blocks=self.settings.store_queue_blocks,
            shard=self.shard,
            saves=self.saves,
            data_dir=self.settings.data_dir,
            memo_ttl_s=self.settings.verified_ttl_s,
            copy_threads=self.settings.copy_threads,
            layerwise=self.settings.layerwise_loads,
        )

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, DscacheMetadata)
        return meta.plan

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        self._worker.start_loads(self._plan().loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if self._worker is not None and index is not None:
            self._worker.wait_layer(index)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        index = self._layer_index.get(layer_name)
        if self._worker is None or index is None:
            return
        try:
            self._worker.save_layer(index, self._plan().saves)
        except Exception as exc:  # never fail the forward for a save
            log.warning("dscache could not start copying layer %s out: %s", layer_name, exc)

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        try:
            self._worker.finish_saves(self._plan().saves)
        except Exception as exc:  # never fail the step for a save
            log.warning("dscache could not copy blocks out for saving: %s", exc)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return set(self._worker.end_step())

    # ------------------------------------------------------------------- metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        increments = self.metrics.take()
        return DscacheStats(data=increments) if increments else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return DscacheStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return DscachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        self._signals.close()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        else:
            self._client.close()

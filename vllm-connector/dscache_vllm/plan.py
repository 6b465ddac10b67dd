"""The scheduler side of the vLLM connector: which blocks to load and to save, per step.

Pure bookkeeping (no vLLM, no torch, no I/O of its own): :class:`Planner` gets the
facts vLLM's scheduler hands the connector and answers with :class:`StepPlan`\\ s the
worker side executes. ``dscache_vllm.connector`` is the thin glue between the two.

Terms: a *block* is a dscache block of ``block_tokens`` tokens (the unit of the
cache-key contract); a *page* is one of vLLM's KV blocks of ``page_tokens`` tokens.
``block_tokens`` is a multiple of ``page_tokens``, so block ``b`` covers pages
``b * r .. (b + 1) * r - 1`` with ``r = block_tokens // page_tokens``.

Contract:
    * :meth:`Planner.matched` answers vLLM's "how many more leading tokens can be
      loaded" with one lookup (``find``: the sidecar's index, read in this process);
      it never counts a prompt's last token (vLLM must compute at least one) nor a
      partial block, and a lookup that fails is a miss (0), never an error.
    * A load is planned only after vLLM allocated pages for it (:meth:`allocated`
      with a non-zero count) and is handed to the worker once, in the step that
      first schedules the request. It covers the pages past vLLM's own prefix-cache
      hit up to the hit's end.
    * A save names each block once, in the step whose forward completes its last
      token; blocks the lookup found stored are never saved again. Tokens past
      ``len(token_ids)`` (speculative drafts) are never saved.
    * Keys come from the tenant's :class:`~dscache.keys.KeyChain`: a request's
      ``cache_salt`` is its tenant, so two salts never share a block. Each block's
      key also holds what else decides its KV (the request's LoRA adapter, the
      multimodal items over it: :class:`~dscache_vllm.extras.RequestInputs`), so
      requests that differ in those never share a block either.
    * A request whose inputs cannot be keyed (``RequestInputs.uncacheable``) is
      neither looked up, loaded nor saved.
    * Shards: when the workers' KV differs per tensor-parallel rank (GQA/MHA heads),
      ``chain_for`` gives one chain per rank; every spec then carries each shard's
      keys (``keys_for``), a lookup counts the blocks *every* shard holds, and a
      worker touches only its own shard's blocks. With one chain (TP 1, or MLA,
      whose latent every rank shares) every worker uses the same keys.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from dscache.keys import KeyChain, block_keys
from dscache_vllm.extras import PLAIN, RequestInputs

log = logging.getLogger(__name__)

#: Tenant of requests without a ``cache_salt``.
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class LoadSpec:
    """Copy stored blocks into a request's pages before the forward that needs them.

    Attributes:
        req_id: vLLM's request id.
        tenant: the sidecar tenant (label of the request's salt).
        keys: keys of blocks ``first_block ..`` in chain order.
        first_block: block index (in the request) of ``keys[0]``.
        first_page: page index (in the request) of ``page_ids[0]``.
        page_ids: vLLM block ids of the pages to fill, in order.
        shard_keys: the same blocks' keys for shards 1, 2, ... (empty: one chain).
    """

    req_id: str
    tenant: str
    keys: tuple[bytes, ...]
    first_block: int
    first_page: int
    page_ids: tuple[int, ...]
    shard_keys: tuple[tuple[bytes, ...], ...] = ()

    def keys_for(self, shard: int) -> tuple[bytes, ...]:
        """The keys of ``shard``'s blocks (shard 0's, or everyone's with one chain)."""
        return self.shard_keys[shard - 1] if shard and self.shard_keys else self.keys

    @property
    def tokens(self) -> int:
        """How many tokens this load fills (whole pages)."""
        return len(self.page_ids)


@dataclass(frozen=True)
class SaveSpec:
    """Copy a request's newly completed blocks out of its pages and store them.

    Attributes:
        req_id: vLLM's request id.
        tenant: the sidecar tenant.
        keys: keys of the blocks to save, in chain order.
        parents: each block's predecessor key (b"" for a prompt's first block).
        page_ids: vLLM block ids of every page of those blocks, in order
            (``len(keys) * pages_per_block`` of them).
        shard_keys: the keys for shards 1, 2, ... (empty: one chain).
        shard_parents: their predecessors, likewise.
        token_ids: the blocks' tokens end to end, little-endian u32 (every shard's
            blocks hold the same tokens): the sidecar names blocks by them in its
            KV events.
    """

    req_id: str
    tenant: str
    keys: tuple[bytes, ...]
    parents: tuple[bytes, ...]
    page_ids: tuple[int, ...]
    shard_keys: tuple[tuple[bytes, ...], ...] = ()
    shard_parents: tuple[tuple[bytes, ...], ...] = ()
    token_ids: bytes = b""

    def block_token_ids(self, i: int) -> list[int]:
        """The tokens of the ``i``-th saved block (empty when not carried)."""
        if not self.token_ids or not self.keys:
            return []
        step = len(self.token_ids) // len(self.keys)
        ids: list[int] = np.frombuffer(self.token_ids[i * step : (i + 1) * step], "<u4").tolist()
        return ids

    def keys_for(self, shard: int) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """``shard``'s keys and parents (shard 0's, or everyone's with one chain)."""
        if shard and self.shard_keys:
            return self.shard_keys[shard - 1], self.shard_parents[shard - 1]
        return self.keys, self.parents


@dataclass(frozen=True)
class StepPlan:
    """What the worker does around one forward pass."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()


@dataclass(frozen=True)
class Scheduled:
    """One request scheduled in this step, as the planner needs it.

    Attributes:
        req_id: vLLM's request id.
        token_ids: every known token id of the request (prompt and output so far).
        num_computed: tokens whose KV exists before this step's forward.
        num_scheduled: tokens this step computes.
        page_ids: vLLM block ids of all the request's pages, in order.
        first: the step schedules the request for the first time (new or resumed).
    """

    req_id: str
    token_ids: Sequence[int]
    num_computed: int
    num_scheduled: int
    page_ids: Sequence[int]
    first: bool


@dataclass
class _Request:
    tenant: str
    chains: tuple[KeyChain, ...]
    inputs: RequestInputs = PLAIN
    #: Each shard's keys, as far as computed.
    keys: list[list[bytes]] = field(default_factory=list)
    #: Blocks known stored (found by the lookup, or handed to the worker to save).
    stored: int = 0
    #: (start, end) tokens of a load that waits for vLLM's allocation / first step.
    pending: tuple[int, int] | None = None
    confirmed: bool = False


class Planner:
    """Per-request state of the scheduler-side connector.

    Args:
        chain_for: the key chain of a tenant (a request's ``cache_salt``, or
            ``DEFAULT_TENANT``), or one chain per shard (all of one tenant).
        find: how many leading keys of a tenant the store holds (may raise: a
            failure is a miss).
        block_tokens: tokens per dscache block.
        page_tokens: tokens per vLLM block.
    """

    def __init__(
        self,
        chain_for: Callable[[str], KeyChain | Sequence[KeyChain]],
        find: Callable[[str, Sequence[bytes]], int],
        block_tokens: int,
        page_tokens: int,
    ) -> None:
        if page_tokens <= 0 or block_tokens % page_tokens:
            raise ValueError(
                f"the dscache block ({block_tokens} tokens) must be a multiple of "
                f"vLLM's block size ({page_tokens} tokens)"
            )
        self._chain_for = chain_for
        self._find = find
        self.block_tokens = block_tokens
        self.page_tokens = page_tokens
        self.pages_per_block = block_tokens // page_tokens
        self._reqs: dict[str, _Request] = {}
        #: Lookups that failed (the store unreachable): counted by the connector.
        self.lookup_failures = 0

    def _request(self, req_id: str, salt: str | None, inputs: RequestInputs) -> _Request:
        state = self._reqs.get(req_id)
        if state is None:
            got = self._chain_for(salt or DEFAULT_TENANT)
            chains = (got,) if isinstance(got, KeyChain) else tuple(got)
            if len({c.tenant for c in chains}) != 1:
                raise ValueError("every shard's chain must belong to one tenant")
            state = _Request(
                tenant=chains[0].tenant,
                chains=chains,
                inputs=inputs,
                keys=[[] for _ in chains],
            )
            self._reqs[req_id] = state
        return state

    def _keys(self, state: _Request, token_ids: Sequence[int], blocks: int) -> list[list[bytes]]:
        """Each shard's first ``blocks`` keys of the request, extending the cached chains."""
        have = len(state.keys[0])
        if blocks > have:
            bt = self.block_tokens
            extras = None if state.inputs.plain else state.inputs.extras(have, blocks, bt)
            tokens = token_ids[have * bt : blocks * bt]
            for chain, keys in zip(state.chains, state.keys, strict=True):
                keys.extend(block_keys(keys[-1] if keys else chain.root, tokens, bt, extras))
        return [keys[:blocks] for keys in state.keys]

    def matched(
        self,
        req_id: str,
        token_ids: Sequence[int],
        salt: str | None,
        num_computed: int,
        inputs: RequestInputs = PLAIN,
    ) -> int:
        """Tokens beyond ``num_computed`` (vLLM's own prefix hit) loadable from the store.

        ``inputs`` (what besides the tokens decides the KV) is read on a request's
        first call; an uncacheable request is never tracked: 0, and nothing saved.
        """
        if inputs.uncacheable is not None and req_id not in self._reqs:
            return 0
        state = self._request(req_id, salt, inputs)
        usable = max(len(token_ids) - 1, 0) // self.block_tokens
        if usable == 0:
            return 0
        shards = self._keys(state, token_ids, usable)
        try:
            # A load needs every shard's block: the hit is what all of them hold.
            found = usable
            for keys in shards:
                found = min(found, self._find(state.tenant, keys[:found]) if found else 0)
        except Exception as exc:  # the cache never fails a request
            self.lookup_failures += 1
            log.debug("lookup failed, treated as a miss: %s", exc)
            found = 0
        state.stored = max(state.stored, found)
        hit = found * self.block_tokens
        if hit <= num_computed:
            state.pending = None
            return 0
        state.pending = (num_computed, hit)
        state.confirmed = False
        return hit - num_computed

    def allocated(self, req_id: str, num_external: int) -> None:
        """vLLM allocated pages for ``num_external`` loaded tokens (0: no load)."""
        state = self._reqs.get(req_id)
        if state is None or state.pending is None:
            return
        if num_external <= 0:
            state.pending = None
            return
        start, _ = state.pending
        state.pending = (start, start + num_external)
        state.confirmed = True

    def step(self, scheduled: Sequence[Scheduled]) -> StepPlan:
        """The loads and saves of one step (each load once, each block saved once)."""
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        for s in scheduled:
            state = self._reqs.get(s.req_id)
            if state is None:
                continue
            if state.pending is not None and state.confirmed and s.first:
                load = self._load(s, state, *state.pending)
                if load is not None:
                    loads.append(load)
                state.pending = None
            save = self._save(s, state)
            if save is not None:
                saves.append(save)
        return StepPlan(tuple(loads), tuple(saves))

    def _load(self, s: Scheduled, state: _Request, start: int, end: int) -> LoadSpec | None:
        pt, r = self.page_tokens, self.pages_per_block
        first_page, end_page = start // pt, end // pt
        if end_page > len(s.page_ids) or first_page >= end_page:
            log.warning("request %s has fewer pages than its load; loading nothing", s.req_id)
            return None
        first_block, end_block = first_page // r, -(-end_page // r)
        shards = [tuple(k[first_block:]) for k in self._keys(state, s.token_ids, end_block)]
        return LoadSpec(
            req_id=s.req_id,
            tenant=state.tenant,
            keys=shards[0],
            first_block=first_block,
            first_page=first_page,
            page_ids=tuple(s.page_ids[first_page:end_page]),
            shard_keys=tuple(shards[1:]),
        )

    def _save(self, s: Scheduled, state: _Request) -> SaveSpec | None:
        done = min(s.num_computed + s.num_scheduled, len(s.token_ids))
        full = done // self.block_tokens
        r = self.pages_per_block
        full = min(full, len(s.page_ids) // r)
        if full <= state.stored:
            return None
        first = state.stored
        shards = self._keys(state, s.token_ids, full)
        keys = [tuple(k[first:full]) for k in shards]
        parents = [tuple(k[i - 1] if i else b"" for i in range(first, full)) for k in shards]
        state.stored = full
        return SaveSpec(
            req_id=s.req_id,
            tenant=state.tenant,
            keys=keys[0],
            parents=parents[0],
            page_ids=tuple(s.page_ids[first * r : full * r]),
            shard_keys=tuple(keys[1:]),
            shard_parents=tuple(parents[1:]),
            token_ids=np.asarray(
                s.token_ids[first * self.block_tokens : full * self.block_tokens], dtype="<u4"
            ).tobytes(),
        )

    def stored_keys(self, req_id: str) -> tuple[str, list[bytes]] | None:
        """The tenant of a request and the keys of its blocks known stored (found by
        its lookup or handed to the worker to save), every shard's; None if unknown."""
        state = self._reqs.get(req_id)
        if state is None or not state.keys:
            return None
        return state.tenant, [k for keys in state.keys for k in keys[: state.stored]]

    def finished(self, req_id: str) -> None:
        """Forgets a request (vLLM is about to free its pages)."""
        self._reqs.pop(req_id, None)

    def __len__(self) -> int:
        return len(self._reqs)

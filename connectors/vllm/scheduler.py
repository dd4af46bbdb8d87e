"""The scheduler side: lookups, load plans, the step's metadata, request lifecycle.

vLLM builds the connector with ``role=SCHEDULER`` beside its scheduler, and
:class:`TieredOffloadConnector` hands that role's calls to
:class:`TieredOffloadScheduler`. It holds no blocks: it asks the worker side's books
(:class:`~.shared._Shared` in this process, else :class:`~.books._RemoteBooks`) what is
held, and tells the worker, through each step's :class:`TieredOffloadMetadata`, which
blocks to load and which to store. Kept apart from :mod:`.worker` because the two
halves run in different processes in vLLM's default mode and share nothing but the
metadata defined here and the books.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload.keys import BlockKey, key_from_hash

from .books import _RemoteBooks
from .events import BlockHash, TieredOffloadKVEvents
from .shared import _REGISTRY, _REGISTRY_LOCK, _Shared

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Load:
    req_id: str
    plan_id: int
    block_ids: list[int]
    """GPU blocks to load into, one per planned key."""
    resumed: bool = False
    """The request was preempted earlier: this load brings its work back."""
    hashes: list[BlockHash] = field(default_factory=list)
    """vLLM's hashes of the planned keys, for KV events (empty when they are off)."""


@dataclass
class _Store:
    req_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    hashes: list[BlockHash] = field(default_factory=list)
    """vLLM's hashes of ``keys``, for KV events (empty when they are off)."""


@dataclass
class TieredOffloadMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM: Any
    """One step's instructions from the scheduler side to the worker side."""

    loads: list[_Load] = field(default_factory=list)
    stores: list[_Store] = field(default_factory=list)


@dataclass
class _ReqState:
    """Scheduler-side view of one request."""

    request: Request
    block_ids: list[int] = field(default_factory=list)
    stored_blocks: int = 0
    """Full blocks already handed to the worker for storing (or known held)."""
    had_store: bool = False
    local_tokens: int = 0
    """GPU prefix-cache hit, from the last ``get_num_new_matched_tokens``."""
    claimed: bool = False
    """The worker may hold a claim (pins, or prefetches waited for) for this request
    that neither a plan nor a release has ended yet."""


class TieredOffloadScheduler:
    """The scheduler side of one engine (see the module docstring)."""

    def __init__(
        self, *, engine_id: str, slot: str, ranks: int, block_size: int, events: bool
    ) -> None:
        self.engine_id = engine_id
        self.ranks = ranks
        self.block_size = block_size
        self._slot = slot
        self._events_enabled = events
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[_Load] = []
        self._preempted: set[str] = set()
        self._remote: _RemoteBooks | None = None
        self._next_plan = 0
        self._events: list[KVCacheEvent] = []

    def _books(self) -> _Shared | _RemoteBooks:
        """Where the scheduler side asks: the worker's state when it is in this
        process (one rank), else connections to every rank."""
        if self._remote is not None:
            return self._remote
        if self.ranks == 1:
            with _REGISTRY_LOCK:
                shared = _REGISTRY.get(self._slot)
            if shared is not None:
                return shared
        self._remote = _RemoteBooks(self.engine_id, self.ranks)
        return self._remote

    def _keys(self, request: Request, n: int) -> list[BlockKey]:
        """vLLM's block hashes as keys; each rank namespaces them (``_Shared.ns``)."""
        return [
            key_from_hash(bytes(h) if not isinstance(h, int) else h)
            for h in request.block_hashes[:n]
        ]

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # Never the last prompt token: vLLM must compute at least one.
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        loadable = min(loadable, len(request.block_hashes))
        start = num_computed_tokens // self.block_size
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        state.local_tokens = num_computed_tokens
        if loadable <= start:
            return 0, False
        # The worker claims the verified prefix (pinned for this request), after
        # prefetching what only a disk tier holds; ``None`` until that is done.
        hit = self._books().lookup(request.request_id, self._keys(request, loadable))
        state.claimed = True
        if hit is None:
            return None, False
        if hit <= start:
            return 0, False
        return hit * self.block_size - num_computed_tokens, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._reqs.setdefault(request.request_id, _ReqState(request))
        if num_external_tokens <= 0:
            if state.claimed:  # nothing to load: the claim's pins go
                self._books().release(request.request_id)
                state.claimed = False
            return
        start = state.local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        # ``blocks`` covers the local hit and the new blocks, from block 0.
        targets = block_ids[start : start + n]
        plan_id = self._next_plan
        self._next_plan += 1
        # The claim pinned blocks [0, hit); the engine loads [start, start + n).
        self._books().plan(plan_id, request.request_id, start, n)
        state.claimed = False
        resumed = request.request_id in self._preempted
        hashes = list(request.block_hashes[start : start + n]) if self._events_enabled else []
        self._pending_loads.append(_Load(request.request_id, plan_id, targets, resumed, hashes))
        # Blocks being loaded are held by us already: no need to store them back.
        state.stored_blocks = max(state.stored_blocks, start + n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredOffloadMetadata:
        meta = TieredOffloadMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._preempted.update(scheduler_output.preempted_req_ids or ())
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is None or new_ids is None:
                continue
            if req_id in cached.resumed_req_ids:
                state.block_ids = list(new_ids[0])
            else:
                state.block_ids.extend(new_ids[0])
        for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None:
                continue
            req = state.request
            done_tokens = req.num_computed_tokens + n_tokens
            full = min(done_tokens // self.block_size, len(req.block_hashes), len(state.block_ids))
            if full > state.stored_blocks:
                first = state.stored_blocks
                keys = self._keys(req, full)[first:]
                hashes = list(req.block_hashes[first:full]) if self._events_enabled else []
                meta.stores.append(_Store(req_id, keys, state.block_ids[first:full], hashes))
                state.stored_blocks = full
                state.had_store = True
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        state = self._reqs.pop(request.request_id, None)
        self._preempted.discard(request.request_id)
        if state is not None and state.claimed:  # ended before its load: aborted
            self._books().release(request.request_id)
        # Hold the blocks while stores from them may still be running; the worker
        # reports the id once they are done.
        return (state is not None and state.had_store), None

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Collect the KV events the worker side sent with its step output.

        Nothing else to do here: in this design the worker side's Offloader completes
        loads and stores itself (``start_load_kv`` waits for the step's loads,
        ``get_finished`` collects finished stores and reports the requests whose
        blocks may be freed: ``finished_sending``), and the scheduler side forgot
        those requests in ``request_finished`` already."""
        # ``getattr``: a field vLLM may move (an open upstream change carries worker
        # events elsewhere); then no events arrive, and nothing breaks.
        events = getattr(connector_output, "kv_cache_events", None)
        if self._events_enabled and isinstance(events, TieredOffloadKVEvents):
            self._events.extend(events.aggregate().get_all_events())

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' ``BlockStored`` / ``BlockRemoved`` events since the previous call
        (vLLM calls this right after ``update_connector_output``, every step); none
        when KV events are off."""
        events, self._events = self._events, []
        return events

"""The scheduler side: lookups, load plans, the step's metadata, request lifecycle.

vLLM builds the connector with ``role=SCHEDULER`` beside its scheduler, and
:class:`TieredOffloadConnector` hands that role's calls to
:class:`TieredOffloadScheduler`. It holds no blocks: it asks the worker side's books
(:class:`~.shared.Shared` in this process, else :class:`~.remote.RemoteBooks`) what is
held, and tells the worker, through each step's :class:`~.metadata.TieredOffloadMetadata`,
which blocks to load and which to store (those :mod:`.stores` picks). Kept apart from
:mod:`.worker` because the two halves run in different processes in vLLM's default
mode and share nothing but the metadata (:mod:`.metadata`) and the books.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import KVCacheEvent

from kvoffload.keys import BlockKey, generation_keys, key_from_hash

from .answers import Answers
from .config import BOTH, CONSUMER, PRODUCER, ROLES
from .costs import PrefillClock
from .events import EventBlocks, KVEventTally
from .groups import FULL, Group
from .hitpath import HitPath
from .metadata import Load, Store, TieredOffloadMetadata
from .remote import RemoteBooks
from .shared import REGISTRY, REGISTRY_LOCK
from .stores import ReqState, StorePlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


logger = logging.getLogger(__name__)

# The step's metadata was defined here: still importable from here.
__all__ = ["TieredOffloadMetadata", "TieredOffloadScheduler"]


class TieredOffloadScheduler:
    """The scheduler side of one engine (see the module docstring)."""

    def __init__(
        self,
        *,
        engine_id: str,
        slot: str,
        ranks: int,
        block_size: int,
        events: bool,
        groups: list[Group] | None = None,
        asked: int | None = None,
        inert: bool = False,
        books_timeout_s: float = 1.0,
        prefetch_on_arrival: bool = True,
        block_bytes: int = 0,
        async_min_bytes: float | None = float("inf"),
        first_tier: str = "cpu",
        role: str = BOTH,
        producer_wait_s: float = 10.0,
        lower_source: str = "disk",
    ) -> None:
        self.engine_id = engine_id
        if role not in ROLES:
            raise ValueError(f"kvoffload: kv_role {role!r}: expected one of {sorted(ROLES)}")
        self.role = role
        """vLLM's ``kv_role``: a producer (a prefill engine) stores and loads nothing; a
        consumer (a decode engine) loads, waits for what a producer is still storing,
        and stores nothing; ``kv_both`` does both and never waits."""
        self.loads = role != PRODUCER
        self.stores = role != CONSUMER
        self.lower_source = lower_source
        """vLLM's ``CacheHitSource`` value for a hit's blocks the cpu tier did not hold
        at the request's first mention: ``disk`` when every lower tier is a local disk
        (mmap, LMDB), else ``external_unspecified`` (a shared server such as Redis, or
        a plugin's backend: a store the connector cannot place)."""
        self.producer_wait_s = producer_wait_s
        """A consumer's longest wait for a prompt's whole loadable prefix to reach the
        tiers, from its first lookup (``producer_wait_ms``)."""
        self.waited_out = 0
        """Consumer lookups that stopped waiting for a producer (``producer_wait_s``)
        and took a shorter hit."""
        self.ranks = ranks
        self.inert = inert
        """vLLM's block hashes are not one per KV cache block: nothing to key, so no
        lookups and no stores."""
        self.books_timeout_s = books_timeout_s
        self.prefetch_on_arrival = prefetch_on_arrival
        self.block_bytes = block_bytes
        """Bytes of one block (on one rank): what a hit of n blocks loads."""
        self.hitpath = HitPath(
            block_bytes=block_bytes, first_tier=first_tier, async_min_bytes=async_min_bytes
        )
        """The hit path's timings, and where each hit loads: a hit of at least
        ``async_min_bytes`` loads in the background, or, with ``None``, the measured
        choice (:mod:`.hitpath`)."""
        self.asked = ranks if asked is None else asked
        """Ranks whose books answer: all, or rank 0 alone for a cache every rank holds
        the same (MLA)."""
        self.groups = groups or [Group(0, FULL, None, b"", ())]
        self._planner = StorePlanner(self.groups, block_size, self._keys, self._event_blocks)
        # Several groups: vLLM takes no block-level load failure (a block id is unique
        # only within its group), only a failed request of an asynchronous load; so
        # such an engine's hits load as vLLM's asynchronous loads, done in one step.
        self._whole_loads = len(self.groups) > 1
        self.block_size = block_size
        self._slot = slot
        self._events_enabled = events
        self._reqs: dict[str, ReqState] = {}
        self._pending_loads: list[Load] = []
        self._pending_stores: list[Store] = []
        self._failed_loads: set[str] = set()
        self._preempted: set[str] = set()
        self._remote: RemoteBooks | None = None
        self._next_plan = 0
        self._events: list[KVCacheEvent] = []
        self._tally = KVEventTally(self.asked)
        """Each rank's events across steps: one is published once every rank that keeps
        tiers has reported it (vLLM's aggregation counts only the ranks that sent
        events in a step)."""
        self._clock = PrefillClock(block_size)
        """The steps timed as prefill samples, for the worker side's estimates."""
        self._output: tuple[set[str], dict[str, Any] | None] = (set(), None)
        """What the latest ``update_connector_output`` brought for :meth:`step_stats`:
        the background loads received, the worker's stats."""
        self.generation = 0
        """Connector resets so far (:meth:`reset_cache`): the keys' reset generation."""

    def _books(self) -> Answers | RemoteBooks:
        """Where the scheduler side asks: the worker's state when it is in this
        process (one rank), else connections to every rank."""
        if self._remote is not None:
            return self._remote
        if self.ranks == 1:
            with REGISTRY_LOCK:
                shared = REGISTRY.get(self._slot)
            if shared is not None:
                return shared.answers
        self._remote = RemoteBooks(self.engine_id, self.asked, self.books_timeout_s)
        return self._remote

    def _keys(self, request: Request, n: int, generation: int | None = None) -> list[BlockKey]:
        """vLLM's block hashes as keys, under a reset generation (the current one
        unless given: a store's is its request's); each rank namespaces them too
        (``Shared.ns``)."""
        keys = [
            key_from_hash(bytes(h) if not isinstance(h, int) else h)
            for h in request.block_hashes[:n]
        ]
        return generation_keys(keys, self.generation if generation is None else generation)

    def _state(self, request: Request) -> ReqState:
        """The scheduler side's view of ``request``, made at its first mention."""
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = ReqState(request, generation=self.generation)
        return state

    def _event_blocks(self, request: Request, positions: Sequence[int]) -> EventBlocks | None:
        """What KV events need of ``request``'s blocks at ``positions``, sent along
        with their store or load; ``None`` when events are off."""
        if not self._events_enabled:
            return None
        state = self._reqs.get(request.request_id)
        generation = self.generation if state is None else state.generation
        return EventBlocks.of(request, positions, self.block_size, generation)

    def on_new_request(self, request: Request) -> None:
        """vLLM queued ``request``: start prefetching its prefix from the lower tiers
        now, so that by the time the scheduler reaches it (a backlog) its blocks are in
        the cpu tier. Its lookup later waits for the same prefetches or finds them
        landed; a request that ends first releases them (``request_finished``)."""
        if self.inert or not self.prefetch_on_arrival or not self.loads:
            return
        loadable = min(
            (request.num_prompt_tokens - 1) // self.block_size, len(request.block_hashes)
        )
        if loadable <= 0:
            return
        state = self._state(request)
        self._books().prefetch(request.request_id, self._keys(request, loadable))
        state.claimed = True

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        # Never the last prompt token: vLLM must compute at least one.
        if self.inert or request.request_id in self._failed_loads or not self.loads:
            # A request whose asynchronous load failed is computed, not loaded again; a
            # producer loads nothing.
            return 0, False
        loadable = (request.num_prompt_tokens - 1) // self.block_size
        loadable = min(loadable, len(request.block_hashes))
        start = num_computed_tokens // self.block_size
        state = self._state(request)
        state.local_tokens = num_computed_tokens
        if state.generation != self.generation:
            # Looked up again after a connector reset (preempted, or still waiting):
            # its KV is computed anew, under the new generation, and stored again.
            state.generation = self.generation
            state.stored_blocks = 0
            state.stored_windows.clear()
        if loadable <= start:
            return 0, False
        if state.first_lookup is None:
            state.first_lookup = time.monotonic()
        self.hitpath.looked(request.request_id)
        # The worker claims the verified prefix (pinned for this request), after
        # prefetching what only a disk tier holds; ``None`` until that is done.
        hit = self._books().lookup(request.request_id, self._keys(request, loadable))
        state.claimed = True
        if hit is None:
            return None, False
        if self.role == CONSUMER and hit < loadable:
            # A producer may still be storing the rest: ask again next step (the next
            # lookup replaces this one's claim), until it is all there or the wait is
            # over; then take what is there and compute the rest.
            if time.monotonic() - state.first_lookup < self.producer_wait_s:
                return None, False
            self.waited_out += 1
            if self.waited_out == 1:
                logger.info(
                    "kvoffload: kv_consumer: request %s found %d of its %d blocks after "
                    "waiting %.0f ms (producer_wait_ms) for a producer; computing the rest",
                    request.request_id,
                    hit,
                    loadable,
                    self.producer_wait_s * 1e3,
                )
        if hit <= start:
            self.hitpath.forget(request.request_id)
            return 0, False
        background = self._whole_loads or self.hitpath.background((hit - start) * self.block_bytes)
        self.hitpath.answered(request.request_id, background)
        state.background = background
        return hit * self.block_size - num_computed_tokens, background

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._state(request)
        if num_external_tokens <= 0:
            if state.claimed:  # nothing to load: the claim's pins go
                self._books().release(request.request_id)
                state.claimed = False
            return
        start = state.local_tokens // self.block_size
        n = num_external_tokens // self.block_size
        # ``blocks`` covers the local hit and the new blocks, from block 0, per group.
        targets = [list(ids[start : start + n]) for ids in blocks.get_block_ids()]
        plan_id = self._next_plan
        self._next_plan += 1
        # The claim pinned blocks [0, hit); the engine loads [start, start + n).
        books = self._books()
        books.plan(plan_id, request.request_id, start, n)
        state.claimed = False
        # Taken now, not when vLLM asks for hit sources (only with stats on, and never
        # for a resumed request): the worker's note would otherwise outlive the request.
        state.resident = books.sources(request.request_id)
        resumed = request.request_id in self._preempted
        self._pending_loads.append(
            Load(
                request.request_id,
                plan_id,
                targets,
                resumed,
                self._event_blocks(request, range(start, start + n)),
                state.background,
            )
        )
        # A background load's blocks are held by vLLM itself until the worker reports
        # the load received (finished_recving), even if the request ends meanwhile:
        # nothing to hold here (a finished_sending for it as well would be one too many).
        self._planner.loaded(state, start + n)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredOffloadMetadata:
        meta = TieredOffloadMetadata(
            loads=self._pending_loads,
            stores=self._pending_stores,
            prefill=self._clock.scheduled(
                int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0)
            ),
        )
        self.hitpath.step_sent(
            (load.req_id for load in meta.loads), scheduler_output.num_scheduled_tokens
        )
        self._pending_loads = []
        self._pending_stores = []
        meta.preempted = set(scheduler_output.preempted_req_ids or ())
        self._preempted.update(meta.preempted)
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            new_ids = cached.new_block_ids[i]
            if state is not None and new_ids is not None:
                state.add_blocks(new_ids, resumed=req_id in cached.resumed_req_ids)
        # vLLM's current tables (sliding-window blocks freed and reused included):
        # those are what a store must read.
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        for req_id, n_tokens in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None or self.inert or not self.stores:
                continue
            if block_state is not None and len(self.groups) > 1:
                # (A dense model's table only grows: the appended ids are exact, and
                # resolving copies the whole table every step.)
                current = block_state.get_block_ids(req_id)
                if current is not None:
                    state.block_ids = [list(ids) for ids in current]
            done_tokens = state.request.num_computed_tokens + n_tokens
            meta.stores.extend(self._planner.step_stores(state, done_tokens))
        if block_state is not None and self.stores:
            for req_id, handoffs in block_state.boundary_state_offloads.items():
                state = self._reqs.get(req_id)
                if state is not None:
                    meta.stores.extend(self._planner.state_stores(state, handoffs))
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int] | tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """The request is done; with HMA ``block_ids`` are its blocks per group. Its
        sliding windows at its final boundary (a later turn of the conversation hits
        there) are stored in the next step's metadata, from the blocks held meanwhile."""
        state = self._reqs.pop(request.request_id, None)
        self.hitpath.forget(request.request_id)
        self._preempted.discard(request.request_id)
        self._failed_loads.discard(request.request_id)
        if state is not None and state.claimed:  # ended before its load: aborted
            self._books().release(request.request_id)
        windows = state is not None and self._planner.sliding and self.stores
        if state is not None and windows and isinstance(block_ids, tuple):
            state.block_ids = [list(ids) for ids in block_ids]
            boundary = min(
                request.num_computed_tokens // self.block_size,
                len(request.block_hashes),
                state.stored_blocks,
            )
            self._pending_stores.extend(self._planner.window_stores(state, boundary))
        # Hold the blocks while stores from them may still be running; the worker
        # reports the id once they are done.
        return (state is not None and state.had_store), None

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """vLLM's per-source split of a hit: tokens whose blocks the cpu tier held at
        the request's first mention (its prefetch on arrival, else its first lookup)
        are ``host``, the rest were prefetched from a lower tier (:attr:`lower_source`)."""
        if num_external_tokens <= 0:
            return {}
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        state = self._reqs.get(request.request_id)
        host = 0 if state is None else state.host_tokens(num_external_tokens, self.block_size)
        lower = CacheHitSource(self.lower_source)
        split = {CacheHitSource.HOST: host, lower: num_external_tokens - host}
        return {source: n for source, n in split.items() if n}

    def reset_cache(self) -> bool:
        """vLLM resets its external caches (``reset_prefix_cache(reset_connector=
        True)``: ``/reset_prefix_cache?reset_external=true``, and the cache clearing
        around a weight update, ``pause_generation(clear_cache=True)``). The weights
        may have changed under the same model id, so no block stored before this is
        ever loaded again by this engine, from any tier: the reset generation in the
        keys goes up (:func:`generation_keys`; a request computed before it stores
        under its own, where nothing looks). The cpu tier's unpinned blocks, unreachable
        now, are dropped to free its memory; the lower tiers' age out."""
        self.generation += 1
        logger.info(
            "kvoffload: connector reset: generation %d; blocks stored before it are "
            "never loaded again by this engine",
            self.generation,
        )
        self._books().reset()
        return True

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Collect the KV events the worker side sent with its step output, and the
        requests whose asynchronous load failed (vLLM computes them instead: they are
        not looked up again).

        Nothing else to do here: in this design the worker side's Offloader completes
        loads and stores itself (``start_load_kv`` waits for the step's loads,
        ``get_finished`` collects finished stores and reports the requests whose
        blocks may be freed: ``finished_sending``), and the scheduler side forgot
        those requests in ``request_finished`` already."""
        stats = getattr(connector_output, "kv_connector_stats", None)
        self._output = (
            set(getattr(connector_output, "finished_recving", None) or ()),
            getattr(stats, "data", None),
        )
        # ``getattr``: a field vLLM may move (an open upstream change carries worker
        # events elsewhere); then no events arrive, and nothing breaks.
        self._failed_loads.update(getattr(connector_output, "failed_recving", None) or ())
        events = getattr(connector_output, "kv_cache_events", None)
        if self._events_enabled:
            self._events.extend(self._tally.add(events))

    def step_stats(self) -> dict[str, float]:
        """A step's output is in: vLLM asks for the scheduler side's stats once per
        step output (``update_from_output``), whereas ``update_connector_output`` is
        skipped for a step whose connector output is empty. So a step is timed here,
        with what ``update_connector_output`` brought, if it came; the hit-path
        counters since the previous call (:mod:`.hitpath`)."""
        received, stats = self._output
        self._output = (set(), None)
        self._clock.done()
        self.hitpath.step_done(received, stats)
        return self.hitpath.take()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The tiers' ``BlockStored`` / ``BlockRemoved`` events since the previous call
        (vLLM calls this right after ``update_connector_output``, every step); none
        when KV events are off."""
        events, self._events = self._events, []
        return events

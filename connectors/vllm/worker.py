"""The worker side: the tiers next to the KV tensors; loads, stores, finished requests.

vLLM builds the connector with ``role=WORKER`` in each worker process, and
:class:`TieredOffloadConnector` hands that role's calls to :class:`TieredOffloadWorker`.
It owns the :class:`~kvoffload.offloader.Offloader` (tiers, lanes, books), registered
with its books server in :mod:`.shared` at ``register_kv_caches``; each step it carries
out the scheduler side's :class:`~.metadata.TieredOffloadMetadata`: loads within the
step (``start_load_kv`` waits for them; with ``layerwise_loads`` it only submits them,
each attention layer waits for its own layer in ``wait_for_layer_load``, and
``wait_for_save`` collects them) or in the background (vLLM's asynchronous loads:
submitted there, collected in a later step's ``get_finished``), which :mod:`.loads`
tracks, stores in the background (``wait_for_save`` submits them), and reports the
requests whose stores or background loads are done (``get_finished``,
``get_transfer_results``), the blocks that failed to load, its stats and its KV
events. Kept apart from :mod:`.scheduler` because it runs in another process in
vLLM's default mode.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig
from kvoffload.datapath import StoreGate
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

from .admin import AdminServer, AdminSpec
from .affinity import rank_affinity
from .config import hybrid_layout
from .costs import Costs
from .events import MAX_EVENT_HASHES, EventBook, TieredOffloadKVEvents
from .groups import Group, describe, pool_from_vllm
from .loads import Loads
from .metadata import TieredOffloadMetadata
from .metrics import TieredOffloadStats, snapshot
from .remote import BooksServer
from .shared import REGISTRY, REGISTRY_LOCK, Shared

logger = logging.getLogger(__name__)


class TieredOffloadWorker:
    """The worker side of one engine's rank (see the module docstring)."""

    def __init__(
        self,
        *,
        config: KVOffloadConfig,
        layout: KVLayout,
        engine_id: str,
        rank: int,
        ranks: int,
        slot: str,
        block_size: int,
        events: bool,
        layerwise: bool = False,
        groups: list[Group] | None = None,
        replicated: bool = False,
        load_or_recompute: bool = True,
        admin: AdminSpec | None = None,
    ) -> None:
        self.config = config
        self.admin = admin
        """The operator endpoint's settings (``None``: off); served once the tiers are."""
        self._admin: AdminServer | None = None
        self.load_or_recompute = load_or_recompute
        """Measure prefill and tier reads, and load only what beats recomputing."""
        self.groups = groups or [Group(0, "full", None, b"", ())]
        self.replicated = replicated
        """The KV cache is the same on every rank (MLA under tensor parallelism):
        rank 0 alone keeps tiers and loads, and sends what it loaded to the others."""
        # Layer-wise loads wait per layer on each rank; a replicated cache arrives
        # from rank 0 whole, and several groups' loads are vLLM's asynchronous loads,
        # done before the request runs.
        self.layerwise = layerwise and not replicated and len(self.groups) == 1
        self.layout = layout
        self.engine_id = engine_id
        self.rank = rank
        self.ranks = ranks
        self.block_size = block_size
        self._slot = slot
        self._events_enabled = events
        self._store_jobs: dict[int, str] = {}
        # Per store job not yet known to be done reading the engine's blocks: its
        # request, its block count and its gate. A request's blocks are the engine's
        # again once none of its stores is left here (not once the stores finish).
        self._store_gates: dict[int, tuple[str, int, StoreGate]] = {}
        self._stores_left: dict[str, int] = {}
        self._store_timeout = config.store_timeout_ms / 1e3
        self._finished_waiting: set[str] = set()
        self._ever_stored: set[str] = set()
        self._reported: dict[str, int | float] = {}
        # Fenced stores' gates: their blocks may be reused once this step is over, so
        # the next step waits for them to be read before it touches the KV cache.
        self._fences: list[StoreGate] = []
        self.loads = Loads(
            block_size=block_size,
            layerwise=self.layerwise,
            replicated=replicated,
            timeout_s=config.load_timeout_ms / 1e3,
        )
        """The loads into the engine's KV cache (:mod:`.loads`)."""

    def _registered(self) -> Shared | None:
        """The worker side's state, ``None`` before ``register_kv_caches``. Read under
        the registry's lock: the scheduler side and shutdown change the registry from
        other threads."""
        with REGISTRY_LOCK:
            return REGISTRY.get(self._slot)

    def _shared(self) -> Shared:
        """The worker side's state (worker side only)."""
        shared = self._registered()
        if shared is None:
            raise RuntimeError("TieredOffloadConnector: no Offloader: register_kv_caches first")
        return shared

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = self.layout
        with rank_affinity(self.ranks):
            if len(self.groups) > 1:
                pool, layer_index = pool_from_vllm(kv_caches)
                layout = hybrid_layout(
                    self.layout, pool.num_layers, pool.layer_bytes[0], describe(self.groups)
                )
            else:
                pool = BlockPool(list(kv_caches.values()))
                # The pool's layers are the dict's values in order: an attention
                # layer's name (wait_for_layer_load) is its key.
                layer_index = {name: i for i, name in enumerate(kv_caches)}
            self.loads.attach(pool, layer_index)
            if self.replicated and self.rank > 0:
                logger.info(
                    "kvoffload: rank %d keeps no tiers: its KV cache is rank 0's, and "
                    "rank 0 sends what it loads",
                    self.rank,
                )
                return
            offloader = Offloader(self.config, layout, pool, events=self._events_enabled)
        held = sum(t.capacity_blocks for t in offloader.stats)
        book = EventBook(
            enabled=self._events_enabled, cap=min(held, MAX_EVENT_HASHES), groups=self.groups
        )
        costs = None
        if self.load_or_recompute:
            costs = Costs(block_tokens=self.block_size, block_bytes=pool.bytes_per_block)
        shared = Shared(
            offloader,
            book,
            layout.fingerprint,
            groups=self.groups,
            costs=costs,
            books_timeout_s=self.config.books_timeout_ms / 1e3,
        )
        shared.server = BooksServer(shared, self.engine_id, self.rank)
        with REGISTRY_LOCK:
            REGISTRY[self._slot] = shared
        if self.admin is not None:
            self._admin = AdminServer(shared, self.admin, self.rank)
        logger.info(
            "kvoffload: %d tier(s) (%s) for %d GPU blocks of %d bytes, %d KV cache group(s)",
            len(offloader.tiers),
            ", ".join(t.name for t in offloader.tiers),
            pool.num_blocks,
            pool.bytes_per_block,
            len(self.groups),
        )

    def _wait_fences(self) -> None:
        """Wait until the fenced stores of the previous step have read their blocks
        (up to ``store_timeout_ms`` for one not begun: abandoned then)."""
        fences, self._fences = self._fences, []
        for gate in fences:
            if not gate.released():
                gate.wait(max(0.0, gate.since + self._store_timeout - time.monotonic()))

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Load the step's planned blocks into the engine's, and wait for them; with
        layer-wise loads, submit them and return (see :meth:`wait_for_layer_load`)."""
        assert isinstance(meta, TieredOffloadMetadata)
        self._load_step(meta)

    def _measure(self, shared: Shared, meta: TieredOffloadMetadata) -> None:
        """Feed the scheduler's step sample and the tiers' reads to the estimates."""
        if shared.costs is None:
            return
        if meta.prefill is not None:
            shared.costs.prefill(*meta.prefill)
        shared.costs.reads([(t.bytes_read, t.read_seconds) for t in shared.offloader.stats])

    def _load_step(self, meta: TieredOffloadMetadata) -> None:
        self._wait_fences()
        if self.replicated and self.rank > 0:
            if meta.loads:
                self.loads.receive()
            return
        if self.loads.layer_loads:  # a step whose loads were never collected: finish them
            self.loads.finish_layer_loads(self._shared())
        if meta.loads:
            self.loads.submit(self._shared(), meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's layer-wise loads have layer ``layer_name`` in the KV
        cache (on CUDA: once the current stream waits for it). An unknown name waits
        for every layer. Nothing to wait for without layer-wise loads."""
        if self.loads.layer_loads:
            self.loads.wait_for_layer(self._shared(), layer_name)

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Submit the stores of the blocks that became full this step; returns at once
        (a fenced store's read is waited for at the next step's start)."""
        assert isinstance(meta, TieredOffloadMetadata)
        if self.replicated and self.rank > 0:
            # Rank 0 stores the cache every rank holds; this one only says when the
            # request's blocks are free (at once).
            self._ever_stored.update(store.req_id for store in meta.stores)
            return
        shared = self._shared()
        off = shared.offloader
        self._measure(shared, meta)
        self.loads.finish_layer_loads(shared)
        # One job per request: its groups' blocks are one pool's blocks under their
        # own keys, and a step's jobs count against the tier's pending-store bound.
        jobs: dict[str, tuple[list[Any], list[int], bool]] = {}
        for store in meta.stores:
            shared.bump("blocks_submitted_for_store", len(store.keys))
            self._ever_stored.add(store.req_id)
            keys = shared.ns(store.keys, store.group)
            if store.events is not None:
                shared.events.remember(keys, store.events, store.group)
            job_keys, job_ids, fenced = jobs.get(store.req_id, ([], [], False))
            jobs[store.req_id] = (
                job_keys + keys,
                job_ids + store.block_ids,
                fenced or store.fenced,
            )
        for req_id, (keys, block_ids, fenced) in jobs.items():
            gate = StoreGate()
            job = off.submit_store(keys, block_ids, gate=gate)
            if job is not None:
                self._store_jobs[job] = req_id
                self._store_gates[job] = (req_id, len(keys), gate)
                self._stores_left[req_id] = self._stores_left.get(req_id, 0) + 1
                if fenced:
                    self._fences.append(gate)

    def handle_preemptions(self, meta: KVConnectorMetadata | None = None) -> None:
        """vLLM calls this every step, before the forward pass. The blocks this step
        may overwrite while our stores still read them are the preempted requests'
        (freed by the scheduler; ``meta.preempted``) and the fenced stores' (a window
        leaving a sliding window, a Mamba state block): wait until those stores have
        read the engine's blocks (up to ``store_timeout_ms`` for one that has not
        begun; it is abandoned then), not until they are written. Every other store
        reads blocks vLLM keeps for its request (running, or held by
        ``request_finished`` until ``finished_sending``): not waited for, so a large
        prefill's stores do not hold up the next step of every request."""
        shared = self._registered()
        if shared is None:
            return
        self._wait_fences()
        self.loads.finish_layer_loads(shared)
        self._collect(shared, shared.offloader.get_finished())
        preempted = meta.preempted if isinstance(meta, TieredOffloadMetadata) else None
        self._free_store_blocks(shared, wait=False, wait_for=preempted or set())

    def _free_store_blocks(
        self, shared: Shared, *, wait: bool, wait_for: set[str] | frozenset[str] = frozenset()
    ) -> None:
        """Let go of the stores that are done reading the engine's blocks. With
        ``wait``, wait for all of them; else for those of the requests in ``wait_for``
        (preempted), and only abandon the others not begun by their deadline (a
        finished request's blocks are held meanwhile)."""
        now = time.monotonic()
        for job, (req_id, blocks, gate) in list(self._store_gates.items()):
            left = gate.since + self._store_timeout - now
            if gate.released():
                abandoned = False
            elif wait or left <= 0 or req_id in wait_for:
                abandoned = gate.wait(left)
            else:
                continue
            del self._store_gates[job]
            self._stores_left[req_id] -= 1
            if self._stores_left[req_id] == 0:
                del self._stores_left[req_id]
            if abandoned:
                shared.bump("store_timeouts", blocks)
                logger.warning(
                    "kvoffload: store of %d blocks for request %s not begun after %.1f s "
                    "(store_timeout_ms); abandoned, the engine has its blocks back",
                    blocks,
                    req_id,
                    self._store_timeout,
                )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        shared = self._registered()
        if shared is not None:
            # Before taking finished results: a layer-wise load's is waited for by id.
            self.loads.finish_layer_loads(shared)
            self._collect(shared, shared.offloader.get_finished())
            self._free_store_blocks(shared, wait=False)
        self._finished_waiting.update(r for r in finished_req_ids if r in self._ever_stored)
        done = {r for r in self._finished_waiting if self._stores_left.get(r, 0) == 0}
        self._finished_waiting -= done
        self._ever_stored -= done
        received = self.loads.take_received()
        return (done or None), (received or None)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """:meth:`get_finished`, and the asynchronous loads that failed (also among the
        finished receives, as vLLM wants them)."""
        sending, received = self.get_finished(finished_req_ids)
        return set(sending or ()), set(received or ()), self.loads.take_failed()

    def _collect(self, shared: Shared, results: list[Any]) -> None:
        """Book finished store jobs: the tokens they wrote (a finished job's gate is
        released: :meth:`_free_store_blocks` lets go of its request's blocks), and
        background loads."""
        self.loads.poll_background(shared, results)
        bpb = shared.offloader.bpb
        for result in results:
            req_id = self._store_jobs.pop(result.job_id, None)
            if req_id is not None and result.success:
                shared.bump("tokens_stored", result.nbytes // bpb * self.block_size)

    def get_kv_connector_stats(self) -> TieredOffloadStats | None:
        """Counts since the previous call (the connector asks only this half: see
        ``TieredOffloadConnector.get_kv_connector_stats``)."""
        shared = self._registered()
        if shared is None:
            return None
        now = snapshot(shared)
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        stats = TieredOffloadStats(data={k: v for k, v in delta.items() if v})
        return None if stats.is_empty() else stats

    def get_kv_connector_kv_cache_events(self) -> TieredOffloadKVEvents | None:
        """The tiers' KV events since the previous step (worker side; ``None`` when
        there are none, or events are off). Drains the tiers' records either way."""
        shared = self._registered()
        if shared is None:
            return None
        events, unknown = shared.events.take(shared.offloader)
        shared.bump("kv_events_dropped", unknown)
        return TieredOffloadKVEvents(events) if events else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        shared = self._registered()
        if shared is not None:
            self.loads.finish_layer_loads(shared)
        return self.loads.take_errors(shared)

    def close_admin(self) -> None:
        """Stop the operator endpoint (before the tiers close; idempotent)."""
        admin, self._admin = self._admin, None
        if admin is not None:
            admin.close()

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode, right before the KV cache's memory is released
        (``sleep``, or a discard of the ``kv_cache`` tag): return only once nothing of
        ours reads or writes the KV cache. vLLM's multi-process engine gets there
        first (its pause steps until every finished request's stores are reported
        done), so this normally finds nothing; whatever is still in flight is waited
        for here: the fenced stores, the layer-wise loads, the background loads (up to
        their deadline; abandoned then, their blocks load errors) and every store
        still reading the engine's blocks (up to ``store_timeout_ms`` for one not
        begun; abandoned then). Idempotent. The tiers keep their blocks, copies keyed
        by vLLM's block hashes; vLLM resets the connector before a sleep, so a prompt
        stored before it is stored anew after the wake (a new reset generation)."""
        shared = self._registered()
        if shared is None:
            return
        self._wait_fences()
        self.loads.finish_layer_loads(shared)
        self.loads.drain(shared)
        self._collect(shared, shared.offloader.get_finished())
        self._free_store_blocks(shared, wait=True)

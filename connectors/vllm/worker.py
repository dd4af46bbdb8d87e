"""The worker side: the tiers next to the KV tensors; loads, stores, finished requests.

vLLM builds the connector with ``role=WORKER`` in each worker process, and
:class:`TieredOffloadConnector` hands that role's calls to :class:`TieredOffloadWorker`.
It owns the :class:`~kvoffload.offloader.Offloader` (tiers, lanes, books), registered
with its books server in :mod:`.shared` at ``register_kv_caches``; each step it carries
out the scheduler side's :class:`~.scheduler.TieredOffloadMetadata`: loads within the
step (``start_load_kv`` waits for them; with ``layerwise_loads`` it only submits them,
each attention layer waits for its own layer in ``wait_for_layer_load``, and
``wait_for_save`` collects them), stores in the background (``wait_for_save`` submits
them), and reports the requests whose stores are done (``get_finished``), the
blocks that failed to load, its stats and its KV events. Kept apart from
:mod:`.scheduler` because it runs in another process in vLLM's default mode.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig
from kvoffload.datapath import LayerProgress, LoadGate, StoreGate
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

from .affinity import _rank_affinity
from .books import _BooksServer
from .events import MAX_EVENT_HASHES, TieredOffloadKVEvents, _EventBook
from .metrics import TieredOffloadStats, _snapshot
from .scheduler import TieredOffloadMetadata, _Load
from .shared import _REGISTRY, _REGISTRY_LOCK, _Shared

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
    ) -> None:
        self.config = config
        self.layerwise = layerwise
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
        self._load_errors: set[int] = set()
        self._ever_stored: set[str] = set()
        self._reported: dict[str, int | float] = {}
        self._layer_index: dict[str, int] = {}
        self._num_layers = 0
        self._device: torch.device | None = None
        # Layer-wise loads submitted by start_load_kv and not yet collected, by job id.
        self._layer_loads: dict[int, tuple[_Load, LayerProgress]] = {}
        # Every load job not yet collected: its gate (to abandon it when late), and the
        # step's deadline (time.monotonic) for its loads.
        self._gates: dict[int, LoadGate] = {}
        self._load_timeout = config.load_timeout_ms / 1e3
        self._deadline = 0.0

    def _registered(self) -> _Shared | None:
        """The worker side's state, ``None`` before ``register_kv_caches``. Read under
        the registry's lock: the scheduler side and shutdown change the registry from
        other threads."""
        with _REGISTRY_LOCK:
            return _REGISTRY.get(self._slot)

    def _shared(self) -> _Shared:
        """The worker side's state (worker side only)."""
        shared = self._registered()
        if shared is None:
            raise RuntimeError("TieredOffloadConnector: no Offloader: register_kv_caches first")
        return shared

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with _rank_affinity(self.ranks):
            pool = BlockPool(list(kv_caches.values()))
            offloader = Offloader(self.config, self.layout, pool, events=self._events_enabled)
        # The pool's layers are the dict's values in order: an attention layer's name
        # (wait_for_layer_load) is its key.
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self._num_layers = pool.num_layers
        self._device = pool.device
        held = sum(t.capacity_blocks for t in offloader.stats)
        book = _EventBook(enabled=self._events_enabled, cap=min(held, MAX_EVENT_HASHES))
        shared = _Shared(offloader, book, self.layout.fingerprint)
        shared.server = _BooksServer(shared, self.engine_id, self.rank)
        with _REGISTRY_LOCK:
            _REGISTRY[self._slot] = shared
        logger.info(
            "kvoffload: %d tier(s) (%s) for %d GPU blocks of %d bytes",
            len(offloader.tiers),
            ", ".join(t.name for t in offloader.tiers),
            pool.num_blocks,
            pool.bytes_per_block,
        )

    def start_load_kv(self, meta: KVConnectorMetadata) -> None:
        """Load the step's planned blocks into the engine's, and wait for them; with
        layer-wise loads, submit them and return (see :meth:`wait_for_layer_load`)."""
        assert isinstance(meta, TieredOffloadMetadata)
        if self._layer_loads:  # a step whose loads were never collected: finish them
            self._finish_layer_loads(self._shared())
        if not meta.loads:
            return
        shared = self._shared()
        off = shared.offloader
        jobs: dict[int, _Load] = {}
        self._deadline = time.monotonic() + self._load_timeout
        for load in meta.loads:
            with shared.lock:
                plan = shared.plans.pop(load.plan_id)
            if load.hashes:  # promotions into the first tier are stores too
                shared.events.remember(plan.keys, load.hashes[: plan.hits])
            layers = LayerProgress(self._num_layers) if self.layerwise else None
            gate = LoadGate()
            job = off.submit_load(plan, load.block_ids[: plan.hits], layers=layers, gate=gate)
            if job is None:
                self._load_errors.update(load.block_ids)
                continue
            # Claimed blocks are pinned, so a plan is never short; were it, the rest
            # would be load errors too.
            self._load_errors.update(load.block_ids[plan.hits :])
            jobs[job] = load
            self._gates[job] = gate
            if layers is not None:
                self._layer_loads[job] = (load, layers)
        if not self.layerwise:
            self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=False)

    def _wait_loads(self, shared: _Shared, jobs: dict[int, _Load]) -> list[Any]:
        """Wait for the step's load jobs until the step's deadline (``load_timeout_ms``
        after they were submitted); abandon those still reading by then: their blocks
        become load errors, recomputed by vLLM. A job whose copy into the KV cache has
        begun is waited for (a memory copy: bounded). Their results, if they come,
        are dropped by :meth:`_collect`."""
        off = shared.offloader
        results = off.wait(list(jobs), max(0.0, self._deadline - time.monotonic()))
        done = {r.job_id for r in results}
        for job, load in jobs.items():
            gate = self._gates.pop(job)
            if job in done:
                continue
            if gate.abandon():
                self._abandoned(shared, load)
            else:
                results.extend(off.wait([job]))
        return list(results)

    def _abandoned(self, shared: _Shared, load: _Load) -> None:
        self._load_errors.update(load.block_ids)
        shared.bump("load_timeouts", len(load.block_ids))
        logger.warning(
            "kvoffload: load of %d blocks for request %s not done after %.1f s "
            "(load_timeout_ms); recomputing them",
            len(load.block_ids),
            load.req_id,
            self._load_timeout,
        )

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once this step's layer-wise loads have layer ``layer_name`` in the KV
        cache (on CUDA: once the current stream waits for it). An unknown name waits
        for every layer. Nothing to wait for without layer-wise loads."""
        if not self._layer_loads:
            return
        layer = self._layer_index.get(layer_name, -1)
        stream = None
        if self._device is not None and self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device)
        t0 = time.perf_counter()
        shared = self._shared()
        for job, (load, progress) in list(self._layer_loads.items()):
            if progress.wait(layer, stream, max(0.0, self._deadline - time.monotonic())):
                continue
            if self._gates[job].abandon():  # late, and nothing copied: recompute it
                del self._layer_loads[job], self._gates[job]
                self._abandoned(shared, load)
            else:
                progress.wait(layer, stream)  # its copy has begun: bounded
        shared.bump("layer_wait_seconds", time.perf_counter() - t0)

    def _finish_layer_loads(self, shared: _Shared) -> None:
        """Wait for the step's layer-wise load jobs and book them: before their blocks'
        load errors are reported, and before anything else touches those blocks (a
        step whose forward pass waited for no layer, e.g. one without attention,
        still finishes them here)."""
        if not self._layer_loads:
            return
        jobs = {job: load for job, (load, _) in self._layer_loads.items()}
        self._layer_loads = {}
        self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=True)

    def _book_loads(
        self, shared: _Shared, results: list[Any], jobs: dict[int, _Load], *, layerwise: bool
    ) -> None:
        """Count finished load jobs; the blocks they did not load are load errors."""
        bpb = shared.offloader.bpb
        for result in results:
            load = jobs[result.job_id]
            loaded = result.nbytes // bpb if result.success else 0
            self._load_errors.update(load.block_ids[loaded:])
            # One transaction: a stats reader in another thread sees them in step.
            shared.bump_many(
                blocks_loaded=loaded,
                tokens_loaded=loaded * self.block_size,
                blocks_loaded_layerwise=loaded if layerwise else 0,
                blocks_loaded_after_preemption=loaded if load.resumed else 0,
            )

    def wait_for_save(self, meta: KVConnectorMetadata) -> None:
        """Submit the stores of the blocks that became full this step; returns at once."""
        assert isinstance(meta, TieredOffloadMetadata)
        shared = self._shared()
        off = shared.offloader
        self._finish_layer_loads(shared)
        for store in meta.stores:
            shared.bump("blocks_submitted_for_store", len(store.keys))
            self._ever_stored.add(store.req_id)
            keys = shared.ns(store.keys)
            if store.hashes:
                shared.events.remember(keys, store.hashes)
            gate = StoreGate()
            job = off.submit_store(keys, store.block_ids, gate=gate)
            if job is not None:
                self._store_jobs[job] = store.req_id
                self._store_gates[job] = (store.req_id, len(keys), gate)
                self._stores_left[store.req_id] = self._stores_left.get(store.req_id, 0) + 1

    def handle_preemptions(self) -> None:
        """A preempted request's blocks are about to be reused: wait until the stores
        in flight have read the engine's blocks (up to ``store_timeout_ms`` for one
        that has not begun; it is abandoned then), not until they are written."""
        shared = self._registered()
        if shared is None:
            return
        self._finish_layer_loads(shared)
        self._collect(shared, shared.offloader.get_finished())
        self._free_store_blocks(shared, wait=True)

    def _free_store_blocks(self, shared: _Shared, *, wait: bool) -> None:
        """Let go of the stores that are done reading the engine's blocks. With
        ``wait``, wait for all of them (a preemption); without, only abandon those not
        begun by their deadline (a finished request's blocks are held meanwhile)."""
        now = time.monotonic()
        for job, (req_id, blocks, gate) in list(self._store_gates.items()):
            left = gate.since + self._store_timeout - now
            if gate.released():
                abandoned = False
            elif wait or left <= 0:
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
            self._finish_layer_loads(shared)
            self._collect(shared, shared.offloader.get_finished())
            self._free_store_blocks(shared, wait=False)
        self._finished_waiting.update(r for r in finished_req_ids if r in self._ever_stored)
        done = {r for r in self._finished_waiting if self._stores_left.get(r, 0) == 0}
        self._finished_waiting -= done
        self._ever_stored -= done
        return (done or None), None

    def _collect(self, shared: _Shared, results: list[Any]) -> None:
        """Book finished store jobs: the tokens they wrote. (A finished job's gate is
        released: :meth:`_free_store_blocks` lets go of its request's blocks.)"""
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
        now = _snapshot(shared)
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
            self._finish_layer_loads(shared)
        errors, self._load_errors = self._load_errors, set()
        if shared is not None:
            shared.bump("load_errors", len(errors))
        return errors

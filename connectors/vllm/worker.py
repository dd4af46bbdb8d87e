"""The worker side: the tiers next to the KV tensors; loads, stores, finished requests.

vLLM builds the connector with ``role=WORKER`` in each worker process, and
:class:`TieredOffloadConnector` hands that role's calls to :class:`TieredOffloadWorker`.
It owns the :class:`~kvoffload.offloader.Offloader` (tiers, lanes, books), registered
with its books server in :mod:`.shared` at ``register_kv_caches``; each step it carries
out the scheduler side's :class:`~.scheduler.TieredOffloadMetadata`: loads within the
step (``start_load_kv`` waits for them; with ``layerwise_loads`` it only submits them,
each attention layer waits for its own layer in ``wait_for_layer_load``, and
``wait_for_save`` collects them) or in the background (vLLM's asynchronous loads:
submitted there, collected in a later step's ``get_finished``), stores in the
background (``wait_for_save`` submits them), and reports the requests whose stores or
background loads are done (``get_finished``, ``get_transfer_results``), the blocks
that failed to load, its stats and its KV events. Kept apart from
:mod:`.scheduler` because it runs in another process in vLLM's default mode.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig
from kvoffload.datapath import LayerProgress, LoadGate, StoreGate
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader

from .admin import AdminServer, AdminSpec
from .affinity import _rank_affinity
from .books import _BooksServer
from .config import hybrid_layout
from .costs import Costs
from .events import MAX_EVENT_HASHES, TieredOffloadKVEvents, _EventBook
from .groups import Group, describe, pool_from_vllm
from .metrics import TieredOffloadStats, _snapshot
from .scheduler import TieredOffloadMetadata, _Load
from .shared import _REGISTRY, _REGISTRY_LOCK, _GroupPlan, _Shared

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Job:
    """One load job: a group's part of a planned load, into ``targets``."""

    load: _Load
    targets: list[int]


@dataclass
class _Background:
    """A load in the background (vLLM's asynchronous load): its jobs not done yet."""

    load: _Load
    jobs: set[int]
    deadline: float
    """``time.monotonic()`` past which its jobs still reading are abandoned."""


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
        self._load_errors: set[int] = set()
        self._ever_stored: set[str] = set()
        self._reported: dict[str, int | float] = {}
        self._layer_index: dict[str, int] = {}
        self._num_layers = 0
        self._device: torch.device | None = None
        self._pool: BlockPool | None = None
        # Fenced stores' gates: their blocks may be reused once this step is over, so
        # the next step waits for them to be read before it touches the KV cache.
        self._fences: list[StoreGate] = []
        # Layer-wise loads submitted by start_load_kv and not yet collected, by job id.
        self._layer_loads: dict[int, tuple[_Job, LayerProgress]] = {}
        # Every load job not yet collected: its gate (to abandon it when late), and the
        # step's deadline (time.monotonic) for its loads.
        self._gates: dict[int, LoadGate] = {}
        self._jobs: dict[int, _Job] = {}
        self._loaded_now: list[int] = []
        # Background loads by job id; those done, and those failed whole, not yet
        # reported.
        self._background: dict[int, _Background] = {}
        self._recv_done: set[str] = set()
        self._recv_failed: set[str] = set()
        """Blocks loaded this step (replicated caches: what rank 0 sends)."""
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
        layout = self.layout
        with _rank_affinity(self.ranks):
            if len(self.groups) > 1:
                pool, self._layer_index = pool_from_vllm(kv_caches)
                layout = hybrid_layout(
                    self.layout, pool.num_layers, pool.layer_bytes[0], describe(self.groups)
                )
            else:
                pool = BlockPool(list(kv_caches.values()))
                # The pool's layers are the dict's values in order: an attention
                # layer's name (wait_for_layer_load) is its key.
                self._layer_index = {name: i for i, name in enumerate(kv_caches)}
            self._pool = pool
            self._num_layers = pool.num_layers
            self._device = pool.device
            if self.replicated and self.rank > 0:
                logger.info(
                    "kvoffload: rank %d keeps no tiers: its KV cache is rank 0's, and "
                    "rank 0 sends what it loads",
                    self.rank,
                )
                return
            offloader = Offloader(self.config, layout, pool, events=self._events_enabled)
        held = sum(t.capacity_blocks for t in offloader.stats)
        book = _EventBook(
            enabled=self._events_enabled, cap=min(held, MAX_EVENT_HASHES), groups=self.groups
        )
        costs = None
        if self.load_or_recompute:
            costs = Costs(block_tokens=self.block_size, block_bytes=pool.bytes_per_block)
        shared = _Shared(
            offloader,
            book,
            layout.fingerprint,
            groups=self.groups,
            costs=costs,
            books_timeout_s=self.config.books_timeout_ms / 1e3,
        )
        shared.server = _BooksServer(shared, self.engine_id, self.rank)
        with _REGISTRY_LOCK:
            _REGISTRY[self._slot] = shared
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

    def _measure(self, shared: _Shared, meta: TieredOffloadMetadata) -> None:
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
                self._receive_loads()
            return
        if self._layer_loads:  # a step whose loads were never collected: finish them
            self._finish_layer_loads(self._shared())
        if not meta.loads:
            return
        shared = self._shared()
        jobs: dict[int, _Job] = {}
        t0 = time.perf_counter()
        self._deadline = time.monotonic() + self._load_timeout
        for load in meta.loads:
            background = _Background(load, set(), self._deadline) if load.background else None
            if background is not None:
                # vLLM holds its blocks until we report it received (an abort waits).
                shared.bump("loads_in_background")
            with shared.lock:
                group_plans = shared.plans.pop(load.plan_id, None)
                if group_plans is None:  # its plan is late (the scheduler gave up on it)
                    shared.abandoned_plans.add(load.plan_id)
            for group_plan in group_plans or []:
                job_id = self._submit(shared, load, group_plan, layerwise=background is None)
                if job_id is None:
                    continue
                if background is None:
                    jobs[job_id] = self._jobs[job_id]
                else:
                    background.jobs.add(job_id)
                    self._background[job_id] = background
            if not group_plans:
                # Late, or planned with no claim held (``[]``): nothing was read for
                # these blocks, so each is a load error, never data (a background
                # load with no jobs fails whole below).
                self._load_errors.update(b for ids in load.block_ids for b in ids if b)
            if background is not None and not background.jobs:
                self._settle_background(shared, background)
        if jobs and not self.layerwise:
            self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=False)
            # What the step waited for its loads: the scheduler side's copy-rate sample.
            shared.bump("in_step_load_seconds", time.perf_counter() - t0)
        if self.replicated:
            self._send_loads()

    def _settle_background(self, shared: _Shared, background: _Background) -> None:
        """A background load is done: report its request received. It succeeds or
        fails whole: a failed receive, which vLLM recomputes from scratch or fails, by
        its policy (counted in ``load_errors`` here), and which the scheduler side never
        looks up again. Block-level errors would not do: vLLM takes none from a model
        with several KV cache groups (it raises), and with one it sends the request
        back to the lookup, which would find the same blocks and fail again."""
        load = background.load
        ids = {b for targets in load.block_ids for b in targets}
        failed = ids & self._load_errors
        if failed:
            self._load_errors -= ids
            self._recv_failed.add(load.req_id)
            shared.bump("load_errors", len(failed))
        self._recv_done.add(load.req_id)

    def _poll_background(self, shared: _Shared, results: list[Any]) -> None:
        """Book the background loads among ``results``, and abandon those still
        reading past their deadline (their blocks become load errors; one whose copy
        into the KV cache has begun is waited for: a memory copy)."""
        now = time.monotonic()
        done = {r.job_id for r in results}
        late = [j for j, b in self._background.items() if b.deadline <= now and j not in done]
        for job_id in late:
            if self._gates[job_id].abandon():
                self._gates.pop(job_id)
                self._abandoned(shared, self._jobs.pop(job_id))
                self._background_done(shared, job_id)
            else:
                results.extend(shared.offloader.wait([job_id]))
        for result in results:
            if result.job_id in self._background:
                self._gates.pop(result.job_id, None)
                job = {result.job_id: self._jobs[result.job_id]}
                self._book_loads(shared, [result], job, layerwise=False, in_step=False)
                self._background_done(shared, result.job_id)

    def _background_done(self, shared: _Shared, job_id: int) -> None:
        background = self._background.pop(job_id)
        background.jobs.discard(job_id)
        if not background.jobs:
            self._settle_background(shared, background)

    def _submit(
        self, shared: _Shared, load: _Load, group_plan: _GroupPlan, *, layerwise: bool
    ) -> int | None:
        """Submit one group's part of a load (layer by layer if ``layerwise`` and the
        worker's loads are); its job id, ``None`` if refused."""
        plan, offset = group_plan.plan, group_plan.first
        ids = load.block_ids[group_plan.group][offset:]
        targets = ids[: plan.hits]
        if load.events is not None:  # promotions into the first tier are stores too
            blocks = load.events.part(offset, offset + plan.hits)
            shared.events.remember(plan.keys, blocks, group_plan.group)
        layers = LayerProgress(self._num_layers) if self.layerwise and layerwise else None
        gate = LoadGate()
        job = shared.offloader.submit_load(plan, targets, layers=layers, gate=gate)
        if job is None:
            self._load_errors.update(ids)
            return None
        # Claimed blocks are pinned, so a plan is never short; were it, the rest
        # would be load errors too.
        self._load_errors.update(ids[plan.hits :])
        self._jobs[job] = _Job(load, targets)
        self._gates[job] = gate
        if layers is not None:
            self._layer_loads[job] = (self._jobs[job], layers)
        return job

    def _send_loads(self) -> None:
        """Rank 0 of a replicated cache: send the blocks this step loaded to the other
        ranks, which take them in :meth:`_receive_loads`: their count, their ids,
        their bytes (a step with loads on one rank has them on every rank: the
        metadata is the same)."""
        assert self._pool is not None
        from vllm.distributed.parallel_state import get_tp_group

        ids, self._loaded_now = self._loaded_now, []
        group = get_tp_group()
        device = self._pool.device
        group.broadcast(torch.tensor([len(ids)], dtype=torch.int64, device=device), 0)
        if ids:
            group.broadcast(torch.tensor(ids, dtype=torch.int64, device=device), 0)
            group.broadcast(self._pool.gather(ids).to(device), 0)

    def _receive_loads(self) -> None:
        """A rank > 0 of a replicated cache: take the blocks rank 0 loaded this step
        (rank 0 reports those it could not load: vLLM recomputes them everywhere)."""
        assert self._pool is not None
        from vllm.distributed.parallel_state import get_tp_group

        group = get_tp_group()
        device = self._pool.device
        count = torch.zeros(1, dtype=torch.int64, device=device)
        group.broadcast(count, 0)
        n = int(count.item())
        if n:
            ids = torch.empty(n, dtype=torch.int64, device=device)
            group.broadcast(ids, 0)
            data = torch.empty((n, self._pool.bytes_per_block), dtype=torch.uint8, device=device)
            group.broadcast(data, 0)
            self._pool.scatter(ids.tolist(), data)

    def _wait_loads(self, shared: _Shared, jobs: dict[int, _Job]) -> list[Any]:
        """Wait for the step's load jobs until the step's deadline (``load_timeout_ms``
        after they were submitted); abandon those still reading by then: their blocks
        become load errors, recomputed by vLLM. A job whose copy into the KV cache has
        begun is waited for (a memory copy: bounded). Their results, if they come,
        are dropped by :meth:`_collect`."""
        off = shared.offloader
        results = off.wait(list(jobs), max(0.0, self._deadline - time.monotonic()))
        done = {r.job_id for r in results}
        for job_id, job in jobs.items():
            gate = self._gates.pop(job_id)
            if job_id in done:
                continue
            if gate.abandon():
                self._abandoned(shared, job)
            else:
                results.extend(off.wait([job_id]))
        return list(results)

    def _abandoned(self, shared: _Shared, job: _Job) -> None:
        self._load_errors.update(job.targets)
        shared.bump("load_timeouts", len(job.targets))
        logger.warning(
            "kvoffload: load of %d blocks for request %s not done after %.1f s "
            "(load_timeout_ms); recomputing them",
            len(job.targets),
            job.load.req_id,
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
        for job_id, (job, progress) in list(self._layer_loads.items()):
            if progress.wait(layer, stream, max(0.0, self._deadline - time.monotonic())):
                continue
            if self._gates[job_id].abandon():  # late, and nothing copied: recompute it
                del self._layer_loads[job_id], self._gates[job_id]
                self._jobs.pop(job_id, None)
                self._abandoned(shared, job)
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
        jobs = {job_id: job for job_id, (job, _) in self._layer_loads.items()}
        self._layer_loads = {}
        self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=True)

    def _book_loads(
        self,
        shared: _Shared,
        results: list[Any],
        jobs: dict[int, _Job],
        *,
        layerwise: bool,
        in_step: bool = True,
    ) -> None:
        """Count finished load jobs; the blocks they did not load are load errors."""
        bpb = shared.offloader.bpb
        for job_id in jobs:
            self._jobs.pop(job_id, None)
        for result in results:
            job = jobs[result.job_id]
            loaded = result.nbytes // bpb if result.success else 0
            self._load_errors.update(job.targets[loaded:])
            if self.replicated:
                self._loaded_now.extend(job.targets[:loaded])
            # One transaction: a stats reader in another thread sees them in step.
            shared.bump_many(
                blocks_loaded=loaded,
                blocks_loaded_in_step=loaded if in_step else 0,
                tokens_loaded=loaded * self.block_size,
                blocks_loaded_layerwise=loaded if layerwise else 0,
                blocks_loaded_after_preemption=loaded if job.load.resumed else 0,
            )

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
        self._finish_layer_loads(shared)
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
        self._finish_layer_loads(shared)
        self._collect(shared, shared.offloader.get_finished())
        preempted = meta.preempted if isinstance(meta, TieredOffloadMetadata) else None
        self._free_store_blocks(shared, wait=False, wait_for=preempted or set())

    def _free_store_blocks(
        self, shared: _Shared, *, wait: bool, wait_for: set[str] | frozenset[str] = frozenset()
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
            self._finish_layer_loads(shared)
            self._collect(shared, shared.offloader.get_finished())
            self._free_store_blocks(shared, wait=False)
        self._finished_waiting.update(r for r in finished_req_ids if r in self._ever_stored)
        done = {r for r in self._finished_waiting if self._stores_left.get(r, 0) == 0}
        self._finished_waiting -= done
        self._ever_stored -= done
        received, self._recv_done = self._recv_done, set()
        return (done or None), (received or None)

    def get_transfer_results(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str], set[str], set[str]]:
        """:meth:`get_finished`, and the asynchronous loads that failed (also among the
        finished receives, as vLLM wants them)."""
        sending, received = self.get_finished(finished_req_ids)
        failed, self._recv_failed = self._recv_failed, set()
        return set(sending or ()), set(received or ()), failed

    def _collect(self, shared: _Shared, results: list[Any]) -> None:
        """Book finished store jobs: the tokens they wrote (a finished job's gate is
        released: :meth:`_free_store_blocks` lets go of its request's blocks), and
        background loads."""
        self._poll_background(shared, results)
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
        # A background load still running keeps its failed blocks: it fails whole when
        # it is done (a block-level error now would send vLLM back to the lookup, and
        # vLLM raises on one from a model with several KV cache groups).
        pending = {b for bg in self._background.values() for ids in bg.load.block_ids for b in ids}
        errors = self._load_errors - pending
        self._load_errors &= pending
        if shared is not None:
            shared.bump("load_errors", len(errors))
        return errors

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
        self._finish_layer_loads(shared)
        if self._background:
            until = max(b.deadline for b in self._background.values())
            left = max(0.0, until - time.monotonic())
            results = shared.offloader.wait(list(self._background), left)
            now = time.monotonic()
            for background in self._background.values():
                background.deadline = min(background.deadline, now)
            self._poll_background(shared, list(results))
        self._collect(shared, shared.offloader.get_finished())
        self._free_store_blocks(shared, wait=True)

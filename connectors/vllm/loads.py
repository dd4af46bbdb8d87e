"""The worker side's loads: in the step, layer by layer, or in the background.

Each step :class:`~.worker.TieredOffloadWorker` hands its planned loads
(:class:`~.metadata.Load`) to :class:`Loads`, which submits each KV cache group's part
(the plan the books turned the claim into, :class:`~.shared.GroupPlan`) to the
Offloader and tracks it until it is booked: a load in the step is waited for before the
forward pass (``start_load_kv``), a layer-wise one per attention layer
(``wait_for_layer_load``), and vLLM's asynchronous load in the background, reported
received or failed whole in a later step. None waits past its deadline
(``load_timeout_ms``): a load still reading by then is abandoned, its blocks load
errors that vLLM recomputes. Under MLA with tensor parallelism rank 0 loads the cache
every rank holds alike and sends it to the others. Kept apart from :mod:`.worker`
because it is the loads' own bookkeeping: their jobs, gates and deadlines.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.datapath import LayerProgress, LoadGate

from .metadata import Load
from .shared import GroupPlan, Shared

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One load job: a group's part of a planned load, into ``targets``."""

    load: Load
    targets: list[int]


@dataclass
class Background:
    """A load in the background (vLLM's asynchronous load): its jobs not done yet."""

    load: Load
    jobs: set[int]
    deadline: float
    """``time.monotonic()`` past which its jobs still reading are abandoned."""


class Loads:
    """One rank's loads into the engine's KV cache (see the module docstring)."""

    def __init__(
        self, *, block_size: int, layerwise: bool, replicated: bool, timeout_s: float
    ) -> None:
        self.block_size = block_size
        self.layerwise = layerwise
        """Loads in the step are copied in layer by layer, each attention layer waiting
        for its own (``layerwise_loads``)."""
        self.replicated = replicated
        """Rank 0 loads a cache every rank holds alike, and sends it to the others."""
        self.timeout_s = timeout_s
        """``load_timeout_ms``: a step's loads not done by then are abandoned."""
        self._pool: BlockPool | None = None
        self._layer_index: dict[str, int] = {}
        self._num_layers = 0
        self._device: torch.device | None = None
        self.errors: set[int] = set()
        """Engine blocks that failed to load, not yet reported."""
        # Layer-wise loads submitted by start_load_kv and not yet collected, by job id.
        self.layer_loads: dict[int, tuple[Job, LayerProgress]] = {}
        # Every load job not yet collected: its gate (to abandon it when late), and the
        # step's deadline (time.monotonic) for its loads.
        self._gates: dict[int, LoadGate] = {}
        self._jobs: dict[int, Job] = {}
        self._loaded_now: list[int] = []
        """Blocks loaded this step (replicated caches: what rank 0 sends)."""
        # Background loads by job id; those done, and those failed whole, not yet
        # reported.
        self.background: dict[int, Background] = {}
        self.received: set[str] = set()
        self.failed: set[str] = set()
        self._deadline = 0.0

    def attach(self, pool: BlockPool, layer_index: dict[str, int]) -> None:
        """The engine's KV cache (``register_kv_caches``), and its layers by name."""
        self._pool = pool
        self._layer_index = layer_index
        self._num_layers = pool.num_layers
        self._device = pool.device

    def submit(self, shared: Shared, loads: list[Load]) -> None:
        """Submit the step's planned loads: those in the step are waited for here
        (with layer-wise loads, only submitted: see :meth:`wait_for_layer`), those in
        the background collected later (:meth:`poll_background`)."""
        jobs: dict[int, Job] = {}
        t0 = time.perf_counter()
        self._deadline = time.monotonic() + self.timeout_s
        for load in loads:
            background = Background(load, set(), self._deadline) if load.background else None
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
                    self.background[job_id] = background
            if not group_plans:
                # Late, or planned with no claim held (``[]``): nothing was read for
                # these blocks, so each is a load error, never data (a background
                # load with no jobs fails whole below).
                self.errors.update(b for ids in load.block_ids for b in ids if b)
            if background is not None and not background.jobs:
                self._settle_background(shared, background)
        if jobs and not self.layerwise:
            self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=False)
            # What the step waited for its loads: the scheduler side's copy-rate sample.
            shared.bump("in_step_load_seconds", time.perf_counter() - t0)
        if self.replicated:
            self._send()

    def _settle_background(self, shared: Shared, background: Background) -> None:
        """A background load is done: report its request received. It succeeds or
        fails whole: a failed receive, which vLLM recomputes from scratch or fails, by
        its policy (counted in ``load_errors`` here), and which the scheduler side never
        looks up again. Block-level errors would not do: vLLM takes none from a model
        with several KV cache groups (it raises), and with one it sends the request
        back to the lookup, which would find the same blocks and fail again."""
        load = background.load
        ids = {b for targets in load.block_ids for b in targets}
        failed = ids & self.errors
        if failed:
            self.errors -= ids
            self.failed.add(load.req_id)
            shared.bump("load_errors", len(failed))
        self.received.add(load.req_id)

    def poll_background(self, shared: Shared, results: list[Any]) -> None:
        """Book the background loads among ``results``, and abandon those still
        reading past their deadline (their blocks become load errors; one whose copy
        into the KV cache has begun is waited for: a memory copy)."""
        now = time.monotonic()
        done = {r.job_id for r in results}
        late = [j for j, b in self.background.items() if b.deadline <= now and j not in done]
        for job_id in late:
            if self._gates[job_id].abandon():
                self._gates.pop(job_id)
                self._abandoned(shared, self._jobs.pop(job_id))
                self._background_done(shared, job_id)
            else:
                results.extend(shared.offloader.wait([job_id]))
        for result in results:
            if result.job_id in self.background:
                self._gates.pop(result.job_id, None)
                job = {result.job_id: self._jobs[result.job_id]}
                self._book_loads(shared, [result], job, layerwise=False, in_step=False)
                self._background_done(shared, result.job_id)

    def _background_done(self, shared: Shared, job_id: int) -> None:
        background = self.background.pop(job_id)
        background.jobs.discard(job_id)
        if not background.jobs:
            self._settle_background(shared, background)

    def _submit(
        self, shared: Shared, load: Load, group_plan: GroupPlan, *, layerwise: bool
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
            self.errors.update(ids)
            return None
        # Claimed blocks are pinned, so a plan is never short; were it, the rest
        # would be load errors too.
        self.errors.update(ids[plan.hits :])
        self._jobs[job] = Job(load, targets)
        self._gates[job] = gate
        if layers is not None:
            self.layer_loads[job] = (self._jobs[job], layers)
        return job

    def _send(self) -> None:
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

    def receive(self) -> None:
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

    def _wait_loads(self, shared: Shared, jobs: dict[int, Job]) -> list[Any]:
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

    def _abandoned(self, shared: Shared, job: Job) -> None:
        self.errors.update(job.targets)
        shared.bump("load_timeouts", len(job.targets))
        logger.warning(
            "kvoffload: load of %d blocks for request %s not done after %.1f s "
            "(load_timeout_ms); recomputing them",
            len(job.targets),
            job.load.req_id,
            self.timeout_s,
        )

    def wait_for_layer(self, shared: Shared, layer_name: str) -> None:
        """Return once this step's layer-wise loads have layer ``layer_name`` in the KV
        cache (on CUDA: once the current stream waits for it). An unknown name waits
        for every layer. Nothing to wait for without layer-wise loads."""
        if not self.layer_loads:
            return
        layer = self._layer_index.get(layer_name, -1)
        stream = None
        if self._device is not None and self._device.type == "cuda":
            stream = torch.cuda.current_stream(self._device)
        t0 = time.perf_counter()
        for job_id, (job, progress) in list(self.layer_loads.items()):
            if progress.wait(layer, stream, max(0.0, self._deadline - time.monotonic())):
                continue
            if self._gates[job_id].abandon():  # late, and nothing copied: recompute it
                del self.layer_loads[job_id], self._gates[job_id]
                self._jobs.pop(job_id, None)
                self._abandoned(shared, job)
            else:
                progress.wait(layer, stream)  # its copy has begun: bounded
        shared.bump("layer_wait_seconds", time.perf_counter() - t0)

    def finish_layer_loads(self, shared: Shared) -> None:
        """Wait for the step's layer-wise load jobs and book them: before their blocks'
        load errors are reported, and before anything else touches those blocks (a
        step whose forward pass waited for no layer, e.g. one without attention,
        still finishes them here)."""
        if not self.layer_loads:
            return
        jobs = {job_id: job for job_id, (job, _) in self.layer_loads.items()}
        self.layer_loads = {}
        self._book_loads(shared, self._wait_loads(shared, jobs), jobs, layerwise=True)

    def _book_loads(
        self,
        shared: Shared,
        results: list[Any],
        jobs: dict[int, Job],
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
            self.errors.update(job.targets[loaded:])
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

    def take_errors(self, shared: Shared | None) -> set[int]:
        """The blocks that failed to load, reported once each (to vLLM, for
        recompute)."""
        # A background load still running keeps its failed blocks: it fails whole when
        # it is done (a block-level error now would send vLLM back to the lookup, and
        # vLLM raises on one from a model with several KV cache groups).
        pending = {b for bg in self.background.values() for ids in bg.load.block_ids for b in ids}
        errors = self.errors - pending
        self.errors &= pending
        if shared is not None:
            shared.bump("load_errors", len(errors))
        return errors

    def drain(self, shared: Shared) -> None:
        """Wait for the background loads (up to their deadline; abandoned then, their
        blocks load errors) and book them."""
        if not self.background:
            return
        until = max(b.deadline for b in self.background.values())
        left = max(0.0, until - time.monotonic())
        results = shared.offloader.wait(list(self.background), left)
        now = time.monotonic()
        for background in self.background.values():
            background.deadline = min(background.deadline, now)
        self.poll_background(shared, list(results))

    def take_received(self) -> set[str]:
        """The requests whose background load is done (failed or not) since the last
        call."""
        received, self.received = self.received, set()
        return received

    def take_failed(self) -> set[str]:
        """The requests whose background load failed whole since the last call."""
        failed, self.failed = self.failed, set()
        return failed

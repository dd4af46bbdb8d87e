"""The stress runner: a seeded offload workload whose every loaded block is checked.

A simulated engine over the real :class:`~kvoffload.offloader.Offloader`: a
:class:`~kvoffload.blockpool.BlockPool` stands in for the GPU block pool, requests
come from a :mod:`~kvoffload.tools.workloads` stream (Zipf shared prefixes, multi-turn chat,
a no-reuse scan, or a replayed trace), and up to ``concurrency`` requests are in flight
at once. Each request takes pool blocks, then

1. plans and submits the load of the longest prefix any tier holds;
2. when the load finishes, verifies every loaded block bit for bit against what the
   generator says it must be, and "prefills" the rest with deterministic data;
3. submits the store of all its blocks (the Offloader skips those already held and
   cascades them down the tiers), and gives its pool blocks back when that finishes.

The caller's side of every submit is timed: that is the engine step's cost. A single
differing byte in a loaded block is an integrity error and fails the run.

A runner made with ``replica`` and ``replicas`` runs only its share of the stream
(:class:`~kvoffload.tools.workloads.ReplicaShare`): what
:func:`~kvoffload.tools.stress_replicas.run_replicas` (``--replicas N``) starts in each
of its processes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, layout_from_config
from kvoffload.exceptions import BlockStateError, ConfigError
from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.offloader import LoadPlan, Offloader
from kvoffload.tools.stress_data import DATA_SEED, BlockDataGenerator, workload_from_config
from kvoffload.tools.stress_report import (
    RESOURCE_EVERY_S,
    Reservoir,
    StressReport,
    TierReport,
    percentile_ms,
    process_resources,
)
from kvoffload.tools.workloads import ReplicaShare
from kvoffload.transfer import JobResult

logger = logging.getLogger(__name__)

SAMPLE_EVERY_S: Final = 0.25
"""Interval of the timeline samples (``--json`` ``timeline``, ``--plot``)."""


def _held(manager: OffloadingManager) -> int | None:
    """Blocks a tier's books hold (read once the run is drained: nothing changes them
    then); ``None`` for a shared server's tier, whose server keeps the count."""
    return len(manager) if isinstance(manager, LRUOffloadingManager) else None


ProgressFn = Callable[[int, float], None]


@dataclass(slots=True)
class _Request:
    keys: list[BlockKey]
    ids: list[int]
    """Pool blocks it holds until its store finishes."""
    start: float
    plan: LoadPlan | None = None


class StressRunner:
    """Runs the workload through an :class:`Offloader`; see the module docstring."""

    def __init__(
        self,
        config: KVOffloadConfig,
        *,
        seed: int | None = None,
        replica: int = 0,
        replicas: int = 1,
    ) -> None:
        """``replica`` of ``replicas``: run only that replica's :class:`ReplicaShare`
        of the stream (``kvoffload stress --replicas``); one replica runs all of it."""
        self.config = config
        self.cfg = config.stress
        self.seed = self.cfg.seed if seed is None else seed
        self.layout = layout_from_config(config)
        self.workload = workload_from_config(self.cfg, self.seed)
        if replicas > 1:
            self.workload = ReplicaShare(
                self.workload, replica=replica, replicas=replicas, seed=self.seed
            )
        n = self.workload.max_blocks
        if n > self.cfg.pool_blocks:
            raise ConfigError(
                f"stress.pool_blocks = {self.cfg.pool_blocks} cannot hold the workload's "
                f"longest request of {n} blocks; set stress.pool_blocks >= {n}"
            )
        self.pool = BlockPool.allocate(self.layout, self.cfg.pool_blocks)
        self.gen = BlockDataGenerator(
            self.layout.bytes_per_block, DATA_SEED, kind=self.cfg.data, dtype=self.layout.dtype
        )
        self.offloader = Offloader(config, self.layout, self.pool)
        self.tiers = self.offloader.tiers
        self.staging = self.pool.new_staging(n)
        self.check_buf = self.pool.new_staging(n)
        self.scratch = torch.empty(self.layout.bytes_per_block, dtype=torch.uint8)
        self.report = StressReport(
            seed=self.seed,
            workload=self.cfg.workload,
            concurrency=self.cfg.concurrency,
            layout=self.layout.to_dict(),
            bytes_per_block=self.layout.bytes_per_block,
        )
        self._free = deque(range(self.cfg.pool_blocks))
        self._jobs: dict[int, tuple[str, _Request]] = {}
        self._submit_s = Reservoir(seed=self.seed)
        self._request_s = Reservoir(seed=self.seed + 1)

    def close(self) -> None:
        self.offloader.close()

    def run(
        self, *, ops: int, duration_s: float, progress: ProgressFn | None = None
    ) -> StressReport:
        start = time.perf_counter()
        deadline = start + duration_s
        rep, off = self.report, self.offloader
        admitted, done, active = 0, 0, 0
        waiting: list[BlockKey] | None = None
        next_sample = start
        while True:
            now = time.perf_counter()
            if now >= next_sample:
                self._sample(now - start)
                next_sample = now + SAMPLE_EVERY_S
            # Admit requests while the pool and the concurrency bound allow.
            while (
                active < self.cfg.concurrency
                and admitted < ops
                and now < deadline
                and (waiting is not None or not self.workload.exhausted)
            ):
                if waiting is None:
                    waiting = self.workload.next()
                if len(self._free) < len(waiting):
                    break  # the pool is full: wait for a store to give blocks back
                ids = [self._free.popleft() for _ in waiting]
                finished = self._begin(_Request(waiting, ids, time.perf_counter()))
                waiting = None
                admitted += 1
                active += 1
                if finished:  # its store was dropped at once
                    active -= 1
                    done += 1
            if active == 0:
                break
            results = off.get_finished()
            if not results:
                results = off.wait([min(self._jobs)], timeout=0.05)
            for result in results:
                if self._on_result(result):
                    active -= 1
                    done += 1
            if progress is not None:
                progress(done, time.perf_counter() - start)
        rep.ops = done
        off.drain()
        rep.duration_s = time.perf_counter() - start
        self._sample(rep.duration_s)
        if rep.resources[-1]["t"] < rep.duration_s:
            self._sample_resources(rep.duration_s)
        problems = off.check()
        if problems:
            raise BlockStateError(f"tiers inconsistent after stress: {problems}")
        rep.tiers = [
            TierReport.from_stats(s, rep.duration_s, tier.backend, _held(tier.manager))
            for s, tier in zip(off.stats, off.tiers, strict=True)
        ]
        rep.submit_p50_ms = percentile_ms(self._submit_s.values, 50)
        rep.submit_p99_ms = percentile_ms(self._submit_s.values, 99)
        submit_max = self._submit_s.max
        rep.submit_max_ms = None if submit_max is None else submit_max * 1e3
        rep.request_p50_ms = percentile_ms(self._request_s.values, 50)
        rep.request_p99_ms = percentile_ms(self._request_s.values, 99)
        return rep

    # -- one request's steps -----------------------------------------------------------
    def _begin(self, req: _Request) -> bool:
        """Plan and submit the prefix load, or go straight to prefill on a miss;
        ``True`` if the request finished already (its store was dropped)."""
        self.report.blocks_requested += len(req.keys)
        t0 = time.perf_counter()
        plan = self.offloader.prepare_load(req.keys)
        job = self.offloader.submit_load(plan, req.ids[: plan.hits]) if plan.hits else None
        if not plan.hits:
            self.offloader.cancel_load(plan)
        self._submit_s.add(time.perf_counter() - t0)
        if job is None:
            return self._prefill_and_store(req, loaded=0)
        self._jobs[job] = ("load", req)
        return False

    def _on_result(self, result: JobResult) -> bool:
        """Advance the request ``result`` belongs to; ``True`` when it is finished."""
        kind, req = self._jobs.pop(result.job_id)
        if kind == "load":
            loaded = result.nbytes // self.layout.bytes_per_block if result.success else 0
            self._verify(req, loaded)
            return self._prefill_and_store(req, loaded)
        self._release(req)
        return True

    def _verify(self, req: _Request, loaded: int) -> None:
        """Compare every loaded block, read back through the public batched API."""
        self.report.blocks_loaded += loaded
        if not loaded:
            return
        check = self.pool.gather(req.ids[:loaded], self.check_buf[:loaded])
        for i in range(loaded):
            if not self.gen.matches(req.keys[i], check[i], self.scratch):
                self.report.integrity_errors += 1
                logger.error("integrity error: block %s (position %d)", req.keys[i].hex(), i)

    def _prefill_and_store(self, req: _Request, loaded: int) -> bool:
        """ "Compute" what was not loaded into the pool, then submit the store."""
        n = len(req.keys)
        if loaded < n:
            staging = self.staging[: n - loaded]
            for i in range(loaded, n):
                self.gen.fill(req.keys[i], staging[i - loaded])
            self.pool.scatter(req.ids[loaded:], staging)
        t0 = time.perf_counter()
        job = self.offloader.submit_store(req.keys, req.ids)
        self._submit_s.add(time.perf_counter() - t0)
        if job is None:
            self.report.stores_dropped += 1
            self._release(req)
            return True
        self._jobs[job] = ("store", req)
        return False

    def _release(self, req: _Request) -> None:
        self._free.extend(req.ids)
        self._request_s.add(time.perf_counter() - req.start)
        self.report.blocks_stored = self.offloader.stats[0].blocks_stored

    def _sample_resources(self, t: float) -> None:
        rep = self.report
        last = rep.resources[-1] if rep.resources else {"requested": 0, "loaded": 0}
        asked = rep.blocks_requested - last["requested"]
        rep.resources.append(
            {
                "t": round(t, 3),
                "requested": rep.blocks_requested,
                "loaded": rep.blocks_loaded,
                "hit_rate": (rep.blocks_loaded - last["loaded"]) / asked if asked else None,
                **process_resources(),
            }
        )

    def _sample(self, t: float) -> None:
        rep = self.report
        if not rep.resources or t - rep.resources[-1]["t"] >= RESOURCE_EVERY_S:
            self._sample_resources(t)
        # One snapshot under the books' lock: the lanes are changing these meanwhile.
        tiers, _ = self.offloader.counters()
        rep.timeline.append(
            {
                "t": round(t, 3),
                "requested": rep.blocks_requested,
                "loaded": rep.blocks_loaded,
                "tiers": [
                    {
                        "bytes_written": c["bytes_written"],
                        "bytes_read": c["bytes_read"],
                        "hits": c["hits"],
                    }
                    for c in tiers.values()
                ],
            }
        )

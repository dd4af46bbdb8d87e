"""``kvoffload stress``: a seeded offload workload whose every loaded block is checked.

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

:func:`run_replicas` (``--replicas N``) runs N such runners in processes of their own,
each over its share of one seeded stream (:class:`~kvoffload.tools.workloads.ReplicaShare`),
sharing the config's server-booked tiers: what one replica stored is a verified hit in
another, and :class:`ReplicaSetReport` puts their reports side by side.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from kvoffload.backend import Backend
from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, StressConfig, layout_from_config
from kvoffload.exceptions import BlockStateError, ConfigError, KVOffloadError
from kvoffload.hostcopy import pooled_bytes
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout, dtype_from_name
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.metrics import TierCounters, blocks_per_gib, tier_fields, tier_state
from kvoffload.offloader import LoadPlan, Offloader, TierStats
from kvoffload.tools.workloads import ReplicaShare, Workload, make_workload
from kvoffload.transfer import JobResult

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- data
DATA_SEED = 0x6B766F
"""Seed of the block contents. Fixed, not the workload's ``--seed``: a block's bytes
are a function of its key alone, so a persistent tier filled by one run is valid data
for the next, whatever its seed (a warm restart, not a false integrity error)."""


def kv_like(layout: KVLayout, n: int, seed: int) -> torch.Tensor:
    """``n`` blocks of small normal values in the layout's dtype, as ``uint8`` rows:
    like a KV cache in that a byte-shuffling codec shrinks them (their high bytes
    repeat), unlike random bytes, which no codec does. Real KV's ratios are in
    docs/benchmarks.md ("Compression"); these come close for bf16."""
    gen = torch.Generator().manual_seed(seed)
    count = layout.bytes_per_block // layout.itemsize
    values = torch.randn((n, count), generator=gen) * 0.5
    return values.to(layout.torch_dtype).view(torch.uint8).reshape(n, layout.bytes_per_block)


class Reservoir:
    """A uniform random sample of at most ``size`` of the values added (Vitter's
    algorithm R), and their exact maximum: percentiles over a whole run in bounded
    memory. A list of every request's latency grew for as long as the run did."""

    def __init__(self, size: int = 20_000, seed: int = 0) -> None:
        self.size = size
        self.seen = 0
        self.values: list[float] = []
        self.max: float | None = None
        self._rng = random.Random(seed)

    def add(self, value: float) -> None:
        self.seen += 1
        self.max = value if self.max is None else max(self.max, value)
        if len(self.values) < self.size:
            self.values.append(value)
            return
        j = self._rng.randrange(self.seen)
        if j < self.size:
            self.values[j] = value


class BlockDataGenerator:
    """Deterministic contents for any key, at memcpy speed.

    A block's bytes are a seeded random base rotated by an offset taken from the key,
    with the key itself stamped in the first bytes: different keys give different
    bytes, and regenerating costs two slice copies, not a random-number pass.
    """

    def __init__(
        self, bytes_per_block: int, seed: int, *, kind: str = "random", dtype: str = "bfloat16"
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.nbytes = bytes_per_block
        self.step = 1
        if kind == "kv":
            # Normal values of the cache's dtype (see StressConfig.data); rotated by
            # whole values, so each stays intact.
            dt = dtype_from_name(dtype)
            self.step = torch.empty(0, dtype=dt).element_size()
            values = torch.randn(bytes_per_block // self.step, generator=gen) * 0.5
            self.base = values.to(dt).view(torch.uint8).reshape(-1)
        else:
            self.base = torch.randint(0, 256, (bytes_per_block,), dtype=torch.uint8, generator=gen)

    def fill(self, key: BlockKey, row: torch.Tensor) -> None:
        """Write ``key``'s contents into ``row`` (``uint8 [bytes_per_block]``)."""
        shift = int.from_bytes(key[:8], "little") % (self.nbytes // self.step) * self.step
        row[: self.nbytes - shift].copy_(self.base[shift:])
        row[self.nbytes - shift :].copy_(self.base[:shift])
        stamp = min(len(key), self.nbytes)
        row[:stamp].copy_(torch.frombuffer(bytearray(key[:stamp]), dtype=torch.uint8))

    def matches(self, key: BlockKey, row: torch.Tensor, scratch: torch.Tensor) -> bool:
        self.fill(key, scratch)
        return torch.equal(row, scratch)


def workload_from_config(cfg: StressConfig, seed: int) -> Workload:
    """The request stream ``cfg`` selects (see :mod:`kvoffload.tools.workloads`)."""
    if cfg.workload == "zipf":
        return make_workload(
            "zipf",
            prefixes=cfg.prefixes,
            zipf_alpha=cfg.zipf_alpha,
            prefix_blocks=cfg.prefix_blocks,
            suffix_blocks=cfg.suffix_blocks,
            seed=seed,
        )
    if cfg.workload == "multiturn":
        return make_workload(
            "multiturn",
            sessions=cfg.sessions,
            turn_blocks=cfg.turn_blocks,
            max_turns=cfg.max_turns,
            seed=seed,
        )
    if cfg.workload == "scan":
        return make_workload("scan", blocks=cfg.scan_blocks, seed=seed)
    assert cfg.trace is not None  # the config validator requires it
    return make_workload("trace", path=Path(cfg.trace), max_blocks=cfg.pool_blocks)


# --------------------------------------------------------------------------- report
SAMPLE_EVERY_S: Final = 0.25
"""Interval of the timeline samples (``--json`` ``timeline``, ``--plot``)."""


def _held(manager: OffloadingManager) -> int | None:
    """Blocks a tier's books hold (read once the run is drained: nothing changes them
    then); ``None`` for a shared server's tier, whose server keeps the count."""
    return len(manager) if isinstance(manager, LRUOffloadingManager) else None


def percentile_ms(samples: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``samples`` seconds, in milliseconds."""
    if not samples:
        return None
    ordered = sorted(samples)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k] * 1e3


@dataclass(kw_only=True)
class TierReport(TierCounters):
    """Per-tier outcome of one run (one row of the table, one ``tiers[]`` entry).

    The tier and its counters are inherited from
    :class:`~kvoffload.metrics.TierCounters`, the one declaration of the tier metrics
    (so a new counter is in the report and its JSON without a line here); what this
    class adds is derived from them over the run."""

    write_gbps: float
    """``bytes_written`` over the run's wall time."""
    read_gbps: float
    store_p50_ms: float | None
    store_p99_ms: float | None
    """Submit-to-done time of store jobs into this tier."""
    load_p50_ms: float | None
    load_p99_ms: float | None
    """Submit-to-done time of loads whose slowest tier was this one."""
    compression: str = "none"
    """The tier's ``compression`` setting (``none`` for a tier without one)."""
    compression_ratio: float | None = None
    """``stored_bytes / logical_bytes`` of what the run wrote (1.0: stored raw)."""
    held_logical_bytes: int | None = None
    held_stored_bytes: int | None = None
    """Payload bytes the tier holds at the end, as given and as stored (``None``: the
    backend keeps no count)."""
    compress_gbps: float | None = None
    decompress_gbps: float | None = None
    """The codec's speed per thread: logical bytes over the seconds it spent."""
    blocks_per_gib: float | None = None
    """``blocks_held`` at the end per GiB of ``capacity_bytes`` (``None``: no capacity
    known, a shared server's tier): more than an uncompressed tier's where compression
    packs blocks into less than their full size."""

    @classmethod
    def from_stats(
        cls,
        s: TierStats,
        seconds: float,
        backend: Backend | None = None,
        blocks_held: int | None = None,
    ) -> TierReport:
        """The report of a tier's counters over a run of ``seconds``, with what its
        ``backend`` says of its compression, footprint and capacity, and the
        ``blocks_held`` by its books at the end (``None``: a shared server's tier)."""
        codec = None if backend is None else backend.codec_stats()
        held = None if backend is None else backend.footprint()
        counters = tier_fields(s)
        if backend is not None:  # what the tier holds now, read from it (TIER_STATE)
            counters |= tier_state(blocks_held, backend.capacity_bytes)
            # Full-size blocks, as inspect counts them: a packed slab has more slots.
            slot = type(backend).slot_bytes(backend.layout)
            counters["capacity_blocks"] = backend.capacity_bytes // slot
        return cls(
            blocks_per_gib=blocks_per_gib(counters["blocks_held"], counters["capacity_bytes"]),
            compression="none" if codec is None else codec.codec,
            compression_ratio=s.stored_bytes / s.logical_bytes if s.logical_bytes else None,
            held_logical_bytes=None if held is None else held[0],
            held_stored_bytes=None if held is None else held[1],
            compress_gbps=None if codec is None else codec.compress_gbps,
            decompress_gbps=None if codec is None else codec.decompress_gbps,
            **counters,
            write_gbps=s.bytes_written / seconds / 1e9 if seconds else 0.0,
            read_gbps=s.bytes_read / seconds / 1e9 if seconds else 0.0,
            store_p50_ms=percentile_ms(s.store_latency_s, 50),
            store_p99_ms=percentile_ms(s.store_latency_s, 99),
            load_p50_ms=percentile_ms(s.load_latency_s, 50),
            load_p99_ms=percentile_ms(s.load_latency_s, 99),
        )


@dataclass
class StressReport:
    """Outcome of ``kvoffload stress``; :meth:`to_json` is the ``--json`` document,
    whose schema docs/config.md ("stress report") describes field by field."""

    seed: int
    workload: str
    concurrency: int
    layout: dict[str, Any]
    bytes_per_block: int
    ops: int = 0
    duration_s: float = 0.0
    blocks_requested: int = 0
    blocks_loaded: int = 0
    blocks_stored: int = 0
    """Blocks written into the first tier (the engine's stores)."""
    stores_dropped: int = 0
    """Requests whose whole store the first tier dropped (queue full or no room)."""
    integrity_errors: int = 0
    submit_p50_ms: float | None = None
    submit_p99_ms: float | None = None
    submit_max_ms: float | None = None
    """The caller's side of ``submit_store`` / ``prepare_load`` + ``submit_load``."""
    request_p50_ms: float | None = None
    request_p99_ms: float | None = None
    """Admission to store completion, per request."""
    tiers: list[TierReport] = field(default_factory=list)
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Samples every 0.25 s: ``t`` (s), ``requested`` and ``loaded`` blocks so far, and
    per tier (``tiers[i]``) cumulative ``bytes_written``, ``bytes_read`` and ``hits``."""
    resources: list[dict[str, Any]] = field(default_factory=list)
    """The process, sampled at the start, every :data:`RESOURCE_EVERY_S` and at the end
    (see :func:`process_resources`), with ``hit_rate`` over the interval since the
    previous sample: what a soak checks for leaks (flat RSS, fds, threads)."""

    @property
    def hit_rate(self) -> float:
        """Prefix-block hit ratio: loaded blocks / requested blocks."""
        return self.blocks_loaded / self.blocks_requested if self.blocks_requested else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        out["schema"] = REPORT_SCHEMA
        return out


RESOURCE_EVERY_S: Final = 5.0
"""Interval of the ``resources`` samples."""


def process_resources() -> dict[str, int]:
    """This process now: resident memory (all, and anonymous), page-locked memory
    (``VmLck``: what a pinned slab locks; 0 where the kernel does not count it), open
    file descriptors and OS threads (OpenMP's and the I/O pools' included), from
    ``/proc/self``; empty where there is no ``/proc``."""
    try:
        status = Path("/proc/self/status").read_text()
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:
        return {}
    fields = {}
    for line in status.splitlines():
        name, _, rest = line.partition(":")
        fields[name] = rest.split()
    kib = 1024
    return {
        "rss_bytes": int(fields.get("VmRSS", ["0"])[0]) * kib,
        # Anonymous memory alone: a leak shows here; file pages are the disk tiers'
        # mapped data, bounded by their capacity.
        "rss_anon_bytes": int(fields.get("RssAnon", ["0"])[0]) * kib,
        "locked_bytes": int(fields.get("VmLck", ["0"])[0]) * kib,
        "open_fds": fds,
        "threads": int(fields.get("Threads", ["0"])[0]),
        # The host buffer pools (staging, pack buffers): bounded, resident, and
        # allocated whenever a new peak of concurrent jobs needs one more; what a
        # soak subtracts to see a leak rather than a pool's high-water mark.
        "pooled_bytes": pooled_bytes(),
    }


REPORT_SCHEMA: Final = "kvoffload.stress/2"
"""Version tag of the ``--json`` document; bumped when a field changes meaning."""


# ---------------------------------------------------------------------------- runner
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


# -------------------------------------------------------------------------- replicas
MAX_REPLICAS: Final = 64
"""Most replica processes ``kvoffload stress --replicas`` starts."""

REPLICAS_SCHEMA: Final = "kvoffload.stress.replicas/1"
"""Version tag of the ``--json`` document of a run with ``--replicas`` above 1."""

REPLICA_START_TIMEOUT_S: Final = 300.0
"""How long a replica waits for the others to open their tiers before giving up."""

REPLICA_MAX_LEAD: Final = 4
"""Most requests a replica finishes ahead of the slowest replica still running. A
fleet's replicas serve at once; one that ran ahead (started first, a core of its own)
would look up the shared prefixes before the others stored them and measure no
sharing, so each waits for the slowest (never past the run's duration)."""


def shared_tiers(config: KVOffloadConfig) -> list[str]:
    """Names of ``config``'s tiers whose books live on their server
    (:attr:`~kvoffload.backend.Backend.server_booked`): the tiers replicas share."""
    from kvoffload.registry import get_backend_class

    return [t.name for t in config.tiers if get_backend_class(t.backend).server_booked]


def replica_config(config: KVOffloadConfig, replica: int) -> dict[str, Any]:
    """``config`` as replica ``replica`` runs it, as a mapping for ``load_config``.

    A local disk tier's directory takes one writer process, so each replica's goes to
    a directory of its own, the tier's ``path`` suffixed ``.replica<R>``; the shared
    (server-booked) tiers and the cpu tier are as configured."""
    from kvoffload.registry import get_backend_class

    raw = config.model_dump()
    # Only what was set: a preset and the default layout both dumped would conflict.
    raw["stress"] = config.stress.model_dump(exclude_unset=True)
    for tier_raw, tier in zip(raw["tiers"], config.tiers, strict=True):
        path = tier_raw.get("path")
        if isinstance(path, str) and not get_backend_class(tier.backend).server_booked:
            tier_raw["path"] = f"{os.path.normpath(path)}.replica{replica}"
    return raw


@dataclass
class ReplicaSetReport:
    """Outcome of ``kvoffload stress --replicas N``: each replica process's
    :class:`StressReport` (``reports[r]``) and their totals. :meth:`to_json` is the
    ``--json`` document; docs/config.md ("stress report") describes it."""

    reports: list[StressReport]
    shared: list[str]
    """Names of the tiers the replicas share (server-booked)."""

    @property
    def ops(self) -> int:
        return sum(r.ops for r in self.reports)

    @property
    def duration_s(self) -> float:
        return max(r.duration_s for r in self.reports)

    @property
    def blocks_requested(self) -> int:
        return sum(r.blocks_requested for r in self.reports)

    @property
    def blocks_loaded(self) -> int:
        return sum(r.blocks_loaded for r in self.reports)

    @property
    def integrity_errors(self) -> int:
        return sum(r.integrity_errors for r in self.reports)

    @property
    def hit_rate(self) -> float:
        """Loaded / requested blocks over every replica's requests."""
        asked = self.blocks_requested
        return self.blocks_loaded / asked if asked else 0.0

    def tier_totals(self) -> list[dict[str, Any]]:
        """Per tier: its identity (replica 0's), ``shared``, every counter summed over
        the replicas (each replica counts its own traffic, so for a shared tier the sum
        is the traffic the server saw from all of them), and ``blocks_per_gib`` of the
        summed blocks and capacity."""
        from kvoffload.metrics import TIER_IDENTITY, TIER_METRICS

        out = []
        for i, first in enumerate(self.reports[0].tiers):
            row: dict[str, Any] = {name: getattr(first, name) for name in TIER_IDENTITY}
            row["shared"] = first.name in self.shared
            for m in TIER_METRICS:
                row[m.name] = sum(getattr(r.tiers[i], m.name) for r in self.reports)
            # Of the sums: each replica's own tier adds its blocks and its capacity.
            row["blocks_per_gib"] = blocks_per_gib(row["blocks_held"], row["capacity_bytes"])
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        first = self.reports[0]
        return {
            "schema": REPLICAS_SCHEMA,
            "replica_count": len(self.reports),
            "seed": first.seed,
            "workload": first.workload,
            "concurrency": first.concurrency,
            "layout": first.layout,
            "bytes_per_block": first.bytes_per_block,
            "shared_tiers": list(self.shared),
            "ops": self.ops,
            "duration_s": self.duration_s,
            "blocks_requested": self.blocks_requested,
            "blocks_loaded": self.blocks_loaded,
            "blocks_stored": sum(r.blocks_stored for r in self.reports),
            "stores_dropped": sum(r.stores_dropped for r in self.reports),
            "integrity_errors": self.integrity_errors,
            "hit_rate": self.hit_rate,
            "tiers": self.tier_totals(),
            "replicas": [{"replica": i, **r.to_json()} for i, r in enumerate(self.reports)],
        }


def run_replicas(
    config: KVOffloadConfig,
    *,
    replicas: int,
    ops: int,
    duration_s: float,
    seed: int | None = None,
    progress: ProgressFn | None = None,
) -> ReplicaSetReport:
    """Run ``replicas`` stress processes that share ``config``'s server-booked tiers.

    Each is a fresh process (``spawn``) with its own tiers above the shared ones (its
    own cpu tier; its own directory for a local disk tier, see :func:`replica_config`)
    running its :class:`~kvoffload.tools.workloads.ReplicaShare` of the one seeded
    stream, ``ops`` requests or ``duration_s`` seconds. They open their tiers, wait
    for each other, start together, and keep within :data:`REPLICA_MAX_LEAD` requests
    of each other (as a fleet's replicas serve at once). ``progress`` gets the
    requests done by all of them. A replica that fails (its config, its tiers'
    consistency check, a crash) raises :class:`~kvoffload.exceptions.KVOffloadError`
    naming it, once all have ended.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    from kvoffload.config import load_config

    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"replicas = {replicas}: it must be between 1 and {MAX_REPLICAS}")
    shared = shared_tiers(config)
    if replicas > 1 and not shared:
        raise ConfigError(
            f"{replicas} replicas need a tier they share: add one whose books live on its "
            "server (backend: redis) below the cpu tier"
        )
    seed = config.stress.seed if seed is None else seed
    raws = [replica_config(config, r) for r in range(replicas)]
    for raw in raws:
        load_config(raw, env={})  # a bad per-replica path fails here, once
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(replicas)
    done = ctx.Array("q", replicas, lock=False)
    over = ctx.Array("b", replicas, lock=False)  # a replica's run has ended
    level = logging.getLogger().getEffectiveLevel()
    procs, pipes = [], []
    for r, raw in enumerate(raws):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_replica_main,
            args=(raw, r, replicas, seed, ops, duration_s, barrier, (done, over), writer, level),
            name=f"kvoffload-stress-replica-{r}",
            daemon=True,
        )
        proc.start()
        writer.close()  # the child's end: EOF here once it exits
        procs.append(proc)
        pipes.append(reader)
    results: dict[int, tuple[str, Any]] = {}
    start = time.perf_counter()
    try:
        waiting = dict(enumerate(pipes))
        while waiting:
            for ready in wait(list(waiting.values()), timeout=0.25):
                r = next(i for i, p in waiting.items() if p is ready)
                pipe = waiting.pop(r)
                try:
                    results[r] = pipe.recv()
                except EOFError:
                    procs[r].join(timeout=10)
                    results[r] = ("error", f"exited with code {procs[r].exitcode} and no report")
            if progress is not None:
                progress(sum(done), time.perf_counter() - start)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in pipes:
            pipe.close()
    failed = [
        f"replica {r}: {msg}" for r, (kind, msg) in sorted(results.items()) if kind == "error"
    ]
    if not failed:  # only the replicas that gave up waiting for a crashed one
        failed = [
            f"replica {r}: {msg}" for r, (kind, msg) in sorted(results.items()) if kind != "ok"
        ]
    if failed:
        raise KVOffloadError("; ".join(failed))
    return ReplicaSetReport([results[r][1] for r in range(replicas)], shared)


def _replica_main(
    raw: dict[str, Any],
    replica: int,
    replicas: int,
    seed: int,
    ops: int,
    duration_s: float,
    barrier: Any,
    progress: tuple[Any, Any],
    out: Any,
    log_level: int,
) -> None:
    """One replica process of :func:`run_replicas`: sends ``("ok", StressReport)`` or
    ``("error", one-line message)`` through ``out``."""
    import threading

    from kvoffload.config import load_config

    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s: replica {replica}: %(message)s",
    )
    runner: StressRunner | None = None
    try:
        try:
            config = load_config(raw, env={})
            runner = StressRunner(config, seed=seed, replica=replica, replicas=replicas)
        except Exception:
            barrier.abort()  # the others stop waiting for us
            raise
        barrier.wait(timeout=REPLICA_START_TIMEOUT_S)
        done, over = progress
        others = [i for i in range(replicas) if i != replica]
        give_up = time.monotonic() + duration_s

        def tick(n: int, _t: float) -> None:
            done[replica] = n
            while time.monotonic() < give_up:  # stay within REPLICA_MAX_LEAD of the slowest
                running = [done[i] for i in others if not over[i]]
                if not running or n - min(running) <= REPLICA_MAX_LEAD:
                    return
                time.sleep(0.002)

        try:
            report = runner.run(ops=ops, duration_s=duration_s, progress=tick)
        finally:
            over[replica] = 1
        out.send(("ok", report))
    except threading.BrokenBarrierError:
        out.send(("broken", "another replica failed to start"))
    except Exception as exc:  # sent to the parent as one line
        logger.debug("replica %d failed", replica, exc_info=True)
        text = str(exc) if isinstance(exc, KVOffloadError) else f"{type(exc).__name__}: {exc}"
        out.send(("error", " ".join(text.split())))
    finally:
        if runner is not None:
            runner.close()
        out.close()

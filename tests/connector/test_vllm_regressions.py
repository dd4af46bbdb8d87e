"""Issue 29's findings against vLLM's engine contract, each a regression test that failed
on the code before the fix: both halves of the connector in one process (the
scheduler side finds the worker's books in the registry, as in vLLM's single-process
mode), over a real Offloader, real tiers (cpu, mmap) and a torch KV cache, driven
through the connector's own API the way vLLM's scheduler and worker call it.

- a connector reset (``reset_cache``) leaves no block stored before it loadable, from
  any tier (it left the mmap tier's, which verified);
- ``requires_kv_delivery`` is false but for a producer (vLLM's default is true for
  ``kv_both``, and then it drops in-flight output at every preemption);
- ``handle_preemptions`` waits only for the stores of the requests the step names as
  preempted (it waited for every store in flight, every step);
- a hit loaded with stats off leaves no per-request note behind (``resident`` grew by
  one entry per hit);
- a load planned with no claim held fails (it loaded nothing and reported success);
- hit sources: blocks a prefetch on arrival brought up from disk are ``disk``, not
  ``host``; a Redis tier's are ``external_unspecified``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvoffload.connectors.vllm import (
    TieredOffloadConnector,
    TieredOffloadMetadata,
    connector_counters,
    connector_health,
)
from kvoffload.connectors.vllm.metadata import Load
from kvoffload.connectors.vllm.shared import REGISTRY
from support.engine_run import write_tiny_llama
from support.vllm_steps import connector_config, new_request_step
from support.waiting import wait_until
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_request_block_hasher, init_none_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from kvoffload.config import load_config
from kvoffload.datapath import StoreGate

BLOCK = 16
LAYERS, HEADS, DIM = 2, 2, 32  # the tiny Llama's KV shape
NUM_BLOCKS = 32
FULL = 4  # full blocks of each prompt (plus one token vLLM computes)


class Engine:
    """Both halves of one engine's connector, and its KV cache."""

    def __init__(self, model: Path, tiers: list[dict[str, Any]], role: str = "kv_both") -> None:
        self.engine_id = f"regress-{uuid.uuid4().hex[:10]}"
        self.config = connector_config(
            str(model),
            BLOCK,
            # Nothing is computed here: a prefill rate measured from these steps
            # would be meaningless, so every hit is loaded (exact counts).
            {"config": {"tiers": tiers, "store_timeout_ms": 300}, "load_or_recompute": False},
            kv_role=role,
            engine_id=self.engine_id,
            kv_load_failure_policy="recompute",
        )
        self.worker = TieredOffloadConnector(self.config, KVConnectorRole.WORKER)
        self.caches = {
            f"layer{i}": torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16)
            for i in range(LAYERS)
        }
        self.worker.register_kv_caches(self.caches)
        self.scheduler = TieredOffloadConnector(self.config, KVConnectorRole.SCHEDULER)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.count = 0

    def request(self, family: int) -> Request:
        tokens = [(family * 7919 + t * 31) % 1000 + 1 for t in range(FULL * BLOCK + 1)]
        self.count += 1
        return Request(
            f"r{self.count}", tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher
        )

    def step(self, meta: TieredOffloadMetadata, finished: set[str] = frozenset()) -> Any:
        """The worker's part of one step; what vLLM collects after it."""
        w = self.worker
        w.bind_connector_metadata(meta)
        w.handle_preemptions(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        results = w.get_transfer_results(set(finished))
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        done = (results.finished_sending, results.finished_recving, results.failed_recving)
        return tuple(set(x or ()) for x in done), errors

    def lookup(self, req: Request) -> int:
        """Ask until decided, as vLLM asks each step."""
        matched: list[int] = []

        def decided() -> bool:
            got, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            if got is not None:
                matched.append(got)
            return got is not None

        wait_until(decided, "the lookup decided", poll=0.002)
        return matched[0]

    def run(
        self, req: Request, block_ids: list[int], sources: list[Any] | None = None
    ) -> tuple[int, set[int]]:
        """Look ``req`` up, allocate ``block_ids``, run its one prefill step (loads,
        then stores of what it computed), finish it and wait for its stores; the tokens
        it loaded and the step's load errors. With ``sources``, ask for its hit sources
        after the allocation, as vLLM does with stats on, and append them there."""
        matched = self.lookup(req)
        blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in block_ids],))
        self.scheduler.update_state_after_alloc(req, blocks, matched)
        if sources is not None:
            sources.append(self.scheduler.get_external_cache_hit_sources(req, matched))
        req.num_computed_tokens = matched
        out = new_request_step(req, block_ids, matched, req.num_prompt_tokens - matched)
        meta = self.scheduler.build_connector_meta(out)
        _, errors = self.step(meta)
        delay, _ = self.scheduler.request_finished(req, block_ids)
        if delay:
            finished = {req.request_id}

            def sent() -> bool:
                (sending, _, _), _ = self.step(TieredOffloadMetadata(), finished)
                finished.clear()
                return req.request_id in sending

            wait_until(sent, "the request's stores finished", poll=0.002)
        return matched, errors

    def counters(self) -> dict[str, int | float]:
        return connector_counters()[self.engine_id]

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_tiny_llama(tmp_path / "model")


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def _tiers(tmp_path: Path) -> list[dict[str, Any]]:
    return [
        {"name": "cpu", "backend": "cpu", "capacity": "4MiB"},
        {
            "name": "disk",
            "backend": "mmap",
            "path": str(tmp_path / "disk"),
            "capacity": "16MiB",
            "write_policy": "write_through",
        },
    ]


def test_no_block_stored_before_a_connector_reset_is_loaded_from_any_tier(
    tmp_path: Path, model: Path, engines: list[Engine]
) -> None:
    """A prompt's 4 blocks stored (cpu and, written through, mmap), then repeated: 64
    tokens loaded. After ``reset_cache`` (True) the same prompt finds nothing (0
    tokens, nothing prefetched from the mmap tier, which still holds the blocks), and
    is stored again; repeated after that, it loads its 4 blocks again: the reset
    hides the old blocks, not the new ones."""
    engine = Engine(model, _tiers(tmp_path))
    engines.append(engine)
    assert engine.run(engine.request(1), [0, 1, 2, 3, 4])[0] == 0
    assert engine.run(engine.request(1), [5, 6, 7, 8, 9])[0] == FULL * BLOCK
    loaded = engine.counters()["blocks_loaded"]
    assert loaded == FULL
    assert engine.scheduler.reset_cache() is True
    assert engine.run(engine.request(1), [10, 11, 12, 13, 14])[0] == 0
    counts = engine.counters()
    assert counts["blocks_loaded"] == loaded, counts
    assert counts["prefetched_blocks"] == 0, counts
    assert engine.run(engine.request(1), [15, 16, 17, 18, 19])[0] == FULL * BLOCK
    assert engine.counters()["blocks_loaded"] == 2 * FULL


@pytest.mark.parametrize(
    ("role", "delivery"), [("kv_both", False), ("kv_consumer", False), ("kv_producer", True)]
)
def test_only_a_producer_requires_kv_delivery(
    tmp_path: Path, model: Path, engines: list[Engine], role: str, delivery: bool
) -> None:
    """vLLM drops a request's in-flight output at a preemption (async scheduling,
    pipeline parallelism) when ``requires_kv_delivery`` is true; a cache must not ask
    for that."""
    engine = Engine(model, _tiers(tmp_path), role=role)
    engines.append(engine)
    assert engine.scheduler.requires_kv_delivery is delivery
    assert engine.worker.requires_kv_delivery is delivery


def test_handle_preemptions_waits_only_for_the_preempted_requests_stores(
    tmp_path: Path, model: Path, engines: list[Engine]
) -> None:
    """A store of request ``a`` not yet begun (its gate never released: a lane that has
    not reached it) is left alone by a step whose metadata names no preemption; a step
    naming ``a`` as preempted waits for it until ``store_timeout_ms`` (300 ms here) has
    passed, then abandons it (it never begins): 3 blocks counted in ``store_timeouts``."""
    engine = Engine(model, _tiers(tmp_path))
    engines.append(engine)
    worker = engine.worker._worker
    assert worker is not None
    gate = StoreGate()
    worker._store_gates[-1] = ("a", 3, gate)
    worker._stores_left["a"] = 1
    worker.handle_preemptions(TieredOffloadMetadata())
    worker.handle_preemptions(TieredOffloadMetadata(preempted={"b"}))
    assert worker._stores_left == {"a": 1}
    assert engine.counters()["store_timeouts"] == 0
    worker.handle_preemptions(TieredOffloadMetadata(preempted={"a"}))
    assert worker._stores_left == {}
    assert engine.counters()["store_timeouts"] == 3


def test_a_hit_with_stats_off_leaves_no_note_behind(
    tmp_path: Path, model: Path, engines: list[Engine]
) -> None:
    """vLLM asks for hit sources only with stats on: two hits loaded without that
    question leave the worker's per-request notes (``resident``), holds and plans
    empty, and the Offloader's check clean."""
    engine = Engine(model, _tiers(tmp_path))
    engines.append(engine)
    engine.run(engine.request(2), [0, 1, 2, 3, 4])
    for ids in ([5, 6, 7, 8, 9], [10, 11, 12, 13, 14]):
        assert engine.run(engine.request(2), ids)[0] == FULL * BLOCK
    shared = REGISTRY[engine.engine_id]
    assert shared.resident == {}
    health = connector_health()[engine.engine_id]
    assert (health["holds"], health["plans"], health["problems"]) == (0, 0, [])


@pytest.mark.parametrize("background", [False, True])
def test_a_load_planned_with_no_claim_fails_its_blocks(
    tmp_path: Path, model: Path, engines: list[Engine], background: bool
) -> None:
    """A plan that finds no claim held for its request loads nothing: its blocks are
    load errors (a step's load) or the request's load fails whole (a background load),
    never reported loaded."""
    engine = Engine(model, _tiers(tmp_path))
    engines.append(engine)
    shared = REGISTRY[engine.engine_id]
    assert shared.plan(7, "ghost", 0, 2) == 0
    load = Load("ghost", 7, [[20, 21]], background=background)
    (_, received, failed), errors = engine.step(TieredOffloadMetadata(loads=[load]))
    if background:
        assert (received, failed, errors) == ({"ghost"}, {"ghost"}, set())
    else:
        assert errors == {20, 21}
    assert engine.counters()["blocks_loaded"] == 0


def test_hit_sources_count_a_prefetch_on_arrival_as_disk(
    tmp_path: Path, model: Path, engines: list[Engine]
) -> None:
    """An engine stores a prompt (cpu, written through to mmap) and stops; a new engine
    over the same mmap tier (its cpu tier empty) is sent the prompt: vLLM queues it
    (``on_new_request``: the prefetch on arrival brings its 4 blocks into the cpu tier),
    then looks it up and loads them. Its hit sources: 64 tokens ``disk``, none
    ``host``."""
    tiers = _tiers(tmp_path)
    first = Engine(model, tiers)
    first.run(first.request(3), [0, 1, 2, 3, 4])
    first.close()
    engine = Engine(model, tiers)
    engines.append(engine)
    req = engine.request(3)
    engine.scheduler.on_new_request(req)
    shared = REGISTRY[engine.engine_id]
    # The prefetch runs on the books' own thread: done once its 4 blocks landed.
    wait_until(
        lambda: (
            engine.counters()["prefetched_blocks"] >= FULL and not shared.offloader.prefetches()[0]
        ),
        "the prefetch on arrival landed",
        poll=0.002,
    )
    sources: list[Any] = []
    assert engine.run(req, [0, 1, 2, 3, 4], sources)[0] == FULL * BLOCK
    assert sources == [{CacheHitSource.DISK: FULL * BLOCK}]
    assert engine.counters()["blocks_loaded"] == FULL


def test_a_shared_tiers_hits_are_external_unspecified() -> None:
    """vLLM's ``disk`` is a local disk; a Redis tier's blocks (or a plugin's) are a
    store the connector cannot place: ``external_unspecified``."""
    from kvoffload.connectors.vllm.config import lower_source

    cpu = {"name": "cpu", "backend": "cpu", "capacity": "1MiB"}
    mmap = {"name": "d", "backend": "mmap", "path": "/nonexistent/x", "capacity": "1MiB"}
    redis = {"name": "r", "backend": "redis", "url": "redis://127.0.0.1:1", "capacity": "1MiB"}
    assert lower_source(load_config({"tiers": [cpu, mmap]})) == "disk"
    assert lower_source(load_config({"tiers": [cpu, mmap, redis]})) == "external_unspecified"
    assert lower_source(load_config({"tiers": [cpu]})) == "disk"

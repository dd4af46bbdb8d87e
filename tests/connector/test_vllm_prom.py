"""The connector's Prometheus metrics, stats counters and KV events, on real vLLM objects.

The two roles run in this process, as in vLLM's single-process mode: a worker side over
a small torch KV cache, and a scheduler side that finds it through the registry. Steps
are driven with vLLM's own ``Request`` / ``SchedulerOutput`` / ``KVConnectorOutput``."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

import torch
from kvoffload.connectors.vllm import (
    TieredOffloadConnector,
    TieredOffloadKVEvents,
    TieredOffloadPromMetrics,
    TieredOffloadStats,
    connector_counters,
    connector_health,
)
from kvoffload.connectors.vllm.shared import REGISTRY
from prometheus_client import CollectorRegistry
from support.engine_run import write_tiny_llama
from support.vllm_steps import connector_config, metric_types, new_request_step
from support.waiting import wait_until
from vllm.config import KVEventsConfig, VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    KVCacheBlock,
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

BLOCK = 32  # tokens per block
BYTES_PER_BLOCK = 2 * 2 * BLOCK * 2 * 32 * 2  # layers x (K, V) x tokens x heads x dim x bf16
LABELS = ["model_name", "engine"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The end-to-end tests' tiny Llama: a config only, which is all vLLM's config needs."""
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def vllm_config(model_dir: str, tiers: list[dict[str, Any]], *, events: bool) -> VllmConfig:
    return connector_config(
        model_dir,
        BLOCK,
        {"config": {"tiers": tiers}},
        events=KVEventsConfig(enable_kv_cache_events=True) if events else None,
    )


def sample(registry: CollectorRegistry, name: str, engine: str, tier: str | None = None) -> Any:
    labels = {"model_name": "m", "engine": engine} | ({"tier": tier} if tier else {})
    return registry.get_sample_value(name, labels)


# ------------------------------------------------------------------------- prometheus
def test_the_prefetch_counters_are_the_offloaders_prefetch_stats() -> None:
    """``PrefetchStats`` declares the prefetch counters: the connector has one counter
    per field, with a help text, exposed with the others and read from that field. A
    field added, dropped or renamed there fails here, not as a counter missing from the
    exposition or a ``getattr`` failing in a running engine."""
    import dataclasses
    import threading
    from types import SimpleNamespace

    from kvoffload.connectors.vllm.metrics import (
        COUNTERS,
        PREFETCH_COUNTERS,
        PREFETCH_HELP,
        snapshot,
    )

    from kvoffload.plans import PrefetchStats

    names = [f.name for f in dataclasses.fields(PrefetchStats)]
    assert list(PREFETCH_COUNTERS.values()) == names
    assert sorted(PREFETCH_HELP) == sorted(names)
    for counter, field in PREFETCH_COUNTERS.items():
        assert COUNTERS[counter] == PREFETCH_HELP[field]
    stats = PrefetchStats(**{name: i + 1 for i, name in enumerate(names)})
    offloader = SimpleNamespace(counters=lambda: ({}, stats), tiers=[], stats=[])
    shared = SimpleNamespace(lock=threading.Lock(), counters={}, offloader=offloader)
    counts = snapshot(shared)  # type: ignore[arg-type]
    assert {c: counts[c] for c in PREFETCH_COUNTERS} == {
        c: getattr(stats, f) for c, f in PREFETCH_COUNTERS.items()
    }


def test_prom_counters_add_the_observed_deltas_by_engine_and_tier(model_dir: str) -> None:
    config = vllm_config(
        model_dir,
        [{"name": "cpu", "capacity": "1MiB"}, {"name": "ram2", "capacity": "2MiB"}],
        events=False,
    )
    registry = CollectorRegistry()
    prom = TieredOffloadConnector.build_prom_metrics(
        config, metric_types(registry), LABELS, {0: ["m", "0"], 1: ["m", "1"]}
    )
    assert isinstance(prom, TieredOffloadPromMetrics)
    # The configured tiers' series exist before anything is observed.
    assert sample(registry, "vllm:kvoffload_tier_hits_total", "0", "ram2") == 0.0
    assert sample(registry, "vllm:kvoffload_tokens_loaded_total", "1") == 0.0

    data = {
        "tokens_loaded": 96,
        "blocks_loaded": 3,
        "tier.cpu.hits": 3,
        "tier.cpu.read_seconds": 0.25,
        "tier.ram2.bytes_written": 4096,
        "tier.gone.tier.hits": 2,  # a tier the config no longer names (dots allowed)
        "tier.cpu.no_such_counter": 5,
        "no_such_counter": 7,
    }
    prom.observe(data, engine_idx=1)
    prom.observe({"tokens_loaded": 32, "tier.cpu.read_seconds": 0.5}, engine_idx=1)

    assert sample(registry, "vllm:kvoffload_tokens_loaded_total", "1") == 128.0
    assert sample(registry, "vllm:kvoffload_blocks_loaded_total", "1") == 3.0
    assert sample(registry, "vllm:kvoffload_tier_hits_total", "1", "cpu") == 3.0
    assert sample(registry, "vllm:kvoffload_tier_read_seconds_total", "1", "cpu") == 0.75
    assert sample(registry, "vllm:kvoffload_tier_bytes_written_total", "1", "ram2") == 4096.0
    assert sample(registry, "vllm:kvoffload_tier_hits_total", "1", "gone.tier") == 2.0
    # The other engine saw nothing; unknown keys made no series.
    assert sample(registry, "vllm:kvoffload_tokens_loaded_total", "0") == 0.0
    assert sample(registry, "vllm:kvoffload_tier_hits_total", "0", "cpu") == 0.0
    names = {m.name for m in registry.collect()}
    assert "vllm:kvoffload_no_such_counter" not in names
    assert "vllm:kvoffload_tier_no_such_counter" not in names


# --------------------------------------------------------------------- both sides
class Engine:
    """A worker side and a scheduler side of one engine, in this process."""

    def __init__(self, config: VllmConfig, num_blocks: int = 16) -> None:
        self.timed: TieredOffloadStats | None = None
        self.config = config
        self.worker = TieredOffloadConnector(config, KVConnectorRole.WORKER)
        layers = {
            f"layer{i}": torch.zeros((num_blocks, 2, BLOCK, 2, 32), dtype=torch.bfloat16)
            for i in range(2)
        }
        self.worker.register_kv_caches(layers)
        self.scheduler = TieredOffloadConnector(config, KVConnectorRole.SCHEDULER)
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)

    def request(self, req_id: str, tokens: list[int]) -> Request:
        return Request(req_id, tokens, SamplingParams(max_tokens=1), None, block_hasher=self.hasher)

    def admit(self, req: Request, block_ids: list[int]) -> int:
        """What vLLM's scheduler does for a new request: ask for a hit beyond its own
        (none here), allocate, and tell the connector. The tokens the tiers hold."""
        matched, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        assert is_async is False
        blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in block_ids],))
        self.scheduler.update_state_after_alloc(req, blocks, matched or 0)
        return matched or 0

    def step(
        self, req: Request, block_ids: list[int], num_tokens: int
    ) -> tuple[list[Any], TieredOffloadStats | None]:
        """One engine step scheduling ``num_tokens`` of ``req`` (admitted, new to the
        step) into ``block_ids``; waits for its stores, if any. The scheduler side's
        events and the worker side's stats of the step."""
        out = new_request_step(req, block_ids, 0, num_tokens)
        meta = self.scheduler.build_connector_meta(out)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)
        self.worker.wait_for_save()
        # Finish the request, then step until the worker says its stores are done.
        finished = {req.request_id}

        def stored() -> bool:
            nonlocal finished
            done = req.request_id in (self.worker.get_finished(finished)[0] or set())
            finished = set()
            return done

        if meta.stores:
            wait_until(stored, "stores finished")
        output = KVConnectorOutput(
            kv_cache_events=self.worker.get_kv_connector_kv_cache_events(),
            kv_connector_stats=self.worker.get_kv_connector_stats(),
        )
        self.worker.clear_connector_metadata()
        self.scheduler.update_connector_output(output)
        # vLLM asks the scheduler side for its stats after every step's output.
        self.timed = self.scheduler.get_kv_connector_stats()
        return list(self.scheduler.take_events()), output.kv_connector_stats

    def close(self) -> None:
        self.worker.shutdown()


def _engine(model_dir: str, *, events: bool) -> Iterator[Engine]:
    # 4 blocks of room: a second 3-block prompt evicts 2 blocks of the first.
    tiers = [{"name": "cpu", "capacity": 4 * BYTES_PER_BLOCK}]
    engine = Engine(vllm_config(model_dir, tiers, events=events))
    yield engine
    engine.close()


@pytest.fixture
def events_on(model_dir: str) -> Iterator[Engine]:
    yield from _engine(model_dir, events=True)


@pytest.fixture
def events_off(model_dir: str) -> Iterator[Engine]:
    yield from _engine(model_dir, events=False)


def prompt(first: int) -> list[int]:
    return [(first + i) % 1000 for i in range(3 * BLOCK + 1)]


def test_stores_and_evictions_become_vllm_kv_events(events_on: Engine) -> None:
    eng = events_on
    a = eng.request("a", prompt(0))
    assert len(a.block_hashes) == 3
    hashes_a = [maybe_convert_block_hash(h) for h in a.block_hashes]

    assert eng.admit(a, [0, 1, 2, 3]) == 0
    events, stats = eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))
    assert [type(e) for e in events] == [BlockStored] * 3
    assert [e.block_hashes for e in events] == [[h] for h in hashes_a]
    assert {(e.medium, e.locality, e.ownership) for e in events} == {("CPU", "LOCAL", None)}
    # Self-describing, as vLLM's own offloading publishes: the block's tokens, its
    # parent's hash, the block size, the group and its kind.
    tokens = prompt(0)
    assert [e.token_ids for e in events] == [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    assert [e.parent_block_hash for e in events] == [None, *hashes_a[:2]]
    assert {(e.block_size, e.group_idx, e.kv_cache_spec_kind) for e in events} == {
        (BLOCK, 0, "full_attention")
    }
    assert {(e.lora_id, e.lora_name) for e in events} == {(None, None)}
    assert stats is not None
    assert stats.data["tokens_stored"] == 3 * BLOCK
    assert stats.data["tier.cpu.blocks_stored"] == 3
    assert stats.data["tier.cpu.bytes_written"] == 3 * BYTES_PER_BLOCK
    assert isinstance(stats.data["tier.cpu.write_seconds"], float)
    assert stats.data["tier.cpu.write_seconds"] > 0

    b = eng.request("b", prompt(500))
    hashes_b = [maybe_convert_block_hash(h) for h in b.block_hashes]
    assert eng.admit(b, [4, 5, 6, 7]) == 0
    events, _ = eng.step(b, [4, 5, 6, 7], len(b.prompt_token_ids or []))
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [[h] for h in hashes_b]
    evicted = [h for e in removed for h in e.block_hashes]
    assert len(evicted) == 2
    assert set(evicted) <= set(hashes_a)
    assert all((e.medium, e.locality, e.ownership) == ("CPU", "LOCAL", None) for e in removed)
    # Nothing is reported twice.
    assert list(eng.scheduler.take_events()) == []


def test_a_load_counts_its_tokens_and_only_the_worker_side_reports(events_on: Engine) -> None:
    eng = events_on
    a = eng.request("a", prompt(0))
    eng.admit(a, [0, 1, 2, 3])
    eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))

    again = eng.request("again", prompt(0))
    targets = [8, 9, 10, 11]
    assert eng.admit(again, targets) == 3 * BLOCK
    events, stats = eng.step(again, targets, 1)

    assert stats is not None
    assert stats.data["tokens_loaded"] == 3 * BLOCK
    assert stats.data["blocks_loaded"] == 3
    assert stats.data["tier.cpu.hits"] == 3
    assert stats.data["tier.cpu.bytes_read"] == 3 * BYTES_PER_BLOCK
    assert "tokens_stored" not in stats.data  # a delta: nothing stored this step
    assert events == []  # a load from the first tier stores nothing
    assert stats.data["blocks_loaded_in_step"] == 3
    assert stats.data["in_step_load_seconds"] > 0
    # The scheduler side shares the process (and the Offloader): it reports its hit
    # timings alone, or vLLM, which adds both sides' stats, would count the rest twice.
    own = eng.timed
    assert own is not None
    assert set(own.data) == {
        "hits_timed",
        "hit_lookup_seconds",
        "hit_schedule_seconds",
        "hit_step_seconds",
    }
    assert own.data["hits_timed"] == 1  # "again"; "a" was a miss
    assert not set(own.data) & set(stats.data)


def test_no_events_when_disabled_and_no_tier_records_pile_up(events_off: Engine) -> None:
    eng = events_off
    a = eng.request("a", prompt(0))
    assert eng.admit(a, [0, 1, 2, 3]) == 0
    events, stats = eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))
    assert events == []
    assert stats is not None
    assert stats.data["tokens_stored"] == 3 * BLOCK
    assert eng.worker.get_kv_connector_kv_cache_events() is None
    # With events off the tiers record nothing at all, so nothing piles up.
    offloader = REGISTRY[eng.worker.engine_id].offloader
    assert offloader.tiers[0].manager.take_events() == []


def test_worker_stats_feed_the_prometheus_counters(events_on: Engine, model_dir: str) -> None:
    eng = events_on
    a = eng.request("a", prompt(0))
    eng.admit(a, [0, 1, 2, 3])
    _, stats = eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))
    assert stats is not None
    registry = CollectorRegistry()
    prom = TieredOffloadConnector.build_prom_metrics(
        eng.config, metric_types(registry), LABELS, {0: ["m", "0"]}
    )
    prom.observe(stats.to_dict(), engine_idx=0)
    assert sample(registry, "vllm:kvoffload_tokens_stored_total", "0") == 3 * BLOCK
    assert sample(registry, "vllm:kvoffload_tier_blocks_stored_total", "0", "cpu") == 3
    seconds = sample(registry, "vllm:kvoffload_tier_write_seconds_total", "0", "cpu")
    assert seconds == pytest.approx(stats.data["tier.cpu.write_seconds"])


def test_events_from_several_workers_keep_what_all_reported() -> None:
    def stored(h: bytes) -> BlockStored:
        return BlockStored(
            block_hashes=[h],
            parent_block_hash=None,
            token_ids=[],
            block_size=0,
            lora_id=None,
            medium="CPU",
            lora_name=None,
        )

    combined = TieredOffloadKVEvents([stored(b"a"), stored(b"b")])
    combined.add_events([stored(b"a")])  # as vLLM's output aggregator combines workers
    combined.increment_workers(1)
    assert combined.aggregate().get_all_events() == [stored(b"a")]
    assert combined.get_number_of_workers() == 1
    single = TieredOffloadKVEvents([stored(b"a"), stored(b"a")])
    assert single.aggregate().get_all_events() == [stored(b"a"), stored(b"a")]
    # They cross from the worker's process to the engine core's pickled.
    assert pickle.loads(pickle.dumps(single)).get_all_events() == [stored(b"a")] * 2


def _matched(tokens: int | None) -> tuple[int] | None:
    """A lookup's answer as a true value (a hit of 0 tokens included), ``None`` while
    it is still being prefetched."""
    return None if tokens is None else (tokens,)


def _hit(eng: Engine, req: Request, block_ids: list[int]) -> int:
    """``admit``, asking again while the hit is prefetched (``None``), as vLLM does."""
    matched: int = wait_until(
        lambda: _matched(eng.scheduler.get_num_new_matched_tokens(req, 0)[0]),
        "the prefetch landed",
    )[0]
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=i) for i in block_ids],))
    eng.scheduler.update_state_after_alloc(req, blocks, matched)
    return matched


def _disk_tiers(tmp_path: Path) -> list[dict[str, Any]]:
    return [
        {"name": "cpu", "capacity": 8 * BYTES_PER_BLOCK},
        {"name": "ssd", "backend": "mmap", "capacity": "1MiB", "path": str(tmp_path / "ssd")},
    ]


def test_hit_sources_say_which_tier_served_the_hit(model_dir: str, tmp_path: Path) -> None:
    """vLLM's per-source hit counts (``get_external_cache_hit_sources``): a repeat's
    blocks come from the cpu tier (``host``); on a new engine over the same mmap tier
    they were prefetched from the disk (``disk``)."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    tiers = _disk_tiers(tmp_path)
    stored = Engine(vllm_config(model_dir, tiers, events=False))
    try:
        _store_prompt_0(stored)
        REGISTRY[stored.worker.engine_id].offloader.drain()
        assert _repeat_sources(stored) == {CacheHitSource.HOST: 3 * BLOCK}
    finally:
        stored.close()
    restarted = Engine(vllm_config(model_dir, tiers, events=False))
    try:
        assert _repeat_sources(restarted) == {CacheHitSource.DISK: 3 * BLOCK}
    finally:
        restarted.close()


def _store_prompt_0(eng: Engine) -> None:
    """Request ``a``, ``prompt(0)``, computed into blocks 0-3 and stored (3 blocks)."""
    a = eng.request("a", prompt(0))
    eng.admit(a, [0, 1, 2, 3])
    eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))


def _on_disk_only(model_dir: str, tmp_path: Path) -> Engine:
    """A new engine over an mmap tier holding ``prompt(0)``'s 3 blocks (stored by
    another, closed engine), its cpu tier empty."""
    tiers = _disk_tiers(tmp_path)
    first = Engine(vllm_config(model_dir, tiers, events=False))
    try:
        _store_prompt_0(first)
    finally:
        first.close()  # runs every queued job: the blocks are on disk
    return Engine(vllm_config(model_dir, tiers, events=False))


def test_a_queued_request_prefetches_before_its_lookup(model_dir: str, tmp_path: Path) -> None:
    """``on_new_request``: vLLM queued the request, and its prefix comes up from the
    disk before the scheduler reaches it; the lookup then finds it landed and answers
    at once (not ``None``, "still prefetching")."""
    eng = _on_disk_only(model_dir, tmp_path)
    try:
        req = eng.request("queued", prompt(0))
        eng.scheduler.on_new_request(req)
        wait_until(
            lambda: connector_counters()[eng.worker.engine_id]["prefetched_blocks"] >= 3,
            "the prefetch landed",
        )
        counts = connector_counters()[eng.worker.engine_id]
        assert (counts["lookups"], counts["prefetches_on_arrival"]) == (0, 1)
        assert eng.scheduler.get_num_new_matched_tokens(req, 0) == (3 * BLOCK, False)
    finally:
        eng.close()


def test_a_request_that_ends_while_queued_leaves_nothing_behind(
    model_dir: str, tmp_path: Path
) -> None:
    """Aborted before the scheduler reached it: its prefetches are released (or
    cancelled), and nothing stays pinned or waiting."""
    eng = _on_disk_only(model_dir, tmp_path)
    try:
        req = eng.request("gone", prompt(0))
        eng.scheduler.on_new_request(req)
        eng.scheduler.request_finished(req, [])
        health = wait_until(
            lambda: (h := connector_health()[eng.worker.engine_id])["prefetches"] == 0 and h,
            "no prefetch left",
        )
        assert health["claims"] == 0
        assert health["holds"] == 0
        assert health["problems"] == []
        assert set(health["pinned"]) == {0}
    finally:
        eng.close()


def test_disk_tier_events_and_a_promotion_describe_their_blocks(
    model_dir: str, tmp_path: Path
) -> None:
    """A disk tier's stores are ``STORAGE`` / ``LOCAL``; a new engine over the same disk
    announces the blocks it recovered (their journal says what they are) at its first
    step; there (the cpu tier empty), a hit prefetched from the disk is stored into
    the cpu tier, and that event too carries the blocks' tokens and parents (sent with
    the load)."""
    tiers = _disk_tiers(tmp_path)
    first = Engine(vllm_config(model_dir, tiers, events=True))
    try:
        a = first.request("a", prompt(0))
        first.admit(a, [0, 1, 2, 3])
        events, _ = first.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))
        REGISTRY[first.worker.engine_id].offloader.drain()
        events += first.step(first.request("short", [1, 2, 3]), [5], 3)[0]  # stores none
    finally:
        first.close()
    assert {(e.locality, e.ownership) for e in events if e.medium == "STORAGE"} == {("LOCAL", None)}
    events = [e for e in events if e.medium == "STORAGE"]
    hashes = [maybe_convert_block_hash(h) for h in a.block_hashes]
    assert [e.block_hashes for e in events] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in events] == [None, *hashes[:2]]

    eng = Engine(vllm_config(model_dir, tiers, events=True))
    try:
        again = eng.request("again", prompt(0))
        assert _hit(eng, again, [8, 9, 10, 11]) == 3 * BLOCK
        events, _ = eng.step(again, [8, 9, 10, 11], 1)
    finally:
        eng.close()
    stored = [e for e in events if isinstance(e, BlockStored)]
    recovered = [e for e in stored if e.medium == "STORAGE"]
    assert sorted(h for e in recovered for h in e.block_hashes) == sorted(hashes)
    assert [e.token_ids for e in recovered] == [e.token_ids for e in events[:3]]
    stored = [e for e in stored if e.medium == "CPU"]
    assert {(e.locality, e.ownership) for e in stored} == {("LOCAL", None)}
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    tokens = prompt(0)
    assert [e.token_ids for e in stored] == [tokens[i * BLOCK : (i + 1) * BLOCK] for i in range(3)]
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:2]]


def test_events_off_send_no_block_details_to_the_worker(events_off: Engine) -> None:
    """With events off a store carries its keys and block ids only."""
    eng = events_off
    a = eng.request("a", prompt(0))
    eng.admit(a, [0, 1, 2, 3])
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = []
    out.num_scheduled_tokens = {"a": len(a.prompt_token_ids or [])}
    eng.scheduler._scheduler_side()._reqs["a"].block_ids = [[0, 1, 2, 3]]
    meta = eng.scheduler.build_connector_meta(out)
    assert [len(s.keys) for s in meta.stores] == [3]
    assert [s.events for s in meta.stores] == [None]
    eng.scheduler.request_finished(a, [0, 1, 2, 3])


def _repeat_sources(eng: Engine) -> dict[Any, int]:
    """The per-source split of the hit of ``prompt(0)`` again."""
    again = eng.request("again", prompt(0))
    assert _hit(eng, again, [8, 9, 10, 11]) == 3 * BLOCK
    sources: dict[Any, int] = eng.scheduler.get_external_cache_hit_sources(again, 3 * BLOCK)
    return sources


def test_reset_cache_empties_the_cpu_tier(events_off: Engine) -> None:
    """``/reset_prefix_cache?reset_external=true`` calls ``reset_cache``: the cpu tier's
    blocks go, and a repeat is a miss."""
    eng = events_off
    a = eng.request("a", prompt(0))
    eng.admit(a, [0, 1, 2, 3])
    eng.step(a, [0, 1, 2, 3], len(a.prompt_token_ids or []))
    offloader = REGISTRY[eng.worker.engine_id].offloader
    assert len(offloader.tiers[0].manager.held_keys()) == 3
    assert eng.scheduler.reset_cache() is True
    assert offloader.tiers[0].manager.held_keys() == []
    assert eng.admit(eng.request("again", prompt(0)), [8, 9, 10, 11]) == 0

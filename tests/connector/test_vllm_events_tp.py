"""KV events at tensor parallelism 2 (connectors/vllm/events.py): two ranks' tiers,
each with its own book, whose stores finish in different steps, their event output
combined by vLLM's own ``KVOutputAggregator`` (as the executor does every step), then
published by the scheduler side.

vLLM's aggregation keeps, within one step, what every rank that sent events *that
step* reported; a block both ranks store, but in different steps, was announced twice
(each rank alone in its step) or never (each step's other rank sent other events).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
from support.blocks import BPB, LAYOUT, POOL, fill_pool, make_keys

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.offloader import Offloader

# Without vLLM this module skips; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

from kvoffload.connectors.vllm.events import (
    EventBlocks,
    EventBook,
    KVEventTally,
    TieredOffloadKVEvents,
)
from kvoffload.connectors.vllm.scheduler import TieredOffloadScheduler
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

BLOCKS = 6
CPU_BLOCKS = 4
TOKENS = 2


class Rank:
    """One rank's worker side: a real Offloader (a cpu tier of ``CPU_BLOCKS``, events
    on) and the book that turns its records into vLLM events. Its keys are its own
    (each rank namespaces vLLM's hashes), the hashes in its events the same as every
    rank's."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.keys = make_keys(BLOCKS, salt=100 + rank)
        config = load_config(
            {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": CPU_BLOCKS * BPB}]}, env={}
        )
        self.off = Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL), events=True)
        self.book = EventBook(enabled=True, cap=2 * BLOCKS)
        self.book.remember(self.keys, BLOCKS_OF_PROMPT)
        self.stored: set[Any] = set()
        """The hashes of the blocks this rank has stored."""

    def store(self, positions: range) -> None:
        """Store blocks ``positions`` of the prompt; done when this returns."""
        keys = [self.keys[p] for p in positions]
        ids = [1 + p for p in positions]
        assert self.off.pool is not None
        fill_pool(self.off.pool, keys, ids)
        job = self.off.submit_store(keys, ids)
        assert job is not None
        (res,) = self.off.wait([job], timeout=30)
        assert res.success, res.error
        assert self.off.drain()
        self.stored.update(_hash(p) for p in positions)

    def output(self) -> Any:
        """This step's model runner output as the executor receives it from the rank's
        process: the events as ``get_kv_connector_kv_cache_events`` makes them (none:
        ``None``), pickled across."""
        events, unknown = self.book.take(self.off)
        assert unknown == 0
        out = pickle.loads(pickle.dumps(EMPTY_MODEL_RUNNER_OUTPUT))
        out.kv_connector_output = KVConnectorOutput(
            kv_cache_events=TieredOffloadKVEvents(events, source=f"rank{self.rank}")
            if events
            else None
        )
        return pickle.loads(pickle.dumps(out))

    def held(self) -> set[Any]:
        """The vLLM hashes of the blocks this rank's cpu tier holds."""
        (tier,) = self.off.tiers
        return {_hash(p) for p, key in enumerate(self.keys) if tier.manager.ready(key)}


def _hash(position: int) -> Any:
    """Block ``position``'s hash as vLLM publishes it (an int: its last 8 bytes)."""
    return int.from_bytes(HASHES[position][-8:], "big")


HASHES: list[bytes | int] = [bytes([0xB0 + i]) * 32 for i in range(BLOCKS)]
BLOCKS_OF_PROMPT = EventBlocks(
    HASHES, [None, *HASHES[:-1]], list(range(BLOCKS * TOKENS)), TOKENS, None, None
)


@pytest.fixture
def ranks() -> Iterator[list[Rank]]:
    both = [Rank(0), Rank(1)]
    try:
        yield both
    finally:
        for r in both:
            r.off.close()


class Announced:
    """What a KV-event subscriber believes each tier holds, from the events published:
    a store of a block it believes held, or a removal of one it does not, is an event
    announced twice."""

    def __init__(self) -> None:
        self.held: dict[str | None, set[Any]] = {}

    def apply(self, events: list[KVCacheEvent]) -> None:
        for e in events:
            tier = self.held.setdefault(e.medium, set())
            for h in e.block_hashes:
                if isinstance(e, BlockStored):
                    assert h not in tier, f"block {h} announced stored twice in {e.medium}"
                    tier.add(h)
                else:
                    assert isinstance(e, BlockRemoved)
                    assert h in tier, f"block {h} announced removed, not announced stored"
                    tier.discard(h)


def _step(ranks: list[Rank], aggregator: KVOutputAggregator) -> Any:
    """Every rank's output of one step, combined by vLLM's aggregator."""
    combined = aggregator.aggregate([r.output() for r in ranks])
    return combined.kv_connector_output.kv_cache_events


# Each step, which blocks each rank finishes storing: rank 1 a step behind rank 0. The
# cpu tier holds 4 blocks, so blocks 4-5 evict blocks 0-1, on each rank in its own step.
STEPS = [
    {0: range(0, 2)},
    {0: range(2, 4), 1: range(0, 2)},
    {0: range(4, 6), 1: range(2, 4)},
    {1: range(4, 6)},
]


def _announceable(ranks: list[Rank]) -> set[Any]:
    """What the events should say the cpu tier holds: the blocks every rank has stored,
    less those every rank has evicted since (a store, and a removal, is announced once
    every rank has reported it)."""
    stored = set.intersection(*(r.stored for r in ranks))
    evicted = set.intersection(*(r.stored - r.held() for r in ranks))
    return stored - evicted


def test_blocks_announced_per_tier_are_what_both_ranks_tiers_hold(ranks: list[Rank]) -> None:
    """After every step, each store and eviction is announced once, once both ranks
    have reported it, though the ranks finish each in different steps; once both have
    caught up, the blocks announced in the cpu tier are those both ranks' tiers hold."""
    tally = KVEventTally(ranks=2)
    aggregator = KVOutputAggregator(expected_finished_count=2)
    seen = Announced()
    for stores in STEPS:
        for rank, positions in stores.items():
            ranks[rank].store(positions)
        seen.apply(tally.add(_step(ranks, aggregator)))
        assert seen.held.get("CPU", set()) == _announceable(ranks)
    assert seen.held["CPU"] == ranks[0].held() & ranks[1].held()
    assert seen.held["CPU"] == {_hash(p) for p in range(2, 6)}
    assert tally.pending() == 0


def test_the_scheduler_side_publishes_what_both_ranks_hold(ranks: list[Rank]) -> None:
    """The same steps through the scheduler side's own calls, as vLLM makes them each
    step: ``update_connector_output`` with the aggregated output, then
    ``take_events`` (the scheduler side publishes through its :class:`KVEventTally`)."""
    sched = TieredOffloadScheduler(
        engine_id="tp-events", slot="tp-events:0", ranks=2, block_size=TOKENS, events=True
    )
    aggregator = KVOutputAggregator(expected_finished_count=2)
    seen = Announced()
    for stores in STEPS:
        for rank, positions in stores.items():
            ranks[rank].store(positions)
        combined = aggregator.aggregate([r.output() for r in ranks])
        sched.update_connector_output(combined.kv_connector_output)
        seen.apply(list(sched.take_events()))
        assert seen.held.get("CPU", set()) == _announceable(ranks)
    assert seen.held["CPU"] == ranks[0].held() & ranks[1].held()


def _stored(position: int) -> BlockStored:
    return BlockStored(
        block_hashes=[_hash(position)],
        parent_block_hash=None,
        token_ids=[],
        block_size=TOKENS,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        ownership="cpu",
    )


def _removed(position: int) -> BlockRemoved:
    return BlockRemoved(block_hashes=[_hash(position)], medium="CPU", ownership="cpu")


def test_a_rank_reporting_a_block_again_counts_for_the_next_announcement() -> None:
    """Rank 0 stores, loses and stores block 0 again before rank 1 reports it once:
    nothing is announced until rank 1 has, then the three in order."""
    tally = KVEventTally(ranks=2)
    zero = TieredOffloadKVEvents([_stored(0), _removed(0)], source="rank0")
    assert tally.add(zero) == []
    assert tally.add(TieredOffloadKVEvents([_stored(0)], source="rank0")) == []
    late = TieredOffloadKVEvents([_stored(0), _removed(0), _stored(0)], source="rank1")
    assert tally.add(late) == [_stored(0), _removed(0), _stored(0)]
    assert tally.pending() == 0


def test_one_reporting_rank_publishes_everything_at_once() -> None:
    """A cache every rank holds alike (MLA) is kept and reported by rank 0 alone."""
    tally = KVEventTally(ranks=1)
    events = TieredOffloadKVEvents([_stored(0), _stored(0), _removed(1)])
    assert tally.add(events) == [_stored(0), _stored(0), _removed(1)]
    assert tally.add(None) == []


def test_the_oldest_events_only_some_ranks_reported_are_dropped_past_the_cap() -> None:
    tally = KVEventTally(ranks=2, cap=2)
    for p in range(3):
        assert tally.add(TieredOffloadKVEvents([_stored(p)], source="rank0")) == []
    assert (tally.pending(), tally.dropped) == (2, 1)
    assert tally.add(TieredOffloadKVEvents([_stored(0)], source="rank1")) == []  # dropped
    assert tally.add(TieredOffloadKVEvents([_stored(2)], source="rank1")) == [_stored(2)]


def test_each_process_reports_as_its_own_rank() -> None:
    """Without a source given, a rank's events say which process made them: made in
    a process forked from this one (as vLLM's workers may be), they count as another
    rank's; two reports of this process's count as one rank's, twice."""
    tally = KVEventTally(ranks=2)
    assert tally.add(TieredOffloadKVEvents([_stored(0)])) == []
    assert tally.add(TieredOffloadKVEvents([_stored(0)])) == []
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: another rank's worker
        try:
            os.write(write, pickle.dumps(TieredOffloadKVEvents([_stored(0)])))
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        theirs = pickle.loads(pipe.read())
    os.waitpid(pid, 0)
    # vLLM's aggregator hands the other rank's events on as get_all_events gives them.
    combined = TieredOffloadKVEvents([])
    combined.add_events(theirs.get_all_events())
    combined.increment_workers(1)
    assert tally.add(combined) == [_stored(0)]
    assert tally.pending() == 1  # this process's second report waits for another rank


def test_a_removal_counts_block_by_block_whatever_batches_each_rank_told() -> None:
    """Rank 0's eviction took two blocks at once, rank 1's one at a time: each block's
    removal is announced once both ranks have told it, those of one step together."""

    def removed(*positions: int) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[_hash(p) for p in positions], medium="CPU", ownership="cpu"
        )

    tally = KVEventTally(ranks=2)
    assert tally.add(TieredOffloadKVEvents([removed(0, 1)], source="rank0")) == []
    assert tally.add(TieredOffloadKVEvents([removed(1)], source="rank1")) == [removed(1)]
    assert tally.add(TieredOffloadKVEvents([removed(0)], source="rank1")) == [removed(0)]
    step = TieredOffloadKVEvents([removed(2, 3)], source="rank0")
    step.add_events(
        TieredOffloadKVEvents([removed(3), removed(2)], source="rank1").get_all_events()
    )
    assert tally.add(step) == [removed(3, 2)]
    assert tally.pending() == 0

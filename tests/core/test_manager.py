"""Narrated scenarios of the LRU offloading manager (and ARC where it differs)."""

from __future__ import annotations

import pytest

from kvoffload.exceptions import BlockStateError
from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingEvent
from kvoffload.slots import SlotAllocator


def k(i: int) -> BlockKey:
    return BlockKey(b"block-%04d" % i)


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


def manager(capacity: int, policy: str = "lru") -> LRUOffloadingManager:
    return LRUOffloadingManager(SlotAllocator(capacity), policy, name="t")


def store(m: LRUOffloadingManager, *ids: int) -> list[BlockKey]:
    out = m.prepare_store(ks(*ids))
    assert out is not None
    m.complete_store(out.keys_to_store)
    return out.evicted


def test_lru_scenario() -> None:
    m = manager(4)
    # store [0,1,2,3] -> fills the tier, evicts nothing
    out = m.prepare_store(ks(0, 1, 2, 3))
    assert out is not None
    assert out.keys_to_store == ks(0, 1, 2, 3)
    assert out.evicted == []
    assert sorted(out.slots) == [0, 1, 2, 3]
    # not loadable until complete_store
    assert m.lookup(ks(0, 1)) == 0
    m.complete_store(out.keys_to_store)
    assert m.lookup(ks(0, 1, 2, 3, 9)) == 4
    assert m.take_events() == [OffloadingEvent(tuple(ks(0, 1, 2, 3)), "t", removed=False)]
    # touch [2] -> LRU order becomes 0,1,3,2
    m.touch(ks(2))
    # store [4] -> evicts [0]
    assert store(m, 4) == ks(0)
    # store [5,6] -> evicts [1,3] (2 was touched)
    assert store(m, 5, 6) == ks(1, 3)
    assert m.lookup(ks(2)) == 1
    assert m.lookup(ks(0)) == 0
    events = m.take_events()
    assert [e.keys for e in events if e.removed] == [tuple(ks(0)), tuple(ks(1, 3))]
    assert m.check() == []


def test_touch_makes_the_first_key_most_recent() -> None:
    m = manager(3)
    store(m, 0, 1, 2)
    # touch [2,1,0] (a request whose prefix is 2,1,0) -> 2, the head, is most recent
    # and 0, the tail, least: a tail is useless without its head, so it goes first
    m.touch(ks(2, 1, 0))
    assert store(m, 3) == ks(0)


def test_prepare_store_skips_held_keys_and_repeats() -> None:
    m = manager(4)
    store(m, 0, 1)
    # store [1,2,2,3] -> only 2 and 3 are new, the repeated 2 counts once
    out = m.prepare_store(ks(1, 2, 2, 3))
    assert out is not None
    assert out.keys_to_store == ks(2, 3)
    assert out.evicted == []
    m.complete_store(out.keys_to_store)
    assert len(m) == 4


def test_pinned_blocks_are_never_evicted() -> None:
    m = manager(2)
    store(m, 0, 1)
    # load [0] -> pinned
    assert m.prepare_load(ks(0)) == [m.state(k(0)).slot]  # type: ignore[union-attr]
    # store [2] -> must evict 1, the only unpinned block, though 0 is older
    assert store(m, 2) == ks(1)
    # store [3] -> 0 pinned, 2 is evictable -> evicts 2
    assert store(m, 3) == ks(2)
    # store [4,5] -> needs 2 slots, only 3 evictable -> None, nothing changes
    assert m.prepare_store(ks(4, 5)) is None
    assert m.lookup(ks(0)) == 1
    assert m.lookup(ks(3)) == 1
    m.complete_load(ks(0))
    # unpinned: now [4,5] fits by evicting 0 and 3
    assert sorted(store(m, 4, 5)) == sorted(ks(0, 3))


def test_blocks_being_written_are_not_evicted_nor_loadable() -> None:
    m = manager(2)
    first = m.prepare_store(ks(0, 1))
    assert first is not None
    # both in flight: no room can be made for [2]
    assert m.prepare_store(ks(2)) is None
    assert m.lookup(ks(0)) == 0
    with pytest.raises(BlockStateError):
        m.prepare_load(ks(0))
    m.complete_store(ks(0, 1))
    assert m.lookup(ks(0, 1)) == 2


def test_keys_named_in_the_same_call_are_protected() -> None:
    m = manager(2)
    store(m, 0, 1)
    # store [0,2] -> 0 is held (skipped) and protected, so 1 goes even though 0 is older
    out = m.prepare_store(ks(0, 2))
    assert out is not None
    assert out.keys_to_store == ks(2)
    assert out.evicted == ks(1)


def test_failed_store_drops_and_frees() -> None:
    m = manager(2)
    out = m.prepare_store(ks(0, 1))
    assert out is not None
    m.complete_store(ks(0), success=True)
    m.complete_store(ks(1), success=False)
    assert m.lookup(ks(0, 1)) == 1
    assert m.allocator.num_free == 1
    events = m.take_events()
    # a block that was never loadable produces no "removed" event
    assert events == [OffloadingEvent(tuple(ks(0)), "t", removed=False)]
    assert m.check() == []


def test_more_keys_than_capacity_returns_none() -> None:
    m = manager(2)
    assert m.prepare_store(ks(0, 1, 2)) is None
    assert len(m) == 0
    assert m.allocator.num_free == 2


def test_complete_store_ignores_keys_it_did_not_prepare() -> None:
    m = manager(2)
    store(m, 0)
    m.complete_store(ks(0, 7), success=False)  # 0 is ready, 7 unknown: both ignored
    assert m.lookup(ks(0)) == 1


def test_complete_load_of_unpinned_key_is_a_bug() -> None:
    m = manager(2)
    store(m, 0)
    with pytest.raises(BlockStateError, match="not pinned"):
        m.complete_load(ks(0))


def test_lookup_stops_at_first_gap() -> None:
    m = manager(4)
    store(m, 0, 2)
    assert m.lookup(ks(0, 1, 2)) == 1
    assert m.lookup(ks(1, 0)) == 0
    assert m.lookup([]) == 0


def test_events_can_be_disabled() -> None:
    m = LRUOffloadingManager(SlotAllocator(2), enable_events=False)
    store(m, 0)
    assert m.take_events() == []


def test_arc_keeps_frequently_used_blocks_over_a_scan() -> None:
    # ARC: 0 and 1 are used twice (T2); a scan of one-off blocks must not flush them.
    m = manager(4, "arc")
    store(m, 0, 1)
    m.touch(ks(0, 1))
    for i in range(10, 20):
        store(m, i)
    assert m.lookup(ks(0)) == 1
    assert m.lookup(ks(1)) == 1
    # Under LRU the same scan flushes them.
    lru = manager(4, "lru")
    store(lru, 0, 1)
    lru.touch(ks(0, 1))
    for i in range(10, 20):
        store(lru, i)
    assert lru.lookup(ks(0)) == 0


def test_arc_ghost_hit_returns_to_frequent_list() -> None:
    m = manager(2, "arc")
    store(m, 0, 1)
    # store [2] -> evicts 0 from T1 into ghost list B1
    assert store(m, 2) == ks(0)
    # store [0] again -> ghost hit: p grows, 0 goes to T2
    store(m, 0)
    assert m.policy.p > 0  # type: ignore[attr-defined]
    assert k(0) in m.policy._t2  # type: ignore[attr-defined]


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="allowed: arc, lru"):
        manager(2, "fifo")

"""A Hypothesis state machine: the manager against a plain reference LRU model.

Invariants checked after every step: capacity is never exceeded, pinned and in-flight
blocks are never evicted, ``lookup`` is the longest ready prefix, and the events
match what the model says happened.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.slots import SlotAllocator

CAPACITY = 5
KEYS = [BlockKey(b"key-%02d" % i) for i in range(12)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)


class ReferenceLRU:
    """The obvious model: an ordered dict of key -> [state, pins], least recent first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockKey, list[int]] = OrderedDict()  # key -> [ready, pins]

    def lookup(self, keys: list[BlockKey]) -> int:
        n = 0
        for key in keys:
            if key not in self.blocks or not self.blocks[key][0]:
                break
            n += 1
        return n

    def prepare_store(self, keys: list[BlockKey]) -> tuple[list[BlockKey], list[BlockKey]] | None:
        new = [key for key in dict.fromkeys(keys) if key not in self.blocks]
        deficit = len(new) - (self.capacity - len(self.blocks))
        victims: list[BlockKey] = []
        if deficit > 0:
            for key, (ready, pins) in self.blocks.items():
                if ready and pins == 0 and key not in keys:
                    victims.append(key)
                    if len(victims) == deficit:
                        break
            if len(victims) < deficit:
                return None
        for key in victims:
            del self.blocks[key]
        for key in new:
            self.blocks[key] = [0, 0]
        return new, victims


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = LRUOffloadingManager(SlotAllocator(CAPACITY), "lru", name="t")
        self.ref = ReferenceLRU(CAPACITY)
        self.in_flight: list[list[BlockKey]] = []  # prepared, not completed stores
        self.loads: list[list[BlockKey]] = []  # pinned, not completed loads
        self.expected_stored: list[BlockKey] = []
        self.expected_removed: list[BlockKey] = []

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[BlockKey]) -> None:
        pinned_before = {key for load in self.loads for key in load}
        writing_before = {key for batch in self.in_flight for key in batch}
        got = self.m.prepare_store(keys)
        want = self.ref.prepare_store(keys)
        if want is None:
            assert got is None
            return
        assert got is not None
        new, victims = want
        assert got.keys_to_store == new
        assert got.evicted == victims
        assert len(set(got.slots)) == len(got.slots)
        assert not set(got.evicted) & pinned_before, "evicted a pinned block"
        assert not set(got.evicted) & writing_before, "evicted a block being written"
        assert not set(got.evicted) & set(keys), "evicted a block named in the call"
        self.expected_removed += victims
        if new:
            self.in_flight.append(new)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        batch = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.m.complete_store(batch, success=success)
        for key in batch:
            if success:
                self.ref.blocks[key][0] = 1
            else:
                del self.ref.blocks[key]
        if success:
            self.expected_stored += batch

    @rule(keys=key_lists)
    def load(self, keys: list[BlockKey]) -> None:
        n = self.m.lookup(keys)
        assert n == self.ref.lookup(keys)
        if n == 0:
            return
        prefix = keys[:n]
        slots = self.m.prepare_load(prefix)
        assert len(slots) == n
        for key in prefix:
            self.ref.blocks[key][1] += 1
        self.m.touch(prefix)
        for key in reversed(prefix):
            if key in self.ref.blocks:
                self.ref.blocks.move_to_end(key)
        self.loads.append(prefix)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        prefix = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(prefix)
        for key in prefix:
            self.ref.blocks[key][1] -= 1

    @rule(keys=key_lists)
    def touch(self, keys: list[BlockKey]) -> None:
        self.m.touch(keys)
        for key in reversed(keys):
            if key in self.ref.blocks:
                self.ref.blocks.move_to_end(key)

    @invariant()
    def capacity_never_exceeded(self) -> None:
        assert len(self.m) <= CAPACITY
        assert len(self.m) == len(self.ref.blocks)

    @invariant()
    def same_blocks_same_states(self) -> None:
        for key, (ready, pins) in self.ref.blocks.items():
            state = self.m.state(key)
            assert state is not None
            assert state.ref_cnt == (pins if ready else -1)

    @invariant()
    def lookup_is_longest_ready_prefix(self) -> None:
        for start in range(0, len(KEYS), 3):
            keys = KEYS[start : start + 4]
            assert self.m.lookup(keys) == self.ref.lookup(keys)

    @invariant()
    def events_match_the_model(self) -> None:
        stored: list[BlockKey] = []
        removed: list[BlockKey] = []
        for event in self.m.take_events():
            (removed if event.removed else stored).extend(event.keys)
        assert stored == self.expected_stored
        assert removed == self.expected_removed
        self.expected_stored, self.expected_removed = [], []

    @invariant()
    def books_are_consistent(self) -> None:
        assert self.m.check() == []


ManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


class ARCManagerMachine(ManagerMachine):
    """The same invariants under ARC; victims are ARC's choice, checked for legality."""

    def __init__(self) -> None:
        super().__init__()
        self.m = LRUOffloadingManager(SlotAllocator(CAPACITY), "arc", name="t")

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[BlockKey]) -> None:
        new = [key for key in dict.fromkeys(keys) if key not in self.ref.blocks]
        evictable = [
            key
            for key, (ready, pins) in self.ref.blocks.items()
            if ready and pins == 0 and key not in keys
        ]
        deficit = len(new) - (CAPACITY - len(self.ref.blocks))
        got = self.m.prepare_store(keys)
        if deficit > len(evictable):
            assert got is None
            return
        assert got is not None
        assert got.keys_to_store == new
        assert len(got.evicted) == max(deficit, 0)
        assert set(got.evicted) <= set(evictable), "evicted a pinned, in-flight or named block"
        for key in got.evicted:
            del self.ref.blocks[key]
        for key in new:
            self.ref.blocks[key] = [0, 0]
        self.expected_removed += got.evicted
        if new:
            self.in_flight.append(new)


ARCManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)
TestARCManagerMachine = ARCManagerMachine.TestCase

"""The manager's opt-in byte budget (issue 33): a compressed tier holds blocks by the
bytes they take, charged ``full_charge`` until their lane reports the stored size.

Narrated rules with exact figures first, then a Hypothesis state machine against a
plain model (an ordered dict of key -> [ready, pins, charge], least recent first).
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvoffload.exceptions import BlockStateError
from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingEvent
from kvoffload.slots import SlotAllocator

FULL = 100


def k(i: int) -> BlockKey:
    return BlockKey(b"block-%04d" % i)


def ks(*ids: int) -> list[BlockKey]:
    return [k(i) for i in ids]


def budgeted(slots: int, blocks: int = 10, policy: str = "lru") -> LRUOffloadingManager:
    """A tier of ``slots`` slots and a budget of ``blocks`` full blocks."""
    return LRUOffloadingManager(
        SlotAllocator(slots), policy, name="t", byte_budget=blocks * FULL, full_charge=FULL
    )


def store(m: LRUOffloadingManager, *ids: int, size: int | None = None) -> list[BlockKey]:
    """Store ``ids`` as the books will: prepare, the lane's sizes, complete."""
    out = m.prepare_store(ks(*ids))
    assert out is not None
    if size is not None:
        m.charge(out.keys_to_store, [size] * len(out.keys_to_store))
    m.complete_store(out.keys_to_store)
    return out.evicted


def snapshot(m: LRUOffloadingManager) -> tuple[object, ...]:
    """Everything a refused call must leave as it was."""
    states = {key: (s.slot, s.ref_cnt) for key in m.held_keys() if (s := m.state(key))}
    return states, m.bytes_held, m.allocator.num_free, m.held_keys()


# -- admission and eviction ----------------------------------------------------------
def test_stores_charged_70_percent_hold_13_blocks_where_slots_would_hold_10() -> None:
    m = budgeted(slots=20)
    # store 0..12 one at a time, each charged 70 by its lane: 13 * 70 = 910 bytes
    for i in range(13):
        assert store(m, i, size=70) == []
    assert (len(m), m.bytes_held) == (13, 910)
    # store 13: admitted at 100 (910 + 100 > 1000) -> evicts 0, the least recent
    assert store(m, 13, size=70) == ks(0)
    assert (len(m), m.bytes_held) == (13, 910)
    assert m.check() == []


def test_restored_charges_of_70_percent_hold_14_blocks() -> None:
    m = budgeted(slots=20)
    allocator = m.allocator
    assert allocator.allocate(14) == list(range(14))
    m.restore([(k(i), i) for i in range(14)], [70] * 14)
    assert (len(m), m.bytes_held) == (14, 980)
    # store 14: 980 + 100 needs 80 bytes -> one round frees 70, a second round 70 more:
    # exactly the two least recent blocks go
    m.touch(ks(0))
    assert store(m, 14) == ks(1, 2)
    assert (len(m), m.bytes_held) == (13, 940)
    assert m.check() == []


def test_eviction_takes_exactly_the_lru_blocks_needed() -> None:
    m = budgeted(slots=20)
    for i, size in enumerate([10, 20, 30, 40, 50, 60, 70, 80, 90]):
        store(m, i, size=size)
    assert m.bytes_held == 450
    # store 9..13 (5 new, 500 bytes): 950 <= 1000, nothing goes
    assert store(m, 9, 10, 11, 12, 13, size=100) == []
    # touch 0 -> the least recent are now 1, 2, 3, ...
    m.touch(ks(0))
    # store 14: 950 + 100 needs 50: 1 (20) then 2 (30) frees 50 exactly; 0 stays
    assert store(m, 14, size=100) == ks(1, 2)
    assert m.bytes_held == 1000
    events = m.take_events()
    assert [e.keys for e in events if e.removed] == [tuple(ks(1, 2))]
    assert m.check() == []


def test_refusal_evicts_nothing() -> None:
    m = budgeted(slots=20)
    store(m, 0, 1, 2, 3, 4, 5, 6, 7, size=100)
    m.prepare_load(ks(0, 1, 2, 3, 4, 5, 6))  # pinned: 700 bytes stay whatever happens
    m.take_events()
    before = snapshot(m)
    # store 8..11: 800 + 400 needs 200, and only 7 (100) may go: refused, and 7 stays
    assert m.prepare_store(ks(8, 9, 10, 11)) is None
    assert snapshot(m) == before
    assert m.take_events() == []
    assert m.check() == []


def test_pinned_and_in_flight_blocks_are_never_evicted() -> None:
    m = budgeted(slots=20)
    store(m, 0, 1, 2, 3, size=100)
    writing = m.prepare_store(ks(4, 5, 6))  # 300 bytes in flight
    assert writing is not None
    m.prepare_load(ks(0, 1))  # pinned
    # store 7, 8, 9, 10: 700 + 400 needs 100 -> 2, the least recent idle block
    assert store(m, 7, 8, 9, 10) == ks(2)
    m.complete_load(ks(0, 1))
    m.complete_store(writing.keys_to_store)
    # now 0 is the least recent idle block again
    assert store(m, 11) == ks(0)
    assert m.check() == []


def test_blocks_named_in_the_call_are_not_evicted_nor_counted_as_room() -> None:
    m = budgeted(slots=20, blocks=3)
    store(m, 0, 1, 2, size=100)
    m.prepare_load(ks(1, 2))
    # store [0, 3]: the only idle block is 0, named in the call, so no room
    assert m.prepare_store(ks(0, 3)) is None
    m.complete_load(ks(1, 2))
    # store [0, 3]: 1 goes (0 is named, though least recent)
    assert store(m, 0, 3) == ks(1)
    assert m.check() == []


def test_a_batch_larger_than_the_budget_is_refused() -> None:
    m = budgeted(slots=20)
    assert m.prepare_store([k(i) for i in range(11)]) is None
    assert (len(m), m.bytes_held) == (0, 0)
    # 10 fit exactly, and a repeated key counts once
    out = m.prepare_store([*ks(0, 0), *(k(i) for i in range(1, 10))])
    assert out is not None
    assert len(out.keys_to_store) == 10
    assert m.bytes_held == 1000


def test_slots_still_cap_the_block_count() -> None:
    m = budgeted(slots=4)
    store(m, 0, 1, 2, 3, size=10)
    # 40 bytes of 1000 held, but no slot free -> evicts 0 for the slot
    assert store(m, 4, size=10) == ks(0)
    assert (len(m), m.bytes_held) == (4, 40)
    # every block pinned: slots bind, refused
    m.prepare_load(ks(1, 2, 3, 4))
    assert m.prepare_store(ks(5)) is None
    assert m.check() == []


def test_arc_under_a_budget_keeps_to_it() -> None:
    m = budgeted(slots=20, blocks=4, policy="arc")
    for i in range(30):
        store(m, i, size=30 + i % 5 * 15)
        m.touch(ks(i // 2))
        assert m.bytes_held <= 400
        assert m.check() == []


# -- charges ---------------------------------------------------------------------
def test_charge_rules() -> None:
    m = budgeted(slots=20)
    out = m.prepare_store(ks(0, 1, 2))
    assert out is not None
    assert m.bytes_held == 300
    with pytest.raises(BlockStateError, match=r"outside 1\.\.100"):
        m.charge(ks(0), [101])
    with pytest.raises(BlockStateError, match=r"outside 1\.\.100"):
        m.charge(ks(0), [0])
    # a bad size later in the batch changes nothing, even for the good ones before it
    with pytest.raises(BlockStateError):
        m.charge(ks(0, 1), [50, 0])
    assert m.bytes_held == 300
    # being written: charged; a key not held is ignored
    m.charge(ks(0, 9), [50, 70])
    assert m.bytes_held == 250
    m.complete_store(out.keys_to_store)
    # ready: charged too; a charge only falls
    m.charge(ks(1), [40])
    assert m.bytes_held == 190
    with pytest.raises(BlockStateError, match=r"outside 1\.\.40"):
        m.charge(ks(1), [41])
    with pytest.raises(ValueError, match="zip"):
        m.charge(ks(0, 1), [10])
    assert m.bytes_held == 190
    assert m.check() == []


def test_charge_of_a_pinned_block_and_unpin() -> None:
    m = budgeted(slots=20, blocks=2)
    store(m, 0, 1)
    m.prepare_load(ks(0, 0))  # pinned twice in one call
    m.charge(ks(0), [30])
    m.complete_load(ks(0))
    with pytest.raises(BlockStateError, match="not pinned"):
        m.complete_load(ks(0, 0))  # one pin left: checked whole, nothing unpinned
    assert m.state(k(0)).ref_cnt == 1  # type: ignore[union-attr]
    m.complete_load(ks(0))
    assert m.check() == []
    # 130 held: store 2 needs 30 -> evicts 0 (30) alone
    assert store(m, 2) == ks(0)
    assert m.bytes_held == 200


def test_failed_store_and_remove_release_their_charge() -> None:
    m = budgeted(slots=20)
    store(m, 0, 1, size=60)
    out = m.prepare_store(ks(2, 3))
    assert out is not None
    m.charge(ks(2), [10])
    assert m.bytes_held == 230
    m.complete_store(out.keys_to_store, success=False)
    assert m.bytes_held == 120
    assert m.remove(ks(0, 7)) == [0]
    assert m.bytes_held == 60
    assert m.check() == []


def test_charge_on_an_unbudgeted_tier_is_ignored() -> None:
    m = LRUOffloadingManager(SlotAllocator(4), name="t")
    store(m, 0)
    m.charge(ks(0), [10**9])
    assert m.bytes_held == 0
    assert m.check() == []


# -- restore -----------------------------------------------------------------------
def test_restore_charges_full_by_default_and_refuses_over_budget() -> None:
    m = budgeted(slots=20)
    assert m.allocator.allocate(11) == list(range(11))
    m.restore([(k(i), i) for i in range(5)])
    assert m.bytes_held == 500
    before = snapshot(m)
    with pytest.raises(BlockStateError, match="exceeds the byte budget 1000"):
        m.restore([(k(i), i) for i in range(5, 11)])  # 600 more
    # each cannot: a charge of 0, a key twice, a slot twice, a slot held, a free slot
    for blocks, charges in [
        ([(k(5), 5)], [0]),
        ([(k(5), 5), (k(5), 6)], [10, 10]),
        ([(k(5), 5), (k(6), 5)], [10, 10]),
        ([(k(5), 4)], [10]),
        ([(k(5), 15)], [10]),
    ]:
        with pytest.raises(BlockStateError, match="cannot restore"):
            m.restore(blocks, charges)
    with pytest.raises(ValueError, match="2 blocks restored with 1 charges"):
        m.restore([(k(5), 5), (k(6), 6)], [10])
    assert snapshot(m) == before
    m.restore([(k(i), i) for i in range(5, 11)], [80] * 6)
    assert m.bytes_held == 980
    assert m.check() == []


def test_restore_with_charges_needs_a_budget() -> None:
    m = LRUOffloadingManager(SlotAllocator(4, used=[0]), name="t")
    with pytest.raises(ValueError, match="no byte budget"):
        m.restore([(k(0), 0)], [10])


def test_a_budget_needs_a_full_charge_that_fits() -> None:
    with pytest.raises(ValueError, match="needs 1 <= full_charge <= it"):
        LRUOffloadingManager(SlotAllocator(4), byte_budget=100)
    with pytest.raises(ValueError, match="needs 1 <= full_charge <= it"):
        LRUOffloadingManager(SlotAllocator(4), byte_budget=99, full_charge=100)


def test_check_finds_charges_out_of_step() -> None:
    m = budgeted(slots=4)
    store(m, 0, size=50)
    m._charges[3] = 7
    m._charges[0] = 101
    problems = m.check()
    assert "free slot 3 carries a charge of 7" in problems
    assert any("charged 101, outside 1..100" in p for p in problems)
    assert "charges sum to 101 but bytes_held is 50" in problems
    assert "idle charges sum to 101 but 50 are kept" in problems
    m._charges[0] = m.bytes_held = 2000
    assert "2000 bytes held exceed the byte budget 1000" in m.check()


# -- without a budget, nothing changes --------------------------------------------
def run_script(m: LRUOffloadingManager) -> list[object]:
    """A scripted mix of every call; what each answered."""
    out: list[object] = []
    for step in range(400):
        keys = [k((step * 7 + j * 3) % 23) for j in range(1 + step % 4)]
        n = m.lookup(keys)
        out.append(n)
        if n:
            out.append(m.prepare_load(keys[:n]))
            m.touch(keys[:n])
            m.complete_load(keys[:n])
        got = m.prepare_store(keys)
        out.append(None if got is None else (got.keys_to_store, got.slots, got.evicted))
        if got is not None:
            m.complete_store(got.keys_to_store, success=step % 5 != 0)
        if step % 11 == 0:
            out.append(m.remove(keys[:1]))
        out.append(m.take_events())
    out.append(m.check())
    return out


def test_a_budget_that_never_binds_changes_no_answer() -> None:
    plain = LRUOffloadingManager(SlotAllocator(8), name="t")
    loose = budgeted(slots=8, blocks=8)  # 8 full blocks fit: the slots bind first
    assert run_script(plain) == run_script(loose)
    assert plain.bytes_held == 0
    assert plain.byte_budget is None


def test_unbudgeted_answers_are_as_before() -> None:
    """Figures of this script on the manager before the budget existed (7dc31ed),
    where its full answers also matched these, under LRU and ARC."""
    answers = run_script(LRUOffloadingManager(SlotAllocator(8), name="t"))
    assert len(answers) == 1238
    assert answers[-1] == []
    assert sum(len(a[2]) for a in answers if isinstance(a, tuple)) == 708  # evicted
    events = [e for a in answers if isinstance(a, list) for e in a if type(e) is OffloadingEvent]
    assert sum(len(e.keys) for e in events if not e.removed) == 745
    assert sum(len(e.keys) for e in events if e.removed) == 708 + 29  # and removed


# -- the state machine ---------------------------------------------------------------
SLOTS = 10
BUDGET = 5 * FULL  # charges of 1..FULL: now the bytes bind, now the slots
KEYS = [BlockKey(b"key-%02d" % i) for i in range(16)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=3)
sizes = st.integers(1, FULL)


class Model:
    """Key -> [ready, pins, charge], least recent first; room made by the obvious walk."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[BlockKey, list[int]] = OrderedDict()

    def held(self) -> int:
        return sum(charge for _, _, charge in self.blocks.values())

    def prepare_store(self, keys: list[BlockKey]) -> tuple[list[BlockKey], list[BlockKey]] | None:
        new = [key for key in dict.fromkeys(keys) if key not in self.blocks]
        if not new:
            return [], []
        slots_short = len(new) - (SLOTS - len(self.blocks))
        bytes_short = self.held() + len(new) * FULL - BUDGET
        victims: list[BlockKey] = []
        for key, (ready, pins, charge) in self.blocks.items():
            if slots_short <= 0 and bytes_short <= 0:
                break
            if ready and pins == 0 and key not in keys:
                victims.append(key)
                slots_short -= 1
                bytes_short -= charge
        if slots_short > 0 or bytes_short > 0:
            return None
        for key in victims:
            del self.blocks[key]
        for key in new:
            self.blocks[key] = [0, 0, FULL]
        return new, victims

    def finish(self, keys: list[BlockKey], success: bool) -> None:
        """A store's end: its blocks ready, or gone with their charge."""
        for key in keys:
            if success:
                self.blocks[key][0] = 1
            else:
                del self.blocks[key]

    def pin(self, keys: list[BlockKey], by: int) -> None:
        for key in keys:
            self.blocks[key][1] += by

    def touch(self, keys: list[BlockKey]) -> None:
        for key in reversed(keys):
            if key in self.blocks:
                self.blocks.move_to_end(key)


class BudgetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = budgeted(SLOTS, BUDGET // FULL)
        self.ref = Model()
        self.in_flight: list[list[BlockKey]] = []
        self.loads: list[list[BlockKey]] = []
        self.expected_removed: list[BlockKey] = []

    def _prepare(self, keys: list[BlockKey]) -> list[BlockKey]:
        """prepare_store on both; the keys to write (none if refused)."""
        got = self.m.prepare_store(keys)
        want = self.ref.prepare_store(keys)
        assert (got is None) == (want is None), "refused where the model makes room, or not"
        if got is None or want is None:
            event("store refused")
            return []
        new, victims = want
        event(f"store evicted {min(len(victims), 3)}+" if victims else "store evicted 0")
        assert got.keys_to_store == new
        assert got.evicted == victims, "evicted other blocks than the least recent needed"
        self.expected_removed += victims
        return new

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[BlockKey]) -> None:
        new = self._prepare(keys)
        if new:
            self.in_flight.append(new)

    @rule(keys=key_lists, size=sizes)
    def store_whole(self, keys: list[BlockKey], size: int) -> None:
        """The common path in one step: prepare, the lane's sizes, complete."""
        new = self._prepare(keys)
        self.m.charge(new, [size] * len(new))
        self.m.complete_store(new)
        self.ref.finish(new, success=True)
        for key in new:
            self.ref.blocks[key][2] = size

    @rule(keys=key_lists, data=st.data())
    def charge(self, keys: list[BlockKey], data: st.DataObject) -> None:
        bad = data.draw(st.booleans())
        sizes_ = data.draw(st.lists(st.integers(0 if bad else 1, FULL + bad), min_size=len(keys)))
        sizes_ = sizes_[: len(keys)]
        blocks = self.ref.blocks
        ok = all(
            1 <= size <= (blocks[key][2] if key in blocks else FULL)
            for key, size in zip(keys, sizes_, strict=True)
        )
        if not ok:
            event("charge refused")
            with pytest.raises(BlockStateError):
                self.m.charge(keys, sizes_)
            return
        self.m.charge(keys, sizes_)
        for key, size in zip(keys, sizes_, strict=True):
            if key in blocks:
                blocks[key][2] = size

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        batch = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        self.m.complete_store(batch, success=success)
        self.ref.finish(batch, success)

    @rule(keys=key_lists)
    def load(self, keys: list[BlockKey]) -> None:
        n = self.m.lookup(keys)
        if n == 0:
            return
        prefix = keys[:n]
        self.m.prepare_load(prefix)
        self.ref.pin(prefix, 1)
        self.m.touch(prefix)
        self.ref.touch(prefix)
        self.loads.append(prefix)

    @precondition(lambda self: self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        prefix = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.m.complete_load(prefix)
        self.ref.pin(prefix, -1)

    @rule(keys=key_lists)
    def touch(self, keys: list[BlockKey]) -> None:
        self.m.touch(keys)
        self.ref.touch(keys)

    @rule(keys=key_lists)
    def remove(self, keys: list[BlockKey]) -> None:
        blocks = self.ref.blocks
        idle = [key for key in keys if key in blocks and blocks[key][:2] == [1, 0]]
        absent = [key for key in keys if key not in blocks]
        self.m.remove(idle + absent)
        for key in dict.fromkeys(idle):
            del blocks[key]
        self.expected_removed += list(dict.fromkeys(idle))

    @rule()
    def reopen(self) -> None:
        """A restart: blocks being written are lost, pins end, the ready blocks come
        back in their slots with the stored sizes the tier recovered."""
        ready = [(key, b[2]) for key, b in self.ref.blocks.items() if b[0]]
        pairs = [(key, self.m.state(key).slot) for key, _ in ready]  # type: ignore[union-attr]
        self.m = budgeted(SLOTS, BUDGET // FULL)
        self.m.allocator.reserve(slot for _, slot in pairs)
        self.m.restore(pairs, [charge for _, charge in ready])
        self.ref.blocks = OrderedDict((key, [1, 0, charge]) for key, charge in ready)
        self.in_flight, self.loads, self.expected_removed = [], [], []

    @invariant()
    def books_agree_with_the_model(self) -> None:
        assert self.m.check() == []
        assert self.m.bytes_held == self.ref.held() <= BUDGET
        assert set(self.m.held_keys()) == set(self.ref.blocks)
        for key, (ready, pins, _) in self.ref.blocks.items():
            state = self.m.state(key)
            assert state is not None
            assert state.ref_cnt == (pins if ready else -1)

    @invariant()
    def evictions_are_the_models(self) -> None:
        removed = [key for e in self.m.take_events() if e.removed for key in e.keys]
        assert removed == self.expected_removed
        self.expected_removed = []


BudgetMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
TestBudgetMachine = BudgetMachine.TestCase

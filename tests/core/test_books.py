"""The Offloader's books on plain keys: cascade, admission, backpressure, corruption,
breakers and claims decided without a thread, a tensor or a byte moved. Each scenario
plays the jobs' part by hand: take the books' orders, hand back their outcomes
(``Books.settle``), as plain values."""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.blocks import make_keys

from kvoffload.books import HIT_COUNTS, HIT_COUNTS_MIN, Books, hit_counts_bound
from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.plans import Copy, Discard, LoadOutcome, Tally, Write, WriteOutcome
from kvoffload.slots import SlotAllocator

BPB = 4096


class Fake:
    """The books' two callbacks, recorded. A discard is I/O: it must find the books'
    lock free (every scenario here runs on one thread, so a held lock is ours)."""

    def __init__(self) -> None:
        self.depth = [0, 0, 0]
        self.discarded: list[tuple[int, list[int]]] = []
        self.books: Books | None = None

    def discard(self, t: int, slots: list[int]) -> None:
        assert self.books is not None
        assert not self.books.lock.locked(), "a discard ran under the books' lock"
        self.discarded.append((t, slots))


def _books(*lower: dict[str, Any], blocks: tuple[int, ...] = (8, 16, 32)) -> tuple[Books, Fake]:
    tiers: list[dict[str, Any]] = [{"name": "cpu", "backend": "cpu", "capacity": blocks[0] * BPB}]
    for i, extra in enumerate(lower, 1):
        tiers.append({"name": f"t{i}", "backend": "cpu", "capacity": blocks[i] * BPB, **extra})
    config = load_config({"tiers": tiers}, env={})
    managers = [
        LRUOffloadingManager(SlotAllocator(n), "lru", name=c.name, enable_events=False)
        for n, c in zip(blocks, config.resolved_tiers(), strict=False)
    ]
    fake = Fake()
    books = Books(
        managers,
        config.resolved_tiers(),
        bytes_per_block=BPB,
        persistent=[False] + [True] * len(lower),
        prefetch_max_inflight=4 * BPB,
        depth=lambda t: fake.depth[t],
        discard=fake.discard,
    )
    fake.books = books
    return books, fake


BUF = object()
"""Stands for a staging buffer: the books only see whether an outcome has one."""


def _landed(w: Write, *, buffered: bool) -> WriteOutcome:
    """The outcome of a write that landed whole (its bytes left in a buffer or not)."""
    return WriteOutcome(w, [True] * len(w.keys), buf=BUF if buffered else None)


def _store(books: Books, keys: list[BlockKey]) -> tuple[Write, list[Copy]]:
    """An engine store that lands whole, its bytes left in a buffer."""
    w = books.plan_store(keys, list(range(len(keys))), 0.0)
    assert w is not None
    return w, books.settle(_landed(w, buffered=True))


def _land(books: Books, order: Copy) -> list[Copy]:
    """A cascade copy that lands whole."""
    return books.settle(_landed(order.write, buffered=order.write.rows is not None))


def test_write_through_cascades_tier_by_tier_from_the_written_buffer() -> None:
    books, _ = _books({}, {})
    keys = make_keys(5)
    _, orders = _store(books, keys)
    (copy,) = orders
    assert (copy.source, copy.write.tier, copy.write.keys, copy.write.rows) == (
        "written",
        1,
        keys,
        [0, 1, 2, 3, 4],
    )
    (down,) = _land(books, copy)
    assert (down.source, down.write.tier, down.write.keys) == ("written", 2, keys)
    assert _land(books, down) == []
    assert books.lookup(keys) == 5
    assert [s.blocks_stored for s in books.stats] == [5, 5, 5]
    # Stored again: every tier already holds them, so nothing moves.
    w = books.plan_store(keys, list(range(5)), 0.0)
    assert w is not None
    assert w.keys == []


def test_on_evict_demotes_exactly_what_the_first_tier_evicts() -> None:
    books, _ = _books({"write_policy": "on_evict"}, blocks=(4, 16))
    first = make_keys(4)
    _, orders = _store(books, first)
    assert orders == []  # on_evict: nothing goes down while the first tier has room
    w = books.plan_store(make_keys(2, salt=1), [0, 1], 0.0)
    assert w is not None
    assert w.demote  # the plan says what to read before overwriting: the job asks nobody
    assert [k for k, _ in w.evicted] == first[:2]  # least recently used first
    out = _landed(w, buffered=True)
    out.demoted, out.evicted = BUF, first[:2]
    (copy,) = books.settle(out)
    assert (copy.source, copy.write.tier, copy.write.keys, copy.write.rows) == (
        "demoted",
        1,
        first[:2],
        [0, 1],
    )
    assert books.stats[0].evictions == 2


def test_admission_copies_a_block_down_at_its_nth_load() -> None:
    books, _ = _books({"admit_after_hits": 2})
    keys = make_keys(3)
    _, orders = _store(books, keys)
    assert orders == []
    assert books.stats[1].not_admitted == 3
    for n in (1, 2):
        plan = books.plan_load(keys)
        assert plan.hits == 3
        orders = books.settle(LoadOutcome(plan, 0.0, valid=3))
        if n == 1:
            assert orders == []
    (copy,) = orders  # the second load admits them
    assert (copy.source, copy.write.tier, copy.write.src_tier, copy.write.keys) == (
        "tier",
        1,
        0,
        keys,
    )
    assert books.pinned() == [3, 0]  # the source stays pinned until the copy has read it
    _land(books, copy)
    assert books.pinned() == [0, 0]
    assert books.stats[0].hits == 6


def test_the_admission_filter_remembers_a_bounded_number_of_load_counts() -> None:
    """Every distinct block loaded adds a load count; past a few times what the tiers
    hold, the least recently loaded are forgotten (a flat 2^20 cap let a soak's memory
    grow for hours). Admission keeps working on the recent ones."""
    books, _ = _books({"admit_after_hits": 1}, blocks=(8, 16))
    bound = hit_counts_bound([8, 16])
    assert bound == HIT_COUNTS_MIN
    for batch in range(bound // 8 + 100):  # 800 more distinct keys than the bound
        keys = make_keys(8, salt=batch)
        _store(books, keys)
        plan = books.plan_load(keys)
        assert plan.hits == 8
        orders = books.settle(LoadOutcome(plan, 0.0, valid=8))
        (copy,) = orders  # loaded once: admitted to tier 1
        assert copy.write.keys == keys
        _land(books, copy)
    assert len(books.cascade._hit_counts) == bound
    assert books.pinned() == [0, 0]


def test_the_load_count_bound_follows_the_tiers_capacity() -> None:
    assert hit_counts_bound([8, 16]) == HIT_COUNTS_MIN
    assert hit_counts_bound([10_000, 20_000]) == 4 * 30_000
    assert hit_counts_bound([1 << 20, 1 << 30]) == HIT_COUNTS


def test_a_full_queue_drops_the_store_and_says_so() -> None:
    books, fake = _books()
    fake.depth[0] = books.configs[0].max_pending_stores
    assert books.plan_store(make_keys(4), [0, 1, 2, 3], 0.0) is None
    assert books.stats[0].dropped_stores == 4
    fake.depth[0] = 0
    assert books.plan_store(make_keys(4), [0, 1, 2, 3], 0.0) is not None


def test_a_corrupt_block_ends_the_prefix_and_leaves_its_tier_for_good() -> None:
    books, fake = _books({}, blocks=(2, 16))
    keys = make_keys(6)
    for i in range(0, 6, 2):  # the cpu tier keeps the last two; tier 1 holds all six
        _, orders = _store(books, keys[i : i + 2])
        for order in orders:
            _land(books, order)
    plan = books.plan_load(keys)
    assert [(r.tier, r.start, r.stop) for r in plan.runs] == [(1, 0, 4), (0, 4, 6)]
    bad = keys[2]
    slot = plan.runs[0].slots[2]
    orders = books.settle(LoadOutcome(plan, 0.0, valid=2, corrupt={1: [bad]}))
    assert orders == [Discard(1, [slot])]
    assert fake.discarded == []  # not under the lock: the caller carries it out
    books.discard([o for o in orders if isinstance(o, Discard)])
    assert fake.discarded == [(1, [slot])]
    assert books.lookup(keys) == 2
    assert books.stats[1].corrupt_blocks == 1
    assert books.pinned() == [0, 0]


def test_a_claim_waits_for_its_prefetch_and_then_pins_the_first_tier_only() -> None:
    books, _ = _books({}, blocks=(8, 16))
    keys = make_keys(6)
    _, orders = _store(books, keys)
    for order in orders:
        _land(books, order)
    filler = make_keys(8, salt=1)
    _store(books, filler)  # evicts all six from the cpu tier (tier 1 keeps them)
    assert books.managers[0].lookup(keys) == 0
    plan, started = books.claim("r1", keys)
    assert plan is None
    assert sum(len(p.write.keys) for p in started) == 4  # the budget: 4 blocks
    again, more = books.claim("r2", keys)
    assert again is None
    assert more == []  # r2 shares r1's prefetch
    for p in started:  # the jobs copy them up, verified
        assert books.prefetch_starts(p)
        out = _landed(p.write, buffered=False)
        out.prefetch, out.seconds = p, 0.001
        assert books.settle(out) == []
    plan, started = books.claim("r1", keys)  # the next round: the last two
    assert plan is None
    assert sum(len(p.write.keys) for p in started) == 2
    for p in started:
        assert books.prefetch_starts(p)
        out = _landed(p.write, buffered=False)
        out.prefetch, out.seconds = p, 0.001
        books.settle(out)
    plan, _ = books.claim("r1", keys)
    assert plan is not None
    assert plan.hits == 6
    assert {r.tier for r in plan.runs} == {0}
    books.release("r2")
    books.unclaim(plan)
    assert books.pinned() == [0, 0]
    assert books.prefetches() == (0, 0)
    assert books.prefetch_stats.prefetched == 6


def test_a_settle_books_the_whole_tally_in_one_transaction() -> None:
    """A job's reads, writes and their health come back as one tally: counted, and the
    breaker fed, in one settle (the lock taken once)."""
    books, _ = _books({"breaker_errors": 2}, blocks=(8, 16))
    keys = make_keys(4)
    _, orders = _store(books, keys)
    (copy,) = orders
    out = _landed(copy.write, buffered=True)
    out.failed, out.ok = True, [False] * 4
    out.tally = Tally(writes=[(1, 0.25)], health=[(1, False), (1, False)])
    taken = 0

    class Counting:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __enter__(self) -> None:
            nonlocal taken
            taken += 1
            self.inner.acquire()

        def __exit__(self, *exc: object) -> None:
            self.inner.release()

    books.lock = Counting(books.lock)  # type: ignore[assignment]
    assert books.settle(out) == []
    assert taken == 1
    stats = books.stats[1]
    assert (stats.write_seconds, stats.store_errors, stats.blocks_stored) == (0.25, 4, 0)
    assert stats.breaker_trips == 1
    assert books.bypassed(1)
    assert books.lookup(keys) == 4  # still up top; the lower tier holds nothing
    assert books.pinned() == [0, 0]


def test_a_load_from_below_settles_into_its_promotion() -> None:
    """A load whose blocks came up through a staging buffer: the settle frees its pins
    and returns the promotion into the first tier as the next order (the buffer's rows
    say which), reserved slots of blocks that did not load freed."""
    books, _ = _books({}, blocks=(4, 16))
    keys = make_keys(4)
    _, orders = _store(books, keys)
    for order in orders:
        _land(books, order)
    cleared, discards = books.clear_first()
    assert cleared == 4
    books.discard(discards)  # their slots serve the promotion only once discarded
    plan = books.plan_load(keys)
    assert [(r.tier, r.start, r.stop) for r in plan.runs] == [(1, 0, 4)]
    assert plan.promote_keys == keys
    (promotion,) = books.settle(
        LoadOutcome(
            plan, 0.0, valid=3, buf=BUF, staged=[True] * 4, tally=Tally(reads=[(1, 0.1, 3 * BPB)])
        )
    )
    assert (promotion.source, promotion.write.tier, promotion.write.keys) == ("loaded", 0, keys[:3])
    assert promotion.write.rows == [0, 1, 2]
    assert books.stats[1].hits == 3
    assert books.stats[1].bytes_read == 3 * BPB
    assert books.stats[0].promotions == 3
    assert books.pinned() == [0, 0]
    assert _land(books, promotion) == []  # written up top (tier 1 holds them already)
    assert books.resident(keys) == 3


def test_a_refused_prefetch_and_a_released_owner_undo_their_writes() -> None:
    """Claims hands back the writes of the prefetches it cancels; the books undo them:
    reserved first-tier slots freed, source pins dropped."""
    books, _ = _books({}, blocks=(8, 16))
    keys = make_keys(4)
    _, orders = _store(books, keys)
    for order in orders:
        _land(books, order)
    books.clear_first()
    plan, started = books.claim("r1", keys)
    assert plan is None
    assert started
    assert books.pinned() == [0, 4]
    for p in started:
        books.prefetch_refused(p)
    assert books.pinned() == [0, 0]
    assert books.prefetches() == (0, 1)
    plan, started = books.claim("r1", keys)
    assert plan is None
    assert started
    books.release("r1")  # nobody else waits and none started: cancelled
    assert books.pinned() == [0, 0]
    assert books.prefetches() == (0, 0)
    assert books.prefetch_stats.wasted == 4
    assert books.managers[0].lookup(keys) == 0


def test_a_discarded_slot_serves_no_store_before_its_discard_ran() -> None:
    """A block found corrupt leaves the books at once, but forgetting it on the medium
    is I/O, so it comes back as an order run outside the lock. Until it has run, its
    slot is out of the free list: a store into the full tier evicts rather than take
    it (the late discard would erase the new block). Once discarded, the slot is
    free, and the next store takes it without evicting."""
    books, fake = _books({}, blocks=(2, 4))
    keys = make_keys(4)
    for i in (0, 2):
        _, orders = _store(books, keys[i : i + 2])
        for order in orders:
            _land(books, order)
    lower = books.managers[1]
    assert isinstance(lower, LRUOffloadingManager)
    assert (len(lower), lower.allocator.num_free) == (4, 0)
    plan = books.plan_load(keys)
    assert [(r.tier, r.start, r.stop) for r in plan.runs] == [(1, 0, 2), (0, 2, 4)]
    bad_slot = plan.runs[0].slots[0]
    orders = books.settle(LoadOutcome(plan, 0.0, valid=0, corrupt={1: [keys[0]]}))
    assert orders == [Discard(1, [bad_slot])]
    # Dropped from the books, its slot held back: 3 blocks held, none free.
    assert (len(lower), lower.allocator.num_free) == (3, 0)
    assert books.withheld.pending == [0, 1]
    assert books.stats[1].corrupt_blocks == 1
    # A store meanwhile: its copy into the lower tier evicts two blocks for its two
    # keys and never lands in the discarded block's slot.
    new = make_keys(2, salt=1)
    _, copies = _store(books, new)
    (copy,) = copies
    assert bad_slot not in copy.write.slots
    assert books.stats[1].evictions == 2
    assert _land(books, copy) == []
    assert (len(lower), lower.allocator.num_free) == (3, 0)
    assert fake.discarded == []
    # The order runs (late, after other transactions): then the slot is free again.
    books.discard(orders)  # type: ignore[arg-type]
    assert fake.discarded == [(1, [bad_slot])]
    assert books.withheld.pending == [0, 0]
    assert (len(lower), lower.allocator.num_free) == (3, 1)
    assert lower.check() == []
    _, (copy,) = _store(books, make_keys(1, salt=2))
    assert copy.write.slots == [bad_slot]
    assert books.stats[1].evictions == 2  # no eviction this time


def test_a_first_tier_reset_holds_its_slots_until_discarded() -> None:
    """``clear_first`` drops every idle block of the first tier at once; the discard
    of the lot runs after, and until then a store finds no room (rejected, counted)
    rather than a slot the discard would clear under it."""
    books, fake = _books(blocks=(4,))
    keys = make_keys(4)
    _store(books, keys)
    cleared, discards = books.clear_first()
    assert cleared == 4
    assert books.lookup(keys) == 0
    assert books.plan_store(make_keys(1, salt=1), [0], 0.0) is None
    assert books.stats[0].rejected_stores == 1
    books.discard(discards)
    assert fake.discarded == [(0, [0, 1, 2, 3])]
    assert books.managers[0].check() == []
    assert books.plan_store(make_keys(1, salt=1), [0], 0.0) is not None


class LateDiscardMachine(RuleBasedStateMachine):
    """Stores, loads that find blocks corrupt, and first-tier resets, with each discard
    order run late: after any number of other transactions, in any order. Whatever
    happens meanwhile, no write is planned into a slot whose discard has not run, a
    held-back slot stays allocated and holds no block, and once every order has run
    the books are consistent again."""

    def __init__(self) -> None:
        super().__init__()
        self.books, self.fake = _books({}, blocks=(4, 6))
        self.keys = make_keys(10)
        self.pending: list[Discard] = []

    def _held(self, t: int) -> set[int]:
        return {s for d in self.pending if d.tier == t for s in d.slots}

    def _carry_out(self, orders: list[Any]) -> None:
        """Land the copies at once (checking where they write); keep the discards."""
        for order in orders:
            if isinstance(order, Discard):
                self.pending.append(order)
                continue
            assert not set(order.write.slots) & self._held(order.write.tier)
            self._carry_out(_land(self.books, order))

    @rule(start=st.integers(0, 9), n=st.integers(1, 3))
    def store(self, start: int, n: int) -> None:
        keys = self.keys[start : start + n]
        w = self.books.plan_store(keys, list(range(len(keys))), 0.0)
        if w is not None:
            assert not set(w.slots) & self._held(0)
            self._carry_out(self.books.settle(_landed(w, buffered=True)))

    @rule(start=st.integers(0, 9), bad=st.integers(0, 3), staged=st.booleans())
    def load_finding_one_corrupt(self, start: int, bad: int, staged: bool) -> None:
        plan = self.books.plan_load(self.keys[start:])
        assert not set(plan.promote_slots) & self._held(0)
        corrupt: dict[int, list[BlockKey]] = {}
        valid = plan.hits
        for run in plan.runs:
            if run.start <= bad < run.stop:
                corrupt = {run.tier: [plan.keys[bad]]}
                valid = bad
        out = LoadOutcome(plan, 0.0, valid=valid, corrupt=corrupt)
        if staged:  # its promotion written from the staging buffer
            out.buf, out.staged = BUF, [True] * plan.hits
        self._carry_out(self.books.settle(out))

    @rule()
    def reset_first_tier(self) -> None:
        _, orders = self.books.clear_first()
        self.pending += orders

    @precondition(lambda self: self.pending)
    @rule(pick=st.integers(0, 100))
    def run_a_discard_late(self, pick: int) -> None:
        order = self.pending.pop(pick % len(self.pending))
        self.books.discard([order])
        assert self.fake.discarded[-1] == (order.tier, order.slots)

    @invariant()
    def held_back_slots_are_allocated_and_empty(self) -> None:
        for t, manager in enumerate(self.books.managers):
            assert isinstance(manager, LRUOffloadingManager)
            held = self._held(t)
            assert self.books.withheld.pending[t] == len(held)
            assert all(manager.allocator.is_allocated(s) for s in held)
            assert not held & {slot for _, slot in manager.policy.items()}

    def teardown(self) -> None:
        self.books.discard(self.pending)
        assert self.books.pinned() == [0, 0]
        assert [m.check() for m in self.books.managers] == [[], []]


LateDiscardMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None
)
TestLateDiscards = LateDiscardMachine.TestCase

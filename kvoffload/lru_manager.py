"""The concrete :class:`~kvoffload.manager.OffloadingManager`: slots from a
:class:`~kvoffload.slots.SlotAllocator`, order from a pluggable eviction policy.

Named for its default policy (LRU); ARC is one ``policy="arc"`` away. Per-block state
is two ints: the slot, in the policy's key -> slot table, and the reference count, in
a list indexed by slot (-1: being written; 0: ready and evictable; n > 0: pinned by
n loads). No Python object per block: the garbage collector has nothing per block to
walk, and a batch of stores allocates no objects beyond its lists. Every primitive is
O(1) per block (``prepare_store`` also skips pinned blocks it meets).
Runs on the scheduler side; not thread-safe, as the engine's scheduler is one thread.

A compressed tier may be given a byte budget (opt-in), kept by the books' byte-budget
part (:class:`~kvoffload.budget.ByteBudget`, mixed in): admission and eviction then
answer to the bytes the blocks hold, and the slot count only caps how many. Without a
budget no path does any work per block for it: each checks ``byte_budget`` once per
call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvoffload.budget import ByteBudget
from kvoffload.exceptions import BlockStateError
from kvoffload.keys import BlockKey
from kvoffload.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from kvoffload.policies import BlockState, EvictionPolicy, make_policy
from kvoffload.slots import SlotAllocator

logger = logging.getLogger(__name__)


class LRUOffloadingManager(ByteBudget, OffloadingManager):
    """Bookkeeping for one tier of ``allocator.num_slots`` blocks.

    With ``byte_budget`` the tier holds at most that many bytes, each block charged
    ``full_charge`` (its uncompressed size; required then, ignored without a budget)
    until :meth:`charge` says what it took. Give a budgeted tier's allocator more slots
    than ``byte_budget // full_charge``, say ``byte_budget // min_charge`` (the least a
    block compresses to): with no more, the slots bind before the bytes and compression
    buys no blocks. A store admitted at ``full_charge`` needs that much headroom until
    it is charged, so a full tier holds about ``(byte_budget - full_charge * blocks in
    flight) / charge`` blocks plus those in flight.
    """

    def __init__(
        self,
        allocator: SlotAllocator,
        policy: EvictionPolicy | str = "lru",
        *,
        name: str = "tier",
        enable_events: bool = True,
        byte_budget: int | None = None,
        full_charge: int | None = None,
    ) -> None:
        self.name = name
        self.allocator = allocator
        self.policy = (
            make_policy(policy, allocator.num_slots) if isinstance(policy, str) else policy
        )
        # Reference count per slot; meaningful for the slots the policy's table holds.
        # A list, not an ``array``: indexing it hands back the (cached small) int it
        # holds, where an array boxes a new one per access, which cost 20-30% more in
        # the per-block loops. One list is one object to the garbage collector.
        self._refs: list[int] = [0] * allocator.num_slots
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._init_budget(byte_budget, full_charge, allocator.num_slots)

    # -- introspection ------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Blocks this tier can hold."""
        return self.allocator.num_slots

    def __len__(self) -> int:
        return len(self.policy)

    def state(self, key: BlockKey) -> BlockState | None:
        """A snapshot of ``key``'s slot and reference count (``None`` if not held)."""
        slot = self.policy.get(key)
        return None if slot is None else BlockState(slot, self._refs[slot])

    def ready(self, key: BlockKey) -> bool:
        slot = self.policy.get(key)
        return slot is not None and self._refs[slot] >= 0

    def holds(self, key: BlockKey) -> bool:
        return self.policy.get(key) is not None

    def idle(self, key: BlockKey) -> bool:
        slot = self.policy.get(key)
        return slot is not None and self._refs[slot] == 0

    def held_keys(self) -> list[BlockKey]:
        return [key for key, _ in self.policy.items()]

    def pinned(self) -> int:
        """Blocks pinned by loads now (``ref_cnt > 0``); O(blocks), for health checks."""
        refs = self._refs
        return sum(1 for _, slot in self.policy.items() if refs[slot] > 0)

    # -- load path ----------------------------------------------------------------
    def lookup(self, keys: Sequence[BlockKey]) -> int:
        refs = self._refs
        for i, slot in enumerate(self.policy.get_many(keys)):
            if slot is None or refs[slot] < 0:
                return i
        return len(keys)

    def prepare_load(self, keys: Sequence[BlockKey]) -> list[int]:
        slots = self.policy.get_many(keys)
        refs = self._refs
        for key, slot in zip(keys, slots, strict=True):
            if slot is None or refs[slot] < 0:
                raise BlockStateError(
                    f"tier {self.name!r}: prepare_load of {key.hex()} which is not ready"
                )
        if self.byte_budget is not None:  # idle blocks about to be pinned
            charges = self._charges
            pins = {s for s in slots if s is not None and refs[s] == 0}
            self._idle_bytes -= sum(charges[s] for s in pins)
        for slot in slots:
            assert slot is not None
            refs[slot] += 1
        return slots  # type: ignore[return-value]  # checked above: no None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.policy.touch(reversed(keys))

    def complete_load(self, keys: Sequence[BlockKey]) -> None:
        if self.byte_budget is not None:
            self._complete_load_budgeted(keys)
            return
        refs = self._refs
        for key, slot in zip(keys, self.policy.get_many(keys), strict=True):
            if slot is None or refs[slot] <= 0:
                raise BlockStateError(
                    f"tier {self.name!r}: complete_load of {key.hex()} which is not pinned"
                )
            refs[slot] -= 1

    # -- store path ---------------------------------------------------------------
    def prepare_store(self, keys: Sequence[BlockKey]) -> PrepareStoreOutput | None:
        if self.byte_budget is not None:
            return self._prepare_store_budgeted(keys, self.byte_budget)
        # dict.fromkeys: keep call order, drop keys repeated within the call.
        unique = list(dict.fromkeys(keys))
        held = self.policy.get_many(unique)
        new = [k for k, slot in zip(unique, held, strict=True) if slot is None]
        if not new:
            return PrepareStoreOutput([], [], [])
        deficit = len(new) - self.allocator.num_free
        evicted: list[BlockKey] = []
        evicted_slots: list[int] = []
        if deficit > 0:
            victims = self.policy.evict(deficit, set(keys), self._refs)
            if victims is None:
                return None
            evicted_slots = [slot for _, slot in victims]
            self.allocator.free(evicted_slots)
            evicted = [key for key, _ in victims]
            self._record(evicted, removed=True)
        slots = self.allocator.allocate(len(new))
        # The deficit was made good above, so allocation cannot fail here.
        assert slots is not None
        refs = self._refs
        for slot in slots:
            refs[slot] = -1  # being written
        self.policy.insert_many(new, slots)
        return PrepareStoreOutput(new, slots, evicted, evicted_slots)

    def complete_store(self, keys: Sequence[BlockKey], success: bool = True) -> None:
        done: list[BlockKey] = []
        freed: list[int] = []
        refs = self._refs
        unique = list(dict.fromkeys(keys))  # a key listed twice is finished once
        for key, slot in zip(unique, self.policy.get_many(unique), strict=True):
            # Keys that were already held when prepare_store ran are not ours to finish.
            if slot is None or refs[slot] != -1:
                continue
            if success:
                refs[slot] = 0
                done.append(key)
            else:
                self.policy.remove(key)
                freed.append(slot)
        if self.byte_budget is not None:
            self._release(freed, idle=False)
            charges = self._charges
            self._idle_bytes += sum(charges[s] for s in self.policy.get_many(done) if s is not None)
            if self._parked:
                for key in unique:
                    freed += self._parked.pop(key, ())
        if freed:
            self.allocator.free(freed)
        if done:
            self._record(done, removed=False)

    def take_events(self) -> list[OffloadingEvent]:
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _record(self, keys: list[BlockKey], *, removed: bool) -> None:
        if self._events is not None:
            self._events.append(OffloadingEvent(tuple(keys), self.name, removed))

    # -- persistence and repair ---------------------------------------------------
    def restore(
        self, blocks: Iterable[tuple[BlockKey, int]], charges: Iterable[int] | None = None
    ) -> None:
        """Adopt ready blocks a persistent backend recovered: ``(key, slot)`` pairs,
        least recently used first, whose slots the allocator already counts as used.
        No events: nothing changed, the books caught up with the disk.

        Under a byte budget, ``charges`` are their stored sizes as the tier recovered
        them, one per pair (``full_charge`` each when left out); blocks that would
        take the books over budget raise :class:`BlockStateError`, adopting none.
        ``charges`` without a budget is a wiring mistake: ``ValueError``."""
        if self.byte_budget is not None:
            blocks = self._charge_restored(list(blocks), charges, self.byte_budget)
        elif charges is not None:
            raise ValueError(f"tier {self.name!r} has no byte budget to restore charges into")
        insert, get, refs = self.policy.insert, self.policy.get, self._refs
        for key, slot in blocks:
            if not self.allocator.is_allocated(slot):
                raise BlockStateError(f"tier {self.name!r}: restored slot {slot} is not allocated")
            if get(key) is not None:
                raise BlockStateError(f"tier {self.name!r}: {key.hex()} restored twice")
            refs[slot] = 0
            insert(key, slot)

    def remove(self, keys: Sequence[BlockKey]) -> list[int]:
        """Drop ready, unpinned blocks (found corrupt, or invalidated); return their
        freed slots. Keys not held are ignored; pinned or in-flight ones raise."""
        freed: list[int] = []
        removed: list[BlockKey] = []
        for key in keys:
            slot = self.policy.get(key)
            if slot is None:
                continue
            if self._refs[slot] != 0:
                raise BlockStateError(
                    f"tier {self.name!r}: remove of {key.hex()} with ref_cnt {self._refs[slot]}"
                )
            self.policy.remove(key)
            freed.append(slot)
            removed.append(key)
        if freed:
            if self.byte_budget is not None:
                self._release(freed, idle=True)
            self.allocator.free(freed)
            self._record(removed, removed=True)
        return freed

    # -- consistency --------------------------------------------------------------
    def check(self) -> list[str]:
        """Problems found (empty when consistent): slots unique, allocated, in range."""
        problems = self.allocator.check()
        seen: dict[int, BlockKey] = {}
        for key, slot in self.policy.items():
            if slot in seen:
                problems.append(f"slot {slot} held by {seen[slot].hex()} and {key.hex()}")
            seen[slot] = key
            if not self.allocator.is_allocated(slot):
                problems.append(f"{key.hex()} sits in free slot {slot}")
        if len(seen) > self.capacity:
            problems.append(f"{len(seen)} blocks exceed capacity {self.capacity}")
        parked = [s for slots in self._parked.values() for s in slots]
        for slot in parked:
            if slot in seen or not self.allocator.is_allocated(slot):
                problems.append(f"parked slot {slot} is held or free")
        in_use = self.allocator.num_slots - self.allocator.num_free - len(parked)
        if in_use != len(seen):
            problems.append(f"{in_use} slots allocated but {len(seen)} blocks held (leak)")
        if self.byte_budget is not None:
            problems += self._check_budget(self.byte_budget, seen)
        return problems

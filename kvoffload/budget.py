"""The byte budget of a tier's books: admission and eviction by the bytes blocks hold.

A compressed tier holds more blocks than full-size slots would, so its books
(:class:`~kvoffload.lru_manager.LRUOffloadingManager`) may be given a byte budget
(opt-in): admission and eviction then answer to the bytes the blocks hold, and the slot
count only caps how many. A block's charge, one more int in a list indexed by slot, is
the most it can take until its lane reports what it took (:meth:`ByteBudget.charge`).
:class:`ByteBudget` is that part of the books, mixed into them: the budgeted store
(victims' slots reused or parked until the store settles), the charges, the slack kept
free for stores whose pages found no run, a budgeted restore and its consistency check.
The books call these only where ``byte_budget`` is set, so without a budget no path
does any work per block for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvoffload.exceptions import BlockStateError
from kvoffload.keys import BlockKey
from kvoffload.manager import PrepareStoreOutput
from kvoffload.policies import EvictionPolicy
from kvoffload.slots import SlotAllocator


class ByteBudget:
    """The byte-budget part of a tier's books (see the module docs); a mixin of
    :class:`~kvoffload.lru_manager.LRUOffloadingManager`, whose state it shares."""

    # The books' own state and methods, which the budget reads and updates.
    name: str
    allocator: SlotAllocator
    policy: EvictionPolicy
    _refs: list[int]

    if TYPE_CHECKING:

        def holds(self, key: BlockKey) -> bool: ...

        def _record(self, keys: list[BlockKey], *, removed: bool) -> None: ...

    def _init_budget(self, byte_budget: int | None, full_charge: int | None, slots: int) -> None:
        """The budget's state, empty: called by the books' ``__init__`` (``byte_budget``
        and ``full_charge`` as :class:`~kvoffload.lru_manager.LRUOffloadingManager` takes
        them)."""
        self.byte_budget = byte_budget  # None: the slots alone bind
        self.full_charge = 0  # a block's charge until its stored size is known
        self.bytes_held = 0  # the held blocks' charges (not kept without a budget)
        # Charges of the blocks with ref_cnt 0 (those eviction may take), kept as refs
        # change, so prepare_store knows whether it can make room before evicting any.
        self._idle_bytes = 0
        self._charges: list[int] = []  # per slot; 0 on a free slot
        if byte_budget is not None:
            if full_charge is None or not 1 <= full_charge <= byte_budget:
                raise ValueError(f"byte_budget {byte_budget} needs 1 <= full_charge <= it")
            self.full_charge = full_charge
            self._charges = [0] * slots
        # Slots of victims a budgeted store did not reuse, freed when the store whose
        # first new key this is completes (see _prepare_store_budgeted).
        self._parked: dict[BlockKey, list[int]] = {}
        self._slack = 0  # bytes of the budget kept free besides (see charge)

    def _prepare_store_budgeted(
        self, keys: Sequence[BlockKey], budget: int
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_store` under a byte budget: room is enough free slots and
        ``bytes_held + len(new) * full_charge <= budget``.

        Whether room can be made is settled before anything is evicted, from the idle
        bytes (kept as references change) less those of idle blocks named in ``keys``.
        The policy's ``evict`` is all-or-nothing by count, so each round asks it for a
        lower bound on the blocks still needed (none is charged over ``full_charge``):
        no block too many goes, and the victims come in the policy's order."""
        unique = list(dict.fromkeys(keys))
        held = self.policy.get_many(unique)
        new = [k for k, slot in zip(unique, held, strict=True) if slot is None]
        if not new:
            return PrepareStoreOutput([], [], [])
        refs, charges, full = self._refs, self._charges, self.full_charge
        protected_idle = sum(charges[s] for s in held if s is not None and refs[s] == 0)
        byte_deficit = self.bytes_held + len(new) * full - budget
        room = self._idle_bytes - protected_idle
        if byte_deficit > room:
            return None  # evicting every block it may would not free enough bytes
        if self._slack:
            # Blocks lately found no run of pages long enough (see charge): keep that
            # much of the budget free as well, as far as idle blocks allow, so freed
            # neighbours merge into longer runs and stores keep landing.
            byte_deficit = max(byte_deficit, min(byte_deficit + self._slack, room))
        slot_deficit = len(new) - self.allocator.num_free
        evicted: list[BlockKey] = []
        evicted_slots: list[int] = []
        protected = set(keys)
        while slot_deficit > 0 or byte_deficit > 0:
            victims = self.policy.evict(
                max(slot_deficit, -(-byte_deficit // full)), protected, refs
            )
            if victims is None:
                # The bytes were checked above, so only the first round (the only one
                # that may ask for more blocks than the bytes need) can fail: by slots.
                assert not evicted
                return None
            round_slots = [slot for _, slot in victims]
            byte_deficit -= self._release(round_slots, idle=True)
            slot_deficit -= len(victims)
            evicted_slots += round_slots
            evicted += [key for key, _ in victims]
        # The victims' slots are not freed here: the write may read them first (a
        # demotion), and a backend lets go of what a freed slot holds (its extent, its
        # record) at once. So victims' slots are reused as they are, free slots make
        # up the rest, and the victims' slots left over are parked until this write is
        # settled, so no other write can take their space before it has read them (the
        # job hands their space back to the backend once it has: Write.released).
        # (The order, victims' slots first, is the one freeing and allocating gives.)
        reuse = min(len(new), len(evicted_slots))
        rest = self.allocator.allocate(len(new) - reuse)
        assert rest is not None  # the slot deficit was made good above
        slots = evicted_slots[:reuse] + rest
        if len(evicted_slots) > reuse:
            self._parked[new[0]] = evicted_slots[reuse:]
        if evicted:
            self._record(evicted, removed=True)
        for slot in slots:
            refs[slot] = -1  # being written
            charges[slot] = full
        self.bytes_held += len(new) * full
        self.policy.insert_many(new, slots)
        return PrepareStoreOutput(new, slots, evicted, evicted_slots)

    def charge(self, keys: Sequence[BlockKey], sizes: Sequence[int], *, unplaced: int = 0) -> None:
        """Set the stored size of blocks being written or ready: what their lane wrote.

        How the books learn it: the lane knows a block's size once it compressed and
        wrote it, and hands the job's sizes back with the job's completion, which the
        books settle under their lock anyway (``complete_store``). That settle calls
        this once with the whole job's keys and sizes, in the same locked section:
        one lock round trip per job, not a second one per block. Until then a block is
        charged ``full_charge``, so a charge only falls: a size below 1 or above the
        block's charge when the call began raises :class:`BlockStateError`, changing
        nothing. Keys not held are ignored (a failed store released its charge); so is
        the call on a tier without a budget, so the books need not ask which is which.

        ``unplaced``: blocks of the same job the tier found no room for as it wrote
        (its free bytes were enough, its free runs of pages too short). The budget
        alone would never evict for them, and stores could keep failing; so the tier
        keeps that many more full-size blocks' bytes free from then on (its *slack*,
        at most a quarter of the budget), and each job that places all its blocks
        lets an eighth of a block of it go: the free space settles where the stores
        land.
        """
        if self.byte_budget is None:
            return
        if unplaced > 0:  # grow the free space kept, up to a quarter of the budget
            grown = self._slack + unplaced * self.full_charge
            self._slack = min(self.byte_budget // 4, grown)
        elif keys and self._slack:  # a job that placed every block: let a little go
            self._slack = max(0, self._slack - self.full_charge // 8)
        refs, charges, full = self._refs, self._charges, self.full_charge
        found: list[int] = []
        found_sizes: list[int] = []
        for key, slot, size in zip(keys, self.policy.get_many(keys), sizes, strict=True):
            if not 1 <= size <= full or (slot is not None and size > charges[slot]):
                limit = full if slot is None else charges[slot]
                raise BlockStateError(
                    f"tier {self.name!r}: charge of {size} bytes for {key.hex()} outside 1..{limit}"
                )
            if slot is not None:
                found.append(slot)
                found_sizes.append(size)
        held_delta = idle_delta = 0
        for slot, size in zip(found, found_sizes, strict=True):
            delta = size - charges[slot]
            charges[slot] = size
            held_delta += delta
            if refs[slot] == 0:
                idle_delta += delta
        self.bytes_held += held_delta
        self._idle_bytes += idle_delta

    def _release(self, slots: Sequence[int], *, idle: bool) -> int:
        """Drop the charges of blocks leaving ``slots`` (``idle``: they had ref_cnt 0);
        the bytes freed."""
        charges = self._charges
        freed = 0
        for slot in slots:
            freed += charges[slot]
            charges[slot] = 0
        self.bytes_held -= freed
        if idle:
            self._idle_bytes -= freed
        return freed

    def _complete_load_budgeted(self, keys: Sequence[BlockKey]) -> None:
        """:meth:`complete_load` where blocks that fall idle bring back their charge.
        Checked whole before it changes anything, so a bad batch cannot leave the idle
        bytes out of step with the reference counts."""
        refs, charges = self._refs, self._charges
        unpins: dict[int, int] = {}  # slot -> loads this call ends
        for key, slot in zip(keys, self.policy.get_many(keys), strict=True):
            if slot is None or refs[slot] - unpins.get(slot, 0) <= 0:
                raise BlockStateError(
                    f"tier {self.name!r}: complete_load of {key.hex()} which is not pinned"
                )
            unpins[slot] = unpins.get(slot, 0) + 1
        for slot, n in unpins.items():
            refs[slot] -= n
            if refs[slot] == 0:
                self._idle_bytes += charges[slot]

    def _charge_restored(
        self, blocks: list[tuple[BlockKey, int]], charges: Iterable[int] | None, budget: int
    ) -> list[tuple[BlockKey, int]]:
        """Check the whole of a budgeted restore, then charge its slots; what
        :meth:`restore`'s loop then adopts cannot fail half-way with charges set."""
        full, slot_charges = self.full_charge, self._charges
        sizes = [full] * len(blocks) if charges is None else list(charges)
        if len(sizes) != len(blocks):
            raise ValueError(f"{len(blocks)} blocks restored with {len(sizes)} charges")
        seen_keys: set[BlockKey] = set()  # keys and slots of this call
        seen_slots: set[int] = set()
        held_any = len(self.policy) > 0  # at start-up nothing is: skip the lookups
        allocated = self.allocator.is_allocated
        for (key, slot), size in zip(blocks, sizes, strict=True):
            taken = key in seen_keys or slot in seen_slots or slot_charges[slot]
            if (
                taken
                or (held_any and self.holds(key))
                or not allocated(slot)
                or not (1 <= size <= full)
            ):
                raise BlockStateError(
                    f"tier {self.name!r}: cannot restore {key.hex()} in slot {slot} charged "
                    f"{size}: taken, not allocated, or outside 1..{full}"
                )
            seen_keys.add(key)
            seen_slots.add(slot)
        total = sum(sizes)
        if self.bytes_held + total > budget:
            raise BlockStateError(
                f"tier {self.name!r}: restoring {total} bytes onto {self.bytes_held} "
                f"exceeds the byte budget {budget}"
            )
        for (_, slot), size in zip(blocks, sizes, strict=True):
            slot_charges[slot] = size
        self.bytes_held += total
        self._idle_bytes += total
        return blocks

    def _check_budget(self, budget: int, held: dict[int, BlockKey]) -> list[str]:
        """Each held block charged 1..full_charge, no other slot charged, sums as kept."""
        problems: list[str] = []
        charges, refs, full = self._charges, self._refs, self.full_charge
        total = idle = 0
        for slot, charge in enumerate(charges):
            if slot not in held:
                if charge:
                    problems.append(f"free slot {slot} carries a charge of {charge}")
                continue
            if not 1 <= charge <= full:
                problems.append(f"{held[slot].hex()} charged {charge}, outside 1..{full}")
            total += charge
            if refs[slot] == 0:
                idle += charge
        if total != self.bytes_held:
            problems.append(f"charges sum to {total} but bytes_held is {self.bytes_held}")
        if self.bytes_held > budget:
            problems.append(f"{self.bytes_held} bytes held exceed the byte budget {budget}")
        if idle != self._idle_bytes:
            problems.append(f"idle charges sum to {idle} but {self._idle_bytes} are kept")
        return problems

"""KV cache events: the tiers' store and eviction records as vLLM ``BlockStored`` /
``BlockRemoved`` events (with ``kv_events_config.enable_kv_cache_events``).

The worker side holds the tiers, so it is where their records are turned into events
(:class:`EventBook`, kept in :class:`~.shared.Shared`); the events then ride the
step's ``KVConnectorOutput`` to the scheduler side (:class:`TieredOffloadKVEvents`),
which hands them to vLLM's publisher. A module of its own because both roles use it
and neither owns it: the worker side makes the events, the scheduler side publishes them.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.tier import Tier

from .event_journal import Journals
from .groups import Group

if TYPE_CHECKING:
    from vllm.v1.request import Request

MAX_EVENT_HASHES: Final = 1 << 20
"""Most keys no tier holds whose vLLM block (hash, parent hash, tokens) the worker side
keeps for KV events (about 400 bytes each with 32-token blocks), when the tiers'
capacities add up to more blocks; twice that in all (see :class:`EventBook`)."""

LOCAL: Final = "LOCAL"
REMOTE: Final = "REMOTE"
"""vLLM's ``locality`` values (``vllm.v1.kv_offload.base.Locality``): where a tier's
storage is relative to the engine that publishes the event."""


BlockHash = bytes | int
"""A vLLM block hash as ``request.block_hashes`` holds it (bytes; ints in older vLLM)."""


@dataclass(slots=True)
class EventBlocks:
    """What a self-describing event needs of some blocks of one request, beyond their
    keys: sent by the scheduler side with a store or a load only when KV events are on.
    Block ``i`` is ``hashes[i]``, the block before it in its request ``parents[i]``
    (``None`` for a request's first block), and its tokens
    ``tokens[i * block_size : (i + 1) * block_size]``."""

    hashes: list[BlockHash]
    parents: list[BlockHash | None]
    tokens: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    generation: int = 0
    """The connector reset generation the blocks' keys are under: a router is told
    only of the current generation's blocks (the only ones this engine looks up)."""

    @classmethod
    def of(
        cls, request: Request, positions: Sequence[int], block_size: int, generation: int = 0
    ) -> EventBlocks:
        """Blocks ``positions`` of ``request`` (each a full block of its tokens)."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        lora = request.lora_request
        return cls(
            [hashes[p] for p in positions],
            [hashes[p - 1] if p > 0 else None for p in positions],
            [t for p in positions for t in tokens[p * block_size : (p + 1) * block_size]],
            block_size,
            None if lora is None else int(lora.adapter_id),
            None if lora is None else str(lora.name),
            generation,
        )

    def part(self, start: int, stop: int) -> EventBlocks:
        """Blocks ``[start, stop)`` of these."""
        bs = self.block_size
        return EventBlocks(
            self.hashes[start:stop],
            self.parents[start:stop],
            self.tokens[start * bs : stop * bs],
            bs,
            self.lora_id,
            self.lora_name,
            self.generation,
        )


@dataclass(slots=True)
class _Block:
    """What the worker side keeps of one key for its events."""

    block_hash: BlockHash
    parent: BlockHash | None
    tokens: array[int]
    lora_id: int | None
    lora_name: str | None
    group: int
    generation: int = 0
    tiers: int = 0
    """The tiers whose records say they hold it (a bit per tier)."""


def _medium(tier: Tier) -> str:
    """vLLM's event medium for a tier: memory (``CPU``), or ``STORAGE`` for a
    persistent backend (a disk, or a shared server: vLLM's own secondary tiers, a file
    system or an object store, local or remote, are ``STORAGE`` too)."""
    return str(MEDIUM_STORAGE if tier.backend.persistent else MEDIUM_CPU)


def _locality(tier: Tier) -> str:
    """``REMOTE`` for a shared server's tier (other engines read and write it, and it
    evicts by itself), ``LOCAL`` for a tier of this engine's host."""
    return REMOTE if tier.backend.server_booked else LOCAL


_SPEC_KINDS: Final = {"full": "full_attention", "sliding": "sliding_window", "mamba": "mamba"}


Place = tuple[str, str]
"""Where a router files a tier's blocks: (``medium``, ``locality``)."""


class EventBook:
    """Worker side: turns the tiers' own store / eviction records into vLLM KV events.

    Every tier's manager records the keys it made ready (``removed=False``) and the keys
    it evicted or dropped (``removed=True``), whoever caused it: engine stores, copies
    down the chain, promotions, eviction, corruption; a shared server's tier records
    what this engine stored there and what a lookup found gone since
    (:class:`~kvoffload.server_events.EventfulServerManager`). The Offloader records
    them only when events are enabled (``Offloader(events=True)``), and they are
    drained here every step. Keys are namespaced digests that cannot be turned back
    into vLLM's hashes, so the scheduler side sends each store's and load's blocks
    along (:class:`EventBlocks`: hashes, parent hashes, tokens, LoRA, reset
    generation; only when events are enabled) and they are remembered here per key.

    Events are per *place*, (``medium``, ``locality``), as vLLM's own offloading
    publishes them (``ownership`` ``None``: Dynamo's indexer drops an event whose
    ``ownership`` it does not know): a block is announced stored in a place when the
    first of its tiers there holds it, removed when the last one lets it go. Only the
    current reset generation's blocks are announced; at a connector reset
    (:meth:`reset`, or a store of a newer generation seen first) every block of an
    older one still announced is announced removed, and nothing more is said of it.

    A key is kept as long as a tier is told holding it (the records say which), so its
    removal can always be told; a key no tier holds (its store still queued, or every
    tier evicted it: an ``on_evict`` tier's copy of an evicted block is queued only
    after the eviction is recorded) is kept among the ``cap`` most recent such keys,
    ``cap`` being what the tiers hold together. Forgetting happens after each step's
    records are translated, not as keys arrive. Past ``2 * cap`` keys in all (at most
    2 * :data:`MAX_EVENT_HASHES`), the oldest held ones are forgotten too. A record for
    a key whose block is unknown (a block recovered from disk whose journal entry is
    missing, or forgotten) emits nothing and is counted."""

    def __init__(self, *, enabled: bool, cap: int, groups: Sequence[Group] = ()) -> None:
        self.enabled = enabled
        self.cap = cap
        self.blocks: OrderedDict[BlockKey, _Block] = OrderedDict()
        """Every key known, the most recently remembered or told last."""
        self.loose: OrderedDict[BlockKey, None] = OrderedDict()
        """The keys no tier is told holding, the most recent last."""
        self.generation = 0
        """The reset generation whose blocks are announced."""
        self._resets = 0
        """Connector resets seen by :meth:`reset` (from the books' thread)."""
        self._newest = 0
        """The newest generation a remembered block was under."""
        self._bits: dict[str, int] = {}
        self._place_of: dict[str, Place] = {}
        self._place_bits: dict[Place, int] = {}
        self.journals: Journals | None = None
        """The persistent tiers' journals (built at the first :meth:`take`)."""
        self._specs = {
            g.index: (g.spec_kind or _SPEC_KINDS.get(g.kind), g.spec_window) for g in groups
        }
        self._specs.setdefault(0, (_SPEC_KINDS["full"], None))

    def reset(self) -> None:
        """A connector reset (worker side of ``reset_cache``): the next :meth:`take`
        announces the blocks of the generation before it removed."""
        self._resets += 1

    def close(self) -> None:
        """Close the persistent tiers' journal files (the worker side's shutdown)."""
        if self.journals is not None:
            self.journals.close()

    def remember(self, keys: Sequence[BlockKey], blocks: EventBlocks, group: int = 0) -> None:
        bs = blocks.block_size
        self._newest = max(self._newest, blocks.generation)
        for i, key in enumerate(keys):
            old = self.blocks.get(key)
            self.blocks[key] = _Block(
                blocks.hashes[i],
                blocks.parents[i],
                array("i", blocks.tokens[i * bs : (i + 1) * bs]),
                blocks.lora_id,
                blocks.lora_name,
                group,
                blocks.generation,
                0 if old is None else old.tiers,
            )
            self.blocks.move_to_end(key)
            if old is None or not old.tiers:
                self.loose[key] = None
                self.loose.move_to_end(key)

    def _bit(self, tier: Tier) -> tuple[int, int]:
        """The tier's bit, and the bits of its place's tiers."""
        bit = self._bits.get(tier.name)
        if bit is None:
            bit = self._bits[tier.name] = 1 << len(self._bits)
            place = self._place_of[tier.name] = (_medium(tier), _locality(tier))
            self._place_bits[place] = self._place_bits.get(place, 0) | bit
        return bit, self._place_bits[self._place_of[tier.name]]

    def take(self, off: Offloader) -> tuple[list[KVCacheEvent], int]:
        """The events since the previous call, and how many records had no known hash."""
        records = off.take_events()
        if not self.enabled:
            return [], 0
        events: list[KVCacheEvent] = []
        if self.journals is None:
            self.journals = Journals(off.tiers)
            events.extend(self._recovered(off.tiers))
        newest = max(self._resets, self._newest)
        if newest > self.generation:
            self.generation = newest
            events.extend(self._retired())
        unknown = 0
        for tier, ev in records:
            bit, mask = self._bit(tier)
            found = [(key, b) for key in ev.keys if (b := self.blocks.get(key)) is not None]
            unknown += len(ev.keys) - len(found)
            place = self._place_of[tier.name]
            if ev.removed:
                by_group: dict[int, list[Any]] = {}
                for key, b in found:
                    held = b.tiers & mask
                    b.tiers &= ~bit
                    if not b.tiers:
                        self.loose[key] = None
                    if held and not b.tiers & mask and b.generation == self.generation:
                        by_group.setdefault(b.group, []).append(_external_hash(b.block_hash))
                events.extend(_removed(place, group, hs) for group, hs in by_group.items())
                continue
            for key, b in found:
                announce = not b.tiers & mask and b.generation == self.generation
                b.tiers |= bit
                self.loose.pop(key, None)
                self.blocks.move_to_end(key)
                # vLLM's own OffloadingConnector's self-describing events: one per
                # offloaded block (its chunk is one block here), with its tokens.
                if announce:
                    events.append(self._stored(b, place))
            self.journals.wrote(tier, found)
        while len(self.loose) > self.cap:
            key, _ = self.loose.popitem(last=False)
            del self.blocks[key]
        while len(self.blocks) > 2 * self.cap:
            key, _ = self.blocks.popitem(last=False)
            self.loose.pop(key, None)
        self.journals.compact(self.blocks)
        return events, unknown

    def _retired(self) -> list[KVCacheEvent]:
        """Every announced block of an older generation than :attr:`generation`,
        announced removed from each place it is in (once, at the reset)."""
        gone: dict[tuple[Place, int], list[Any]] = {}
        for b in self.blocks.values():
            if not b.tiers or b.generation >= self.generation:
                continue
            for place, mask in self._place_bits.items():
                if b.tiers & mask:
                    gone.setdefault((place, b.group), []).append(_external_hash(b.block_hash))
        return [_removed(place, group, hashes) for (place, group), hashes in gone.items()]

    def _recovered(self, tiers: Sequence[Tier]) -> list[KVCacheEvent]:
        """The blocks persistent tiers hold from before this process whose journal
        entries say what they are, remembered and announced stored. A restarted engine
        is at generation 0 again: a block of a later one is kept silent (generation
        -1), as a retired one."""
        assert self.journals is not None
        events: list[KVCacheEvent] = []
        newest = self._newest
        for tier, record in self.journals.recovered(tiers):
            key, h, parent, tokens, lora_id, lora_name, group, gen = record
            gen = gen if gen == self.generation else -1
            blocks = EventBlocks([h], [parent], tokens, len(tokens), lora_id, lora_name, gen)
            self.remember([key], blocks, group)
            bit, mask = self._bit(tier)
            b = self.blocks[key]
            announce = not b.tiers & mask and b.generation == self.generation
            b.tiers |= bit
            self.loose.pop(key, None)
            if announce:
                events.append(self._stored(b, self._place_of[tier.name]))
        self._newest = newest
        return events

    def _stored(self, b: _Block, place: Place) -> BlockStored:
        kind, window = self._specs.get(b.group, (None, None))
        return BlockStored(
            block_hashes=[_external_hash(b.block_hash)],
            parent_block_hash=None if b.parent is None else _external_hash(b.parent),
            token_ids=b.tokens.tolist(),
            block_size=len(b.tokens),
            lora_id=b.lora_id,
            medium=place[0],
            lora_name=b.lora_name,
            group_idx=b.group,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            locality=place[1],
        )


def _removed(place: Place, group: int, hashes: list[Any]) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=place[0], group_idx=group, locality=place[1])


def _external_hash(block_hash: BlockHash) -> Any:
    """The hash as vLLM publishes it (an int, the hash's last 8 bytes, under vLLM's
    default ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; else the bytes)."""
    return maybe_convert_block_hash(block_hash) if isinstance(block_hash, bytes) else block_hash


# Re-exported: how events travel between the roles (kept in their own module).
from .event_tally import KVEventTally, TieredOffloadKVEvents  # noqa: E402

__all__ = [
    "MAX_EVENT_HASHES",
    "BlockHash",
    "EventBlocks",
    "EventBook",
    "KVEventTally",
    "TieredOffloadKVEvents",
]

"""A tier: one backend (bytes) and the manager that keeps its books.

The two share one :class:`~kvoffload.slots.SlotAllocator`, so a slot the manager hands
out is exactly a slot the backend has reserved. Built from config by :func:`build_tiers`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.backend import Backend
from kvoffload.config import KVOffloadConfig
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.manager import OffloadingManager
from kvoffload.registry import create_backend
from kvoffload.server_events import EventfulServerManager
from kvoffload.server_manager import ServerBookedManager


@dataclass(slots=True)
class Tier:
    """A configured tier, in the order the config lists it (fastest first)."""

    name: str
    backend: Backend
    manager: OffloadingManager
    """Typed as the interface: the Offloader and its books plan through it only."""

    def drop(self, keys: Sequence[BlockKey]) -> None:
        """Forget blocks for good: out of the books (slots freed) and off the medium.
        Used for blocks a load found corrupt: they must become misses, now and after a
        restart. The keys must be unpinned (``complete_load`` first)."""
        self.backend.discard(self.manager.remove(keys))

    def close(self) -> None:
        self.backend.close()


def build_tiers(config: KVOffloadConfig, layout: KVLayout, *, events: bool = False) -> list[Tier]:
    """Instantiate every configured tier for ``layout``; closes what it opened on error.

    ``events``: the managers record stored / removed events for ``take_events``. Off
    unless a consumer drains them (the vLLM connector with KV events on): undrained
    records would grow with every block ever stored."""
    tiers: list[Tier] = []
    try:
        for i, tier_config in enumerate(config.resolved_tiers()):
            backend = create_backend(tier_config, layout)
            manager: OffloadingManager
            if backend.server_booked:
                # With events: what this engine stored there, and what a lookup found
                # gone since (kvoffload.server_events).
                booked = EventfulServerManager if events else ServerBookedManager
                manager = booked(backend, backend.num_slots, name=tier_config.name)
                tiers.append(Tier(tier_config.name, backend, manager))
                if i == 0:
                    raise ConfigError(
                        f"tiers[0] ({tier_config.name!r}): backend {tier_config.backend!r} "
                        "is a shared server, which cannot be the first tier (loads copy "
                        "from the first tier's memory); put a cpu tier in front of it"
                    )
                continue
            lru = local_manager(backend, config.eviction, events=events)
            tiers.append(Tier(tier_config.name, backend, lru))
            adopt_recovered(lru, backend)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def local_manager(
    backend: Backend, eviction: str = "lru", *, events: bool = False
) -> LRUOffloadingManager:
    """The books of a tier kept here: over ``backend``'s slots, and under its byte
    budget where it has one (a packed, compressed tier: see
    :meth:`~kvoffload.backend.Backend.budget`)."""
    budget = backend.budget()
    return LRUOffloadingManager(
        backend.slots,
        eviction,
        name=backend.name,
        enable_events=events,
        byte_budget=None if budget is None else budget[0],
        full_charge=None if budget is None else budget[1],
    )


def adopt_recovered(manager: LRUOffloadingManager, backend: Backend) -> int:
    """Hand what ``backend`` recovered at open to ``manager`` (with each block's charge
    under a budget); how many blocks."""
    found = backend.recover()
    full = manager.full_charge
    charges = None if manager.byte_budget is None else [b.charge or full for b in found]
    manager.restore(((b.key, b.slot) for b in found), charges)
    return len(found)

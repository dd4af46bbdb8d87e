"""How the offline tools (:mod:`~kvoffload.tools.maintenance`,
:mod:`~kvoffload.tools.maintenance_snapshot`) reach a persistent tier: which tiers,
under which layout (the one stored in the tier, a persistent backend's
``stored_layout``, else the config's ``stress.layout``), opened as it was written and
never reformatted, and read in batches of bounded memory. A tier whose books live on
a shared server is reached through :class:`ServerStore`."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Final, Protocol, runtime_checkable

from kvoffload.backend import Backend
from kvoffload.config import KVOffloadConfig, TierConfig, layout_from_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.registry import get_backend_class

BATCH_BYTES: Final = 64 * 1024 * 1024
"""Bytes read per batch while scanning a tier: large I/Os, bounded memory."""
SCAN_KEYS: Final = 1000
"""Keys listed per batch from a shared server (at most :data:`BATCH_BYTES` of values)."""


@runtime_checkable
class ServerStore(Protocol):
    """What the tools need of a backend whose books are its server's (see the module
    docs); :class:`~kvoffload.backends.redis.RedisBackend` implements it."""

    def scan(self, batch: int) -> Iterator[list[BlockKey]]:
        """This tier's (this layout's) keys on the server, ``batch`` at a time."""
        ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks; how many were there."""
        ...

    def server_info(self) -> dict[str, Any]:
        """Where the server is (no credentials) and what it says of its memory."""
        ...


def server_store(backend: Backend) -> ServerStore:
    """``backend`` as a :class:`ServerStore`, or a one-line refusal naming the tier: a
    third-party server-booked backend may lack what the tools list its blocks with."""
    if not isinstance(backend, ServerStore):
        raise ConfigError(
            f"tier {backend.name!r}: its backend keeps its books on its server but has no "
            "scan/delete/server_info, so inspect and verify cannot list its blocks"
        )
    return backend


def tier_layout(tier: TierConfig, config: KVOffloadConfig) -> KVLayout:
    """The layout the tier's data was written under, or the config's stress layout."""
    layout = get_backend_class(tier.backend).stored_layout(tier)
    return layout if layout is not None else layout_from_config(config)


def persistent_tiers(config: KVOffloadConfig, name: str | None) -> list[TierConfig]:
    """The tiers that keep blocks across processes (only ``--tier name``'s, if given):
    the others have nothing for an offline tool to read."""
    tiers = config.resolved_tiers()
    if name is not None:
        tiers = [t for t in tiers if t.name == name]
        if not tiers:
            known = ", ".join(t.name for t in config.tiers)
            raise ConfigError(f"--tier {name!r}: no such tier in the config; tiers: {known}")
    chosen = [t for t in tiers if get_backend_class(t.backend).persistent]
    if name is not None and not chosen:
        raise ConfigError(f"--tier {name!r}: backend {tiers[0].backend!r} keeps nothing on disk")
    return chosen


@contextmanager
def open_existing(tier: TierConfig, layout: KVLayout, *, write: bool = False) -> Iterator[Backend]:
    """Open an existing tier as it was written (see ``Backend.existing_config``):
    never reformatted, resized or created by a tool that only looks."""
    cls = get_backend_class(tier.backend)
    existing = cls.existing_config(tier, write=write)
    if existing is None:
        raise ConfigError(
            f"tier {tier.name!r}: nothing written at path = {getattr(tier, 'path', '?')!r} yet"
        )
    backend = cls(existing, layout)
    backend.record_access = False  # a scan is not a use: keep the LRU order
    try:
        yield backend
    finally:
        backend.close()


def batches(n: int, layout: KVLayout) -> Iterator[slice]:
    """Slices of ``n`` blocks, each at most :data:`BATCH_BYTES`: large I/Os, bounded
    memory, whatever the tier's size."""
    step = max(1, BATCH_BYTES // layout.bytes_per_block)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))

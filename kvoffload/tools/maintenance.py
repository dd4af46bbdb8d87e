"""Offline tools over persistent tiers: ``inspect``, ``verify`` and safetensors snapshots.

Runs in its own process (the CLI), never beside an engine writing the same tier: the
slab backend's directory lock refuses that. Everything goes through the
:class:`~kvoffload.backend.Backend` interface (``recover``, ``read``, ``discard``), so
any persistent backend, built-in or third-party, gets these tools for free.

Which layout a tier is opened with: the one stored in the tier (a persistent backend's
``stored_layout``), else the config's ``stress.layout``; a snapshot import into an
empty tier adopts the snapshot's layout.

A tier whose books live on a shared server (``server_booked``, the ``redis`` tier) has
nothing to recover: its blocks are whatever the server holds under its key prefix and
the layout's fingerprint, written by any number of engines, and another engine may be
writing it while a tool looks. ``inspect`` and ``verify`` go through
:class:`ServerStore` for it instead: ``scan`` lists the layout's keys in batches,
``read`` verifies each value, ``exists`` tells a damaged value from one evicted
meanwhile, and ``delete`` repairs.

This module holds ``inspect`` and ``verify``; how a tier is opened is
:mod:`~kvoffload.tools.maintenance_open`, the snapshots are
:mod:`~kvoffload.tools.maintenance_snapshot`, and every name is importable from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvoffload.backend import Backend, RecoveredBlock
from kvoffload.config import KVOffloadConfig, TierConfig
from kvoffload.layout import KVLayout
from kvoffload.metrics import blocks_per_gib
from kvoffload.registry import get_backend_class
from kvoffload.tools.maintenance_open import (
    BATCH_BYTES,
    SCAN_KEYS,
    ServerStore,
    batches,
    open_existing,
    persistent_tiers,
    server_store,
    tier_layout,
)
from kvoffload.tools.maintenance_snapshot import (
    SNAPSHOT_FORMAT,
    check_snapshot,
    export_snapshot,
    import_snapshot,
)

__all__ = [
    "BATCH_BYTES",
    "SCAN_KEYS",
    "SNAPSHOT_FORMAT",
    "ServerStore",
    "check_snapshot",
    "export_snapshot",
    "import_snapshot",
    "inspect_tiers",
    "tier_layout",
    "verify_tiers",
]


# ------------------------------------------------------------------------- inspect
def inspect_tiers(config: KVOffloadConfig) -> dict[str, dict[str, Any]]:
    """Per tier: blocks, bytes, oldest/newest access time, capacity used, blocks per GiB
    of capacity, codec, layout."""
    report: dict[str, dict[str, Any]] = {}
    for tier in config.resolved_tiers():
        cls = get_backend_class(tier.backend)
        if not cls.persistent:
            report[tier.name] = {"backend": tier.backend, "persistent": False, "blocks": 0}
            continue
        layout = tier_layout(tier, config)
        if cls.server_booked:
            report[tier.name] = _inspect_server(tier, layout)
            continue
        if cls.existing_config(tier, write=False) is None:
            report[tier.name] = {
                "backend": tier.backend,
                "persistent": True,
                "blocks": 0,
                "missing": True,
            }
            continue
        with open_existing(tier, layout) as backend:
            blocks = backend.recover()
            atimes = [b.atime for b in blocks]
            logical, stored = backend.stats().held or (len(blocks) * layout.bytes_per_block,) * 2
            report[tier.name] = {
                "backend": tier.backend,
                "persistent": True,
                "missing": False,
                "blocks": len(blocks),
                "bytes": len(blocks) * layout.bytes_per_block,
                **_capacity(backend, blocks),
                # What compression saves: payload bytes as they sit in the tier over
                # the same blocks' bytes as the engine gave them (records written
                # under any codec count, whatever the setting is now).
                "compression": getattr(tier, "compression", "none"),
                "logical_bytes": logical,
                "stored_bytes": stored,
                "compression_ratio": stored / logical if logical else None,
                "oldest": min(atimes) if atimes else None,
                "newest": max(atimes) if atimes else None,
                "layout": layout.to_dict(),
                "fingerprint": layout.fingerprint.hex(),
            }
    return report


def _capacity(backend: Backend, blocks: Sequence[RecoveredBlock]) -> dict[str, Any]:
    """How full a tier is, and how many blocks its capacity holds per GiB.

    ``capacity_blocks`` is the full-size blocks the capacity holds, whatever the slots
    (a packed slab keeps more slots than that, for blocks compressed smaller). A tier
    with a byte budget (:meth:`~kvoffload.backend.Backend.budget`) is as full as its
    blocks' charges (what each takes there, 0 recorded for a full one) over the budget;
    the others, as their blocks over their slots."""
    capacity_bytes = backend.capacity_bytes
    out: dict[str, Any] = {
        "capacity_blocks": capacity_bytes // type(backend).slot_bytes(backend.layout),
        "capacity_bytes": capacity_bytes,
        "slots": backend.num_slots,
        "blocks_per_gib": blocks_per_gib(len(blocks), capacity_bytes),
    }
    budget = backend.budget()
    if budget is None:
        out["used"] = len(blocks) / backend.num_slots
        return out
    budget_bytes, full_charge = budget
    held = sum(b.charge or full_charge for b in blocks)
    out |= {"budget_bytes": budget_bytes, "bytes_held": held, "used": held / budget_bytes}
    return out


def _inspect_server(tier: TierConfig, layout: KVLayout) -> dict[str, Any]:
    """A shared server's tier: this layout's blocks on it (counted with SCAN; a value
    is not read, so ``bytes`` is what they take if intact, headers included), and what
    the server says of its memory and evictions."""
    with open_existing(tier, layout) as backend:
        store = server_store(backend)
        blocks = sum(len(keys) for keys in store.scan(SCAN_KEYS))
        return {
            "backend": tier.backend,
            "persistent": True,
            "server_booked": True,
            "missing": False,
            "blocks": blocks,
            "bytes": blocks * backend.slot_bytes(layout),
            **store.server_info(),
            "layout": layout.to_dict(),
            "fingerprint": layout.fingerprint.hex(),
        }


# -------------------------------------------------------------------------- verify
def verify_tiers(config: KVOffloadConfig, *, repair: bool = False) -> dict[str, dict[str, int]]:
    """Re-read every persisted block; ``{tier: {blocks, ok, corrupt, repaired}}``.

    With ``repair`` the corrupt blocks' records are discarded, so a reopen no longer
    finds them (they were never served: loads verify too). A shared server's tier
    (:func:`_verify_server`) also counts ``gone``: blocks listed but evicted or
    expired before their read.
    """
    report: dict[str, dict[str, int]] = {}
    for tier in persistent_tiers(config, None):
        layout = tier_layout(tier, config)
        if get_backend_class(tier.backend).server_booked:
            report[tier.name] = _verify_server(tier, layout, repair=repair)
            continue
        if get_backend_class(tier.backend).existing_config(tier, write=False) is None:
            report[tier.name] = {"blocks": 0, "ok": 0, "corrupt": 0, "repaired": 0}
            continue
        with open_existing(tier, layout, write=repair) as backend:
            blocks = backend.recover()
            counts = {"blocks": len(blocks), "ok": 0, "corrupt": 0, "repaired": 0}
            for part in batches(len(blocks), layout):
                batch = blocks[part]
                buf = torch.empty((len(batch), layout.bytes_per_block), dtype=torch.uint8)
                valid = backend.read([b.slot for b in batch], [b.key for b in batch], buf)
                bad = [b.slot for b, ok in zip(batch, valid, strict=True) if not ok]
                counts["ok"] += len(batch) - len(bad)
                counts["corrupt"] += len(bad)
                if repair and bad:
                    backend.discard(bad)
                    backend.free(bad)
                    counts["repaired"] += len(bad)
            report[tier.name] = counts
    return report


def _verify_server(tier: TierConfig, layout: KVLayout, *, repair: bool) -> dict[str, int]:
    """Read and verify this layout's blocks on a shared server, a scan batch at a time.

    A value that fails verification and is still there when asked again (``exists``)
    is ``corrupt``: damaged, torn, of another format or another writer's; one that is
    no longer there was evicted or expired meanwhile (``gone``, the normal life of a
    shared cache). With ``repair`` the corrupt ones are deleted, so that engines stop
    finding and re-reading them. Another engine may rewrite a key between the read and
    the delete; deleting its fresh value costs one recomputed block, never data."""
    counts = {"blocks": 0, "ok": 0, "corrupt": 0, "gone": 0, "repaired": 0}
    bpb = layout.bytes_per_block
    step = max(1, min(SCAN_KEYS, BATCH_BYTES // bpb))
    with open_existing(tier, layout, write=repair) as backend:
        store = server_store(backend)
        for keys in store.scan(step):
            buf = torch.empty((len(keys), bpb), dtype=torch.uint8)
            valid = backend.read(range(len(keys)), keys, buf)  # slots are nominal
            bad = [k for k, ok in zip(keys, valid, strict=True) if not ok]
            there = store.exists(bad) if bad else []
            corrupt = [k for k, held in zip(bad, there, strict=True) if held]
            counts["blocks"] += len(keys)
            counts["ok"] += len(keys) - len(bad)
            counts["corrupt"] += len(corrupt)
            counts["gone"] += len(bad) - len(corrupt)
            if repair and corrupt:
                counts["repaired"] += store.delete(corrupt)
    return counts

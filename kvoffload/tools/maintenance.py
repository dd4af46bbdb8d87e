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
"""

from __future__ import annotations

import json
import logging
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

import torch

from kvoffload.backend import Backend, RecoveredBlock
from kvoffload.blockpool import byte_view
from kvoffload.config import KVOffloadConfig, TierConfig, layout_from_config
from kvoffload.exceptions import ConfigError, LayoutMismatchError
from kvoffload.keys import MAX_KEY_BYTES, BlockKey
from kvoffload.layout import KVLayout
from kvoffload.metrics import blocks_per_gib
from kvoffload.registry import get_backend_class
from kvoffload.tier import adopt_recovered, local_manager

logger = logging.getLogger(__name__)

BATCH_BYTES: Final = 64 * 1024 * 1024
"""Bytes read per batch while scanning a tier: large I/Os, bounded memory."""
SNAPSHOT_FORMAT: Final = "kvoffload-snapshot-v1"
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


def _server_store(backend: Backend) -> ServerStore:
    if not isinstance(backend, ServerStore):
        raise ConfigError(
            f"tier {backend.name!r}: its backend keeps its books on its server but has no "
            "scan/delete/server_info, so inspect and verify cannot list its blocks"
        )
    return backend


def tier_layout(tier: TierConfig, config: KVOffloadConfig) -> KVLayout:
    """The layout the tier's data was written under, or the config's stress layout."""
    cls = get_backend_class(tier.backend)
    stored = getattr(cls, "stored_layout", None)
    layout = stored(tier) if stored is not None else None
    return layout if isinstance(layout, KVLayout) else layout_from_config(config)


def _persistent_tiers(config: KVOffloadConfig, name: str | None) -> list[TierConfig]:
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
def _open(tier: TierConfig, layout: KVLayout, *, write: bool = False) -> Iterator[Backend]:
    """Open an existing tier as it was written (see ``Backend.existing_config``):
    never reformatted, resized or created by a tool that only looks."""
    cls = get_backend_class(tier.backend)
    existing = cls.existing_config(tier, write=write)
    if existing is None:
        raise ConfigError(
            f"tier {tier.name!r}: nothing written at path = {getattr(tier, 'path', '?')!r} yet"
        )
    backend = cls(existing, layout)
    if hasattr(backend, "record_access"):
        backend.record_access = False  # a scan is not a use: keep the LRU order
    try:
        yield backend
    finally:
        backend.close()


def _batches(n: int, layout: KVLayout) -> Iterator[slice]:
    step = max(1, BATCH_BYTES // layout.bytes_per_block)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


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
        with _open(tier, layout) as backend:
            blocks = backend.recover()
            atimes = [b.atime for b in blocks]
            logical, stored = backend.footprint() or (len(blocks) * layout.bytes_per_block,) * 2
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
    with _open(tier, layout) as backend:
        store = _server_store(backend)
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
    for tier in _persistent_tiers(config, None):
        layout = tier_layout(tier, config)
        if get_backend_class(tier.backend).server_booked:
            report[tier.name] = _verify_server(tier, layout, repair=repair)
            continue
        if get_backend_class(tier.backend).existing_config(tier, write=False) is None:
            report[tier.name] = {"blocks": 0, "ok": 0, "corrupt": 0, "repaired": 0}
            continue
        with _open(tier, layout, write=repair) as backend:
            blocks = backend.recover()
            counts = {"blocks": len(blocks), "ok": 0, "corrupt": 0, "repaired": 0}
            for part in _batches(len(blocks), layout):
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
    with _open(tier, layout, write=repair) as backend:
        store = _server_store(backend)
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


# ------------------------------------------------------------------------ snapshots
def export_snapshot(config: KVOffloadConfig, out: Path, tier_name: str | None = None) -> int:
    """Write every intact block of one persistent tier to a safetensors file.

    Streams: blocks are read in batches and appended, so memory stays bounded
    whatever the tier's size. Tensors: ``blocks`` uint8 [n, bytes_per_block],
    ``keys`` uint8 [n, 64] (zero-padded), ``key_lens`` int16 [n]; the layout goes in
    the metadata. Returns the number of blocks written.
    """
    tiers = _persistent_tiers(config, tier_name)
    if not tiers:
        raise ConfigError("snapshot export: the config has no persistent tier (mmap, lmdb, ...)")
    tier = tiers[0]
    layout = tier_layout(tier, config)
    if get_backend_class(tier.backend).server_booked:
        raise ConfigError(
            f"snapshot export: tier {tier.name!r} (backend {tier.backend!r}) keeps its "
            "blocks on a shared server, which export does not read; name a local "
            "persistent tier with --tier"
        )
    if get_backend_class(tier.backend).existing_config(tier, write=False) is None:
        raise ConfigError(
            f"snapshot export: tier {tier.name!r} has nothing at path = "
            f"{getattr(tier, 'path', '?')!r}; check tiers[].path"
        )
    with _open(tier, layout) as backend:
        blocks = backend.recover()
        n_max = len(blocks)
        bpb = layout.bytes_per_block
        meta = {
            "format": SNAPSHOT_FORMAT,
            "tier": tier.name,
            "layout": json.dumps(layout.to_dict(), sort_keys=True),
            "fingerprint": layout.fingerprint.hex(),
        }
        # The header is written last, once the number of intact blocks is known, into
        # room reserved for the largest possible header (padding is allowed).
        reserve = len(_header_json(n_max, bpb, meta)) + 64
        keys: list[BlockKey] = []
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "wb") as f:
            f.write(b"\0" * (8 + reserve))
            for part in _batches(n_max, layout):
                batch = blocks[part]
                buf = torch.empty((len(batch), bpb), dtype=torch.uint8)
                valid = backend.read([b.slot for b in batch], [b.key for b in batch], buf)
                for i, (block, ok) in enumerate(zip(batch, valid, strict=True)):
                    if ok:
                        f.write(byte_view(buf[i]))
                        keys.append(block.key)
            key_bytes = torch.zeros((len(keys), MAX_KEY_BYTES), dtype=torch.uint8)
            key_lens = torch.zeros(len(keys), dtype=torch.int16)
            for i, key in enumerate(keys):
                key_bytes[i, : len(key)] = torch.frombuffer(bytearray(key), dtype=torch.uint8)
                key_lens[i] = len(key)
            if keys:  # an empty tier: empty tensors, no bytes (and no view of nothing)
                f.write(byte_view(key_bytes))
                f.write(byte_view(key_lens))
            header = _header_json(len(keys), bpb, meta)
            f.seek(0)
            f.write(struct.pack("<Q", reserve) + header.ljust(reserve, b" "))
    logger.info("exported %d blocks of tier %s to %s", len(keys), tier.name, out)
    return len(keys)


def _header_json(n: int, bpb: int, meta: dict[str, str]) -> bytes:
    blocks_end = n * bpb
    keys_end = blocks_end + n * MAX_KEY_BYTES
    header = {
        "__metadata__": meta,
        "blocks": {"dtype": "U8", "shape": [n, bpb], "data_offsets": [0, blocks_end]},
        "keys": {
            "dtype": "U8",
            "shape": [n, MAX_KEY_BYTES],
            "data_offsets": [blocks_end, keys_end],
        },
        "key_lens": {"dtype": "I16", "shape": [n], "data_offsets": [keys_end, keys_end + 2 * n]},
    }
    return json.dumps(header, separators=(",", ":")).encode()


_SNAPSHOT_TENSORS: Final = {"blocks": "U8", "keys": "U8", "key_lens": "I16"}


def check_snapshot(src: Path) -> KVLayout:
    """Validate a whole snapshot file without touching any tier; its layout.

    Everything an import relies on is checked first, so a garbage, truncated or foreign
    file is refused in one line (:class:`LayoutMismatchError`, exit 2 from the CLI)
    before a single block is written: the safetensors header (its declared size against
    the file's, before it is parsed, so a huge declared header is not read), the
    format and layout in the metadata and their fingerprint, the three tensors' names,
    dtypes and shapes against each other and the layout, and every key length."""
    from safetensors import SafetensorError, safe_open

    def bad(why: str) -> LayoutMismatchError:
        return LayoutMismatchError(f"{src}: not a usable kvoffload snapshot: {why}")

    try:
        size = src.stat().st_size
        with src.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise LayoutMismatchError(
            f"{src}: cannot read the snapshot: {exc.strerror or exc}"
        ) from None
    if len(head) < 8:
        raise bad(f"{size} bytes, shorter than a safetensors header")
    (declared,) = struct.unpack("<Q", head)
    if declared > size - 8:
        raise bad(f"the header declares {declared} bytes but the file has {size - 8} after it")
    try:
        with safe_open(str(src), framework="pt") as snap:
            meta = snap.metadata() or {}
            names = set(snap.keys())
            shapes = {n: snap.get_slice(n).get_shape() for n in names}
            dtypes = {n: snap.get_slice(n).get_dtype() for n in names}
            if meta.get("format") != SNAPSHOT_FORMAT:
                raise bad(f"format {meta.get('format')!r}, expected {SNAPSHOT_FORMAT!r}")
            if set(_SNAPSHOT_TENSORS) != names:
                raise bad(f"tensors {sorted(names)}, expected {sorted(_SNAPSHOT_TENSORS)}")
            for name, dtype in _SNAPSHOT_TENSORS.items():
                if dtypes[name] != dtype:
                    raise bad(f"tensor {name!r} is {dtypes[name]}, expected {dtype}")
            try:
                layout = KVLayout(**json.loads(meta["layout"]))
            except (KeyError, TypeError, ValueError) as exc:
                raise bad(f"its layout metadata is invalid ({exc})") from None
            if layout.fingerprint.hex() != meta.get("fingerprint"):
                raise bad("its layout and fingerprint disagree (damaged?)")
            n = shapes["blocks"][0] if len(shapes["blocks"]) == 2 else -1
            want = {
                "blocks": [n, layout.bytes_per_block],
                "keys": [n, MAX_KEY_BYTES],
                "key_lens": [n],
            }
            for name, shape in want.items():
                if list(shapes[name]) != shape:
                    raise bad(f"tensor {name!r} has shape {list(shapes[name])}, expected {shape}")
            lens = snap.get_tensor("key_lens")
            if n and (int(lens.min()) < 1 or int(lens.max()) > MAX_KEY_BYTES):
                raise bad(f"key lengths must be 1..{MAX_KEY_BYTES}")
    except SafetensorError as exc:
        raise bad(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return layout


def import_snapshot(
    config: KVOffloadConfig, src: Path, tier_name: str | None = None
) -> dict[str, int]:
    """Pre-warm a persistent tier from a snapshot; refuse one of another layout.

    Returns ``{blocks, imported, present, rejected, evicted}``: ``imported`` are held
    when the import ends, ``present`` were already in the tier, ``rejected`` found no
    room, ``evicted`` were imported and then pushed out by later ones (a snapshot
    bigger than the tier).
    """
    from safetensors import safe_open

    tiers = _persistent_tiers(config, tier_name)
    if not tiers:
        raise ConfigError("snapshot import: the config has no persistent tier (mmap, lmdb, ...)")
    tier = tiers[0]
    layout = check_snapshot(src)  # the whole file, before any tier is opened
    with safe_open(str(src), framework="pt") as snap:
        stored = getattr(get_backend_class(tier.backend), "stored_layout", None)
        have = stored(tier) if stored is not None else None
        if isinstance(have, KVLayout) and have.fingerprint != layout.fingerprint:
            raise LayoutMismatchError(
                f"{src}: snapshot layout {layout.to_dict()} does not match tier "
                f"{tier.name!r}'s layout {have.to_dict()}; import it into a tier of that "
                "layout (or an empty tier directory)"
            )
        key_bytes = snap.get_tensor("keys")
        key_lens = snap.get_tensor("key_lens").tolist()
        keys = [BlockKey(bytes(key_bytes[i, :n].tolist())) for i, n in enumerate(key_lens)]
        blocks = snap.get_slice("blocks")
        counts = {"blocks": len(keys), "imported": 0, "present": 0, "rejected": 0, "evicted": 0}
        cls = get_backend_class(tier.backend)
        target = cls.existing_config(tier, write=True) or tier  # a new node: create it
        imported: set[BlockKey] = set()
        backend = cls(target, layout)
        try:
            manager = local_manager(backend, config.eviction)
            adopt_recovered(manager, backend)
            # Batches never larger than the tier, so an oversized snapshot still fills
            # it; blocks come oldest access first, so the most recent ones stay.
            step = min(max(1, BATCH_BYTES // layout.bytes_per_block), backend.num_slots)
            budget = backend.budget()
            if budget is not None:  # a packed tier admits a batch at full size
                step = max(1, min(step, budget[0] // budget[1] // 2))
            for start in range(0, len(keys), step):
                part = slice(start, min(len(keys), start + step))
                batch_keys = keys[part]
                plan = manager.prepare_store(batch_keys)
                if plan is None:
                    counts["rejected"] += len(batch_keys)
                    continue
                counts["present"] += len(batch_keys) - len(plan.keys_to_store)
                # A snapshot bigger than the tier evicts its own earlier blocks.
                counts["evicted"] += len(imported.intersection(plan.evicted))
                imported.difference_update(plan.evicted)
                if not plan.keys_to_store:
                    continue
                rows = blocks[part.start : part.stop]
                row_of = {k: i for i, k in enumerate(batch_keys)}
                src_rows = rows[torch.tensor([row_of[k] for k in plan.keys_to_store])]
                # A packed tier's victims beyond the slots reused: their space now.
                backend.released([s for s in plan.evicted_slots if s not in plan.slots])
                sizes = backend.write(plan.slots, plan.keys_to_store, src_rows.contiguous())
                stored = plan.keys_to_store
                if sizes is not None:  # a packed tier: blocks it found no room for drop
                    lost = [k for k, size in zip(stored, sizes, strict=True) if not size]
                    manager.complete_store(lost, success=False)
                    counts["rejected"] += len(lost)
                    stored = [k for k, size in zip(stored, sizes, strict=True) if size]
                    manager.charge(stored, [size for size in sizes if size], unplaced=len(lost))
                manager.complete_store(stored)
                imported.update(stored)
        finally:
            backend.close()
        counts["imported"] = len(imported)
    logger.info("imported %s from %s into tier %s", counts, src, tier.name)
    return counts

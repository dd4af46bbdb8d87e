"""``kvoffload snapshot export|import``: a persistent tier's blocks through a
safetensors file (``blocks``, ``keys``, ``key_lens``; the layout in the metadata),
streamed in batches, and every snapshot checked whole before an import writes a
block."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Final

import torch

from kvoffload.blockpool import byte_view
from kvoffload.config import KVOffloadConfig
from kvoffload.exceptions import ConfigError, LayoutMismatchError
from kvoffload.keys import MAX_KEY_BYTES, BlockKey
from kvoffload.layout import KVLayout
from kvoffload.registry import get_backend_class
from kvoffload.tier import adopt_recovered, local_manager
from kvoffload.tools.maintenance_open import (
    BATCH_BYTES,
    batches,
    open_existing,
    persistent_tiers,
    tier_layout,
)

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT: Final = "kvoffload-snapshot-v1"


def export_snapshot(config: KVOffloadConfig, out: Path, tier_name: str | None = None) -> int:
    """Write every intact block of one persistent tier to a safetensors file.

    Streams: blocks are read in batches and appended, so memory stays bounded
    whatever the tier's size. Tensors: ``blocks`` uint8 [n, bytes_per_block],
    ``keys`` uint8 [n, 64] (zero-padded), ``key_lens`` int16 [n]; the layout goes in
    the metadata. Returns the number of blocks written.
    """
    tiers = persistent_tiers(config, tier_name)
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
    with open_existing(tier, layout) as backend:
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
            for part in batches(n_max, layout):
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

    tiers = persistent_tiers(config, tier_name)
    if not tiers:
        raise ConfigError("snapshot import: the config has no persistent tier (mmap, lmdb, ...)")
    tier = tiers[0]
    layout = check_snapshot(src)  # the whole file, before any tier is opened
    with safe_open(str(src), framework="pt") as snap:
        have = get_backend_class(tier.backend).stored_layout(tier)
        if have is not None and have.fingerprint != layout.fingerprint:
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

"""Opening an ``mmap`` slab: its geometry, its files, and what their header tables hold.

The geometry comes from the config: how many slab files, how many slots and data pages
each, and whether the slab is packed (compressed blocks in page extents, several slots
per full-size block) or has fixed slots. A file written under another geometry or
layout starts empty. Then the recovery scan: every header is validated (magic,
version, CRC, layout fingerprint, a length and, when packed, an extent that fits), the
newest copy of each key is kept, a packed slab's surviving extents are adopted (the
newest of any that overlap, and no more than the budget, least recently used first to
go), and the rest reclaimed. The blocks found go to the manager in ``atime`` order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Final

import numpy as np
from kvoffload.backends.mmap.extents import PackedSpace, resolve
from kvoffload.backends.mmap.files import ALIGN, align_up
from kvoffload.backends.mmap.headers import HeaderTables

from kvoffload.backend import RecoveredBlock
from kvoffload.keys import BlockKey
from kvoffload.record import (
    FLAG_EXTENT,
    HEADER_BYTES,
    MAGIC,
    READABLE_VERSIONS,
    extent_pages,
    header_crc,
    stored_lengths,
)

logger = logging.getLogger(__name__)

PACKING: Final = 4
"""A packed slab keeps this many slots per full-size block its capacity holds (fewer
for blocks of under 4 pages, since an extent is at least a page): compression can
then fit up to this many times the blocks, and the slots' headers cost 128 bytes each
(0.2% of a 256 KiB block's space, 3% of a 16 KiB one's)."""


class SlabRecovery(HeaderTables):
    """The slab's geometry and files, opened, and the blocks they hold, recovered."""

    space: PackedSpace | None
    """A packed slab's extents (set by :meth:`_open_files`); ``None`` for fixed slots."""
    _recovered: list[RecoveredBlock]

    def _packing(self) -> int:
        """Slots per full-size block: :data:`PACKING` when packed, else 1."""
        if not self._is_packed():
            return 1
        return max(1, min(PACKING, align_up(self.layout.bytes_per_block) // ALIGN))

    def _is_packed(self) -> bool:
        """Packed when compressed, or when the slab already there is packed and fits
        this config: turning ``compression`` off then keeps every block (new ones are
        stored raw, in extents). Turning it on over a fixed-slot slab starts a packed
        one, empty: compression that bought no capacity would not be what was asked."""
        packed = self.__dict__.get("_packed_cache")
        if packed is None:
            cfg = self.config
            packed = getattr(cfg, "compression", "none") != "none"
            if not packed:
                meta = self.read_superblock(Path(getattr(cfg, "path", "")) / "slab-000.kvo")
                old = None if meta is None else meta.get("packed")
                packed = old is not None and (old["capacity"], old["max_file_bytes"]) == (
                    cfg.capacity,
                    getattr(cfg, "max_file_bytes", None),
                )
            self.__dict__["_packed_cache"] = packed
        return bool(packed)

    def _geometry(self) -> list[tuple[int, int]]:
        """``(slots, data pages)`` of each slab file. Each file stands for as many
        full-size blocks as ``max_file_bytes`` holds; a packed one keeps
        :meth:`_packing` slots for each and fills the rest of its bytes with pages."""
        unit = self.stride + HEADER_BYTES
        k = self._packing()
        per_file = max(1, self.cfg.max_file_bytes // unit)
        left = self.num_slots // k
        out: list[tuple[int, int]] = []
        while left > 0:
            units = min(per_file, left)
            out.append((units * k, (units * unit - units * k * HEADER_BYTES) // ALIGN))
            left -= units
        return out

    def _open_files(self) -> None:
        first = 0
        first_page = 0
        expected_names = set()
        geometry = self._geometry()
        for index, (count, pages) in enumerate(geometry):
            path = self.dir / f"slab-{index:03d}.kvo"
            expected_names.add(path.name)
            self.files.append(self._open_file(index, path, first, count, (first_page, pages)))
            first += count
            first_page += pages
        if self.packed:
            self.space = PackedSpace(
                [pages for _, pages in geometry], self.num_slots, self.stride // ALIGN
            )
        # Slab files of an earlier, larger geometry hold nothing this tier can use.
        for stale in self.dir.glob("slab-*.kvo"):
            if stale.name not in expected_names:
                stale.unlink()
        self._recovered = self._recover_headers()

    def _recover_headers(self) -> list[RecoveredBlock]:
        fp = np.array([self.layout.fingerprint], dtype="V16")[0]
        best: dict[bytes, tuple[int, int, float]] = {}  # key -> (seq, slot, atime)
        reclaim: list[int] = []
        max_seq = 0
        for f in self.files:
            h = f.headers
            used = h["magic"] != b""
            stored = stored_lengths(h)
            ok = (
                used
                & (h["magic"] == MAGIC)
                & np.isin(h["version"], READABLE_VERSIONS)
                & (h["layout"] == fp)
                & (h["length"] == self.payload_bytes)
                & np.where(h["codec"] == 0, stored == self.payload_bytes, stored > 0)
                & (stored <= self.payload_bytes)
                & (h["key_len"] > 0)
                & (h["key_len"] <= 64)
            )
            if self.packed:
                ok &= self._placed(h, stored)
            else:
                ok &= h["flags"] & FLAG_EXTENT == 0
            candidates = np.flatnonzero(ok)
            good = np.zeros(f.num_slots, dtype=bool)
            raw = h.view(np.uint8).reshape(f.num_slots, HEADER_BYTES)
            hcrc = h["hcrc"]
            for local in candidates.tolist():
                if header_crc(raw[local].tobytes()) == int(hcrc[local]):
                    good[local] = True
            for local in np.flatnonzero(used & ~good).tolist():
                reclaim.append(f.first_slot + local)
            locals_ = np.flatnonzero(good)
            seqs, atimes, key_lens = h["seq"][locals_], h["atime"][locals_], h["key_len"][locals_]
            keys = h["key"][locals_]
            for j, local in enumerate(locals_.tolist()):
                key = keys[j].tobytes()[: int(key_lens[j])]
                seq = int(seqs[j])
                max_seq = max(max_seq, seq)
                slot = f.first_slot + local
                prev = best.get(key)
                if prev is None or seq > prev[0]:
                    if prev is not None:
                        reclaim.append(prev[1])
                    best[key] = (seq, slot, float(atimes[j]))
                else:
                    reclaim.append(slot)
        charges: dict[int, int] = {}
        if self.space is not None:
            kept = self._adopt_extents([v for v in best.values()])
            budget = self.budget()
            total = sum(kept.values())
            if budget is not None and total > budget[0]:
                # More than the budget (a crash before cleared headers reached the
                # disk, or a reserve that grew): the least recently used go, so the
                # books can take the rest.
                # (atime, seq): a batch shares one write time; its order is its seq.
                for _, slot, _ in sorted(best.values(), key=lambda v: (v[2], v[0])):
                    if total <= budget[0]:
                        break
                    if slot in kept:
                        total -= kept.pop(slot)
                        self.space.release(slot)
            for key in [k for k, v in best.items() if v[1] not in kept]:
                reclaim.append(best.pop(key)[1])
            charges = kept
        self._seq = max_seq
        if reclaim:
            logger.warning(
                "tier %s: reclaimed %d slots with torn, foreign or superseded headers",
                self.name,
                len(reclaim),
            )
            self._clear_headers(reclaim)
        blocks = sorted(
            (
                RecoveredBlock(BlockKey(key), slot, atime, charges.get(slot, 0))
                for key, (_, slot, atime) in best.items()
            ),
            key=lambda b: b.atime,
        )
        self.slots.reserve(b.slot for b in blocks)
        if blocks:
            logger.info("tier %s: recovered %d blocks from %s", self.name, len(blocks), self.dir)
        return blocks

    def _placed(
        self, h: np.ndarray[Any, np.dtype[np.void]], stored: np.ndarray[Any, Any]
    ) -> np.ndarray[Any, np.dtype[np.bool_]]:
        """Which of a packed file's headers name an extent that lies in one file."""
        assert self.space is not None
        first = np.array(self.space.first_page, dtype=np.int64)
        start = h["wtime"].astype(np.int64)
        pages = extent_pages(h)
        last = start + pages - 1
        inside = (
            (h["flags"] & FLAG_EXTENT != 0)
            & (pages <= self.space.max_pages)
            & (last < self.space.total_pages)
        )
        same_file = np.searchsorted(first, start, "right") == np.searchsorted(first, last, "right")
        return np.asarray(inside & same_file)

    def _adopt_extents(self, found: list[tuple[int, int, float]]) -> dict[int, int]:
        """Keep the newest of any overlapping extents among the headers that survived
        (``(seq, slot, atime)`` each), adopt them into the free-space map, and return
        each kept slot's charge (its extent's bytes)."""
        assert self.space is not None
        slots = np.array([slot for _, slot, _ in found], dtype=np.int64)
        seqs = np.array([seq for seq, _, _ in found], dtype=np.uint64)
        starts = np.zeros(len(found), dtype=np.int64)
        pages = np.zeros(len(found), dtype=np.int64)
        if len(found):
            files, locals_ = self._locate_all(slots.tolist())
            for f, idx in self._by_file(files):
                recs = f.headers[locals_[idx]]
                starts[idx] = recs["wtime"].astype(np.int64)
                pages[idx] = extent_pages(recs)
        keep = resolve(starts, pages, seqs)
        self.space.adopt(slots[keep].tolist(), starts[keep].tolist(), pages[keep].tolist())
        return dict(zip(slots[keep].tolist(), (pages[keep] * ALIGN).tolist(), strict=True))

"""Recovery of an ``lmdb`` tier at open: which of the records found are this layout's
intact blocks, and which of those to keep when they no longer all fit.

Headers are checked here; payload checksums only when a block is loaded, as reading
every payload would make start-up as slow as a full scan of the tier. The newest
blocks (by last write: LMDB values are not rewritten on load) are kept, as many as
fit the slots and, for a compressing tier, the byte budget, each charged its record's
length.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import lmdb
import numpy as np

from kvoffload.exceptions import BackendError
from kvoffload.layout import KVLayout
from kvoffload.record import (
    HEADER_BYTES,
    HEADER_DTYPE,
    check_headers,
    header_key,
    stored_lengths,
    unpack_header,
)

logger = logging.getLogger(__name__)

Found = tuple[float, int, bytes, int]
"""A block recovered: (atime, seq, key, stored payload bytes)."""


@dataclass(slots=True)
class Scan:
    """What the scan of a tier found, sorted out."""

    keep: list[Found]
    """The blocks to adopt, oldest first (the order ``restore()`` wants)."""
    surplus: list[Found]
    """This layout's intact blocks that did not fit."""
    damaged: list[bytes]
    """Keys of records cut short, run on, or whose header is unreadable."""
    foreign: list[bytes]
    """Keys of intact records of another layout (or another model's keys)."""
    max_seq: int
    """The highest record sequence number seen (0 if none)."""

    def reclaim(self) -> list[bytes]:
        """The keys of the records that can never be served: they go (unless read-only)."""
        return self.damaged + self.foreign + [key for _, _, key, _ in self.surplus]

    def log(self, tier: str, *, readonly: bool) -> None:
        if self.reclaim():
            logger.info(
                "tier %s: recovered %d blocks; %s %d damaged, %d of another layout, "
                "%d over capacity",
                tier,
                len(self.keep),
                "ignored (read-only)" if readonly else "reclaimed",
                len(self.damaged),
                len(self.foreign),
                len(self.surplus),
            )
        else:
            logger.info("tier %s: recovered %d blocks", tier, len(self.keep))


def scan(
    env: lmdb.Environment,
    blocks: lmdb._Database,
    layout: KVLayout,
    *,
    num_slots: int,
    budget: int | None,
    tier: str,
    path: Path,
) -> Scan:
    """Scan every record in ``blocks``: keep the newest intact ones of ``layout`` that
    fit ``num_slots`` and, where given, ``budget`` bytes of records (header plus stored
    payload each). LMDB errors come back as :class:`BackendError`."""
    fp, length = layout.fingerprint, layout.bytes_per_block
    damaged: list[bytes] = []
    intact: list[bytes] = []  # keys whose header is intact, in scan order
    headers = bytearray()  # their headers, checked as one batch after the scan
    lengths: list[int] = []  # and the payload bytes each value holds
    try:
        with env.begin(db=blocks, buffers=True) as txn:
            for raw_key, value in txn.cursor():
                key = bytes(raw_key)
                rec = unpack_header(value)
                if rec is None or header_key(rec) != key:
                    damaged.append(key)
                    continue
                intact.append(key)
                headers += value[:HEADER_BYTES]
                lengths.append(len(value) - HEADER_BYTES)
    except lmdb.Error as exc:
        raise BackendError(f"tier {tier!r}: cannot scan {path}: {exc}") from exc
    recs = np.frombuffer(bytes(headers), dtype=HEADER_DTYPE)
    sizes = stored_lengths(recs)
    # A value cut short or run on is damage, whatever its layout; the rest that
    # fails the check is of another layout (or another model's keys).
    whole = sizes == np.asarray(lengths, dtype=np.int64)
    ours = check_headers(recs, intact, layout_fp=fp, length=length) & whole
    max_seq = int(recs["seq"].max()) if len(recs) else 0
    found: list[Found] = []
    foreign: list[bytes] = []
    for j, key in enumerate(intact):
        if ours[j]:
            found.append((float(recs["atime"][j]), int(recs["seq"][j]), key, int(sizes[j])))
        elif not whole[j]:
            damaged.append(key)
        else:
            foreign.append(key)
    found.sort(reverse=True)  # newest first
    fits = num_slots
    if budget is not None:  # and the newest whose records' bytes fit the budget
        total = np.cumsum([HEADER_BYTES + f[3] for f in found[:fits]], dtype=np.int64)
        fits = int(np.searchsorted(total, budget, side="right"))
    keep, surplus = found[:fits], found[fits:]
    keep.reverse()  # oldest first, the order restore() wants
    return Scan(keep, surplus, damaged, foreign, max_seq)

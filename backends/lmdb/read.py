"""The read side of an ``lmdb`` tier: a batch of records copied out of one read
transaction, verified, and decompressed into the caller's rows.

Reads run on the caller's thread in their own read transaction, which the writer never
blocks and which never sees half a batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import lmdb
import numpy as np

from kvoffload.codec import Packer, parallel_map
from kvoffload.exceptions import BackendError
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES, HEADER_DTYPE, check_headers, header_crc, payload_checksum

logger = logging.getLogger(__name__)

_CODEC_BYTE: Final = HEADER_DTYPE.fields["codec"][1]  # type: ignore[index]
"""Where a record's header keeps its codec id (0: raw)."""


class RecordReader:
    """Reads a tier's records into rows, and counts and logs the ones it cannot serve.

    ``readonly``: the tier is another process's, so a record gone is one the writer
    replaced since (a miss, counted in :attr:`missing_blocks`), not damage."""

    def __init__(
        self, layout: KVLayout, packer: Packer, *, tier: str, path: Path, readonly: bool
    ) -> None:
        self.layout = layout
        self.packer = packer
        self.tier = tier
        self.path = path
        self.readonly = readonly
        self.missing_blocks = 0
        self._warned = False
        self._lock = threading.Lock()

    def renew_lock(self) -> None:
        """In a forked child: a parent thread may have held the lock at fork time."""
        self._lock = threading.Lock()

    def read(
        self,
        env: lmdb.Environment,
        blocks: lmdb._Database,
        keys: Sequence[bytes],
        rows: np.ndarray[Any, Any],
    ) -> np.ndarray[Any, Any]:
        """Copy the records of ``keys`` into ``rows`` (contiguous, on the host),
        verified; which of them are valid. One absent or unusable is logged and not
        valid. LMDB errors come back as :class:`BackendError`."""
        n, length = len(keys), self.layout.bytes_per_block
        # Headers, checksums and lengths are gathered as the values are copied, and
        # checked as one batch afterwards (``check_headers``): numpy per record cost
        # about 30 us a block more than the copy of a small one (2026-11-26).
        heads = np.zeros(n, dtype=HEADER_DTYPE)
        raw = heads.view(np.uint8).reshape(n, HEADER_BYTES)
        stored = np.zeros(n, dtype=np.int64)
        sums = np.zeros(n, dtype=np.uint64)
        read: list[int] = []  # positions whose value came back with a plausible length
        packed: dict[int, bytes] = {}  # position -> its compressed payload (a copy)
        try:
            # buffers=True: values are views of the map, valid only inside the
            # transaction. Verify a copy, not the map: what the caller gets is then
            # exactly what was summed, even if a page under a reader that lost its
            # lock-table slot was reused meanwhile (see fork). A raw payload is copied
            # straight into its row (one copy); a compressed one into a private buffer,
            # decompressed into the row only once its record verified.
            with env.begin(db=blocks, buffers=True) as txn:
                for i, key in enumerate(keys):
                    value = txn.get(key)
                    if value is None:
                        self.missing(key)
                        continue
                    if not HEADER_BYTES < len(value) <= HEADER_BYTES + length:
                        self.corrupt(key, f"record of {len(value)} bytes")
                        continue
                    read.append(i)
                    raw[i] = np.frombuffer(value, np.uint8, count=HEADER_BYTES)
                    payload = value[HEADER_BYTES:]
                    stored[i] = len(payload)
                    if raw[i, _CODEC_BYTE] == 0 and stored[i] == length:
                        np.copyto(rows[i], np.frombuffer(payload, np.uint8))
                        sums[i] = payload_checksum(rows[i])
                    else:
                        packed[i] = bytes(payload)
                        sums[i] = payload_checksum(packed[i])
        except lmdb.MapResizedError as exc:
            raise BackendError(
                f"tier {self.tier!r}: the writer of {self.path} now maps more than this "
                "process does; reopen the tier to read it"
            ) from exc
        except lmdb.Error as exc:
            raise BackendError(f"tier {self.tier!r}: LMDB read failed: {exc}") from exc
        valid = np.zeros(n, dtype=bool)
        if read:
            valid[read] = check_headers(
                heads[read],
                [bytes(keys[i]) for i in read],
                layout_fp=self.layout.fingerprint,
                length=length,
                checksums=sums[read],
                crcs=[header_crc(raw[i].data) for i in read],
                stored=stored[read],
            )
        unpack = [i for i in packed if valid[i]]

        def decompress(i: int) -> bool:
            return self.packer.decompress_into(packed[i], rows[i])

        for i, ok in zip(unpack, parallel_map(decompress, unpack), strict=True):
            valid[i] = ok
        for i in read:
            if not valid[i]:
                self.corrupt(keys[i], "header, payload checksum or compressed data mismatch")
        return valid

    def missing(self, key: bytes) -> None:
        if self.readonly:
            # The writer replaced it since we learnt of it: a miss, not damage.
            with self._lock:
                self.missing_blocks += 1
            logger.debug("tier %s: block %s is no longer stored", self.tier, key.hex())
        else:
            self.corrupt(key, "record missing")

    def corrupt(self, key: bytes, problem: str) -> None:
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            logger.warning(
                "tier %s: block %s is unusable (%s) and is served as a miss; further "
                "ones are logged at debug level (the Offloader counts them all in the "
                "tier's corrupt_blocks)",
                self.tier,
                key.hex(),
                problem,
            )
        else:
            logger.debug("tier %s: block %s is unusable (%s)", self.tier, key.hex(), problem)

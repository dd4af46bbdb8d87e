"""What an ``lmdb`` tier runs on its writer thread: a batch of puts (packed on the
caller's thread and handed over through a queue) in one transaction, and deletions.

Every write transaction runs on one writer thread per process: LMDB binds a write
transaction to the thread that began it and allows one at a time. A batch is one
transaction, committed (with ``fsync``, synced) before the store returns; a reader
never sees half of it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, Final

import numpy as np
from kvoffload.backends.lmdb.env import Handles, delete_keys, reserve
from kvoffload.backends.lmdb.slotmap import SlotRecords

from kvoffload.codec import Packer
from kvoffload.exceptions import BackendError
from kvoffload.hostcopy import Buffers
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES, pack_values

logger = logging.getLogger(__name__)

PACK_CHUNK_BYTES: Final = 16 * 1024 * 1024
"""Values packed per hand-over to the writer thread: large enough that the hand-over
costs nothing, small enough that the writer starts early and that the
:data:`PACK_BUFFERS` buffers (reused, so resident) stay small."""
PACK_BUFFERS: Final = 3
"""One being packed, one being put, one spare so neither side waits on the other."""

Chunk = tuple[int, int, np.ndarray[Any, Any], list[int]]
"""A packed chunk handed to the writer: batch positions lo..hi, the buffer, and the
length of each value in it (shorter than its row when compressed)."""


class BatchWriter:
    """Stores a tier's batches: each one transaction on the writer thread, replacing
    the records its slots held (:class:`SlotRecords`), fed while later chunks are packed.

    ``take_seq(n)`` hands out ``n`` consecutive record sequence numbers (the first)."""

    def __init__(
        self,
        layout: KVLayout,
        packer: Packer,
        records: SlotRecords,
        take_seq: Callable[[int], int],
    ) -> None:
        self.layout = layout
        self.packer = packer
        self.records = records
        self._take_seq = take_seq
        value_bytes = HEADER_BYTES + layout.bytes_per_block
        self._buffers = Buffers(
            value_bytes, keep_bytes=PACK_BUFFERS * max(PACK_CHUNK_BYTES, value_bytes)
        )
        """Pack buffers, reused across batches so they fault in once."""

    def write(
        self, handles: Handles, slots: list[int], keys: list[bytes], rows: np.ndarray[Any, Any]
    ) -> list[int]:
        """One write transaction for the batch, fed in chunks while later ones are packed.

        Packing (copy behind the header, checksum) runs on the caller's thread and
        ``put``/commit on the writer thread, which LMDB requires; both release the GIL
        for their copies, so on two cores they overlap. Done one after the other, as
        before 2026-11-23, a 512 MiB batch of 2 MiB blocks spent 0.5 s packing (fresh
        ``bytearray`` per block: page faults and zero-fill, then the copy) before the
        writer's 1.2-1.9 s began: 0.22 GB/s. Chunk buffers are reused across batches,
        so they fault in once. Durability is unchanged: one transaction per batch,
        committed (with ``fsync``, synced) before ``write`` returns. Returns each
        block's stored payload bytes."""
        assert handles.writer is not None, "read-only tiers have no writer"
        n = len(keys)
        value_bytes = HEADER_BYTES + self.layout.bytes_per_block
        per_chunk = max(1, PACK_CHUNK_BYTES // value_bytes)
        count = min(PACK_BUFFERS, -(-n // per_chunk))
        held = [self._buffers.acquire(per_chunk) for _ in range(count)]
        bufs = [b.numpy() for b in held]
        free: queue.SimpleQueue[np.ndarray[Any, Any]] = queue.SimpleQueue()
        for buf in bufs:
            free.put(buf)
        feed: queue.SimpleQueue[Chunk | None] = queue.SimpleQueue()
        stored = [0] * n
        fut = handles.writer.submit(
            lambda: self._put_batch(handles, _fed(feed, free, slots, keys), n, value_bytes)
        )
        now = time.time()
        try:
            for lo in range(0, n, per_chunk):
                hi = min(n, lo + per_chunk)
                chunk = _next_free(free, fut)
                if chunk is None:
                    break  # the writer failed; its error is raised below
                lens = pack_values(
                    keys[lo:hi],
                    rows[lo:hi],
                    chunk[: hi - lo],
                    packer=self.packer,
                    layout_fp=self.layout.fingerprint,
                    first_seq=self._take_seq(hi - lo),
                    now=now,
                )
                stored[lo:hi] = [v - HEADER_BYTES for v in lens]
                feed.put((lo, hi, chunk, lens))
        except BaseException:
            feed.put((-1, -1, bufs[0], []))  # abort the transaction
            with contextlib.suppress(BaseException):
                fut.result()
            for b in held:
                self._buffers.release(b)
            raise
        feed.put(None)
        try:
            fut.result()
        finally:
            for b in held:
                self._buffers.release(b)
        with self.records.lock:
            self.records.stored[slots] = stored
        return stored

    def _put_batch(
        self,
        handles: Handles,
        items: Iterable[tuple[int, bytes, memoryview]],
        count: int,
        value_bytes: int,
    ) -> None:
        """On the writer thread: one transaction replacing what the slots held, with
        ``count`` values of ``value_bytes``."""
        records = self.records
        slot_key, key_slot = records.slot_key, records.key_slot
        with records.lock:
            # Old values of the map entries changed, restored if the transaction fails.
            journal = records.journal()
            released = records.take_released()  # freed since, budgeted: their records go
            try:
                # Each put may delete the record its slot held.
                deletes = count + len(released)
                reserve(handles, puts=count, deletes=deletes, value_bytes=value_bytes)
                with handles.env.begin(db=handles.blocks, write=True) as txn:
                    for slot in released:
                        old = slot_key[slot]
                        if old is not None:
                            txn.delete(old)
                            journal.set_key(old, None)
                            journal.set_slot(slot, None)
                    for slot, key, value in items:
                        old = slot_key[slot]
                        if old is not None and old != key:
                            txn.delete(old)
                            journal.set_key(old, None)
                        prev = key_slot.get(key)
                        if prev is not None and prev != slot:
                            # The key was evicted from ``prev`` and is stored again here.
                            # ``prev`` must stop claiming it, or reusing ``prev`` later
                            # would delete the record this slot now holds.
                            journal.set_slot(prev, None)
                        txn.put(key, value)
                        journal.set_slot(slot, key)
                        journal.set_key(key, slot)
            except BaseException:
                records.requeue(released)
                journal.undo()
                raise


def delete_released(handles: Handles, records: SlotRecords, tier: str) -> None:
    """On the writer thread: delete the queued released slots' records."""
    with records.lock:
        slots = records.take_released()
        keys = records.keys_of(slots)
        try:
            if keys:
                delete_keys(handles, keys)
        except BaseException as exc:
            records.requeue(slots)
            logger.warning(
                "tier %s: could not delete %d evicted records (%s); the next write retries",
                tier,
                len(keys),
                exc,
            )
            return
        records.forget(slots)


def delete_slots(handles: Handles, records: SlotRecords, slots: list[int]) -> None:
    """On the writer thread: delete what the slots hold, then forget it."""
    with records.lock:
        keys = records.keys_of(slots)
        if keys:  # a budgeted tier's released slots may have gone already
            delete_keys(handles, keys)
        records.forget(slots)  # only once the deletion committed


def _fed(
    feed: queue.SimpleQueue[Chunk | None],
    free: queue.SimpleQueue[np.ndarray[Any, Any]],
    slots: list[int],
    keys: list[bytes],
) -> Iterator[tuple[int, bytes, memoryview]]:
    """On the writer thread: the (slot, key, value) of each packed chunk as it arrives,
    handing a chunk's buffer back once its last value was put (``put`` copies)."""
    while True:
        item = feed.get()
        if item is None:
            return
        lo, hi, buf, lens = item
        if lo < 0:
            raise BackendError("store aborted while packing")
        for j in range(lo, hi):
            yield slots[j], keys[j], buf[j - lo, : lens[j - lo]].data
        free.put(buf)


def _next_free(
    free: queue.SimpleQueue[np.ndarray[Any, Any]], writer: Future[None]
) -> np.ndarray[Any, Any] | None:
    """A pack buffer the writer is done with, or ``None`` once the writer has failed."""
    while True:
        try:
            return free.get(timeout=0.05)
        except queue.Empty:
            if writer.done():
                return None

"""The ``lmdb`` backend: a persistent tier in one LMDB environment, on the worker side.

Runs wherever the tier's bytes move (the transfer worker); the scheduler-side manager
only sees its slots. The environment is the directory ``config.path`` (``data.mdb``
and ``lock.mdb``) with two named sub-databases:

- ``blocks``: key = block key, value = the 128-byte record header of
  :mod:`kvoffload.record` followed by the payload;
- ``meta``: the layout the tier was written under (``layout`` -> JSON), so tools can
  open a tier without being told its layout (:meth:`LmdbBackend.stored_layout`).

Blocks live in a named database rather than the main one because LMDB keeps the
names of sub-databases as keys of the main database: block keys there could collide
with them, and ``stat()`` would count them as entries.

LMDB addresses values by key, not by position, so slots are bookkeeping only: a
``slot -> key`` map lets a write into a reused slot delete the record it replaces in
the same transaction. The database therefore never holds more than ``num_slots``
records, and the capacity the manager enforces is the capacity on disk.

A compressing tier (``compression`` not ``none``) counts stored bytes instead: its
manager gets a byte budget of the configured capacity (:meth:`LmdbBackend.budget`),
each block charged its record's length, and it keeps :data:`PACKING` slots per
full-size block so the slots do not bind first. A freed slot's record is then
deleted on the writer thread soon after (:meth:`LmdbBackend.released`), since the
budget no longer counts it.

Threads and processes: every write transaction runs on one writer thread per process
(LMDB binds a write transaction to the thread that began it and allows one at a
time); reads run on the caller's thread in their own read transaction, which the
writer never blocks and which never sees half a batch. One process per directory
writes; any number may open it with ``readonly: true`` and read concurrently. The
environment is opened on first use in each process, so a forked child reopens it
instead of using its parent's handles.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import lmdb
import numpy as np
import torch

from kvoffload.backend import Backend, RecoveredBlock
from kvoffload.codec import CodecStats, Packer, codec_named, parallel_map
from kvoffload.config import LmdbTierConfig, TierConfig
from kvoffload.dirlock import lock_tier_dir
from kvoffload.exceptions import BackendError, BlockStateError, ConfigError, LayoutMismatchError
from kvoffload.hostcopy import Buffers
from kvoffload.keys import MAX_KEY_BYTES, BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import (
    HEADER_BYTES,
    HEADER_DTYPE,
    check_headers,
    header_crc,
    header_key,
    key_bytes,
    pack_values,
    payload_checksum,
    stored_lengths,
    unpack_header,
)
from kvoffload.sizes import format_size

logger = logging.getLogger(__name__)

BLOCKS_DB: Final = b"blocks"
META_DB: Final = b"meta"
LAYOUT_KEY: Final = b"layout"
META_FORMAT: Final = 1

PACK_CHUNK_BYTES: Final = 16 * 1024 * 1024
"""Values packed per hand-over to the writer thread: large enough that the hand-over
costs nothing, small enough that the writer starts early and that the
:data:`PACK_BUFFERS` buffers (reused, so resident) stay small."""
PACK_BUFFERS: Final = 3
"""One being packed, one being put, one spare so neither side waits on the other."""

PACKING: Final = 4
"""Slots a compressing tier keeps per full-size block its capacity holds. A block is
charged 128 bytes plus its stored payload, so KV data that compresses to a quarter
fits up to this many times the blocks; more slots would cost memory (per-slot maps)
for blocks few models' data compresses enough to fill."""

_MAX_DBS: Final = 2
# Each read transaction in flight takes one slot of the lock file's reader table,
# shared by every process that opens the tier (LMDB's default is 126).
_MAX_READERS: Final = 512
_MAP_HEADROOM: Final = 64 * 1024**2
_NODE_HEADER: Final = 8  # LMDB leaf node header, before key and value
_PAGE_HEADER: Final = 16  # LMDB page header, also in front of overflow runs
_RESERVE_SLACK_PAGES: Final = 32  # the main database's path and the meta updates, at commit

_T = TypeVar("_T")


def map_size_for(layout: KVLayout, num_slots: int, budget: int | None = None) -> int:
    """Bytes of address space to map for ``num_slots`` records of ``layout``, whose
    values total at most ``budget`` bytes where given (a compressing tier).

    Only address space: the data file grows as pages are used. LMDB cannot grow past
    it, so it must cover the records as LMDB lays them out, twice over: copy-on-write
    keeps the pages a batch replaces until no reader can still see them (and, under a
    budget, the records of evicted blocks until they are deleted), and a freed
    overflow run is reused only where a new value fits. The headroom holds the B-tree.
    """
    page = mmap.PAGESIZE
    value = HEADER_BYTES + layout.bytes_per_block
    node = _NODE_HEADER + MAX_KEY_BYTES + value
    # Too big for a leaf page, a value gets its own run of whole overflow pages; small
    # values share leaf pages, which are only half full after a split.
    big = node > page // 2
    per_block = -(-(value + _PAGE_HEADER) // page) * page if big else 2 * (node + 2)
    records = num_slots * per_block
    if budget is not None:
        # The records' values total at most ``budget``. An overflow run takes its value
        # plus under a page (so does a value short enough for a leaf: under twice
        # itself); a leaf value takes twice itself plus its node. So the budget bounds
        # the bytes and the slots only the rounding: their 4x alone would map 4x.
        extra = page + _PAGE_HEADER if big else 2 * (_NODE_HEADER + MAX_KEY_BYTES + 2)
        records = min(records, (1 if big else 2) * budget + num_slots * extra)
    size = 2 * records + _MAP_HEADROOM
    return -(-size // page) * page


@dataclass(slots=True)
class _Handles:
    """What one process opened. LMDB handles must not cross ``fork()``; ``pid`` tells
    whether these are ours or inherited from a parent."""

    env: lmdb.Environment
    blocks: lmdb._Database | None
    """``None`` only when read-only and the writer has not created the database yet."""
    writer: ThreadPoolExecutor | None
    """The one thread that runs write transactions; ``None`` when read-only."""
    pid: int
    data_fd: int | None = None
    """The writer's own descriptor of ``data.mdb``, to reserve pages (:func:`_reserve`)."""
    reserved: int = 0
    """Bytes from the start of ``data.mdb`` known to be backed by disk blocks."""
    lock_fd: int | None = None
    """The writer's own descriptor of ``lock.mdb``; closed only after the environment,
    as closing it drops LMDB's POSIX locks on the file."""


class LmdbBackend(Backend):
    """A tier in one LMDB environment; contents survive restarts (see module docs)."""

    config_model = LmdbTierConfig
    persistent = True

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, LmdbTierConfig):
            raise ConfigError(
                f"tier {config.name!r}: the lmdb backend takes an LmdbTierConfig "
                f"(path, fsync, readonly), got {type(config).__name__}"
            )
        super().__init__(config, layout)
        self.path = Path(config.path)
        self.readonly = config.readonly
        self.fsync = config.fsync
        budget = self.budget()
        self.map_size = map_size_for(layout, self.num_slots, None if budget is None else budget[0])
        """Bytes mapped by a writer; set before first use to change it (tests do)."""
        self.missing_blocks = 0
        """Read-only: blocks asked for that the writer has since replaced (not damage).
        Blocks found damaged, of another layout, or (when writable) missing are not
        counted here but by the Offloader, which sees every tier's reads (its
        ``corrupt_blocks``); they are logged, the first at warning level."""
        # slot -> key and key -> slot, inverse of each other. A freed slot keeps its key
        # until the slot is reused or discarded: the record is still intact, and a
        # restart may as well recover it.
        self._slot_key: list[bytes | None] = [None] * self.num_slots
        self._key_slot: dict[bytes, int] = {}
        self._maps_lock = threading.Lock()
        self._open_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._released: list[int] = []
        """Freed slots of a budgeted tier whose records the writer has yet to delete."""
        self._released_lock = threading.Lock()  # held for list operations only
        self._lock_pid = os.getpid()
        self._handles: _Handles | None = None
        self._closed = False
        self._warned = False
        self._seq = itertools.count(1)  # advanced under ``_stats_lock``
        self.packer = Packer(codec_named(config.compression), layout.itemsize)
        value_bytes = HEADER_BYTES + layout.bytes_per_block
        self._buffers = Buffers(
            value_bytes, keep_bytes=PACK_BUFFERS * max(PACK_CHUNK_BYTES, value_bytes)
        )
        """Pack buffers, reused across batches so they fault in once."""
        self._stored = np.zeros(self.num_slots, dtype=np.int64)
        """Payload bytes as stored, per slot whose record this process knows of."""
        # One writer process per directory: LMDB serialises writers itself, but two
        # processes each keeping their own slot -> key map would overwrite each
        # other's blocks. Readers (readonly) take no lock.
        self._dir_lock: int | None = (
            None
            if self.readonly
            else lock_tier_dir(self.path, self.name, alternative=", or open it with readonly: true")
        )

    @classmethod
    def existing_config(cls, config: TierConfig, *, write: bool) -> TierConfig | None:
        path = Path(getattr(config, "path", ""))
        if not (path / "data.mdb").is_file():
            return None
        layout = cls.stored_layout(config)  # type: ignore[arg-type]
        entries = value_bytes = 0
        compressed = getattr(config, "compression", "none") != "none"
        if layout is not None:
            env = lmdb.open(str(path), map_size=0, readonly=True, max_dbs=_MAX_DBS)
            try:
                blocks = _open_existing_db(env, BLOCKS_DB)
                entries = _entries(env, blocks)
                if compressed and blocks is not None:
                    # Lengths only: a value's overflow pages are not read for its size.
                    with env.begin(db=blocks, buffers=True) as txn:
                        value_bytes = sum(map(len, txn.cursor().iternext(keys=False)))
            finally:
                env.close()
        # Room for every record already there, so recovery keeps them all: slots for
        # each, and (compressing) a budget for their bytes.
        needed = 0
        if layout is not None:
            full = cls.slot_bytes(layout)
            records = -(-entries // PACKING) if compressed else entries
            needed = max(records, -(-value_bytes // full)) * full
        return config.model_copy(
            update={"readonly": not write, "capacity": max(config.capacity, needed)}
        )

    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        """Payload plus the record header: the capacity counts headers."""
        return layout.bytes_per_block + HEADER_BYTES

    def _compressed(self) -> bool:
        return cast(LmdbTierConfig, self.config).compression != "none"

    def slots_for(self, full_slots: int) -> int:
        return full_slots * PACKING if self._compressed() else full_slots

    def budget(self) -> tuple[int, int] | None:
        """Compressing: the configured capacity in record bytes, each block charged
        its record's length (header plus stored payload) once written."""
        if not self._compressed():
            return None
        full = self.slot_bytes(self.layout)
        return self.num_slots // PACKING * full, full

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots // self.slots_for(1) * self.slot_bytes(self.layout)

    def released(self, slots: Sequence[int]) -> None:
        """Budgeted: the freed slots' records no longer count, so they go. Called by the
        slot allocator's ``free`` under the books' lock (and by a job once it read what
        it demotes), so no I/O here: the slots are queued for the writer thread, which
        deletes their records before anything else it does (a write into one of them
        included) and forgets their keys. Without a budget nothing happens: the manager
        may free a slot before the job's demotion read of it, and a write into the
        reused slot deletes its record in the same transaction."""
        if not slots or not self._compressed():
            return
        if self.readonly:  # the records are the writer's; no writer holds this lock
            with self._maps_lock:
                self._forget(slots)
            return
        with self._released_lock:
            first = not self._released
            self._released.extend(slots)
        handles = self._handles
        writer = None if handles is None or handles.pid != os.getpid() else handles.writer
        if first and writer is not None and handles is not None:
            # Not waited for; a write queued meanwhile deletes them in its transaction.
            with contextlib.suppress(RuntimeError):  # closing: they stay queued
                writer.submit(self._delete_released, handles)

    def _take_released(self) -> list[int]:
        with self._released_lock:
            slots, self._released = self._released, []
        return slots

    def _requeue(self, slots: list[int]) -> None:
        with self._released_lock:
            self._released[:0] = slots

    def _delete_released(self, handles: _Handles) -> None:
        """On the writer thread: delete the queued released slots' records."""
        with self._maps_lock:
            slots = self._take_released()
            keys = [k for k in (self._slot_key[s] for s in slots) if k is not None]
            try:
                if keys:
                    _delete_keys(handles, keys)
            except BaseException as exc:
                self._requeue(slots)
                logger.warning(
                    "tier %s: could not delete %d evicted records (%s); the next write retries",
                    self.name,
                    len(keys),
                    exc,
                )
                return
            self._forget(slots)

    def entries(self) -> int:
        """Records in the blocks database; when writable, counted on the writer thread,
        so after every write and deletion queued before the call."""
        if self.readonly:
            handles = self._open_handles()
            return _entries(handles.env, self._blocks_db(handles))
        return self._on_writer(lambda h: _entries(h.env, h.blocks))

    @classmethod
    def stored_layout(cls, config: LmdbTierConfig) -> KVLayout | None:
        """The layout the tier at ``config.path`` was written under, or ``None`` if
        there is no tier there yet. For tools that open a tier without knowing its
        model. Opens the environment read-only for the call, so it raises
        :class:`BackendError` if this process already has the tier open."""
        path = Path(config.path)
        if not (path / "data.mdb").is_file():
            return None
        try:
            env = lmdb.open(
                str(path),
                map_size=0,  # adopt the writer's map size, recorded in the file
                readonly=True,
                max_dbs=_MAX_DBS,
                max_readers=_MAX_READERS,
            )
        except lmdb.Error as exc:
            raise BackendError(f"{path}: cannot open LMDB environment: {exc}") from exc
        try:
            try:
                meta = env.open_db(META_DB, create=False)
            except lmdb.NotFoundError:
                return None
            with env.begin(db=meta) as txn:
                raw = txn.get(LAYOUT_KEY)
        except lmdb.Error as exc:
            raise BackendError(f"{path}: cannot read the tier's layout: {exc}") from exc
        finally:
            env.close()
        return None if raw is None else _layout_from_meta(raw, path)

    # -- opening, per process -----------------------------------------------------
    def _open_handles(self) -> _Handles:
        """This process's handles, opening (or, in a forked child, reopening) them."""
        handles = self._handles
        pid = os.getpid()
        if handles is not None and handles.pid == pid:
            return handles
        self._renew_locks_after_fork()
        with self._open_lock:
            if self._closed:
                raise BackendError(f"tier {self.name!r} is closed")
            handles = self._handles
            inherited = handles is not None and handles.pid != pid
            if handles is not None and inherited:
                self._handles = None
                _close_inherited(handles)
            if self._handles is None:
                self._handles = self._open(pid, inherited)
            return self._handles

    def _renew_locks_after_fork(self) -> None:
        """In a forked child, replace the locks: a parent thread may have held one at
        fork time, and it would never be released here. The child starts with one
        thread, so nothing races the swap."""
        pid = os.getpid()
        if self._lock_pid != pid:
            self._open_lock = threading.Lock()
            self._maps_lock = threading.Lock()
            self._stats_lock = threading.Lock()
            self._released_lock = threading.Lock()
            self._lock_pid = pid

    def _open(self, pid: int, after_fork: bool) -> _Handles:
        try:
            if not self.readonly:
                self.path.mkdir(parents=True, exist_ok=True)
            env = lmdb.open(
                str(self.path),
                # Read-only: 0 adopts the writer's map size, so a reader never maps less
                # than the writer may fill.
                map_size=0 if self.readonly else self.map_size,
                readonly=self.readonly,
                # writemap: puts go straight into the shared map instead of through
                # malloc'd dirty pages copied at commit; commits stay synchronous
                # (no map_async). Measured 2.6x faster overwrites at 64 KiB blocks.
                writemap=not self.readonly,
                sync=self.fsync,
                metasync=self.fsync,
                max_dbs=_MAX_DBS,
                max_readers=_MAX_READERS,
                # No cached read transaction: it would keep a lock-table slot that a
                # forked child, closing its copy of the environment, would release.
                max_spare_txns=0,
            )
        except (lmdb.Error, OSError) as exc:
            hint = " (read-only: start the writer first)" if self.readonly else ""
            raise BackendError(
                f"tier {self.name!r}: cannot open LMDB environment at {self.path}{hint}: {exc}"
            ) from exc
        handles = _Handles(env, None, None, pid)
        try:
            if self.readonly:
                handles.blocks = _open_existing_db(env, BLOCKS_DB)
            else:
                handles.writer = ThreadPoolExecutor(
                    1, thread_name_prefix=f"kvoffload-lmdb-{self.name}"
                )
                handles.data_fd = os.open(self.path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
                # The reader table is mapped too, and sparse: a reader taking a slot on
                # a page not yet backed would be a SIGBUS on a full disk (see _reserve).
                # The descriptor stays open until the environment is closed: closing any
                # descriptor of lock.mdb drops every POSIX lock this process holds on it,
                # LMDB's included, and another process would then reset the lock table
                # under a running writer (MDB_CORRUPTED, records lost or left behind).
                handles.lock_fd = os.open(self.path / "lock.mdb", os.O_RDWR | os.O_CLOEXEC)
                os.posix_fallocate(handles.lock_fd, 0, os.fstat(handles.lock_fd).st_size)
                handles.blocks = handles.writer.submit(self._init_dbs, handles).result()
        except BaseException as exc:
            _close_handles(handles)
            if isinstance(exc, lmdb.Error | OSError):
                raise BackendError(f"tier {self.name!r}: cannot set up {self.path}: {exc}") from exc
            raise
        logger.info(
            "tier %s: lmdb at %s, %d slots x %d bytes, %s, map %s%s",
            self.name,
            self.path,
            self.num_slots,
            self.slot_bytes(self.layout),
            "read-only" if self.readonly else ("fsync" if self.fsync else "no fsync"),
            format_size(env.info()["map_size"]),
            " (reopened after fork)" if after_fork else "",
        )
        return handles

    def _init_dbs(self, handles: _Handles) -> lmdb._Database:
        """On the writer thread: create the databases and record the layout."""
        env = handles.env
        # A reader that died mid-transaction pins old pages until its slot is cleared.
        env.reader_check()
        _reserve(handles, puts=3, value_bytes=4096)  # two database records, the layout
        blocks = env.open_db(BLOCKS_DB)
        meta = env.open_db(META_DB)
        fp = self.layout.fingerprint
        record = json.dumps(
            {
                "format": META_FORMAT,
                "layout": self.layout.to_dict(),
                "fingerprint": fp.hex(),
                "bytes_per_block": self.layout.bytes_per_block,
            },
            sort_keys=True,
        ).encode()
        with env.begin(db=meta, write=True) as txn:
            old = txn.get(LAYOUT_KEY)
            if old != record:
                txn.put(LAYOUT_KEY, record)
        if old is not None and old != record:
            logger.info(
                "tier %s: %s was written under another layout; recovery reclaims its blocks",
                self.name,
                self.path,
            )
        return blocks

    def _blocks_db(self, handles: _Handles) -> lmdb._Database | None:
        if handles.blocks is None:
            # Read-only and the writer had not created it when we opened: look again.
            with self._open_lock:
                if handles.blocks is None:
                    handles.blocks = _open_existing_db(handles.env, BLOCKS_DB)
        return handles.blocks

    def _on_writer(self, fn: Callable[[_Handles], _T]) -> _T:
        """Run ``fn`` on this process's writer thread and wait for it; LMDB and OS
        errors come back as :class:`BackendError`."""
        handles = self._open_handles()
        assert handles.writer is not None, "read-only tiers have no writer"
        try:
            return handles.writer.submit(fn, handles).result()
        except (lmdb.Error, OSError) as exc:
            raise BackendError(f"tier {self.name!r}: LMDB write failed: {exc}") from exc

    # -- data ---------------------------------------------------------------------
    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        """Budgeted (compressing), returns each block's charge: its record's length."""
        self.check_batch(slots, keys, src)
        if self.readonly:
            raise BackendError(
                f"tier {self.name!r} is read-only (readonly: true): another process writes it"
            )
        if not slots:
            return [] if self._compressed() else None
        key_list = key_bytes(self.name, keys)
        rows = (src if src.device.type == "cpu" else src.to("cpu")).numpy()
        slot_list = list(slots)
        try:
            try:
                stored = self._stream_write(slot_list, key_list, rows)
            except lmdb.MapFullError:
                # Pages are pinned by the oldest live reader; a reader process that died
                # holding a transaction pins them for ever until its slot is cleared.
                if not self._open_handles().env.reader_check():
                    raise
                logger.warning("tier %s: cleared stale LMDB readers; retrying the store", self.name)
                stored = self._stream_write(slot_list, key_list, rows)
        except (lmdb.Error, OSError) as exc:
            raise BackendError(f"tier {self.name!r}: LMDB write failed: {exc}") from exc
        return [HEADER_BYTES + n for n in stored] if self._compressed() else None

    def _stream_write(
        self, slots: list[int], keys: list[bytes], rows: np.ndarray[Any, Any]
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
        handles = self._open_handles()
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
        feed: queue.SimpleQueue[_Chunk | None] = queue.SimpleQueue()
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
                with self._stats_lock:
                    first = next(self._seq)
                    self._seq = itertools.count(first + hi - lo)
                lens = pack_values(
                    keys[lo:hi],
                    rows[lo:hi],
                    chunk[: hi - lo],
                    packer=self.packer,
                    layout_fp=self.layout.fingerprint,
                    first_seq=first,
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
        with self._maps_lock:
            self._stored[slots] = stored
        self.count_stored(n * self.layout.bytes_per_block, sum(stored))
        return stored

    def io_counters(self) -> dict[str, int]:
        return self.stored_counters()

    def codec_stats(self) -> CodecStats:
        return self.packer.stats()

    def _put_batch(
        self,
        handles: _Handles,
        items: Iterable[tuple[int, bytes, memoryview]],
        count: int,
        value_bytes: int,
    ) -> None:
        """On the writer thread: one transaction replacing what the slots held, with
        ``count`` values of ``value_bytes``."""
        slot_key, key_slot = self._slot_key, self._key_slot
        # Old values of the map entries changed, restored if the transaction fails.
        saved_slots: dict[int, bytes | None] = {}
        saved_keys: dict[bytes, int | None] = {}

        def set_slot(slot: int, key: bytes | None) -> None:
            saved_slots.setdefault(slot, slot_key[slot])
            slot_key[slot] = key

        def set_key(key: bytes, slot: int | None) -> None:
            saved_keys.setdefault(key, key_slot.get(key))
            if slot is None:
                key_slot.pop(key, None)
            else:
                key_slot[key] = slot

        with self._maps_lock:
            released = self._take_released()  # freed since, budgeted: their records go
            try:
                # Each put may delete the record its slot held.
                deletes = count + len(released)
                _reserve(handles, puts=count, deletes=deletes, value_bytes=value_bytes)
                with handles.env.begin(db=handles.blocks, write=True) as txn:
                    for slot in released:
                        old = slot_key[slot]
                        if old is not None:
                            txn.delete(old)
                            set_key(old, None)
                            set_slot(slot, None)
                    for slot, key, value in items:
                        old = slot_key[slot]
                        if old is not None and old != key:
                            txn.delete(old)
                            set_key(old, None)
                        prev = key_slot.get(key)
                        if prev is not None and prev != slot:
                            # The key was evicted from ``prev`` and is stored again here.
                            # ``prev`` must stop claiming it, or reusing ``prev`` later
                            # would delete the record this slot now holds.
                            set_slot(prev, None)
                        txn.put(key, value)
                        set_slot(slot, key)
                        set_key(key, slot)
            except BaseException:
                self._requeue(released)
                for slot, old_key in saved_slots.items():
                    slot_key[slot] = old_key
                for key, old_slot in saved_keys.items():
                    if old_slot is None:
                        key_slot.pop(key, None)
                    else:
                        key_slot[key] = old_slot
                raise

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        handles = self._open_handles()
        blocks = self._blocks_db(handles)
        if blocks is None:
            for key in keys:
                self._missing(key)
            return [False] * len(keys)
        # Rows are checksummed where they land, so ``dst`` needs contiguous rows; a
        # device or strided ``dst`` is filled through a host copy.
        direct = dst.device.type == "cpu" and dst.stride(1) == 1
        out = dst if direct else torch.empty(dst.shape, dtype=torch.uint8)
        rows = out.numpy()
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
            with handles.env.begin(db=blocks, buffers=True) as txn:
                for i, key in enumerate(keys):
                    value = txn.get(key)
                    if value is None:
                        self._missing(key)
                        continue
                    if not HEADER_BYTES < len(value) <= HEADER_BYTES + length:
                        self._corrupt(key, f"record of {len(value)} bytes")
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
                f"tier {self.name!r}: the writer of {self.path} now maps more than this "
                "process does; reopen the tier to read it"
            ) from exc
        except lmdb.Error as exc:
            raise BackendError(f"tier {self.name!r}: LMDB read failed: {exc}") from exc
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
                self._corrupt(keys[i], "header, payload checksum or compressed data mismatch")
        if out is not dst:
            dst.copy_(out)
        # The load time is not written back: LMDB values are not updated in place, so
        # refreshing ``atime`` would rewrite the whole block. Recovery therefore orders
        # blocks by last write; the manager's own LRU order governs while running.
        return cast(list[bool], valid.tolist())

    def _missing(self, key: bytes) -> None:
        if self.readonly:
            # The writer replaced it since we learnt of it: a miss, not damage.
            with self._stats_lock:
                self.missing_blocks += 1
            logger.debug("tier %s: block %s is no longer stored", self.name, key.hex())
        else:
            self._corrupt(key, "record missing")

    def _corrupt(self, key: bytes, problem: str) -> None:
        with self._stats_lock:
            first, self._warned = not self._warned, True
        if first:
            logger.warning(
                "tier %s: block %s is unusable (%s) and is served as a miss; further "
                "ones are logged at debug level (the Offloader counts them all in the "
                "tier's corrupt_blocks)",
                self.name,
                key.hex(),
                problem,
            )
        else:
            logger.debug("tier %s: block %s is unusable (%s)", self.name, key.hex(), problem)

    # -- persistence --------------------------------------------------------------
    def recover(self) -> list[RecoveredBlock]:
        """Adopt the intact records of this layout, newest ones first if they no longer
        all fit (in the slots and, compressing, in the budget by record length).
        Headers are checked here; payload checksums only when a block is loaded, as
        reading every payload would make start-up as slow as a full scan of the tier.
        Records that can never be served are deleted (unless read-only)."""
        if self._key_slot or self.num_free != self.num_slots:
            raise BlockStateError(
                f"tier {self.name!r}: recover() must run once, before any slot is used"
            )
        handles = self._open_handles()
        blocks = self._blocks_db(handles)
        if blocks is None:
            return []
        fp, length = self.layout.fingerprint, self.layout.bytes_per_block
        damaged: list[bytes] = []
        intact: list[bytes] = []  # keys whose header is intact, in scan order
        headers = bytearray()  # their headers, checked as one batch after the scan
        lengths: list[int] = []  # and the payload bytes each value holds
        try:
            with handles.env.begin(db=blocks, buffers=True) as txn:
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
            raise BackendError(f"tier {self.name!r}: cannot scan {self.path}: {exc}") from exc
        recs = np.frombuffer(bytes(headers), dtype=HEADER_DTYPE)
        sizes = stored_lengths(recs)
        # A value cut short or run on is damage, whatever its layout; the rest that
        # fails the check is of another layout (or another model's keys).
        whole = sizes == np.asarray(lengths, dtype=np.int64)
        ours = check_headers(recs, intact, layout_fp=fp, length=length) & whole
        max_seq = int(recs["seq"].max()) if len(recs) else 0
        found: list[tuple[float, int, bytes, int]] = []  # (atime, seq, key, stored)
        foreign: list[bytes] = []
        for j, key in enumerate(intact):
            if ours[j]:
                found.append((float(recs["atime"][j]), int(recs["seq"][j]), key, int(sizes[j])))
            elif not whole[j]:
                damaged.append(key)
            else:
                foreign.append(key)
        self._seq = itertools.count(max_seq + 1)
        found.sort(reverse=True)  # newest first
        fits = self.num_slots
        budget = self.budget()
        if budget is not None:  # and the newest whose records' bytes fit the budget
            total = np.cumsum([HEADER_BYTES + f[3] for f in found[:fits]], dtype=np.int64)
            fits = int(np.searchsorted(total, budget[0], side="right"))
        keep, surplus = found[:fits], found[fits:]
        keep.reverse()  # oldest first, the order restore() wants
        with self._maps_lock:
            for slot, (_, _, key, size) in enumerate(keep):
                self._slot_key[slot] = key
                self._key_slot[key] = slot
                self._stored[slot] = size
        self.slots.reserve(range(len(keep)))
        reclaim = damaged + foreign + [key for _, _, key, _ in surplus]
        if reclaim and not self.readonly:
            self._on_writer(lambda h: _delete_keys(h, reclaim))
        if reclaim:
            logger.info(
                "tier %s: recovered %d blocks; %s %d damaged, %d of another layout, "
                "%d over capacity",
                self.name,
                len(keep),
                "ignored (read-only)" if self.readonly else "reclaimed",
                len(damaged),
                len(foreign),
                len(surplus),
            )
        else:
            logger.info("tier %s: recovered %d blocks", self.name, len(keep))
        charged = budget is not None
        return [
            RecoveredBlock(BlockKey(key), slot, atime, HEADER_BYTES + size if charged else 0)
            for slot, (atime, _, key, size) in enumerate(keep)
        ]

    def discard(self, slots: Sequence[int]) -> None:
        """Delete what the slots hold, so a reopen does not recover it. Read-only:
        only forgotten here, as the records belong to the writer."""
        if not slots:
            return
        if self.readonly:
            with self._maps_lock:
                self._forget(slots)
            return
        slot_list = list(slots)
        self._on_writer(lambda h: self._delete_slots(h, slot_list))

    def _delete_slots(self, handles: _Handles, slots: list[int]) -> None:
        with self._maps_lock:
            keys = [k for k in (self._slot_key[s] for s in slots) if k is not None]
            if keys:  # a budgeted tier's released slots may have gone already
                _delete_keys(handles, keys)
            self._forget(slots)  # only once the deletion committed

    def _forget(self, slots: Sequence[int]) -> None:
        for slot in slots:
            key = self._slot_key[slot]
            if key is not None:
                self._slot_key[slot] = None
                del self._key_slot[key]
            self._stored[slot] = 0

    def footprint(self) -> tuple[int, int]:
        """Logical and stored payload bytes of the records this process maps (a freed
        slot's record stays in the map, intact, until the slot is reused)."""
        with self._maps_lock:
            held = [s for s, key in enumerate(self._slot_key) if key is not None]
            stored = int(self._stored[held].sum())
        return len(held) * self.layout.bytes_per_block, stored

    # -- consistency and shutdown -------------------------------------------------
    def check(self) -> list[str]:
        """Allocator and maps consistent, and (when writable) the database holds
        exactly the blocks the slots map to. A freed slot may still map to its last
        block: the record is intact until the slot is reused."""
        problems = super().check()
        with self._maps_lock:
            for slot, key in enumerate(self._slot_key):
                if key is not None and self._key_slot.get(key) != slot:
                    problems.append(f"slot {slot} maps to {key.hex()}, which maps elsewhere")
            for key, slot in self._key_slot.items():
                if self._slot_key[slot] != key:
                    problems.append(f"{key.hex()} maps to slot {slot}, which maps elsewhere")
        if not self.readonly:
            # On the writer thread, so no batch commits between the two snapshots.
            problems += self._on_writer(self._check_db)
        return problems

    def _check_db(self, handles: _Handles) -> list[str]:
        with self._maps_lock:
            held = set(self._key_slot)
        with handles.env.begin(db=handles.blocks) as txn:
            stored = set(txn.cursor().iternext(values=False))
        problems = []
        if len(stored) != len(held):
            problems.append(f"{len(stored)} records in {self.path} but {len(held)} blocks mapped")
        for what, keys in (("unmapped record", stored - held), ("no record for", held - stored)):
            problems += [f"{what} {key.hex()}" for key in sorted(keys)[:5]]
        return problems

    def close(self) -> None:
        """Finish queued writes, then close the environment. Idempotent."""
        if self._dir_lock is not None and os.getpid() == self._lock_pid:
            os.close(self._dir_lock)
            self._dir_lock = None
        self._renew_locks_after_fork()
        with self._open_lock:
            if self._closed:
                return
            self._closed = True
            handles, self._handles = self._handles, None
        if handles is None:
            return
        if handles.pid != os.getpid():
            _close_inherited(handles)
            return
        _close_handles(handles)


_CODEC_BYTE: Final = HEADER_DTYPE.fields["codec"][1]  # type: ignore[index]
"""Where a record's header keeps its codec id (0: raw)."""

_Chunk = tuple[int, int, np.ndarray[Any, Any], list[int]]
"""A packed chunk handed to the writer: batch positions lo..hi, the buffer, and the
length of each value in it (shorter than its row when compressed)."""


def _fed(
    feed: queue.SimpleQueue[_Chunk | None],
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


def _entries(env: lmdb.Environment, blocks: lmdb._Database | None) -> int:
    if blocks is None:
        return 0
    with env.begin(db=blocks) as txn:
        return int(txn.stat(blocks)["entries"])


def _delete_keys(handles: _Handles, keys: Sequence[bytes]) -> None:
    """On the writer thread: delete records in one transaction (missing ones are fine)."""
    _reserve(handles, deletes=len(keys))
    with handles.env.begin(db=handles.blocks, write=True) as txn:
        for key in keys:
            txn.delete(key)


def _reserve(handles: _Handles, *, puts: int = 0, deletes: int = 0, value_bytes: int = 0) -> None:
    """On the writer thread, before a write transaction: back with disk blocks every
    page the transaction may add to ``data.mdb``, or raise ``OSError`` (ENOSPC).

    With ``writemap`` LMDB sizes its file to the whole map, sparse, and writes pages in
    place through the shared mapping: a page the filesystem cannot back when first
    written is a SIGBUS, which kills the process (seen on a full tmpfs). Reserved here
    with ``posix_fallocate``, a full disk is an error before the transaction begins, and
    the store fails cleanly, counted like any other failed write.

    Pages up to ``last_pgno`` have all been written once, so are backed; freed ones are
    reused from there. A transaction adds pages past it only for pages it dirties, at
    most: the tree pages it copies on write (a root-to-leaf path per put, two per delete
    for the sibling a merge touches, one level more for a root split; never more than
    the tree has), each put's new
    pages (its value's overflow run and a split per level), and the free list saved at
    commit (8 bytes per page of the file and of the transaction, twice over). A bound,
    so on a nearly full disk a store may fail a little before the last page is used."""
    if handles.data_fd is None:
        return
    env = handles.env
    info = env.info()
    if handles.blocks is None:
        stat = env.stat()
    else:
        with env.begin() as txn:
            stat = txn.stat(handles.blocks)
    page = stat["psize"]
    depth = stat["depth"] + 1
    paths = (puts + 2 * deletes) * depth
    tree = min(paths, stat["branch_pages"] + stat["leaf_pages"] + 1)
    fresh = puts * (-(-(value_bytes + _PAGE_HEADER) // page) + depth)
    used = info["last_pgno"] + 1
    free_list = 2 * (8 * (used + tree + fresh) // page + 1)
    pages = used + tree + fresh + free_list + _RESERVE_SLACK_PAGES
    want = min(info["map_size"], pages * page)
    start = max(handles.reserved, used * page)
    if want > start:
        try:
            os.posix_fallocate(handles.data_fd, start, want - start)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot reserve {want - start} bytes for the write: {exc.strerror}"
            ) from None
        handles.reserved = want


def _close_handles(handles: _Handles) -> None:
    """Finish queued writes, then close the environment and the reserving descriptor."""
    if handles.writer is not None:
        handles.writer.shutdown(wait=True)
    handles.env.close()
    for fd in (handles.data_fd, handles.lock_fd):
        if fd is not None:
            os.close(fd)
    handles.data_fd = handles.lock_fd = None


def _open_existing_db(env: lmdb.Environment, name: bytes) -> lmdb._Database | None:
    try:
        return env.open_db(name, create=False)
    except lmdb.NotFoundError:
        return None


def _close_inherited(handles: _Handles) -> None:
    """Close a forked child's copy of its parent's environment.

    py-lmdb refuses to open an environment twice in one process, and the inherited
    copy counts, so it must go before the child reopens. Closing it leaves the parent
    alone as long as no transaction of the parent was alive at fork time: LMDB's file
    locks are per process and not inherited, and it clears only this pid's reader
    slots. A read transaction alive at fork time (another thread mid-load, or one
    py-lmdb cached, hence ``max_spare_txns=0``) would have its lock-table slot
    released by the close, leaving the parent's reader unregistered; loads verify
    the bytes they deliver, so that costs misses, not wrong data. A store in flight
    at fork time is aborted in the child's copy only. The parent's writer thread does
    not exist here; its executor is dropped, not joined.
    """
    handles.env.close()
    for fd in (handles.data_fd, handles.lock_fd):  # the child's copies of the descriptors
        if fd is not None:
            os.close(fd)
    handles.data_fd = handles.lock_fd = None


def _layout_from_meta(raw: bytes, path: Path) -> KVLayout:
    try:
        meta: dict[str, Any] = json.loads(raw)
        layout = KVLayout(**meta["layout"])
        fingerprint = bytes.fromhex(meta["fingerprint"])
    except (ValueError, KeyError, TypeError) as exc:
        raise BackendError(f"{path}: unreadable layout record: {exc}") from exc
    if layout.fingerprint != fingerprint:
        raise LayoutMismatchError(
            f"{path}: layout {layout} does not reproduce the stored fingerprint "
            f"{fingerprint.hex()}; the tier was written by another kvoffload version"
        )
    return layout

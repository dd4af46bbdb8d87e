"""The ``lmdb`` backend: a persistent tier in one LMDB environment, on the worker side.

Runs wherever the tier's bytes move (the transfer worker); the scheduler-side manager
only sees its slots. The environment is the directory ``config.path``: its databases,
map size and meta record are :mod:`~kvoffload.backends.lmdb.env`'s; which record each
slot holds, :mod:`~kvoffload.backends.lmdb.slotmap`'s (the database never holds more
than ``num_slots`` records, so the capacity the manager enforces is the capacity on
disk); the writer thread's work, :mod:`~kvoffload.backends.lmdb.writer`'s; the read
path, :mod:`~kvoffload.backends.lmdb.read`'s; what a reopen keeps,
:mod:`~kvoffload.backends.lmdb.recovery`'s. This module puts them together behind the
:class:`~kvoffload.backend.Backend` API.

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
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, TypeVar, cast

import lmdb
import torch
from kvoffload.backends.lmdb import env as lmdb_env
from kvoffload.backends.lmdb.env import BLOCKS_DB as BLOCKS_DB
from kvoffload.backends.lmdb.env import LAYOUT_KEY as LAYOUT_KEY
from kvoffload.backends.lmdb.env import META_DB as META_DB
from kvoffload.backends.lmdb.env import META_FORMAT as META_FORMAT
from kvoffload.backends.lmdb.env import Handles
from kvoffload.backends.lmdb.env import map_size_for as map_size_for
from kvoffload.backends.lmdb.read import RecordReader
from kvoffload.backends.lmdb.recovery import scan
from kvoffload.backends.lmdb.slotmap import SlotRecords
from kvoffload.backends.lmdb.writer import PACK_BUFFERS as PACK_BUFFERS
from kvoffload.backends.lmdb.writer import PACK_CHUNK_BYTES as PACK_CHUNK_BYTES
from kvoffload.backends.lmdb.writer import BatchWriter, delete_released, delete_slots

from kvoffload.backend import Backend, BackendStats, RecoveredBlock
from kvoffload.codec import Packer, codec_named
from kvoffload.config import LmdbTierConfig, TierConfig
from kvoffload.dirlock import lock_tier_dir
from kvoffload.exceptions import BackendError, BlockStateError, ConfigError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES, key_bytes
from kvoffload.sizes import format_size

logger = logging.getLogger(__name__)

PACKING: Final = 4
"""Slots a compressing tier keeps per full-size block its capacity holds. A block is
charged 128 bytes plus its stored payload, so KV data that compresses to a quarter
fits up to this many times the blocks; more slots would cost memory (per-slot maps)
for blocks few models' data compresses enough to fill."""

_T = TypeVar("_T")


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
        self._records = SlotRecords(self.num_slots)
        self._open_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._lock_pid = os.getpid()
        self._handles: Handles | None = None
        self._closed = False
        self._seq = itertools.count(1)  # advanced under ``_stats_lock``
        self.packer = Packer(codec_named(config.compression), layout.itemsize)
        self._writer = BatchWriter(layout, self.packer, self._records, self._take_seq)
        self._reader = RecordReader(
            layout, self.packer, tier=self.name, path=self.path, readonly=self.readonly
        )
        # One writer process per directory: LMDB serialises writers itself, but two
        # processes each keeping their own slot -> key map would overwrite each
        # other's blocks. Readers (readonly) take no lock.
        self._dir_lock: int | None = (
            None
            if self.readonly
            else lock_tier_dir(self.path, self.name, alternative=", or open it with readonly: true")
        )

    @property
    def missing_blocks(self) -> int:
        """Read-only: blocks asked for that the writer has since replaced (not damage).
        Blocks found damaged, of another layout, or (when writable) missing are not
        counted here but by the Offloader, which sees every tier's reads (its
        ``corrupt_blocks``); they are logged, the first at warning level."""
        return self._reader.missing_blocks

    @classmethod
    def existing_config(cls, config: TierConfig, *, write: bool) -> TierConfig | None:
        path = Path(getattr(config, "path", ""))
        if not (path / "data.mdb").is_file():
            return None
        layout = cls.stored_layout(config)
        entries = value_bytes = 0
        compressed = getattr(config, "compression", "none") != "none"
        if layout is not None:
            entries, value_bytes = lmdb_env.stored_usage(path, value_bytes=compressed)
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
            with self._records.lock:
                self._records.forget(slots)
            return
        first = self._records.release(slots)
        handles = self._handles
        writer = None if handles is None or handles.pid != os.getpid() else handles.writer
        if first and writer is not None and handles is not None:
            # Not waited for; a write queued meanwhile deletes them in its transaction.
            with contextlib.suppress(RuntimeError):  # closing: they stay queued
                writer.submit(delete_released, handles, self._records, self.name)

    def entries(self) -> int:
        """Records in the blocks database; when writable, counted on the writer thread,
        so after every write and deletion queued before the call."""
        if self.readonly:
            handles = self._open_handles()
            return lmdb_env.entries(handles.env, self._blocks_db(handles))
        return self._on_writer(lambda h: lmdb_env.entries(h.env, h.blocks))

    @classmethod
    def stored_layout(cls, config: TierConfig) -> KVLayout | None:
        """The layout the tier at ``config.path`` was written under, or ``None`` if
        there is no tier there yet. For tools that open a tier without knowing its
        model. Opens the environment read-only for the call, so it raises
        :class:`BackendError` if this process already has the tier open."""
        return lmdb_env.read_stored_layout(Path(getattr(config, "path", "")))

    # -- opening, per process -----------------------------------------------------
    def _open_handles(self) -> Handles:
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
                lmdb_env.close_inherited(handles)
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
            self._stats_lock = threading.Lock()
            self._records.renew_locks()
            self._reader.renew_lock()
            self._lock_pid = pid

    def _open(self, pid: int, after_fork: bool) -> Handles:
        handles = lmdb_env.open_handles(
            self.path,
            name=self.name,
            readonly=self.readonly,
            fsync=self.fsync,
            map_size=self.map_size,
            pid=pid,
            init=lambda h: lmdb_env.init_dbs(h, self.layout, tier=self.name, path=self.path),
        )
        logger.info(
            "tier %s: lmdb at %s, %d slots x %d bytes, %s, map %s%s",
            self.name,
            self.path,
            self.num_slots,
            self.slot_bytes(self.layout),
            "read-only" if self.readonly else ("fsync" if self.fsync else "no fsync"),
            format_size(handles.env.info()["map_size"]),
            " (reopened after fork)" if after_fork else "",
        )
        return handles

    def _blocks_db(self, handles: Handles) -> lmdb._Database | None:
        if handles.blocks is None:
            # Read-only and the writer had not created it when we opened: look again.
            with self._open_lock:
                if handles.blocks is None:
                    handles.blocks = lmdb_env.open_existing_db(handles.env, BLOCKS_DB)
        return handles.blocks

    def _on_writer(self, fn: Callable[[Handles], _T]) -> _T:
        """Run ``fn`` on this process's writer thread and wait for it; LMDB and OS
        errors come back as :class:`BackendError`."""
        handles = self._open_handles()
        assert handles.writer is not None, "read-only tiers have no writer"
        try:
            return handles.writer.submit(fn, handles).result()
        except (lmdb.Error, OSError) as exc:
            raise BackendError(f"tier {self.name!r}: LMDB write failed: {exc}") from exc

    def _take_seq(self, n: int) -> int:
        """The first of ``n`` consecutive record sequence numbers, now taken."""
        with self._stats_lock:
            first = next(self._seq)
            self._seq = itertools.count(first + n)
        return first

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
                stored = self._writer.write(self._open_handles(), slot_list, key_list, rows)
            except lmdb.MapFullError:
                # Pages are pinned by the oldest live reader; a reader process that died
                # holding a transaction pins them for ever until its slot is cleared.
                if not self._open_handles().env.reader_check():
                    raise
                logger.warning("tier %s: cleared stale LMDB readers; retrying the store", self.name)
                stored = self._writer.write(self._open_handles(), slot_list, key_list, rows)
        except (lmdb.Error, OSError) as exc:
            raise BackendError(f"tier {self.name!r}: LMDB write failed: {exc}") from exc
        self.count_stored(len(stored) * self.layout.bytes_per_block, sum(stored))
        return [HEADER_BYTES + n for n in stored] if self._compressed() else None

    def stats(self, *, held: bool = True) -> BackendStats:
        """The stored bytes, the codec's figures, and the logical and stored payload
        bytes of the records this process maps (a freed slot's record stays in the map,
        intact, until the slot is reused)."""
        footprint = self._records.footprint(self.layout.bytes_per_block) if held else None
        return BackendStats(self.stored_counters(), self.packer.stats(), footprint)

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        handles = self._open_handles()
        blocks = self._blocks_db(handles)
        if blocks is None:
            for key in keys:
                self._reader.missing(key)
            return [False] * len(keys)
        # Rows are checksummed where they land, so ``dst`` needs contiguous rows; a
        # device or strided ``dst`` is filled through a host copy.
        direct = dst.device.type == "cpu" and dst.stride(1) == 1
        out = dst if direct else torch.empty(dst.shape, dtype=torch.uint8)
        valid = self._reader.read(handles.env, blocks, keys, out.numpy())
        if out is not dst:
            dst.copy_(out)
        # The load time is not written back: LMDB values are not updated in place, so
        # refreshing ``atime`` would rewrite the whole block. Recovery therefore orders
        # blocks by last write; the manager's own LRU order governs while running.
        return cast(list[bool], valid.tolist())

    # -- persistence --------------------------------------------------------------
    def recover(self) -> list[RecoveredBlock]:
        """Adopt the intact records of this layout, newest ones first if they no longer
        all fit (in the slots and, compressing, in the budget by record length; see
        :mod:`~kvoffload.backends.lmdb.recovery`). Records that can never be served
        are deleted (unless read-only)."""
        if self._records.key_slot or self.num_free != self.num_slots:
            raise BlockStateError(
                f"tier {self.name!r}: recover() must run once, before any slot is used"
            )
        handles = self._open_handles()
        blocks = self._blocks_db(handles)
        if blocks is None:
            return []
        budget = self.budget()
        found = scan(
            handles.env,
            blocks,
            self.layout,
            num_slots=self.num_slots,
            budget=None if budget is None else budget[0],
            tier=self.name,
            path=self.path,
        )
        self._seq = itertools.count(found.max_seq + 1)
        self._records.adopt([(key, size) for _, _, key, size in found.keep])
        self.slots.reserve(range(len(found.keep)))
        reclaim = found.reclaim()
        if reclaim and not self.readonly:
            self._on_writer(lambda h: lmdb_env.delete_keys(h, reclaim))
        found.log(self.name, readonly=self.readonly)
        charged = budget is not None
        return [
            RecoveredBlock(BlockKey(key), slot, atime, HEADER_BYTES + size if charged else 0)
            for slot, (atime, _, key, size) in enumerate(found.keep)
        ]

    def discard(self, slots: Sequence[int]) -> None:
        """Delete what the slots hold, so a reopen does not recover it. Read-only:
        only forgotten here, as the records belong to the writer."""
        if not slots:
            return
        if self.readonly:
            with self._records.lock:
                self._records.forget(slots)
            return
        slot_list = list(slots)
        self._on_writer(lambda h: delete_slots(h, self._records, slot_list))

    # -- consistency and shutdown -------------------------------------------------
    def check(self) -> list[str]:
        """Allocator and maps consistent, and (when writable) the database holds
        exactly the blocks the slots map to. A freed slot may still map to its last
        block: the record is intact until the slot is reused."""
        problems = super().check() + self._records.problems()
        if not self.readonly:
            # On the writer thread, so no batch commits between the two snapshots.
            problems += self._on_writer(lambda h: self._records.db_problems(h, self.path))
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
            lmdb_env.close_inherited(handles)
            return
        lmdb_env.close_handles(handles)

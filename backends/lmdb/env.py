"""The LMDB environment of an ``lmdb`` tier: its map size, opening it in a process, the
meta record of the layout, and the disk pages a write transaction may need.

The environment is the directory of the tier (``data.mdb`` and ``lock.mdb``) with two
named sub-databases:

- ``blocks`` (:data:`BLOCKS_DB`): key = block key, value = the 128-byte record header
  of :mod:`kvoffload.record` followed by the payload;
- ``meta`` (:data:`META_DB`): the layout the tier was written under (``layout`` ->
  JSON), so tools can open a tier without being told its layout
  (:func:`read_stored_layout`).

Blocks live in a named database rather than the main one because LMDB keeps the
names of sub-databases as keys of the main database: block keys there could collide
with them, and ``stat()`` would count them as entries.

Everything here works on one process's :class:`Handles` and knows nothing of slots:
which record each slot holds is :mod:`~kvoffload.backends.lmdb.slotmap`'s business.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import lmdb

from kvoffload.exceptions import BackendError, LayoutMismatchError
from kvoffload.keys import MAX_KEY_BYTES
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES

logger = logging.getLogger(__name__)

BLOCKS_DB: Final = b"blocks"
META_DB: Final = b"meta"
LAYOUT_KEY: Final = b"layout"
META_FORMAT: Final = 1

MAX_DBS: Final = 2
# Each read transaction in flight takes one slot of the lock file's reader table,
# shared by every process that opens the tier (LMDB's default is 126).
MAX_READERS: Final = 512
_MAP_HEADROOM: Final = 64 * 1024**2
_NODE_HEADER: Final = 8  # LMDB leaf node header, before key and value
_PAGE_HEADER: Final = 16  # LMDB page header, also in front of overflow runs
_RESERVE_SLACK_PAGES: Final = 32  # the main database's path and the meta updates, at commit


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
class Handles:
    """What one process opened. LMDB handles must not cross ``fork()``; ``pid`` tells
    whether these are ours or inherited from a parent."""

    env: lmdb.Environment
    blocks: lmdb._Database | None
    """``None`` only when read-only and the writer has not created the database yet."""
    writer: ThreadPoolExecutor | None
    """The one thread that runs write transactions; ``None`` when read-only."""
    pid: int
    data_fd: int | None = None
    """The writer's own descriptor of ``data.mdb``, to reserve pages (:func:`reserve`)."""
    reserved: int = 0
    """Bytes from the start of ``data.mdb`` known to be backed by disk blocks."""
    lock_fd: int | None = None
    """The writer's own descriptor of ``lock.mdb``; closed only after the environment,
    as closing it drops LMDB's POSIX locks on the file."""


def open_handles(
    path: Path,
    *,
    name: str,
    readonly: bool,
    fsync: bool,
    map_size: int,
    pid: int,
    init: Callable[[Handles], lmdb._Database],
) -> Handles:
    """Open the environment at ``path`` for this process: read-only, or as its writer
    with the writer thread, which runs ``init`` (:func:`init_dbs`) before anything else.
    Errors come back as :class:`BackendError`, with nothing left open."""
    try:
        if not readonly:
            path.mkdir(parents=True, exist_ok=True)
        env = lmdb.open(
            str(path),
            # Read-only: 0 adopts the writer's map size, so a reader never maps less
            # than the writer may fill.
            map_size=0 if readonly else map_size,
            readonly=readonly,
            # writemap: puts go straight into the shared map instead of through
            # malloc'd dirty pages copied at commit; commits stay synchronous
            # (no map_async). Measured 2.6x faster overwrites at 64 KiB blocks.
            writemap=not readonly,
            sync=fsync,
            metasync=fsync,
            max_dbs=MAX_DBS,
            max_readers=MAX_READERS,
            # No cached read transaction: it would keep a lock-table slot that a
            # forked child, closing its copy of the environment, would release.
            max_spare_txns=0,
        )
    except (lmdb.Error, OSError) as exc:
        hint = " (read-only: start the writer first)" if readonly else ""
        raise BackendError(
            f"tier {name!r}: cannot open LMDB environment at {path}{hint}: {exc}"
        ) from exc
    handles = Handles(env, None, None, pid)
    try:
        if readonly:
            handles.blocks = open_existing_db(env, BLOCKS_DB)
        else:
            handles.writer = ThreadPoolExecutor(1, thread_name_prefix=f"kvoffload-lmdb-{name}")
            handles.data_fd = os.open(path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
            # The reader table is mapped too, and sparse: a reader taking a slot on
            # a page not yet backed would be a SIGBUS on a full disk (see reserve).
            # The descriptor stays open until the environment is closed: closing any
            # descriptor of lock.mdb drops every POSIX lock this process holds on it,
            # LMDB's included, and another process would then reset the lock table
            # under a running writer (MDB_CORRUPTED, records lost or left behind).
            handles.lock_fd = os.open(path / "lock.mdb", os.O_RDWR | os.O_CLOEXEC)
            os.posix_fallocate(handles.lock_fd, 0, os.fstat(handles.lock_fd).st_size)
            handles.blocks = handles.writer.submit(init, handles).result()
    except BaseException as exc:
        close_handles(handles)
        if isinstance(exc, lmdb.Error | OSError):
            raise BackendError(f"tier {name!r}: cannot set up {path}: {exc}") from exc
        raise
    return handles


def init_dbs(handles: Handles, layout: KVLayout, *, tier: str, path: Path) -> lmdb._Database:
    """On the writer thread: create the databases and record the layout. Returns the
    blocks database."""
    env = handles.env
    # A reader that died mid-transaction pins old pages until its slot is cleared.
    env.reader_check()
    reserve(handles, puts=3, value_bytes=4096)  # two database records, the layout
    blocks = env.open_db(BLOCKS_DB)
    meta = env.open_db(META_DB)
    record = json.dumps(
        {
            "format": META_FORMAT,
            "layout": layout.to_dict(),
            "fingerprint": layout.fingerprint.hex(),
            "bytes_per_block": layout.bytes_per_block,
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
            tier,
            path,
        )
    return blocks


def read_stored_layout(path: Path) -> KVLayout | None:
    """The layout the tier at ``path`` was written under, or ``None`` if there is no
    tier there yet. Opens the environment read-only for the call, so it raises
    :class:`BackendError` if this process already has the tier open."""
    if not (path / "data.mdb").is_file():
        return None
    try:
        env = lmdb.open(
            str(path),
            map_size=0,  # adopt the writer's map size, recorded in the file
            readonly=True,
            max_dbs=MAX_DBS,
            max_readers=MAX_READERS,
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


def stored_usage(path: Path, *, value_bytes: bool) -> tuple[int, int]:
    """The records in the tier at ``path`` and, if ``value_bytes``, their values' total
    length (else 0), read in a read-only environment opened for the call."""
    env = lmdb.open(str(path), map_size=0, readonly=True, max_dbs=MAX_DBS)
    try:
        blocks = open_existing_db(env, BLOCKS_DB)
        count = entries(env, blocks)
        total = 0
        if value_bytes and blocks is not None:
            # Lengths only: a value's overflow pages are not read for its size.
            with env.begin(db=blocks, buffers=True) as txn:
                total = sum(map(len, txn.cursor().iternext(keys=False)))
    finally:
        env.close()
    return count, total


def entries(env: lmdb.Environment, blocks: lmdb._Database | None) -> int:
    if blocks is None:
        return 0
    with env.begin(db=blocks) as txn:
        return int(txn.stat(blocks)["entries"])


def delete_keys(handles: Handles, keys: Sequence[bytes]) -> None:
    """On the writer thread: delete records in one transaction (missing ones are fine)."""
    reserve(handles, deletes=len(keys))
    with handles.env.begin(db=handles.blocks, write=True) as txn:
        for key in keys:
            txn.delete(key)


def reserve(handles: Handles, *, puts: int = 0, deletes: int = 0, value_bytes: int = 0) -> None:
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


def close_handles(handles: Handles) -> None:
    """Finish queued writes, then close the environment and the reserving descriptor."""
    if handles.writer is not None:
        handles.writer.shutdown(wait=True)
    handles.env.close()
    for fd in (handles.data_fd, handles.lock_fd):
        if fd is not None:
            os.close(fd)
    handles.data_fd = handles.lock_fd = None


def open_existing_db(env: lmdb.Environment, name: bytes) -> lmdb._Database | None:
    try:
        return env.open_db(name, create=False)
    except lmdb.NotFoundError:
        return None


def close_inherited(handles: Handles) -> None:
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

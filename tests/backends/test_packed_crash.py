"""Crash safety of the packed ``mmap`` slab (issue 33), on real files.

A Hypothesis state machine drives a real packed ``MmapBackend`` (zstd, three slab
files, blocks of 8 pages whose contents compress to 1, about 3, about 6 or 8 pages)
through its own slot API: allocate and write new keys, free slots, overwrite a held
slot with a new key, store a freed key again, reopen cleanly, and crash. Every
``pwrite``/``pwritev`` the backend makes to its slab files is recorded (the ``os`` of
``kvoffload.backends.mmap.files``, the one module of the backend that makes system
calls, is a recording proxy); a crash replays a prefix of those writes, chosen by
Hypothesis, onto a copy of the files as they stood when the backend opened, and opens
a backend on that image: the state on disk after a crash between any two of the
backend's writes since it opened.

Checked after every step: ``check()`` is empty (every page free xor used once, each
held slot's extent allocated), held extents do not overlap, and the slots holding
extents are exactly the slots the model holds; a rule reads every held block back
(exactly, all of them).
Checked at every (re)open: every recovered key was written, recovered extents do not
overlap, a recovered block reads back exactly its key's bytes or is a miss, and every
block whose header write (its payload goes first) is in the image, and that was not
freed or overwritten before the crash point, is recovered in its slot and reads back
exactly: whether or not the rest of its batch's headers landed.
"""

from __future__ import annotations

import importlib
import itertools
import os
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import kvoffload.backends.mmap.files as mmap_files
import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvoffload.backends.mmap import MmapBackend

from kvoffload.keys import BlockKey, namespaced
from kvoffload.layout import KVLayout
from kvoffload.testing import kv_like, make_backend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32)  # 8 pages
FULL_SLOTS = 8
MAX_FILE_BYTES = 3 * (LAYOUT.bytes_per_block + 128)  # 3 full blocks a file: 3 files
KINDS = ("zeros", "quarter", "kv", "random")
"""Block contents: nearly all zeros (1 page stored), a random quarter (about 3 pages),
KV-like values (about 6) and random bytes (8, stored raw)."""

SEEN: Counter[str] = Counter()
"""How often the machine met each case (printed with ``-s``): crash points, misses."""

Write = tuple[str, int, bytes]  # slab file name, offset, bytes written


class RecordingOs:
    """``os`` as the mmap backend's file module sees it, recording every completed
    ``pwrite``/``pwritev`` to a slab file, in the order they returned."""

    def __init__(self) -> None:
        self.log: list[Write] = []
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    def _record(self, fd: int, offset: int, data: bytes) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        if name.startswith("slab-"):
            with self.lock:
                self.log.append((name, offset, data))

    def pwrite(self, fd: int, buf: Any, offset: int) -> int:
        done = os.pwrite(fd, buf, offset)
        self._record(fd, offset, bytes(memoryview(buf).cast("B")[:done]))
        return done

    def pwritev(self, fd: int, bufs: Sequence[Any], offset: int) -> int:
        done = os.pwritev(fd, bufs, offset)
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)[:done]
        self._record(fd, offset, data)
        return done


def block_row(kind: str, n: int) -> torch.Tensor:
    """Block ``n``'s contents, unique per ``n``, of the given kind."""
    size = LAYOUT.bytes_per_block
    gen = torch.Generator().manual_seed(n)
    if kind == "kv":
        row = kv_like(LAYOUT, 1, n)[0].clone()
    elif kind == "random":
        row = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    else:
        row = torch.zeros(size, dtype=torch.uint8)
        if kind == "quarter":
            row[: size // 4] = torch.randint(0, 256, (size // 4,), dtype=torch.uint8, generator=gen)
    row[:8] = torch.frombuffer(bytearray(n.to_bytes(8, "little")), dtype=torch.uint8)
    return row


class PackedCrashMachine(RuleBasedStateMachine):
    """A packed slab against a model of what it must hold, with crash images."""

    root: Path = Path(tempfile.gettempdir())  # set by the test to its tmp_path

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(dir=self.root, prefix="packed-"))
        self.dir = self.tmp / "tier"
        self.rec = RecordingOs()
        mmap_files.os = self.rec  # type: ignore[attr-defined,assignment]
        self.data: dict[BlockKey, torch.Tensor] = {}  # every key ever written
        self.live: dict[int, BlockKey] = {}  # slot -> key the slab must hold
        self.stamp: dict[int, int] = {}  # slot -> when its block was written (a counter)
        # Per key, each stored instance: [slot, log length once its header was on
        # disk, log length when it was freed or overwritten (None: held)].
        self.lives: dict[BlockKey, list[list[Any]]] = {}
        self.counter = 0
        self.backend: MmapBackend | None = None
        self.base: dict[str, bytes] = {}
        self._open(fresh=True)

    # -- helpers ---------------------------------------------------------------------

    def _open(self, *, fresh: bool) -> None:
        """Open a backend on ``self.dir``; the base image is the files as they are
        before it opens (after, for a fresh slab), and the log starts empty, so the
        writes recovery makes are recorded too."""
        if not fresh:
            self.base = {p.name: p.read_bytes() for p in sorted(self.dir.glob("slab-*.kvo"))}
            self.rec.log = []
        backend = make_backend(
            "mmap",
            LAYOUT,
            FULL_SLOTS,
            self.tmp,
            path=str(self.dir),
            compression="zstd",
            direct_io="off",
            io_threads=1,  # placement order, so the write log, is deterministic
            max_file_bytes=MAX_FILE_BYTES,
        )
        assert isinstance(backend, MmapBackend)
        assert backend.space is not None
        assert len(backend.files) == 3
        self.backend = backend
        if fresh:
            self.base = {p.name: p.read_bytes() for p in sorted(self.dir.glob("slab-*.kvo"))}
            self.rec.log = []

    @property
    def b(self) -> MmapBackend:
        assert self.backend is not None
        return self.backend

    def _new_key(self, kind: str) -> BlockKey:
        self.counter += 1
        key = namespaced(b"packed-crash", self.counter.to_bytes(8, "little"))
        self.data[key] = block_row(kind, self.counter)
        return key

    def _store(self, slots: list[int], keys: list[BlockKey]) -> None:
        """Write ``keys`` to ``slots``; blocks not placed (charge 0) free their slot."""
        src = torch.stack([self.data[k] for k in keys])
        begin = len(self.rec.log)
        charges = self.b.write(slots, keys, src)
        assert charges is not None
        assert len(charges) == len(keys)
        unplaced = []
        for slot, key, charge in zip(slots, keys, charges, strict=True):
            if charge == 0:
                unplaced.append(slot)
                continue
            assert charge % 4096 == 0
            assert 4096 <= charge <= self.b.stride
            extent = self.b.space.extent(slot) if self.b.space else None
            assert extent is not None
            assert extent[1] * 4096 == charge
            self.live[slot] = key
            self.stamp[slot] = self.counter
            done = self._header_written(slot, begin)
            self.lives.setdefault(key, []).append([slot, done, None])
        if unplaced:
            event("write: a block found no room")
            self.b.free(unplaced)

    def _make_room(self, n: int, keep: int | None = None) -> None:
        """As the books do before a store: the blocks held plus ``n`` new ones at full
        size stay within the budget, the least recently written going first (a
        reopen over the budget drops the least recently used, which a model that
        evicted after the write would not predict). ``keep``: a slot being rewritten,
        whose extent the write frees."""
        budget = self.b.budget()
        assert budget is not None
        space = self.b.space
        assert space is not None
        held = {s: int(space.pages[s]) * 4096 for s in self.live if s != keep}
        while held and sum(held.values()) + n * self.b.stride > budget[0]:
            oldest = min(held, key=lambda slot: self.stamp[slot])
            del held[oldest]
            self._gone(oldest, len(self.rec.log))
            self.b.free([oldest])

    def _header_written(self, slot: int, since: int) -> int:
        """How many recorded writes there were once ``slot``'s header, written by the
        write that began after write ``since``, was on disk: from then on the block is
        complete (its payload went first), so a crash image holding it must recover it
        even if the rest of its batch's headers never landed. The last such write: the
        first may be the one clearing the page's freed headers before the payloads."""
        f, local = self.b._locate(slot)
        at = 4096 + local * 128  # the header table follows the superblock page
        for i in reversed(range(since, len(self.rec.log))):
            name, offset, chunk = self.rec.log[i]
            if name == f.path.name and offset <= at < offset + len(chunk):
                return i + 1
        raise AssertionError(f"slot {slot}: write returned before its header was written")

    def _gone(self, slot: int, at: int) -> None:
        key = self.live.pop(slot)
        for life in self.lives[key]:
            if life[0] == slot and life[2] is None:
                life[2] = at

    def _must(self, cut: int) -> dict[BlockKey, int]:
        """The blocks an image holding the first ``cut`` recorded writes must hold
        (key -> slot): written completely within them, not freed or overwritten before."""
        return {
            key: life[0]
            for key, lives in self.lives.items()
            for life in lives
            if life[1] <= cut and (life[2] is None or life[2] >= cut)
        }

    def _reopened(self, must: dict[BlockKey, int], cut: int) -> None:
        """Check what a backend just opened on an image recovered: ``must`` (key ->
        slot) must be there and read back exactly. The model then becomes what was
        recovered and read back exactly; misses are freed."""
        blocks = self.b.recover()
        space = self.b.space
        assert space is not None
        assert self.b.check() == []
        extents = []
        for blk in blocks:
            assert blk.key in self.data, f"recovered {blk.key.hex()}, never written"
            extent = space.extent(blk.slot)
            assert extent is not None
            assert blk.charge == extent[1] * 4096
            extents.append(extent)
        assert not _overlaps(extents), extents
        got = self._read([b.slot for b in blocks], [b.key for b in blocks])
        missing = set(must) - {b.key for b, ok in zip(blocks, got, strict=True) if ok}
        assert not missing, f"{len(missing)} completed blocks lost at write {cut}"
        for blk in blocks:
            if blk.key in must:
                assert blk.slot == must[blk.key]
        self.live = {b.slot: b.key for b, ok in zip(blocks, got, strict=True) if ok}
        self.lives = {key: [[slot, 0, None]] for slot, key in self.live.items()}
        misses = [b.slot for b, ok in zip(blocks, got, strict=True) if not ok]
        event("reopen: a recovered block was a miss" if misses else "reopen: no miss")
        back = len(blocks) - len(misses) - len(must)
        event("reopen: freed blocks came back" if back else "reopen: only the blocks due")
        if misses:
            self.b.discard(misses)
            self.b.free(misses)

    def _read(self, slots: list[int], keys: list[BlockKey]) -> list[bool]:
        """Read blocks; any served must be exactly its key's bytes."""
        if not slots:
            return []
        dst = torch.empty((len(slots), LAYOUT.bytes_per_block), dtype=torch.uint8)
        valid = self.b.read(slots, keys, dst)
        for i, (key, ok) in enumerate(zip(keys, valid, strict=True)):
            if ok:
                assert torch.equal(dst[i], self.data[key]), f"wrong bytes for {key.hex()}"
        return valid

    # -- rules -----------------------------------------------------------------------

    @rule(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6))
    def write_new(self, kinds: list[str]) -> None:
        n = min(len(kinds), self.b.num_free)
        if n == 0:
            return
        self._make_room(n)
        slots = self.b.allocate(n)
        assert slots is not None
        self._store(slots, [self._new_key(kind) for kind in kinds[:n]])

    @precondition(lambda self: self.live)
    @rule(picks=st.lists(st.integers(0, 1 << 16), min_size=1, max_size=4))
    def free_some(self, picks: list[int]) -> None:
        held = sorted(self.live)
        slots = sorted({held[p % len(held)] for p in picks})
        for slot in slots:
            self._gone(slot, len(self.rec.log))
        self.b.free(slots)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 1 << 16), kind=st.sampled_from(KINDS))
    def overwrite(self, pick: int, kind: str) -> None:
        slot = sorted(self.live)[pick % len(self.live)]
        self._make_room(1, keep=slot)
        self._gone(slot, len(self.rec.log))  # its extent is freed before any write
        self._store([slot], [self._new_key(kind)])

    @precondition(lambda self: len(self.data) > len(self.live))
    @rule(pick=st.integers(0, 1 << 16))
    def store_again(self, pick: int) -> None:
        """A key freed earlier stored again (same bytes) in a new slot: its old header
        may still be on disk, so a reopen sees two copies of it."""
        held = set(self.live.values())
        freed = [k for k in self.data if k not in held]
        if not self.b.num_free:
            return
        self._make_room(1)
        slots = self.b.allocate(1)
        assert slots is not None
        self._store(slots, [freed[pick % len(freed)]])

    @rule()
    def read_back(self) -> None:
        """Every held block reads back exactly (a rule, not an invariant: a load
        refreshes ``atime``, whose header write also persists freed slots' cleared
        headers, and runs without one between a free and a reopen are wanted too)."""
        assert all(self._read(list(self.live), list(self.live.values())))

    @precondition(lambda self: self.rec.log)
    @rule()
    def reopen(self) -> None:
        must = {key: slot for slot, key in self.live.items()}
        self.b.close()
        self.backend = None
        self._open(fresh=False)
        self._reopened(must, 0)

    @precondition(lambda self: len(self.rec.log) >= 2)
    @rule(data=st.data())
    def crash(self, data: st.DataObject) -> None:
        # Mostly between two writes: integers() alone favours the ends of the log.
        total = len(self.rec.log)
        inner = st.integers(1, total - 1) if total > 1 else st.just(total)
        cut = data.draw(st.one_of(inner, st.sampled_from([0, total])), label="crash after")
        image = {name: bytearray(raw) for name, raw in self.base.items()}
        for name, offset, chunk in self.rec.log[:cut]:
            image[name][offset : offset + len(chunk)] = chunk
        must = self._must(cut)
        event(f"crash: {cut} of {len(self.rec.log)}")
        self.b.close()  # its own last writes go to the files replaced next
        self.backend = None
        for name, raw in image.items():
            (self.dir / name).write_bytes(raw)
        self._open(fresh=False)
        self._reopened(must, cut)

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def consistent(self) -> None:
        space = self.b.space
        assert space is not None
        assert self.b.check() == []
        held = np.flatnonzero(space.pages > 0).tolist()
        assert held == sorted(self.live)
        assert self.b.num_free == self.b.num_slots - len(self.live)
        extents = [space.extent(slot) for slot in held]
        assert not _overlaps([e for e in extents if e is not None])

    def teardown(self) -> None:
        try:
            if self.backend is not None:
                self.backend.close()
        finally:
            mmap_files.os = os  # type: ignore[attr-defined]
            shutil.rmtree(self.tmp)


def event(what: str) -> None:
    SEEN[what] += 1


def _overlaps(extents: list[tuple[int, int]]) -> bool:
    ordered = sorted(extents)
    return any(a[0] + a[1] > b[0] for a, b in itertools.pairwise(ordered))


def only_the_file_module_makes_system_calls() -> None:
    """The recording sees every write only if no other module of the backend reaches
    ``os``: a write moved elsewhere would go unrecorded, and the crash images miss it."""
    package = Path(mmap_files.__file__).parent
    for path in sorted(package.glob("*.py")):
        if path.stem not in ("files", "__init__"):
            module = importlib.import_module(f"kvoffload.backends.mmap.{path.stem}")
            assert not hasattr(module, "os"), path.name


def test_packed_slab_survives_a_crash_between_any_two_writes(tmp_path: Path) -> None:
    """The machine above; its docstring says what each step and each open checks."""
    only_the_file_module_makes_system_calls()
    PackedCrashMachine.root = tmp_path
    run_state_machine_as_test(
        PackedCrashMachine,
        settings=settings(max_examples=50, stateful_step_count=20, deadline=None),
    )
    print(dict(SEEN))


def test_the_contents_make_extents_of_different_lengths(tmp_path: Path) -> None:
    """The machine's four kinds of contents are stored in 1, 3, 6 and 8 pages (random
    bytes raw), so its extents differ in length and freed space is reused unevenly."""
    backend = make_backend(
        "mmap",
        LAYOUT,
        FULL_SLOTS,
        tmp_path,
        compression="zstd",
        direct_io="off",
        max_file_bytes=MAX_FILE_BYTES,
    )
    try:
        slots = backend.allocate(len(KINDS))
        assert slots is not None
        keys = [namespaced(b"kinds", bytes([i])) for i in range(len(KINDS))]
        rows = torch.stack([block_row(kind, i) for i, kind in enumerate(KINDS)])
        charges = backend.write(slots, keys, rows)
        assert charges is not None
        assert [c // 4096 for c in charges] == [1, 3, 6, 8]
    finally:
        backend.close()


def test_a_newer_header_on_disk_beats_the_freed_one_it_overlaps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overlap only a reordering of writes can leave: block A (its slot's header
    in file 1's table) is freed, B (header in file 0's table) takes A's pages. The
    write clears A's header on disk first, then B's payload and header; a power loss
    without fsync may keep the last two and lose the first. On that image both
    headers are valid and their extents overlap: the reopen keeps B (the newer, whose
    payload went before its header) and drops A."""
    only_the_file_module_makes_system_calls()
    rec = RecordingOs()
    monkeypatch.setattr(mmap_files, "os", rec)
    path = tmp_path / "tier"

    def open_backend() -> MmapBackend:
        backend = make_backend(
            "mmap",
            LAYOUT,
            FULL_SLOTS,
            tmp_path,
            path=str(path),
            compression="zstd",
            direct_io="off",
            io_threads=1,
            max_file_bytes=MAX_FILE_BYTES,
        )
        assert isinstance(backend, MmapBackend)
        assert backend.space is not None
        return backend

    backend = open_backend()
    base = {p.name: p.read_bytes() for p in sorted(path.glob("slab-*.kvo"))}
    rec.log = []
    taken = backend.allocate(backend.num_slots)
    assert taken is not None
    backend.free([s for s in taken if s not in (0, 20)])
    assert [backend._locate(s)[0].index for s in (0, 20)] == [0, 1]
    a, b = namespaced(b"overlap", b"a"), namespaced(b"overlap", b"b")
    rows = {a: block_row("kv", 1), b: block_row("kv", 2)}
    assert backend.write([20], [a], rows[a][None]) == [6 * 4096]
    assert backend.space is not None
    extent_a = backend.space.extent(20)
    backend.free([20])
    begin = len(rec.log)
    assert backend.write([0], [b], rows[b][None]) == [6 * 4096]
    assert backend.space.extent(0) == extent_a  # best fit: A's pages, just freed
    names = [(name, offset) for name, offset, _ in rec.log[begin:]]
    # A's cleared header page (file 1), then B's payload and header page (file 0).
    assert [n for n, _ in names] == ["slab-001.kvo", "slab-000.kvo", "slab-000.kvo"]
    assert [o for _, o in names][::2] == [4096, 4096]
    backend.close()

    image = {name: bytearray(raw) for name, raw in base.items()}
    for name, offset, chunk in rec.log[:begin] + rec.log[begin + 1 : begin + 3]:
        image[name][offset : offset + len(chunk)] = chunk
    for name, raw in image.items():
        (path / name).write_bytes(raw)
    backend = open_backend()
    try:
        found = backend.recover()
        assert [(blk.key, blk.slot) for blk in found] == [(b, 0)]
        dst = torch.empty((1, LAYOUT.bytes_per_block), dtype=torch.uint8)
        assert backend.read([0], [b], dst) == [True]
        assert torch.equal(dst[0], rows[b])
        assert backend.check() == []
    finally:
        backend.close()


@pytest.fixture(autouse=True)
def _restore_os() -> Any:
    """Whatever a failing machine left, the file module gets the real ``os`` back."""
    yield
    mmap_files.os = os  # type: ignore[attr-defined]

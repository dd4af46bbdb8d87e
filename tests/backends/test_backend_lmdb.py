"""The ``lmdb`` backend: the contract, then what a persistent, shared tier must do.

Everything here is real: LMDB environments in ``tmp_path``, records damaged by
editing them through LMDB itself, a writer in another process, a forked child.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import subprocess
import sys
import textwrap
import threading
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any

import lmdb
import pytest
import torch
from kvoffload.backends.lmdb import BLOCKS_DB, PACKING, LmdbBackend

from kvoffload.backend import Backend
from kvoffload.config import LmdbTierConfig, load_config
from kvoffload.exceptions import BackendError, BlockStateError
from kvoffload.keys import BlockKey, namespaced
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES
from kvoffload.testing import BackendContract, BackendFactory, make_backend
from kvoffload.tier import build_tiers

# 1 KiB blocks: small enough to be fast, big enough to be a real payload.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")


class TestLmdbContract(BackendContract):
    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        return lambda layout, num_slots: make_backend("lmdb", layout, num_slots, tmp_path)


class TestLmdbContractCompressed(BackendContract):
    """A compressing tier keeps PACKING slots per full-size block its capacity holds
    (its manager budgets bytes), so the factory asks for a quarter of the slots."""

    @pytest.fixture
    def backend_factory(self, tmp_path: Path) -> BackendFactory:
        def build(layout: KVLayout, num_slots: int) -> Backend:
            assert num_slots % PACKING == 0, "the contract asks for multiples of 4 slots"
            full = num_slots // PACKING
            return make_backend("lmdb", layout, full, tmp_path, compression="zstd")

        return build

    def test_capacity_is_what_was_asked(self, backend: Backend, layout: KVLayout) -> None:
        """The contract's version wants ``capacity_bytes`` to cover every slot at full
        size; here it is the configured capacity (2 full-size records), which the
        manager's byte budget spends on up to 8 smaller ones."""
        assert backend.num_slots == backend.num_free == 8
        assert backend.capacity_bytes == 2 * LmdbBackend.slot_bytes(layout)
        assert backend.budget() == (backend.capacity_bytes, LmdbBackend.slot_bytes(layout))


# -- helpers ----------------------------------------------------------------------


def _keys(n: int, salt: int = 0) -> list[BlockKey]:
    return [namespaced(b"lmdb-%d" % salt, i.to_bytes(4, "little")) for i in range(n)]


def _payload(n: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.bytes_per_block), dtype=torch.uint8, generator=gen)


def _make(path: Path, num_slots: int, layout: KVLayout = LAYOUT, **extra: Any) -> LmdbBackend:
    config = LmdbTierConfig(
        name="disk",
        capacity=num_slots * LmdbBackend.slot_bytes(layout),
        path=str(path),
        **{"fsync": False, **extra},
    )
    return LmdbBackend(config, layout)


def _read(be: LmdbBackend, slots: list[int], keys: list[BlockKey]) -> tuple[list[bool], Any]:
    out = torch.zeros((len(keys), be.layout.bytes_per_block), dtype=torch.uint8)
    return be.read(slots, keys, out), out


def _records(path: Path) -> dict[bytes, bytes]:
    """Every record of the ``blocks`` database, read through LMDB directly."""
    with lmdb.open(str(path), max_dbs=2, readonly=True, map_size=0) as env:
        db = env.open_db(BLOCKS_DB, create=False)
        with env.begin(db=db) as txn:
            assert txn.stat(db)["entries"] == sum(1 for _ in txn.cursor())
            return dict(txn.cursor())


def _edit(path: Path, edits: dict[bytes, bytes | None]) -> None:
    """Overwrite (or, for ``None``, delete) records behind the backend's back."""
    with lmdb.open(str(path), max_dbs=2) as env:
        db = env.open_db(BLOCKS_DB, create=False)
        with env.begin(db=db, write=True) as txn:
            for key, value in edits.items():
                if value is None:
                    txn.delete(key)
                else:
                    txn.put(key, value)


def _flip(value: bytes, offset: int) -> bytes:
    raw = bytearray(value)
    raw[offset] ^= 0xFF
    return bytes(raw)


# -- persistence ------------------------------------------------------------------


def test_blocks_survive_a_reopen(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 8)
    assert be.recover() == []
    slots = be.allocate(5)
    assert slots is not None
    keys, data = _keys(5), _payload(5, seed=1)
    # Two batches: recovery returns the older one first.
    be.write(slots[:3], keys[:3], data[:3])
    be.write(slots[3:], keys[3:], data[3:])
    be.close()
    be.close()  # idempotent

    again = _make(path, 8)
    found = again.recover()
    assert [b.key for b in found] == keys
    assert [b.atime for b in found] == sorted(b.atime for b in found)
    assert again.num_free == 3
    assert all(again.is_allocated(b.slot) for b in found)
    valid, out = _read(again, [b.slot for b in found], keys)
    assert valid == [True] * 5
    assert torch.equal(out, data)
    assert again.check() == []
    # A recovered tier keeps working: a new block goes into a free slot.
    more = again.allocate(1)
    assert more is not None
    again.write(more, _keys(1, salt=1), _payload(1, seed=2))
    assert again.check() == []
    again.close()


def test_build_tiers_restores_what_was_stored(tmp_path: Path) -> None:
    config = load_config(
        {
            "tiers": [
                {
                    "name": "disk",
                    "backend": "lmdb",
                    "capacity": 8 * LmdbBackend.slot_bytes(LAYOUT),
                    "path": str(tmp_path / "tier"),
                    "fsync": False,
                }
            ]
        }
    )
    keys, data = _keys(5), _payload(5, seed=3)
    (tier,) = build_tiers(config, LAYOUT)
    # prepare store [k0..k4] -> five free slots, nothing evicted
    out = tier.manager.prepare_store(keys)
    assert out is not None
    assert out.keys_to_store == keys
    tier.backend.write(out.slots, out.keys_to_store, data)
    tier.manager.complete_store(keys)
    tier.close()

    # rebuild -> the manager learns the blocks from the disk, ready to load
    (tier,) = build_tiers(config, LAYOUT)
    assert isinstance(tier.backend, LmdbBackend)
    assert tier.manager.lookup(keys) == 5
    slots = tier.manager.prepare_load(keys)
    back = torch.zeros_like(data)
    assert tier.backend.read(slots, keys, back) == [True] * 5
    tier.manager.complete_load(keys)
    assert torch.equal(back, data)
    assert tier.manager.check() == []
    assert tier.backend.check() == []
    tier.close()


def test_a_dropped_block_stays_gone_after_a_restart(tmp_path: Path) -> None:
    config = load_config(
        {
            "tiers": [
                {
                    "name": "disk",
                    "backend": "lmdb",
                    "capacity": 4 * LmdbBackend.slot_bytes(LAYOUT),
                    "path": str(tmp_path / "tier"),
                    "fsync": False,
                }
            ]
        }
    )
    keys = _keys(3)
    (tier,) = build_tiers(config, LAYOUT)
    out = tier.manager.prepare_store(keys)
    assert out is not None
    tier.backend.write(out.slots, keys, _payload(3, seed=4))
    tier.manager.complete_store(keys)
    # a load found keys[1] corrupt -> drop it: out of the books and off the disk
    tier.drop([keys[1]])
    assert tier.backend.check() == []
    tier.close()
    (tier,) = build_tiers(config, LAYOUT)
    assert tier.manager.lookup(keys[:1]) == 1
    assert tier.manager.lookup(keys[1:2]) == 0
    assert tier.manager.lookup(keys[2:]) == 1
    tier.close()


def test_another_layout_sees_only_misses(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 4)
    slots = be.allocate(3)
    assert slots is not None
    keys = _keys(3)
    be.write(slots, keys, _payload(3, seed=5))
    be.close()
    assert LmdbBackend.stored_layout(LmdbTierConfig(path=str(path))) == LAYOUT

    # Same block size, other dtype: only the fingerprint tells them apart.
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="float16")
    assert other.bytes_per_block == LAYOUT.bytes_per_block
    be = _make(path, 4, other)
    assert be.recover() == []
    assert be.num_free == 4
    valid, _ = _read(be, [0, 1, 2], keys)
    assert valid == [False] * 3
    be.close()
    # The old layout's blocks could never be served again, so they were reclaimed,
    # and the tier now says it holds the new layout.
    assert _records(path) == {}
    assert LmdbBackend.stored_layout(LmdbTierConfig(path=str(path))) == other

    # Another block size as well.
    deeper = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=4)
    be = _make(path, 4, deeper)
    assert be.recover() == []
    be.close()


def test_stored_layout_of_a_missing_tier_is_none(tmp_path: Path) -> None:
    assert LmdbBackend.stored_layout(LmdbTierConfig(path=str(tmp_path / "nothing"))) is None


def test_stored_layout_needs_the_tier_closed_in_this_process(tmp_path: Path) -> None:
    # py-lmdb refuses a second open of one environment in one process.
    be = _make(tmp_path / "tier", 2)
    be.recover()
    with pytest.raises(BackendError, match="already open"):
        LmdbBackend.stored_layout(LmdbTierConfig(path=str(tmp_path / "tier")))
    be.close()


# -- damage -----------------------------------------------------------------------


def test_a_flipped_payload_byte_is_a_miss_for_that_block_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tier"
    be = _make(path, 4)
    slots = be.allocate(3)
    assert slots is not None
    keys, data = _keys(3), _payload(3, seed=6)
    be.write(slots, keys, data)
    be.close()
    record = _records(path)[keys[1]]
    _edit(path, {keys[1]: _flip(record, HEADER_BYTES + 100)})

    be = _make(path, 4)
    # Recovery trusts intact headers and leaves payloads to the load.
    found = be.recover()
    assert len(found) == 3
    by_key = {b.key: b.slot for b in found}
    caplog.set_level(logging.DEBUG, logger="kvoffload.backends.lmdb")
    valid, out = _read(be, [by_key[k] for k in keys], keys)
    assert valid == [True, False, True]
    assert torch.equal(out[0], data[0])
    assert torch.equal(out[2], data[2])
    # Again: a miss again, but warned about only once. (Counting is the Offloader's:
    # its tier's corrupt_blocks, one path for every backend.)
    assert _read(be, [by_key[keys[1]]], keys[1:2])[0] == [False]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "checksum" in warnings[0].getMessage()
    be.close()


def test_damaged_records_are_dropped_at_recovery(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 8)
    slots = be.allocate(4)
    assert slots is not None
    keys, data = _keys(4), _payload(4, seed=7)
    be.write(slots, keys, data)
    be.close()
    records = _records(path)
    _edit(
        path,
        {
            keys[0]: _flip(records[keys[0]], 20),  # a header byte (wtime): its CRC fails
            keys[1]: records[keys[1]][:-1],  # truncated payload
            keys[2]: records[keys[3]],  # the header of another key
            b"stray": b"not a record",
        },
    )

    be = _make(path, 8)
    found = be.recover()
    assert [b.key for b in found] == [keys[3]]
    valid, out = _read(be, [found[0].slot], [keys[3]])
    assert valid == [True]
    assert torch.equal(out[0], data[3])
    assert be.check() == []
    be.close()
    assert set(_records(path)) == {keys[3]}


# -- capacity ---------------------------------------------------------------------


def test_reused_slots_keep_at_most_num_slots_records(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 4)
    slots = be.allocate(4)
    assert slots is not None
    keys, data = _keys(10), _payload(10, seed=8)
    for i in range(10):
        # slot i % 4 now holds block i: the record it replaces goes in the same txn
        be.write([slots[i % 4]], [keys[i]], data[i : i + 1])
        assert _entries(be) == min(i + 1, 4)
    assert be.check() == []
    valid, out = _read(be, [slots[i % 4] for i in range(6, 10)], keys[6:])
    assert valid == [True] * 4
    assert torch.equal(out, data[6:])
    be.close()
    assert set(_records(path)) == set(keys[6:])


def _entries(be: LmdbBackend) -> int:
    """Records in the open backend's database, through its own handles (py-lmdb will
    not open the environment a second time in this process)."""
    handles = be._open_handles()
    with handles.env.begin(db=handles.blocks) as txn:
        return txn.stat(handles.blocks)["entries"]


def test_a_key_stored_again_elsewhere_survives_reuse_of_its_old_slot(tmp_path: Path) -> None:
    be = _make(tmp_path / "tier", 3)
    s = be.allocate(3)
    assert s is not None
    k, j = _keys(2)
    data = _payload(3, seed=9)
    be.write([s[0]], [k], data[0:1])
    # k evicted from s0, then stored again in s1
    be.write([s[1]], [k], data[1:2])
    # s0 reused for j: must not delete k, whose record s1 now holds
    be.write([s[0]], [j], data[2:3])
    valid, out = _read(be, [s[1], s[0]], [k, j])
    assert valid == [True, True]
    assert torch.equal(out, data[1:3])
    assert be.check() == []
    be.close()


def test_a_smaller_capacity_keeps_the_newest_blocks(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 6)
    slots = be.allocate(6)
    assert slots is not None
    keys, data = _keys(6), _payload(6, seed=10)
    for i in range(6):
        be.write([slots[i]], [keys[i]], data[i : i + 1])
    be.close()

    be = _make(path, 3)
    found = be.recover()
    assert [b.key for b in found] == keys[3:]
    assert be.num_free == 0
    valid, out = _read(be, [b.slot for b in found], keys[3:])
    assert valid == [True] * 3
    assert torch.equal(out, data[3:])
    assert be.check() == []
    be.close()
    assert set(_records(path)) == set(keys[3:])


def test_a_full_map_is_a_backend_error(tmp_path: Path) -> None:
    big = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16)  # 16 KiB
    be = _make(tmp_path / "tier", 16, big)
    assert be.map_size >= 2 * 16 * be.slot_bytes(big)
    be.map_size = 64 * 4096  # before first use: far less than 16 blocks need
    slots = be.allocate(16)
    assert slots is not None
    keys, data = _keys(16), _payload(16, seed=11, layout=big)
    be.write(slots[:2], keys[:2], data[:2])
    with pytest.raises(BackendError, match="MDB_MAP_FULL") as info:
        be.write(slots[2:], keys[2:], data[2:])
    assert isinstance(info.value.__cause__, lmdb.MapFullError)
    # The failed batch left nothing behind, in the database or in the slot map.
    assert be.check() == []
    valid, out = _read(be, slots[:3], keys[:3])
    assert valid == [True, True, False]
    assert torch.equal(out[:2], data[:2])
    be.close()


def test_reads_into_strided_rows(tmp_path: Path) -> None:
    be = _make(tmp_path / "tier", 2)
    slots = be.allocate(2)
    assert slots is not None
    keys, data = _keys(2), _payload(2, seed=17)
    be.write(slots, keys, data)
    # Every other byte of a wider buffer: rows that cannot be checksummed in place.
    wide = torch.zeros((2, 2 * LAYOUT.bytes_per_block), dtype=torch.uint8)
    dst = wide[:, ::2]
    assert be.read(slots, keys, dst) == [True, True]
    assert torch.equal(dst, data)
    assert not wide[:, 1::2].any()
    be.close()


def test_recover_twice_or_after_use_is_refused(tmp_path: Path) -> None:
    be = _make(tmp_path / "tier", 2)
    assert be.allocate(1) is not None
    with pytest.raises(BlockStateError, match="once"):
        be.recover()
    be.close()


# -- read-only, several processes, fork -------------------------------------------


def test_readonly_reads_and_recovers_but_refuses_writes(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    be = _make(path, 4)
    slots = be.allocate(3)
    assert slots is not None
    keys, data = _keys(3), _payload(3, seed=12)
    be.write(slots, keys, data)
    be.close()

    ro = _make(path, 2, readonly=True)  # smaller: surplus is ignored, not deleted
    found = ro.recover()
    assert [b.key for b in found] == keys[1:]
    with pytest.raises(BackendError, match="read-only"):
        ro.write([found[0].slot], [keys[0]], data[:1])
    valid, out = _read(ro, [0, 0, 0], keys)  # by key: a reader's slots are its own
    assert valid == [True] * 3
    assert torch.equal(out, data)
    ro.discard([found[0].slot])  # forgotten here, not deleted
    assert ro.check() == []
    ro.close()
    assert set(_records(path)) == set(keys)


def test_readonly_without_a_tier_is_a_backend_error(tmp_path: Path) -> None:
    ro = _make(tmp_path / "nothing", 2, readonly=True)
    with pytest.raises(BackendError, match="start the writer first"):
        ro.recover()
    ro.close()
    assert not (tmp_path / "nothing").exists()


def test_fsync_maps_to_lmdb_sync_flags(tmp_path: Path) -> None:
    for fsync in (True, False):
        be = _make(tmp_path / f"tier-{fsync}", 2, fsync=fsync)
        slots = be.allocate(1)
        assert slots is not None
        be.write(slots, _keys(1), _payload(1, seed=13))
        flags = be._open_handles().env.flags()
        assert (flags["sync"], flags["metasync"]) == (fsync, fsync)
        be.close()


WRITER = textwrap.dedent(
    """
    import sys, time
    import torch
    from kvoffload.backends.lmdb import LmdbBackend
    from kvoffload.config import LmdbTierConfig
    from kvoffload.layout import KVLayout

    path, num_slots, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4)
    be = LmdbBackend(
        LmdbTierConfig(
            name="writer",
            capacity=num_slots * LmdbBackend.slot_bytes(layout),
            path=path,
            fsync=False,
        ),
        layout,
    )
    be.recover()
    slots = be.allocate(num_slots)
    base = torch.arange(layout.bytes_per_block, dtype=torch.int64) * 7
    for i in range(total):
        row = ((base + i) % 256).to(torch.uint8).unsqueeze(0)
        # slot i % num_slots: block i replaces block i - num_slots
        be.write([slots[i % num_slots]], [b"block-%08d" % i], row)
        print(i, flush=True)
        time.sleep(0.002)
    be.close()
    """
)


def _expected_row(i: int) -> torch.Tensor:
    base = torch.arange(LAYOUT.bytes_per_block, dtype=torch.int64) * 7
    return ((base + i) % 256).to(torch.uint8)


def test_a_reader_process_reads_while_another_writes(tmp_path: Path) -> None:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    path = tmp_path / "tier"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(path), "32", "300"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reported: queue.Queue[bytes] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            reported.put(line)
        reported.put(b"")

    threading.Thread(target=pump, daemon=True).start()
    ro: LmdbBackend | None = None
    reads = hits = invalid = 0
    try:
        while line := reported.get(timeout=30):
            if ro is None:  # the first report means the environment exists
                ro = _make(path, 32, readonly=True)
                ro.recover()
            i = int(line)
            key = BlockKey(b"block-%08d" % i)
            # Block i replaced block i - 32 before it was reported: that one is gone.
            gone = BlockKey(b"block-%08d" % (i - 32))
            valid, out = _read(ro, [0, 1], [key, gone])
            reads += 1
            invalid += valid.count(False)
            assert valid[1] is False or i < 32
            if valid[0]:
                # Whatever the reader gets is exactly what was written, never torn.
                assert torch.equal(out[0], _expected_row(i)), f"block {i} differs"
                hits += 1
        assert proc.wait(timeout=30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        proc.kill()
        proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()
        if proc.stdout is not None:
            proc.stdout.close()
    assert ro is not None
    assert reads == 300
    # Every block the reader missed was one the writer had replaced, none damaged: a
    # damaged one is not counted as missing.
    assert ro.missing_blocks == invalid
    # A new block can only be gone if the writer replaced it (32 writes later) before
    # the reader got to it; nearly every read must hit.
    assert hits >= reads * 3 // 4
    assert ro.missing_blocks == (reads - hits) + reads
    ro.close()


def _child(be: LmdbBackend, slots: list[int], results: SimpleQueue[Any]) -> None:
    """In a forked child: read the parent's blocks, then store one of our own."""
    keys, data = _keys(3), _payload(3, seed=14)
    valid, out = _read(be, slots, keys)
    new_key, new_data = _keys(1, salt=9), _payload(1, seed=15)
    be.write([7], new_key, new_data)
    back_valid, back = _read(be, [7], new_key)
    results.put((valid, torch.equal(out, data), back_valid, torch.equal(back, new_data)))
    be.close()


# Python >= 3.12 warns about fork() in a process with threads (our writer thread).
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_reopens_the_environment(tmp_path: Path) -> None:
    be = _make(tmp_path / "tier", 8)
    be.recover()
    slots = be.allocate(3)
    assert slots is not None
    be.write(slots, _keys(3), _payload(3, seed=14))

    ctx = multiprocessing.get_context("fork")
    results: SimpleQueue[Any] = ctx.SimpleQueue()
    child = ctx.Process(target=_child, args=(be, slots, results))
    child.start()
    child.join(timeout=30)
    assert child.exitcode == 0
    assert results.get() == ([True] * 3, True, [True], True)

    # The parent's handles are untouched by the child closing its copy: its readers
    # still register in the lock table (a cached read transaction would have lost its
    # slot to the child's close), it reads the child's block and keeps writing.
    handles = be._open_handles()
    with handles.env.begin():
        assert f" {os.getpid()} " in handles.env.readers()
    valid, out = _read(be, [7], _keys(1, salt=9))
    assert valid == [True]
    assert torch.equal(out, _payload(1, seed=15))
    more = be.allocate(1)
    assert more is not None
    be.write(more, _keys(1, salt=10), _payload(1, seed=16))
    assert _read(be, more, _keys(1, salt=10))[0] == [True]
    be.close()


def test_second_writer_on_same_dir_is_refused(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2)
    first = make_backend("lmdb", layout, 4, tmp_path)
    code = (
        "import sys; from pathlib import Path; from kvoffload.testing import make_backend;"
        "from kvoffload.layout import KVLayout;"
        "make_backend('lmdb', KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=2),"
        " 4, Path(sys.argv[1]))"
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            cwd=tmp_path,
        )
    finally:
        first.close()
    assert proc.returncode != 0
    assert "in use by another writer" in proc.stderr

"""Compressed tiers (``compression:``): real files, a real LMDB, a real redis-server.

What a codec may never change: every load is bit-exact or a miss. Damage to a stored
(compressed) payload is caught by its checksum before anything is decompressed; a
chunk that verifies but does not decompress (a foreign writer's) is a miss, not an
exception. A block that does not shrink is stored raw. Changing a tier's setting keeps
its blocks readable, and records written before compression existed (header version
1) still verify. The backends' contract runs over compressed tiers in their own test
files; here is what only compression has.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from kvoffload.backends.mmap import ALIGN, MmapBackend
from support.redisserver import RedisServer, require_redis

from kvoffload.backend import Backend
from kvoffload.codec import CODECS, Packer
from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey, namespaced
from kvoffload.layout import KVLayout
from kvoffload.record import (
    HEADER_BYTES,
    HEADER_DTYPE,
    build_headers,
    check_headers,
    header_crc,
    stored_lengths,
)
from kvoffload.testing import kv_like, make_backend

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32)  # 32 KiB bf16
FP8 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, block_size=32, dtype="float8_e4m3fn")
_prefixes = itertools.count()


def _keys(n: int, salt: int = 0) -> list[BlockKey]:
    return [namespaced(b"compress-%d" % salt, i.to_bytes(4, "little")) for i in range(n)]


def _random(n: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.bytes_per_block), dtype=torch.uint8, generator=gen)


def _read(be: Backend, slots: list[int], keys: list[BlockKey]) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros((len(keys), be.layout.bytes_per_block), dtype=torch.uint8)
    return be.read(slots, keys, out), out


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-compress")).start()
    yield server.url()
    server.kill()


Make = Callable[..., Backend]


@pytest.fixture(params=["mmap", "mmap-buffered", "lmdb", "redis"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Make]:
    """``make(compression=..., layout=...)``: a tier of that kind over the same place
    each time (the same directory, or the same server and key prefix)."""
    kind = str(request.param)
    made: list[Backend] = []
    prefix = f"c{next(_prefixes)}"

    def build(compression: str = "zstd", layout: KVLayout = LAYOUT, slots: int = 16) -> Backend:
        extra: dict[str, Any] = {"compression": compression}
        name = kind.removesuffix("-buffered")
        if kind == "mmap-buffered":
            extra["direct_io"] = "off"
        if name == "redis":
            extra |= {"url": request.getfixturevalue("redis_url"), "key_prefix": prefix}
        be = make_backend(name, layout, slots, tmp_path, **extra)
        made.append(be)
        return be

    yield build
    for be in made:
        be.close()


def _reopen(be: Backend, make: Make, **settings: Any) -> Backend:
    slots_held = be.capacity_bytes // type(be).slot_bytes(be.layout)  # same capacity
    be.close()
    again = make(slots=slots_held, **settings)
    again.recover()
    return again


# -- what is stored -------------------------------------------------------------------


def test_kv_like_blocks_shrink_and_load_bit_exact(make: Make) -> None:
    be = make()
    keys = _keys(8)
    data = kv_like(LAYOUT, 8, seed=1)
    slots = be.allocate(8)
    assert slots is not None
    be.write(slots, keys, data)
    logical, stored = be.stats().held  # type: ignore[misc]
    assert logical == 8 * LAYOUT.bytes_per_block
    assert stored < 0.9 * logical  # normal bf16 values: their high bytes compress
    valid, out = _read(be, slots[::-1], keys[::-1])
    assert valid == [True] * 8
    assert torch.equal(out, data.flip(0))


def test_blocks_that_do_not_shrink_are_stored_raw(make: Make) -> None:
    be = make()
    keys, data = _keys(4), _random(4)
    slots = be.allocate(4)
    assert slots is not None
    be.write(slots, keys, data)
    assert be.stats().held == (4 * LAYOUT.bytes_per_block,) * 2
    valid, out = _read(be, slots, keys)
    assert valid == [True] * 4
    assert torch.equal(out, data)


def test_fp8_blocks_compress_with_a_one_byte_shuffle(make: Make) -> None:
    be = make(layout=FP8)
    keys, data = _keys(4), kv_like(FP8, 4, seed=2)
    slots = be.allocate(4)
    assert slots is not None
    be.write(slots, keys, data)
    logical, stored = be.stats().held  # type: ignore[misc]
    assert stored < logical
    valid, out = _read(be, slots, keys)
    assert valid == [True] * 4
    assert torch.equal(out, data)


@pytest.mark.parametrize(("first", "then"), [("zstd", "none"), ("none", "lz4"), ("lz4", "zstd")])
def test_changing_the_setting_keeps_every_block_readable(
    make: Make, first: str, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """But for a fixed-slot mmap slab told to compress: it starts a packed slab, empty
    (said in the log), so that compression buys the blocks it was asked for; its old
    blocks are misses, never data."""
    be = make(compression=first)
    keys, data = _keys(6), kv_like(LAYOUT, 6, seed=3)
    slots = be.allocate(6)
    assert slots is not None
    be.write(slots, keys, data)
    repacked = isinstance(be, MmapBackend) and first == "none"
    be = _reopen(be, make, compression=then)
    if repacked:
        assert be.num_free == be.num_slots
        assert "starting it empty" in caplog.text
        return
    valid, out = _read(be, slots, keys)
    assert valid == [True] * 6
    assert torch.equal(out, data)


# -- damage ---------------------------------------------------------------------------


def _damage(be: Backend, slot: int, key: BlockKey, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite the stored record of ``key`` (header + stored payload) behind the
    tier's back with ``edit(record)``."""
    if isinstance(be, MmapBackend):
        f, local = be._locate(slot)
        size = int(stored_lengths(f.headers[local : local + 1])[0])
        header = f.headers[local].tobytes()
        path, at = be.payload_at(slot)
        with open(path, "r+b") as fh:
            fh.seek(at)
            record = edit(header + fh.read(size))
            assert len(record) == HEADER_BYTES + size, "mmap edits keep the length"
            fh.seek(at)
            fh.write(record[HEADER_BYTES:])
        return
    if be.config.backend == "lmdb":
        # The environment is open in this process: edit through its own writer.
        def put(handles: Any) -> None:
            with handles.env.begin(db=handles.blocks, write=True) as txn:
                txn.put(bytes(key), edit(bytes(txn.get(bytes(key)))))

        be._on_writer(put)  # type: ignore[attr-defined]
        return
    client = be._get_client()  # type: ignore[attr-defined]
    name = be.redis_key(bytes(key))  # type: ignore[attr-defined]
    client.set(name, edit(client.get(name)))


def _flip(at: int) -> Callable[[bytes], bytes]:
    def edit(record: bytes) -> bytes:
        raw = bytearray(record)
        raw[at] ^= 0x10
        return bytes(raw)

    return edit


def _forged(record: bytes) -> bytes:
    """The record with its stored payload replaced by garbage of the same length whose
    checksum and header are made to verify: only the decompressor can tell."""
    garbage = bytes(reversed(record[HEADER_BYTES:]))
    header = np.frombuffer(record[:HEADER_BYTES], dtype=HEADER_DTYPE).copy()
    assert int(header["codec"][0]) != 0, "the block must be compressed"
    header["checksum"] = xxhash.xxh3_64_intdigest(garbage)
    raw = header.view(np.uint8)
    header["hcrc"] = header_crc(raw.tobytes())
    return header.tobytes() + garbage


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(_flip(HEADER_BYTES + 200), id="stored-byte"),
        pytest.param(_flip(HEADER_BYTES + 4), id="chunk-header-byte"),
        pytest.param(_forged, id="verifies-but-does-not-decompress"),
    ],
)
def test_a_damaged_compressed_block_is_a_miss(make: Make, damage: Callable[[bytes], bytes]) -> None:
    be = make()
    keys, data = _keys(4), kv_like(LAYOUT, 4, seed=4)
    slots = be.allocate(4)
    assert slots is not None
    be.write(slots, keys, data)
    if isinstance(be, MmapBackend) and damage is _forged:
        # The mmap tier keeps its header table in memory: forge the table entry too.
        f, local = be._locate(slots[1])
        record = _forged(f.headers[local].tobytes() + _stored(be, slots[1]))
        f.headers[local] = np.frombuffer(record[:HEADER_BYTES], dtype=HEADER_DTYPE)[0]
        _damage(be, slots[1], keys[1], lambda r: r[:HEADER_BYTES] + record[HEADER_BYTES:])
    else:
        _damage(be, slots[1], keys[1], damage)
    valid, out = _read(be, slots, keys)
    assert valid == [True, False, True, True]
    for i in (0, 2, 3):
        assert torch.equal(out[i], data[i])


def _stored(be: MmapBackend, slot: int) -> bytes:
    f, local = be._locate(slot)
    size = int(stored_lengths(f.headers[local : local + 1])[0])
    path, at = be.payload_at(slot)
    with open(path, "rb") as fh:
        fh.seek(at)
        return fh.read(size)


def test_a_reopened_mmap_tier_drops_a_header_that_claims_too_many_bytes(tmp_path: Path) -> None:
    be = make_backend("mmap", LAYOUT, 8, tmp_path, compression="zstd")
    keys, data = _keys(2), kv_like(LAYOUT, 2, seed=5)
    slots = be.allocate(2)
    assert slots is not None
    be.write(slots, keys, data)
    be.close()
    slab = tmp_path / "tier-mmap" / "slab-000.kvo"
    with open(slab, "r+b") as fh:  # header of slot 0: stored = length + 1, resealed
        fh.seek(ALIGN + slots[0] * HEADER_BYTES)
        header = np.frombuffer(fh.read(HEADER_BYTES), dtype=HEADER_DTYPE).copy()
        header["stored"] = LAYOUT.bytes_per_block + 1
        header["hcrc"] = header_crc(header.tobytes())
        fh.seek(ALIGN + slots[0] * HEADER_BYTES)
        fh.write(header.tobytes())
    be = make_backend("mmap", LAYOUT, 8, tmp_path, compression="zstd")
    assert {b.key for b in be.recover()} == {keys[1]}
    be.close()


# -- the record -----------------------------------------------------------------------


def test_a_version_1_header_still_verifies() -> None:
    """Version 1 (before compression) had version u2, key_len u2 and wtime f8 where
    version 2 has version/codec, key_len/flags and stored/wtime."""
    keys = _keys(1)
    v2 = build_headers(
        [bytes(k) for k in keys],
        length=LAYOUT.bytes_per_block,
        first_seq=7,
        now=1.7e9,
        layout_fp=LAYOUT.fingerprint,
        checksums=[123],
    )
    v1 = np.zeros(1, dtype=HEADER_DTYPE)
    raw = bytearray(v2.tobytes())
    raw[4:6] = (1).to_bytes(2, "little")  # version u2
    raw[6:8] = len(bytes(keys[0])).to_bytes(2, "little")  # key_len u2
    raw[20:28] = np.float64(1.7e9).tobytes()  # wtime f8
    raw[124:128] = header_crc(bytes(raw)).to_bytes(4, "little")
    v1 = np.frombuffer(bytes(raw), dtype=HEADER_DTYPE)
    assert int(v1["codec"][0]) == 0
    assert int(stored_lengths(v1)[0]) == LAYOUT.bytes_per_block
    assert check_headers(
        v1,
        [bytes(keys[0])],
        layout_fp=LAYOUT.fingerprint,
        length=LAYOUT.bytes_per_block,
        checksums=[123],
        crcs=[header_crc(bytes(raw))],
    ).tolist() == [True]


def test_every_codec_round_trips_and_names_itself() -> None:
    data = kv_like(LAYOUT, 1, seed=6)[0].numpy()
    ids = set()
    for codec in CODECS.values():
        packer = Packer(codec, LAYOUT.itemsize)
        packed = packer.compress(data)
        ids.add(codec.id)
        if codec.is_none:
            assert packed is None
            continue
        assert packed is not None
        assert len(packed) < data.nbytes
        out = np.zeros_like(data)
        assert packer.decompress_into(packed, out)
        assert np.array_equal(out, data)
        assert not packer.decompress_into(packed[:-1], out)  # cut short: refused
    assert len(ids) == len(CODECS)


# -- configuration --------------------------------------------------------------------


def _tier(**extra: Any) -> dict[str, Any]:
    return {"tiers": [{"name": "ssd", "backend": "mmap", "path": "/tmp/x", **extra}]}


def test_an_unknown_codec_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(_tier(compression="brotli"))
    message = str(err.value)
    assert "\n" not in message.strip()
    assert "compression" in message
    assert "brotli" in message
    assert "zstd" in message


def test_a_codec_without_blosc2_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kvoffload.codec._blosc2", [None])
    with pytest.raises(ConfigError) as err:
        load_config(_tier(compression="lz4"))
    message = str(err.value)
    assert "\n" not in message.strip()
    assert "blosc2" in message
    assert "kvoffload[compress]" in message
    assert load_config(_tier(compression="none")).tiers[0].compression == "none"  # type: ignore[attr-defined]

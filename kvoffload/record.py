"""The block record every persisted block carries: its one home.

Every persistent or shared tier (mmap, lmdb, redis) stores a block as this 128-byte
header plus its payload, packs it with :func:`pack_values` / :func:`pack_payloads`,
checks a batch of headers with :func:`check_headers` and turns a verified payload back
into the engine's bytes with :func:`restore`. A new field (the codec) lands here once.

128 bytes, little-endian, in front of (LMDB, Redis) or beside (SSD slab) the payload::

    magic    4s   b"KVBH"             a header was written here
    version  u1   2                   1: written before compression existed (below)
    codec    u1   kvoffload.codec id  0: the payload is the engine's bytes as they are
    key_len  u1   1..64               bytes of ``key`` in use
    flags    u1   0, or FLAG_EXTENT   bit 0: ``wtime`` holds the payload's first page;
                                      bits 1..7 then: pages the extent holds beyond
                                      the stored bytes' (a splinter it took along)
    length   u4   logical bytes       must equal the layout's bytes_per_block
    seq      u8   write sequence      newest wins when a key appears twice
    stored   u4   payload bytes       as stored: length when codec is 0, less otherwise
    wtime    u4   write time          whole seconds since the epoch; in a packed slab
                                      (FLAG_EXTENT) the first 4 KiB page of the
                                      payload's extent instead
    atime    f8   last load time      persisted lazily; approximate LRU order on reopen
    layout   16s  layout fingerprint  data of another model/dtype/layout is never served
    checksum u8   xxh3_64(stored)     of the bytes as stored: damage is caught before
                                      anything is decompressed
    key      64s  block key
    hcrc     u4   crc32 of bytes 0..123: a torn or flipped header is never trusted

Version 1 had ``version u2``, ``key_len u2`` and ``wtime f8`` where version 2 has
``version``/``codec``, ``key_len``/``flags`` and ``stored``/``wtime``: read as version
2, a version-1 header has codec 0 and flags 0 (the high bytes of small numbers), and
its ``stored`` is its ``length`` (:func:`stored_lengths`). So tiers written before
compression existed keep serving after an upgrade; only version 2 is written.

The layout fingerprint does not include the codec: a block's logical bytes are the
same whatever it is packed with, so changing a tier's ``compression`` keeps every
block it holds readable.

xxh3_64 because it runs at ~31 GB/s on this machine's CPU (crc32c 18.7, zlib crc32
2.2, blake2b 0.6), so verifying every load costs a few percent of disk bandwidth,
and its 64 bits make an undetected corruption far less likely than a 32-bit CRC.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Final, cast

import numpy as np
import xxhash

from kvoffload.codec import Packer
from kvoffload.exceptions import BackendError
from kvoffload.keys import MAX_KEY_BYTES

MAGIC: Final = b"KVBH"
VERSION: Final = 2
READABLE_VERSIONS: Final = (1, 2)
HEADER_BYTES: Final = 128
FLAG_EXTENT: Final = 1
"""``flags`` bit: a packed slab's record, whose ``wtime`` is its extent's first page
(backends/mmap/extents.py). The header CRC covers it like any field, so a torn or
flipped placement is never trusted."""

HEADER_DTYPE: Final = np.dtype(
    [
        ("magic", "S4"),
        ("version", "u1"),
        ("codec", "u1"),
        ("key_len", "u1"),
        ("flags", "u1"),
        ("length", "<u4"),
        ("seq", "<u8"),
        ("stored", "<u4"),
        ("wtime", "<u4"),
        ("atime", "<f8"),
        ("layout", "V16"),  # raw bytes: "S" fields drop trailing NULs
        ("checksum", "<u8"),
        ("key", f"V{MAX_KEY_BYTES}"),
        ("hcrc", "<u4"),
    ]
)
assert HEADER_DTYPE.itemsize == HEADER_BYTES


def payload_checksum(payload: object) -> int:
    """xxh3_64 of a bytes-like payload (a ``memoryview`` of a tensor row works)."""
    return int(xxhash.xxh3_64_intdigest(payload))  # type: ignore[arg-type]


def header_crc(raw: bytes | memoryview) -> int:
    """CRC of a packed header's first 124 bytes (everything but ``hcrc``)."""
    return zlib.crc32(raw[: HEADER_BYTES - 4])


def unpack_header(raw: bytes | memoryview) -> np.void | None:
    """The header in ``raw[:128]``, or ``None`` if it is absent, torn or not ours."""
    if len(raw) < HEADER_BYTES:
        return None
    rec: np.void = np.frombuffer(raw, dtype=HEADER_DTYPE, count=1)[0]
    if rec["magic"] != MAGIC or int(rec["version"]) not in READABLE_VERSIONS:
        return None
    if not 0 < rec["key_len"] <= MAX_KEY_BYTES:
        return None
    if int(rec["hcrc"]) != header_crc(bytes(raw[:HEADER_BYTES])):
        return None
    return rec


def header_key(rec: np.void) -> bytes:
    return bytes(rec["key"].tobytes()[: int(rec["key_len"])])


def extent_pages(recs: np.ndarray[Any, np.dtype[np.void]]) -> np.ndarray[Any, Any]:
    """Pages of each packed record's extent (:data:`FLAG_EXTENT`): its stored bytes'
    pages plus the spare ones its flags count."""
    stored = stored_lengths(recs)
    spare = recs["flags"].astype(np.int64) >> 1
    return np.asarray(np.maximum(1, -(-stored // 4096)) + spare, dtype=np.int64)


def stored_lengths(recs: np.ndarray[Any, np.dtype[np.void]]) -> np.ndarray[Any, Any]:
    """Payload bytes as stored, per header (a version-1 header's is its ``length``)."""
    return np.where(recs["version"] == 1, recs["length"], recs["stored"]).astype(np.int64)


def build_headers(
    keys: Sequence[bytes],
    *,
    length: int,
    first_seq: int,
    now: float,
    layout_fp: bytes,
    checksums: Sequence[int],
    stored: Sequence[int] | None = None,
    codecs: Sequence[int] | None = None,
    extents: Sequence[int] | None = None,
    spare: Sequence[int] | None = None,
) -> np.ndarray[Any, np.dtype[np.void]]:
    """The headers of a batch as one ``HEADER_DTYPE`` array, ``hcrc`` included; block
    ``i`` gets ``seq = first_seq + i``; ``stored``/``codecs`` default to raw payloads;
    ``extents``: each payload's first page in a packed slab (:data:`FLAG_EXTENT`),
    ``spare`` the pages its extent holds beyond its stored bytes (0..127).

    A batch at a time because numpy scalar field access costs about 20 us a header:
    0.7 s of a 512 MiB store of 16 KiB blocks, more than the disk took (2026-11-23,
    ``kvoffload bench``). As array assignments plus one ``crc32`` per header it is
    about 1 us."""
    n = len(keys)
    arr = np.zeros(n, dtype=HEADER_DTYPE)
    if n == 0:
        return arr
    arr["magic"] = MAGIC
    arr["version"] = VERSION
    arr["codec"] = 0 if codecs is None else np.asarray(codecs, dtype=np.uint8)
    arr["key_len"] = [len(k) for k in keys]
    arr["length"] = length
    arr["seq"] = np.arange(first_seq, first_seq + n, dtype=np.uint64)
    arr["stored"] = length if stored is None else np.asarray(stored, dtype=np.uint32)
    if extents is None:
        arr["wtime"] = int(now)
    else:
        extra = np.zeros(n, dtype=np.uint8) if spare is None else np.asarray(spare, np.uint8)
        arr["flags"] = FLAG_EXTENT | (extra << 1)
        arr["wtime"] = np.asarray(extents, dtype=np.uint32)
    arr["atime"] = now
    arr["layout"] = np.void(bytes(layout_fp))
    arr["checksum"] = np.array(checksums, dtype=np.uint64)
    arr["key"] = padded_keys(keys)
    seal_rows(arr, range(n))
    return arr


def check_headers(
    recs: np.ndarray[Any, np.dtype[np.void]],
    keys: Sequence[bytes],
    *,
    layout_fp: bytes,
    length: int,
    checksums: Sequence[int] | np.ndarray[Any, Any] | None = None,
    crcs: Sequence[int] | np.ndarray[Any, Any] | None = None,
    stored: Sequence[int] | np.ndarray[Any, Any] | None = None,
) -> np.ndarray[Any, np.dtype[np.bool_]]:
    """Which of a batch's headers describe an intact record of ``keys[i]``, written
    under this layout, as one array operation (for the reason in :func:`build_headers`).

    Always checked: magic, a readable version, the layout, the logical length, the
    key, and a stored length that is the length (raw) or below it (compressed).
    ``checksums``: of each payload as it came back, compared with the header's;
    ``crcs``: of each header's first 124 bytes as it came back (a table this process
    wrote and keeps in memory needs neither); ``stored``: the payload bytes each
    record actually held (an inline record's value length less the header)."""
    n = len(keys)
    if n == 0:
        return np.zeros(0, dtype=bool)
    got = stored_lengths(recs)
    raw = recs["codec"] == 0
    ok = (
        (recs["magic"] == MAGIC)
        & np.isin(recs["version"], READABLE_VERSIONS)
        & (recs["layout"] == np.array([bytes(layout_fp)], dtype="V16")[0])
        & (recs["length"] == length)
        & (recs["key_len"] == np.array([len(k) for k in keys], dtype=np.uint8))
        & (recs["key"] == padded_keys(keys))
        & np.where(raw, got == length, (got > 0) & (got < length))
    )
    if checksums is not None:
        ok &= recs["checksum"] == np.asarray(checksums, dtype=np.uint64)
    if crcs is not None:
        ok &= recs["hcrc"] == np.asarray(crcs, dtype=np.uint32)
    if stored is not None:
        ok &= got == np.asarray(stored, dtype=np.int64)
    return cast("np.ndarray[Any, np.dtype[np.bool_]]", ok)


def pack_payloads(
    rows: Sequence[np.ndarray[Any, Any]] | np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    packer: Packer,
) -> tuple[list[int], list[int], list[int]]:
    """Each row's payload as stored into the front of ``out``'s row (a row at least
    as long as the payload), with its stored length, codec id and checksum. ``rows``:
    a ``[n, length]`` array, or a list of its rows (views, never copied).

    The checksum is of the copy in ``out``, not of ``rows``: what is stored is then
    exactly what was summed, even if the caller reuses its rows while we run."""
    n = len(rows)
    if packer.codec.is_none and isinstance(rows, np.ndarray) and n:
        # The raw tier's path as before the record had a codec: one copy of the
        # batch, then a checksum per row of the copy.
        length = rows.shape[1]
        np.copyto(out[:n, :length], rows)
        return [length] * n, [0] * n, [payload_checksum(out[i, :length]) for i in range(n)]
    stored, codecs, sums = [0] * n, [0] * n, [0] * n
    for i in range(n):
        length = rows[i].nbytes
        packed = packer.compress(rows[i])
        if packed is None:
            np.copyto(out[i, :length], rows[i])
            stored[i] = length
        else:
            size = len(packed)
            out[i, :size] = np.frombuffer(packed, dtype=np.uint8)
            stored[i], codecs[i] = size, packer.codec.id
        sums[i] = payload_checksum(out[i, : stored[i]])
    return stored, codecs, sums


def pack_values(
    keys: Sequence[bytes],
    rows: np.ndarray[Any, Any],
    out: np.ndarray[Any, Any],
    *,
    packer: Packer,
    layout_fp: bytes,
    first_seq: int,
    now: float,
) -> list[int]:
    """Header plus payload of each row into the rows of ``out`` (``[n, 128 +
    length]``), for tiers that store a record as one value (LMDB, Redis); returns
    each value's length (shorter than the row when its payload was compressed)."""
    n = len(keys)
    stored, codecs, sums = pack_payloads(rows, out[:, HEADER_BYTES:], packer)
    headers = build_headers(
        keys,
        length=rows.shape[1],
        first_seq=first_seq,
        now=now,
        layout_fp=layout_fp,
        checksums=sums,
        stored=stored,
        codecs=codecs,
    )
    out[:n, :HEADER_BYTES] = headers.view(np.uint8).reshape(n, HEADER_BYTES)
    return [HEADER_BYTES + s for s in stored]


def restore(stored: Any, codec: int, want: int, dst: np.ndarray[Any, Any], packer: Packer) -> bool:
    """Turn one record's verified payload into the engine's bytes in ``dst`` (a
    contiguous ``uint8`` row); ``False`` (a miss, ``dst`` undefined) if it is damaged.

    Raw (codec 0): ``stored`` is copied into ``dst`` unless it is ``dst`` already, and
    the copy is checksummed, so what the caller gets is exactly what was summed.
    Compressed: ``stored`` must be this process's own copy (not a view of a map another
    writer may reuse); it is checksummed first and decompressed only if it is intact,
    so damage never reaches the decompressor."""
    if codec == 0:
        if not _same_memory(stored, dst):
            np.copyto(dst, np.frombuffer(stored, dtype=np.uint8))
        return payload_checksum(dst) == want
    if payload_checksum(stored) != want:
        return False
    return packer.decompress_into(stored, dst)


def _same_memory(a: Any, b: np.ndarray[Any, Any]) -> bool:
    return isinstance(a, np.ndarray) and a.ctypes.data == b.ctypes.data and a.nbytes == b.nbytes


def padded_keys(keys: Sequence[bytes]) -> np.ndarray[Any, np.dtype[np.void]]:
    """``keys`` as the header's ``key`` field stores them (NUL-padded), for comparing a
    batch of headers with the keys asked for in one array operation."""
    joined = b"".join(bytes(k).ljust(MAX_KEY_BYTES, b"\0") for k in keys)
    return np.frombuffer(joined, dtype=f"V{MAX_KEY_BYTES}")


def seal_rows(table: np.ndarray[Any, np.dtype[np.void]], rows: Iterable[int]) -> None:
    """:func:`seal` the given elements of a contiguous ``HEADER_DTYPE`` array, without
    numpy scalar access (see :func:`build_headers`)."""
    raw = table.view(np.uint8).data.cast("B")
    hcrc = table["hcrc"]
    for i in rows:
        start = i * HEADER_BYTES
        hcrc[i] = zlib.crc32(raw[start : start + HEADER_BYTES - 4])


def key_bytes(tier: str, keys: Iterable[bytes]) -> list[bytes]:
    """``keys`` as ``bytes``, each checked to fit a header's key field (1..64 bytes):
    a key that does not fit could not be verified on read, so it is refused up front."""
    out = [bytes(k) for k in keys]
    for key in out:
        if not 0 < len(key) <= MAX_KEY_BYTES:
            raise BackendError(
                f"tier {tier!r}: block keys must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}"
            )
    return out

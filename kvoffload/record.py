"""The record header every persisted block carries, shared by the disk backends.

128 bytes, little-endian, in front of (LMDB) or beside (SSD slab) the payload::

    magic    4s   b"KVBH"             a header was written here
    version  u2   1
    key_len  u2   1..64               bytes of ``key`` in use
    length   u4   payload bytes       must equal the layout's bytes_per_block
    seq      u8   write sequence      newest wins when a key appears twice
    wtime    f8   write time          seconds since the epoch
    atime    f8   last load time      persisted lazily; approximate LRU order on reopen
    layout   16s  layout fingerprint  data of another model/dtype/layout is never served
    checksum u8   xxh3_64(payload)    torn or rotten payloads are never served
    key      64s  block key
    hcrc     u4   crc32 of bytes 0..123: a torn or flipped header is never trusted

xxh3_64 because it runs at ~31 GB/s on this machine's CPU (crc32c 18.7, zlib crc32
2.2, blake2b 0.6), so verifying every load costs a few percent of disk bandwidth,
and its 64 bits make an undetected corruption far less likely than a 32-bit CRC.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
import xxhash

from kvoffload.exceptions import BackendError
from kvoffload.keys import MAX_KEY_BYTES

MAGIC: Final = b"KVBH"
VERSION: Final = 1
HEADER_BYTES: Final = 128

HEADER_DTYPE: Final = np.dtype(
    [
        ("magic", "S4"),
        ("version", "<u2"),
        ("key_len", "<u2"),
        ("length", "<u4"),
        ("seq", "<u8"),
        ("wtime", "<f8"),
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


def fill_header(
    rec: np.void,
    *,
    key: bytes,
    length: int,
    seq: int,
    wtime: float,
    atime: float,
    layout_fp: bytes,
    checksum: int,
) -> None:
    """Fill one element of a ``HEADER_DTYPE`` array in place, ``hcrc`` included."""
    rec["magic"] = MAGIC
    rec["version"] = VERSION
    rec["key_len"] = len(key)
    rec["length"] = length
    rec["seq"] = seq
    rec["wtime"] = wtime
    rec["atime"] = atime
    rec["layout"] = np.void(bytes(layout_fp))
    rec["checksum"] = checksum
    rec["key"] = np.void(key.ljust(MAX_KEY_BYTES, b"\0"))
    seal(rec)


def seal(rec: np.void) -> None:
    """Recompute ``hcrc`` after any field changed (e.g. ``atime``)."""
    raw = rec.tobytes()
    rec["hcrc"] = header_crc(raw)


def pack_header(**fields: object) -> bytes:
    """One header as 128 bytes (for backends that store it inline, like LMDB)."""
    arr = np.zeros(1, dtype=HEADER_DTYPE)
    fill_header(arr[0], **fields)  # type: ignore[arg-type]
    return arr.tobytes()


def unpack_header(raw: bytes | memoryview) -> np.void | None:
    """The header in ``raw[:128]``, or ``None`` if it is absent, torn or not ours."""
    if len(raw) < HEADER_BYTES:
        return None
    rec: np.void = np.frombuffer(raw, dtype=HEADER_DTYPE, count=1)[0]
    if rec["magic"] != MAGIC or rec["version"] != VERSION:
        return None
    if not 0 < rec["key_len"] <= MAX_KEY_BYTES:
        return None
    if int(rec["hcrc"]) != header_crc(bytes(raw[:HEADER_BYTES])):
        return None
    return rec


def header_key(rec: np.void) -> bytes:
    return bytes(rec["key"].tobytes()[: int(rec["key_len"])])


def header_matches(rec: np.void, key: bytes, layout_fp: bytes, length: int) -> bool:
    """Whether a valid header describes ``key`` written under this layout."""
    return (
        rec["layout"].tobytes() == bytes(layout_fp)
        and int(rec["length"]) == length
        and header_key(rec) == bytes(key)
    )


def build_headers(
    keys: Sequence[bytes],
    *,
    length: int,
    first_seq: int,
    wtime: float,
    atime: float,
    layout_fp: bytes,
    checksums: Sequence[int],
) -> np.ndarray[Any, np.dtype[np.void]]:
    """The headers of a batch as one ``HEADER_DTYPE`` array, ``hcrc`` included; block
    ``i`` gets ``seq = first_seq + i``.

    A batch at a time because :func:`fill_header` goes through numpy scalar field
    access, about 20 us a header: 0.7 s of a 512 MiB store of 16 KiB blocks, more than
    the disk took (2026-11-23, ``kvoffload bench``). As array assignments plus one
    ``crc32`` per header it is about 1 us."""
    n = len(keys)
    arr = np.zeros(n, dtype=HEADER_DTYPE)
    if n == 0:
        return arr
    arr["magic"] = MAGIC
    arr["version"] = VERSION
    arr["key_len"] = [len(k) for k in keys]
    arr["length"] = length
    arr["seq"] = np.arange(first_seq, first_seq + n, dtype=np.uint64)
    arr["wtime"] = wtime
    arr["atime"] = atime
    arr["layout"] = np.void(bytes(layout_fp))
    arr["checksum"] = np.array(checksums, dtype=np.uint64)
    arr["key"] = padded_keys(keys)
    seal_rows(arr, range(n))
    return arr


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

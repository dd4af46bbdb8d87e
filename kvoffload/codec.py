"""Lossless block compression for the persistent and shared tiers (``compression:``).

A tier's ``compression`` names a :class:`Codec`; ``none`` (the default) stores the
engine's bytes as they are. The others are c-blosc2 codecs behind a *byte shuffle*:
a cache value of ``s`` bytes keeps most of its redundancy in one byte position (a
bf16's sign and exponent byte), and the shuffle puts byte ``k`` of every value side by
side, so a fast LZ codec finds it. The element size is the cache dtype's
(:attr:`~kvoffload.layout.KVLayout.dtype`), never guessed from the bytes.

A compressed payload is a blosc2 *chunk*: it names its own codec and filters and
carries its uncompressed and compressed sizes, so a tier reads back blocks written
under any codec, whatever its setting says now. The record header still names the
codec (:mod:`kvoffload.record`), for ``kvoffload inspect`` and so that a reader
without blosc2 counts such a block as a miss instead of failing.

Why blosc2: it is the maintained library built for exactly this (typed, shuffled,
multi-codec binary data), ships manylinux wheels, and compresses and decompresses
with the GIL released (once :func:`blosc2_module` turns that on), so the lane
threads of a tier run it in parallel. It is an
optional dependency (``pip install 'kvoffload[compress]'``); a tier that names a codec
without it is refused at start-up, in one line.

A block that does not shrink is stored as it is (codec ``none`` in its header): a
codec never costs a tier capacity or a copy on load.
"""

from __future__ import annotations

import importlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeVar

import numpy as np

NONE_ID: Final = 0
Compression = Literal["none", "lz4", "zstd"]
"""A tier's ``compression``: the names of :data:`CODECS`, declared once (the tiers'
settings take it from here; a test holds the two together)."""
_T = TypeVar("_T")
_R = TypeVar("_R")


@dataclass(frozen=True)
class Codec:
    """One ``compression`` setting: how a tier's payloads are packed."""

    name: Compression
    id: int
    """Stored in each record header; 0 is ``none``. Never reused for another codec."""
    blosc_codec: str = ""
    """Name of the c-blosc2 codec (``blosc2.Codec``); empty for ``none``."""
    clevel: int = 0
    filter: str = "SHUFFLE"
    """c-blosc2 filter applied before the codec (``blosc2.Filter``)."""
    filter_1byte: str = ""
    """The filter for a one-byte dtype (fp8), where it differs (``""``: ``filter``)."""

    @property
    def is_none(self) -> bool:
        return self.id == NONE_ID


CODECS: Final[dict[str, Codec]] = {
    c.name: c
    for c in (
        Codec("none", NONE_ID),
        # From scripts/bench_codecs.py over real SmolLM2-135M KV (docs/benchmarks.md,
        # "Compression"; stored / logical, bf16 and fp8). zstd: an entropy coder for the
        # bf16 high byte the shuffle gathers (0.688, 0.853); level 3 or 5 gains nothing
        # and compresses 3-15x slower, and with one-byte values the shuffle is a no-op
        # that slowed decompression. lz4: bit planes, not bytes, are what an LZ matcher
        # finds repeats in (0.814 vs 0.878 with a byte shuffle, and twice as fast to
        # compress; fp8 0.963). lz4hc is not offered: 23% saved at 40 MB/s per thread.
        Codec("lz4", 1, "LZ4", 1, "BITSHUFFLE"),
        Codec("zstd", 2, "ZSTD", 1, "SHUFFLE", "NOFILTER"),
    )
}
BY_ID: Final[dict[int, Codec]] = {c.id: c for c in CODECS.values()}


def codec_named(name: str) -> Codec:
    """The codec of a ``compression`` setting (validated by the config first)."""
    return CODECS[name]


def blosc2_module() -> Any:
    """``blosc2``, imported on first use (only compressed tiers need it); ``None`` if
    it is not installed."""
    if not _blosc2:
        try:
            b2 = importlib.import_module("blosc2")
        except ImportError:
            b2 = None
        if b2 is not None:
            # Off by default: a call would hold the GIL throughout, and a tier's lanes
            # (mmap's I/O threads) would decompress one block at a time. Measured
            # 2026-11-26 on the H100 host (16 cores): a zstd mmap tier loaded at
            # 0.66x the uncompressed one with the GIL held.
            b2.set_releasegil(True)
        _blosc2.append(b2)
    return _blosc2[0]


_blosc2: list[Any] = []


_pool: list[ThreadPoolExecutor] = []
_pool_lock = threading.Lock()


def parallel_map(fn: Callable[[_T], _R], items: Sequence[_T]) -> list[_R]:
    """``[fn(x) for x in items]`` on a shared pool of codec threads (one per core, up
    to 8), for a tier whose reads come back on one thread (LMDB's transaction, a
    Redis reply stream) and would otherwise decompress a batch one block at a time.
    blosc2 releases the GIL (see :func:`blosc2_module`), so they run in parallel."""
    if len(items) <= 1:
        return [fn(x) for x in items]
    with _pool_lock:
        if not _pool:
            workers = min(8, os.cpu_count() or 1)
            _pool.append(ThreadPoolExecutor(workers, thread_name_prefix="kvo-codec"))
    return list(_pool[0].map(fn, items))


def require_blosc2(where: str, name: str) -> None:
    """Raise a one-line :class:`ValueError` (the config turns it into its error) when
    codec ``name`` is asked for and blosc2 is not installed."""
    if name != "none" and blosc2_module() is None:
        raise ValueError(
            f"{where}: compression {name!r} needs the blosc2 package, which is not "
            "installed; pip install 'kvoffload[compress]', or set compression: none"
        )


@dataclass(frozen=True)
class CodecStats:
    """What one tier's codec did so far: its name, and the logical bytes it compressed
    and decompressed with the seconds each took, summed over threads (so the GB/s
    are per thread: a tier's lanes run several at once)."""

    codec: str
    compressed_bytes: int = 0
    compress_seconds: float = 0.0
    decompressed_bytes: int = 0
    decompress_seconds: float = 0.0

    @property
    def compress_gbps(self) -> float | None:
        if not self.compress_seconds:
            return None
        return self.compressed_bytes / self.compress_seconds / 1e9

    @property
    def decompress_gbps(self) -> float | None:
        if not self.decompress_seconds:
            return None
        return self.decompressed_bytes / self.decompress_seconds / 1e9


class Packer:
    """Compresses and decompresses one tier's payloads; safe to share among threads
    (every call builds its own c-blosc2 context, and each runs on one thread: the
    tier's lanes are the parallelism)."""

    def __init__(self, codec: Codec, typesize: int) -> None:
        self.codec = codec
        self.typesize = max(1, typesize)
        self._b2 = None if codec.is_none else blosc2_module()
        self._cparams: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._totals = [0, 0.0, 0, 0.0]  # compressed bytes, s, decompressed bytes, s
        if self._b2 is not None:
            b2 = self._b2
            self._cparams = {
                "codec": getattr(b2.Codec, codec.blosc_codec),
                "clevel": codec.clevel,
                "typesize": self.typesize,
                "nthreads": 1,
                "filters": [getattr(b2.Filter, self._filter_name())],
                "filters_meta": [0],
            }

    def _filter_name(self) -> str:
        one_byte = self.typesize == 1 and self.codec.filter_1byte
        return self.codec.filter_1byte if one_byte else self.codec.filter

    def compress(self, payload: Any) -> bytes | None:
        """``payload`` compressed, or ``None`` when it does not shrink (or the tier
        stores raw bytes): the caller then stores it as it is."""
        if self._b2 is None:
            return None
        size = len(memoryview(payload).cast("B"))
        began = time.perf_counter()
        out: bytes = self._b2.compress2(payload, **self._cparams)
        took = time.perf_counter() - began
        with self._lock:
            self._totals[0] += size
            self._totals[1] += took
        return out if len(out) < size else None

    def decompress_into(self, stored: Any, dst: np.ndarray[Any, Any]) -> bool:
        """Decompress a verified chunk into ``dst`` (a contiguous ``uint8`` row).
        ``False``, leaving ``dst`` undefined, if the chunk is not one of exactly that
        many bytes (a foreign writer's, say), or blosc2 is missing here."""
        b2 = self._b2 if self._b2 is not None else blosc2_module()
        if b2 is None:
            return False
        try:
            nbytes, cbytes, _ = b2.get_cbuffer_sizes(stored)
            if nbytes != dst.nbytes or cbytes != len(memoryview(stored).cast("B")):
                return False
            began = time.perf_counter()
            # One thread: blosc2's default (all cores) costs 4x here in thread
            # hand-offs (2026-11-26, 256 KiB lz4: 0.85 GB/s vs 4.0), and the tier's
            # lanes already decompress several blocks at once.
            b2.decompress2(stored, dst=dst, nthreads=1)
            took = time.perf_counter() - began
        except Exception:  # a malformed chunk: a miss, never an exception
            return False
        with self._lock:
            self._totals[2] += dst.nbytes
            self._totals[3] += took
        return True

    def stats(self) -> CodecStats:
        """A snapshot of what this packer did (see :class:`CodecStats`)."""
        with self._lock:
            c, cs, d, ds = self._totals
        return CodecStats(self.codec.name, int(c), float(cs), int(d), float(ds))


__all__ = [
    "BY_ID",
    "CODECS",
    "NONE_ID",
    "Codec",
    "CodecStats",
    "Compression",
    "Packer",
    "codec_named",
    "parallel_map",
    "require_blosc2",
]

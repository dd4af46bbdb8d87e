"""The ``mmap`` tier's settings, importable without torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvoffload.tierconfig import Bytes, DiskTierConfig


class MmapTierConfig(DiskTierConfig):
    """SSD slab: preallocated files of fixed-size, 4096-aligned slots."""

    backend: Literal["mmap"] = "mmap"
    """Selects the SSD slab backend."""
    direct_io: Literal["auto", "on", "off"] = "auto"
    """``auto``: O_DIRECT where the filesystem allows it (probed at open, logged),
    buffered I/O otherwise. ``on``: fail to open without O_DIRECT. ``off``: buffered."""
    io_threads: int = Field(default=8, ge=1, le=64)
    """Threads issuing ``pwritev``/``preadv`` concurrently; NVMe needs several in flight."""
    max_file_bytes: Bytes = 64 * 1024**3
    """Largest slab file; a bigger capacity is split over several files."""
    preallocate: bool = True
    """Reserve the files' blocks at open (``posix_fallocate``), so a full disk shows up
    at start-up rather than as failed stores later."""


SETTINGS = MmapTierConfig
"""This tier's settings model: the config validates a tier naming it with this."""

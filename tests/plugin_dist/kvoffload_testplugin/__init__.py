"""Third-party backends for tests.

- ``memdict``: blocks kept as ``bytes`` in a dict;
- ``flakycpu``: the built-in cpu tier, with read failures injected on purpose (an I/O
  error where the engine loads from), for the end-to-end tests of the late load path;
- ``faultymmap``: the built-in mmap tier inside :class:`kvoffload.testing.FaultyBackend`,
  its faults set in the tier's config, for the end-to-end tests under disk faults;
- ``ackmmap``: the built-in mmap tier, which appends the keys of every store that has
  returned to a log file (``ack_log``), for the end-to-end ``kill -9`` test: what a
  killed engine's tier acknowledged, checked after a reopen.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Literal

import torch
from kvoffload.backends.cpu import CPUBackend
from kvoffload.backends.mmap import MmapBackend
from pydantic import Field

from kvoffload.backend import Backend
from kvoffload.config import CPUTierConfig, MmapTierConfig, TierConfig
from kvoffload.exceptions import BackendError
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.testing import Faults, FaultyBackend


class DictTierConfig(TierConfig):
    """The plugin's own settings, validated like the built-in ones."""

    copies: int = Field(default=1, gt=0)
    """How many copies of each block to keep (any positive int; only the first is read)."""


class DictBackend(Backend):
    """Keeps ``slot -> (key, bytes)``; verifies the key on read."""

    config_model = DictTierConfig

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self._data: dict[int, tuple[bytes, bytes]] = {}

    def write(self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor) -> None:
        self.check_batch(slots, keys, src)
        for slot, key, row in zip(slots, keys, src, strict=True):
            self._data[slot] = (bytes(key), row.contiguous().numpy().tobytes())

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        valid = []
        for i, (slot, key) in enumerate(zip(slots, keys, strict=True)):
            entry = self._data.get(slot)
            ok = entry is not None and entry[0] == bytes(key)
            if ok and entry is not None:
                dst[i].copy_(torch.frombuffer(bytearray(entry[1]), dtype=torch.uint8))
            valid.append(ok)
        return valid


class FlakyCPUTierConfig(CPUTierConfig):
    """The cpu tier's settings, plus which reads fail."""

    # CPUTierConfig pins ``backend`` to "cpu"; this backend registers under its own name.
    backend: Literal["flakycpu"] = "flakycpu"  # type: ignore[assignment]
    """Selects this backend."""
    fail_reads: int = Field(default=0, ge=0)
    """The first this many non-empty ``read`` calls raise ``BackendError``."""
    fail_every: int = Field(default=0, ge=0)
    """After those, every ``fail_every``-th non-empty read call raises too (0: none)."""


class FlakyCPUBackend(CPUBackend):
    """:class:`CPUBackend` whose reads fail as configured; writes always succeed.

    It does not hand out its slab (:meth:`rows` is ``None``), so every load goes
    through :meth:`read`, one call per load, and an injected failure is an I/O error
    at load time (the built-in cpu tier's loads copy straight from the slab, where
    nothing can be made to fail)."""

    config_model = FlakyCPUTierConfig

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        assert isinstance(config, FlakyCPUTierConfig)
        self.flaky = config
        self.reads = 0
        self.failed_reads = 0
        self._count_lock = threading.Lock()

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        if slots:
            with self._count_lock:
                self.reads += 1
                n = self.reads
                fail = n <= self.flaky.fail_reads or (
                    self.flaky.fail_every > 0
                    and (n - self.flaky.fail_reads) % self.flaky.fail_every == 0
                )
                self.failed_reads += fail
            if fail:
                raise BackendError(
                    f"tier {self.name!r}: injected read failure (read {n} of {len(slots)} blocks)"
                )
        return super().read(slots, keys, dst)

    def rows(self, start: int, n: int) -> torch.Tensor | None:
        return None


class FaultyMmapTierConfig(MmapTierConfig):
    """The mmap tier's settings, plus the faults injected into its reads and writes
    (probabilities per call; see :class:`kvoffload.testing.Faults`)."""

    backend: Literal["faultymmap"] = "faultymmap"  # type: ignore[assignment]
    """Selects this backend."""
    read_error: float = Field(default=0.0, ge=0, le=1)
    write_error: float = Field(default=0.0, ge=0, le=1)
    enospc: float = Field(default=0.0, ge=0, le=1)
    short_write: float = Field(default=0.0, ge=0, le=1)
    slow: float = Field(default=0.0, ge=0, le=1)
    slow_s: float = Field(default=0.05, ge=0)
    hang: float = Field(default=0.0, ge=0, le=1)
    read_hang: float = Field(default=0.0, ge=0, le=1)
    hang_s: float = Field(default=2.0, ge=0)
    seed: int = 0


class FaultyMmapBackend(FaultyBackend):
    """A real :class:`MmapBackend` with the configured faults injected."""

    config_model = FaultyMmapTierConfig

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        assert isinstance(config, FaultyMmapTierConfig)
        names = Faults.__dataclass_fields__
        faults = Faults(**{k: getattr(config, k) for k in names})
        super().__init__(MmapBackend(config, layout), faults)

    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        return MmapBackend.slot_bytes(layout)


class AckMmapTierConfig(MmapTierConfig):
    """The mmap tier's settings, plus the file its acknowledged stores are logged to."""

    backend: Literal["ackmmap"] = "ackmmap"  # type: ignore[assignment]
    """Selects this backend."""
    ack_log: str | None = Field(default=None, min_length=1)
    """A file each returned store appends one line to: ``ACK <n> <key hex>...``; none
    by default (the backend contract suite runs every installed backend with its
    defaults: then this is a plain mmap tier)."""


ACK_TAG = "ACK"


def read_ack_log(path: str | os.PathLike[str]) -> list[list[BlockKey]]:
    """The stores an ``ackmmap`` tier acknowledged in ``path``, one list of keys per
    store, in order. A last line cut short by a kill (no newline, or fewer keys than it
    announces) was never fully written, so it does not count; any other bad line
    raises."""
    with open(path, "rb") as f:
        text = f.read().decode()
    lines = text.split("\n")
    stores: list[list[BlockKey]] = []
    for i, line in enumerate(lines[:-1]):  # the part after the last newline: cut short
        tag, count, *keys = line.split(" ")
        if tag != ACK_TAG or int(count) != len(keys):
            raise ValueError(f"{path}: line {i + 1} is not an acknowledgement: {line[:200]!r}")
        stores.append([BlockKey(bytes.fromhex(k)) for k in keys])
    return stores


class AckMmapBackend(MmapBackend):
    """A real :class:`MmapBackend` (the same files, reopened as ``mmap`` as well) whose
    every ``write`` that returns appends ``ACK <n> <key hex>...`` (the keys it stored:
    all of them, or, from a packed slab, those whose charge is not 0) to ``ack_log``: one
    ``os.write`` on an ``O_APPEND`` descriptor, after the payloads and headers are
    written (and, with ``fsync`` on, flushed). A line is thus logged only for a store
    that has returned, and whole or cut short, never interleaved with another's."""

    config_model = AckMmapTierConfig  # type: ignore[assignment]

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        assert isinstance(config, AckMmapTierConfig)
        self._ack_fd: int | None = None
        super().__init__(config, layout)
        if config.ack_log is not None:
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
            self._ack_fd = os.open(config.ack_log, flags, 0o644)

    def write(
        self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor
    ) -> list[int] | None:
        charges = super().write(slots, keys, src)
        fd = self._ack_fd
        # A packed (compressed) slab answers each block's charge: 0 is a block that
        # found no room and was not stored, so it is not acknowledged either.
        stored = (
            list(keys)
            if charges is None
            else [k for k, c in zip(keys, charges, strict=True) if c > 0]
        )
        if stored and fd is not None:
            line = " ".join([ACK_TAG, str(len(stored)), *(k.hex() for k in stored)])
            data = (line + "\n").encode()
            if os.write(fd, data) != len(data):
                raise BackendError(f"tier {self.name!r}: short write to its ack log")
        return charges

    def close(self) -> None:
        super().close()
        fd, self._ack_fd = self._ack_fd, None
        if fd is not None:
            os.close(fd)

"""A third-party backend for tests: blocks kept as ``bytes`` in a dict."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field

from kvoffload.backend import Backend
from kvoffload.config import TierConfig
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout


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

"""KV layout: the shape of one block of KV cache, and its fingerprint.

Every persisted block carries the fingerprint of the layout it was written under; a
tier opened under another model, dtype or block size sees those blocks as misses, so
it can never hand an engine KV that belongs to a different model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    import torch

# dtype name -> bytes per element. Kept free of torch so that importing the config
# (``kvoffload config validate``) does not import torch; the names are torch's.
ITEMSIZE: Final[dict[str, int]] = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
DTYPE_NAMES: Final = tuple(ITEMSIZE)


def dtype_from_name(name: str) -> torch.dtype:
    """Map a config dtype name to torch; ``ValueError`` lists the accepted names."""
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPE_NAMES)}")
    import torch

    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """Inverse of :func:`dtype_from_name`."""
    name = str(dtype).removeprefix("torch.")
    if name not in ITEMSIZE:
        raise ValueError(f"unsupported dtype {dtype}; allowed: {', '.join(DTYPE_NAMES)}")
    return name


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Shape of one block: ``num_layers`` x ``kv_factor`` x ``block_size`` tokens x
    ``num_kv_heads`` x ``head_dim`` elements of ``dtype``.

    ``namespace`` separates data that has the same shape but must not mix (model name,
    tensor-parallel rank); it is part of the fingerprint.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"
    kv_factor: int = 2
    namespace: str = ""
    _fp: bytes = field(init=False, repr=False, compare=False, default=b"")

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "kv_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive integer, got {value!r}")
        if self.dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {self.dtype!r}; allowed: {', '.join(DTYPE_NAMES)}")
        canonical = json.dumps(
            {k: v for k, v in asdict(self).items() if k != "_fp"}, sort_keys=True
        ).encode()
        fp = hashlib.blake2b(b"kvoffload-layout-v1" + canonical, digest_size=16).digest()
        # frozen dataclass: the fingerprint is computed once, here, and stored.
        object.__setattr__(self, "_fp", fp)

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def layer_block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block within one layer, in the canonical pool layout."""
        return (self.kv_factor, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_layer_block(self) -> int:
        k, n, h, d = self.layer_block_shape
        return k * n * h * d * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """Payload bytes of one block across all layers: the unit every tier stores."""
        return self.num_layers * self.bytes_per_layer_block

    @property
    def fingerprint(self) -> bytes:
        """16 stable bytes identifying this layout (same across processes and versions)."""
        return self._fp

    def to_dict(self) -> dict[str, object]:
        return {k: v for k, v in asdict(self).items() if k != "_fp"}

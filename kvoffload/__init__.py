"""kvoffload: tiered KV-cache offloading for LLM serving engines.

The engine-agnostic core. Import what you need from here::

    from kvoffload import load_config, KVLayout, BlockPool, LRUOffloadingManager
"""

from __future__ import annotations

import pkgutil

# Run from a source checkout (``python -m kvoffload`` in the repo root), ``./kvoffload``
# shadows the installed package, which is where ``backends/`` and ``connectors/`` are
# mapped to ``kvoffload.backends`` / ``kvoffload.connectors``. Extending ``__path__``
# with the installed copy keeps those subpackages importable in that case.
__path__ = pkgutil.extend_path(__path__, __name__)

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvoffload.blockpool import BlockPool
    from kvoffload.config import KVOffloadConfig, load_config
    from kvoffload.exceptions import (
        BackendError,
        BlockStateError,
        ConfigError,
        KVOffloadError,
        LayoutMismatchError,
        RegistryError,
    )
    from kvoffload.keys import BlockKey, chain_block_keys, key_from_hash
    from kvoffload.layout import KVLayout
    from kvoffload.lru_manager import LRUOffloadingManager
    from kvoffload.manager import OffloadingEvent, OffloadingManager, PrepareStoreOutput
    from kvoffload.transfer import JobResult, TransferStats, TransferWorker

# Public name -> module. Imported on first use (PEP 562), so `kvoffload config
# validate` does not pay for importing torch.
_LAZY = {
    "BlockPool": "blockpool",
    "KVOffloadConfig": "config",
    "load_config": "config",
    "BackendError": "exceptions",
    "BlockStateError": "exceptions",
    "ConfigError": "exceptions",
    "KVOffloadError": "exceptions",
    "LayoutMismatchError": "exceptions",
    "RegistryError": "exceptions",
    "BlockKey": "keys",
    "chain_block_keys": "keys",
    "key_from_hash": "keys",
    "KVLayout": "layout",
    "LRUOffloadingManager": "lru_manager",
    "OffloadingEvent": "manager",
    "OffloadingManager": "manager",
    "PrepareStoreOutput": "manager",
    "JobResult": "transfer",
    "TransferStats": "transfer",
    "TransferWorker": "transfer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
    return getattr(import_module(f"kvoffload.{module}"), name)


__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BlockKey",
    "BlockPool",
    "BlockStateError",
    "ConfigError",
    "KVLayout",
    "KVOffloadConfig",
    "KVOffloadError",
    "LRUOffloadingManager",
    "LayoutMismatchError",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "JobResult",
    "TransferStats",
    "TransferWorker",
    "RegistryError",
    "__version__",
    "chain_block_keys",
    "key_from_hash",
    "load_config",
]

"""Block identity: chained prefix hashes over token ids.

A block's key depends on its own tokens *and* on every block before it, so equal keys
mean an equal prefix, which is what makes a stored block reusable (the same chaining
vLLM's prefix cache uses). Keys are plain ``bytes``; an engine may pass its own block
hashes instead (vLLM's ``request.block_hashes``), through :func:`key_from_hash`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import Final, NewType

BlockKey = NewType("BlockKey", bytes)
"""Opaque identity of one block of KV: a prefix hash, at most :data:`MAX_KEY_BYTES` long."""

KEY_BYTES: Final = 16
MAX_KEY_BYTES: Final = 64
"""Longest key a tier accepts; persisted tiers reserve this much in each slot header."""

ROOT_KEY: Final = BlockKey(hashlib.blake2b(b"kvoffload-root-v1", digest_size=KEY_BYTES).digest())
"""Parent of the first block of every sequence."""


def chain_key(parent: bytes, payload: bytes) -> BlockKey:
    """The key of a block whose content is ``payload`` and whose prefix is ``parent``."""
    h = hashlib.blake2b(parent, digest_size=KEY_BYTES)
    h.update(payload)
    return BlockKey(h.digest())


def chain_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    extra_keys: Iterable[object] = (),
    parent: BlockKey = ROOT_KEY,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``extra_keys`` (LoRA id, cache salt, multimodal hashes...) are folded into the first
    block, so they separate whole sequences, as vLLM does. Token ids are hashed as
    little-endian int64, so any vocabulary fits.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    salt = repr(tuple(extra_keys)).encode() if extra_keys else b""
    keys: list[BlockKey] = []
    prev = parent
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        payload = struct.pack(f"<{block_size}q", *block)
        if salt and start == 0:
            payload = salt + b"\x00" + payload
        prev = chain_key(prev, payload)
        keys.append(prev)
    return keys


def key_from_hash(block_hash: bytes | int) -> BlockKey:
    """Wrap an engine's own block hash (bytes, or an int from older vLLM) as a key."""
    if isinstance(block_hash, int):
        block_hash = block_hash.to_bytes(16, "little", signed=block_hash < 0)
    if not block_hash or len(block_hash) > MAX_KEY_BYTES:
        raise ValueError(f"block hash must be 1..{MAX_KEY_BYTES} bytes, got {len(block_hash)}")
    return BlockKey(bytes(block_hash))


def namespaced(key: bytes, namespace: bytes) -> BlockKey:
    """Key ``key`` under ``namespace`` (layout fingerprint, TP rank), so tiers shared by
    several models or ranks never hand one the other's blocks."""
    return chain_key(namespace, key)


GENERATION_SPACE: Final = b"kvoffload-reset-generation"
"""The namespace of a connector reset's generation in the keys (:func:`generation_keys`)."""


def generation_keys(keys: list[BlockKey], generation: int) -> list[BlockKey]:
    """``keys`` as the engine's ``generation``-th connector reset sees them: unchanged
    before the first reset (the keys of every tier written before resets existed, and
    of an engine never reset), else under a namespace of their own. A reset bumps the
    generation, so no block stored before it is found again by this engine, on any
    tier; engines (replicas, a P/D pair) share blocks while they have been reset as
    many times (docs/vllm.md, "Weight updates"). The scheduler side keys its lookups
    and stores with it; the operator endpoint's ``/query`` looks where they do."""
    if generation == 0:
        return keys
    space = GENERATION_SPACE + struct.pack("<Q", generation)
    return [namespaced(k, space) for k in keys]

"""``/query``: a prompt's prefix as this engine's tiers hold it, in a router's shape.

The request and the answer follow the Mooncake KV indexer RFC (kvcache-ai/Mooncake
#1403), which Dynamo's standalone indexer answers too: token ids (or block hashes)
in, per medium the tokens of the prompt's prefix held there out, under the engine's
instance id, counted as Dynamo counts them (a cumulative walk through the media), so
that a router reading both compares them block for block; docs/operator.md says
where they differ (this endpoint cannot see vLLM's GPU prefix cache; Dynamo cannot see
a shared tier).

In (a JSON object; other fields of the RFC, ``model``, ``tenant_id``,
``instance_id``, are accepted and ignored: this engine serves one model):

- ``token_ids``: the prompt's token ids; hashed as vLLM hashes them (its
  ``block_size``, ``prefix_caching_hash_algo`` and ``PYTHONHASHSEED``, through
  :class:`~kvoffload.lookup.VllmHashing`), only full blocks count; with an optional
  ``cache_salt`` (vLLM folds it into the first block);
- or ``block_hashes``: vLLM's own block hashes (``request.block_hashes``), as hex
  strings (the full hash: the int a KV event carries is only its last 8 bytes, from
  which no key can be rebuilt);
- ``block_size``, if given, must be the engine's; ``lora_name``, if given, must be
  empty (LoRA prompts hash the adapter's path too, which a router does not know).

Out: see :func:`answer`. Bad input raises :class:`BadRequestError`, one line naming the
field, the value and the fix, which the endpoint sends back with a 400.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Final

from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey, key_from_hash
from kvoffload.lookup import Prompt, VllmHashing
from kvoffload.offloader import Offloader

from .tierview import WALK, BooksView, match

MAX_BLOCKS: Final = 1 << 16
"""Most full blocks one query may name (2M tokens at 32 a block)."""


class BadRequestError(ValueError):
    """A request the endpoint refuses: its message is the one line sent back."""


def _show(value: Any) -> str:
    """``value`` as the error line shows it, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadRequestError(f"token_ids = {_show(value)}: expected a JSON array of token ids")
    for i, token in enumerate(value):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise BadRequestError(
                f"token_ids[{i}] = {_show(token)}: expected a non-negative integer token id"
            )
    return value


def _block_hashes(value: Any) -> list[bytes]:
    if not isinstance(value, list):
        raise BadRequestError(
            f"block_hashes = {_show(value)}: expected a JSON array of vLLM block hashes as hex"
        )
    out: list[bytes] = []
    for i, item in enumerate(value):
        where = f"block_hashes[{i}] = {_show(item)}"
        if isinstance(item, int) and not isinstance(item, bool):
            raise BadRequestError(
                f"{where}: an int is a KV event's last 8 bytes of the hash, from which no "
                "key can be rebuilt; send vLLM's full block hash as hex, or token_ids"
            )
        try:
            raw = bytes.fromhex(item) if isinstance(item, str) else b""
            out.append(bytes(key_from_hash(raw)))
        except ValueError:
            raise BadRequestError(
                f"{where}: expected vLLM's block hash as hex (1 to 64 bytes), as "
                "request.block_hashes holds it"
            ) from None
    return out


def parse(
    body: Any, *, block_size: int, hashing: VllmHashing | str, by_hash: bool = False
) -> list[bytes]:
    """The vLLM block hashes a request names (see the module docstring). ``hashing``:
    the engine's hashing, or why token ids cannot be hashed here. ``by_hash``: the
    request came to ``/query_by_hash``, which takes block hashes only."""
    if not isinstance(body, dict):
        raise BadRequestError(
            f"body = {_show(body)}: expected a JSON object such as "
            '{"token_ids": [1, 2, 3]} or {"block_hashes": ["9f2c..."]}'
        )
    size = body.get("block_size")
    if size is not None and size != block_size:
        raise BadRequestError(
            f"block_size = {_show(size)}: this engine's blocks are {block_size} tokens; "
            "send its block_size, or leave it out"
        )
    lora = body.get("lora_name")
    if lora not in (None, ""):
        raise BadRequestError(
            f"lora_name = {_show(lora)}: LoRA prompts are not supported here (their "
            "hashes fold in the adapter's path); send their block_hashes instead"
        )
    given = [name for name in ("token_ids", "block_hashes") if name in body]
    if by_hash and given != ["block_hashes"]:
        raise BadRequestError(
            '/query_by_hash: expected {"block_hashes": [...]} (hex), without token_ids'
        )
    if len(given) != 1:
        raise BadRequestError(
            f"fields {given or 'none'}: expected exactly one of token_ids or block_hashes"
        )
    if given == ["block_hashes"]:
        hashes = _block_hashes(body["block_hashes"])
    else:
        hashes = _hash(_token_ids(body["token_ids"]), body.get("cache_salt"), hashing)
    if len(hashes) > MAX_BLOCKS:
        raise BadRequestError(f"{given[0]}: {len(hashes)} blocks; at most {MAX_BLOCKS} per query")
    return hashes


def _hash(tokens: list[int], salt: Any, hashing: VllmHashing | str) -> list[bytes]:
    if salt is not None and not isinstance(salt, str):
        raise BadRequestError(f"cache_salt = {_show(salt)}: expected a string, or leave it out")
    if isinstance(hashing, str):
        raise BadRequestError(f"token_ids: {hashing}")
    try:
        return hashing.block_hashes(Prompt(tokens, cache_salt=salt or None))
    except ConfigError as exc:  # e.g. the CBOR algorithms without cbor2 installed
        raise BadRequestError(f"token_ids: {exc}") from None


def answer(
    offloader: Offloader,
    view: BooksView,
    hashes: Sequence[bytes],
    keys: Callable[[list[BlockKey]], list[BlockKey]],
    *,
    instance: str,
    dp_rank: int,
    block_size: int,
) -> dict[str, Any]:
    """The answer for vLLM block hashes ``hashes``; ``keys`` turns their keys into this
    rank's tier keys (``Shared.ns``). Tokens throughout (blocks x ``block_size``)::

        {"instances": {instance: {"longest_matched": 96, "gpu": 0, "dp": {"0": 0},
                                  "cpu": 32, "disk": 64, "remote": 96}},
         "tiers": {"cpu": 32, "ssd": 64, "shared": 96}, "block_size": 32, "blocks": 4}

    ``instances`` is Dynamo's entry for this engine, field for field, so that a router
    reads both alike: ``cpu``, ``disk`` and then ``remote`` are one cumulative walk
    (:func:`~.tierview.match`), ``longest_matched`` its end. ``gpu`` and ``dp`` (Dynamo's
    per data-parallel rank count of the GPU prefix) are 0: vLLM's prefix cache lives in
    the scheduler's process, which this worker-side endpoint cannot read, so the walk
    starts where a GPU prefix of 0 would leave it. ``tiers``: the prefix each tier
    holds alone."""
    tier_keys = keys([key_from_hash(h) for h in hashes])
    per_tier, walk = match(offloader, view, tier_keys)
    entry: dict[str, Any] = {
        "longest_matched": walk[WALK[-1]] * block_size,
        "gpu": 0,
        "dp": {str(dp_rank): 0},
    }
    entry.update({name: n * block_size for name, n in walk.items()})
    return {
        "instances": {instance: entry},
        "tiers": {t.name: n * block_size for t, n in zip(offloader.tiers, per_tier, strict=True)},
        "block_size": block_size,
        "blocks": len(hashes),
    }

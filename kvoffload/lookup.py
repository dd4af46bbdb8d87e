"""Prefix lookup on the shared tier: how much of each prompt's prefix a server holds.

A router that spreads requests over vLLM engines asks, for a batch of token-id
prompts, how many leading blocks of each the shared (``redis``) tier holds, and so how
much prefill an engine with the kvoffload connector would load instead of compute.
Everything needed to name a prompt's blocks on the server is rebuilt here, without
vLLM and without asking any engine:

1. **vLLM's block hashes** (:class:`VllmHashing`): vLLM 0.32 hashes each full block of
   ``block_size`` tokens as ``hash_fn((parent_hash, tuple(token_ids), extra_keys))``,
   chained from ``NONE_HASH = hash_fn(seed)``, with ``hash_fn`` its
   ``prefix_caching_hash_algo`` (``sha256`` pickles, ``sha256_cbor`` CBOR-encodes,
   ``xxhash``/``xxhash_cbor`` the same with xxh3-128) and the seed the engine's
   ``PYTHONHASHSEED``, or for the sha256 algorithms ``"vllm-none-hash"`` when unset (the
   xxhash ones then draw a random seed per process: no one can rebuild those hashes).
   ``extra_keys`` are the LoRA ``("lora", name, path)`` on every block and
   ``("cache_salt", salt)`` on the first; multimodal prompts are not supported.
2. **The connector's keys**: each hash, as bytes, namespaced by the layout fingerprint
   of the engine's rank (``namespaced(hash, fingerprint)``, as the connector's
   ``Shared.ns`` does for a model with one KV cache group). The fingerprint covers the
   model's shape and ``model_id`` (:class:`VllmEngineLayout`, the same formula as
   ``layout_from_vllm``), or is given as it is.
3. **The server's names**: ``{key_prefix}:{fingerprint hex}:{key hex}``, the redis
   tier's naming, for every redis tier of the connector's config.

Every name of the batch (deduplicated: prompts that share a prefix share its blocks'
names) goes out in one pipeline of ``EXISTS``: one round trip per node, a cluster's
commands grouped per master. With tensor parallelism each rank keeps its own shard of
a block, and a prefix counts as held when every rank's shard is there.

Presence only, as the engine's own lookup: a value evicted after the answer, or found
damaged when read, is a miss then. Only the shared tier is asked: the cpu tier lives
in each engine's memory and a disk tier is locked by its engine (it answers for no one
else).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvoffload.exceptions import ConfigError
from kvoffload.keys import key_from_hash, namespaced
from kvoffload.layout import DTYPE_NAMES, KVLayout

if TYPE_CHECKING:
    from kvoffload.backends.redis import RedisBackend
    from kvoffload.config import KVOffloadConfig

HASH_ALGOS: Final = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``prefix_caching_hash_algo`` values (``CacheConfig``); vLLM's default is
``sha256``."""
DEFAULT_SEED: Final = "vllm-none-hash"
"""The seed of vLLM's ``NONE_HASH`` for the sha256 algorithms when ``PYTHONHASHSEED``
is unset (``kv_cache_utils.DEFAULT_NONE_HASH_SEED``)."""
FP8_CACHES: Final = {"fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
"""vLLM's fp8 ``cache_dtype`` values and the format each names in the fingerprint."""


def _hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name(algo)`` (``vllm.utils.hashing``), without vLLM."""
    if algo not in HASH_ALGOS:
        raise ConfigError(
            f"hash_algo = {algo!r}: not one of vLLM's prefix_caching_hash_algo values; "
            f"use one of {', '.join(HASH_ALGOS)}, the engines' setting (default sha256)"
        )
    if algo.endswith("_cbor"):
        try:
            import cbor2
        except ImportError:
            raise ConfigError(
                f"hash_algo = {algo!r} needs the cbor2 package (pip install cbor2)"
            ) from None

        def encode(obj: Any) -> bytes:
            return bytes(cbor2.dumps(obj, canonical=True))
    else:

        def encode(obj: Any) -> bytes:
            return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)

    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(encode(obj)).digest()
    import xxhash

    return lambda obj: xxhash.xxh3_128_digest(encode(obj))


@dataclass(frozen=True)
class Prompt:
    """One prompt as vLLM hashes it: its token ids, and what else vLLM folds into its
    block hashes."""

    token_ids: Sequence[int]
    cache_salt: str | None = None
    """The request's ``cache_salt`` (first block only)."""
    lora: tuple[str, str] | None = None
    """The request's LoRA adapter as ``(lora_name, lora_path)`` (every block)."""


@dataclass(frozen=True)
class VllmHashing:
    """How the engines hash blocks: their ``block_size``, ``prefix_caching_hash_algo``
    and ``PYTHONHASHSEED`` (``seed``; ``None``: unset, which a router can match only
    under the sha256 algorithms)."""

    block_size: int
    algo: str = "sha256"
    seed: str | None = None
    _fn: Callable[[Any], bytes] = field(init=False, repr=False, compare=False)
    _none: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ConfigError(
                f"block_size = {self.block_size!r}: expected a positive integer, the "
                "engines' block_size (vLLM's CacheConfig.block_size)"
            )
        fn = _hash_function(self.algo)
        if self.seed is None and self.algo.startswith("xxhash"):
            raise ConfigError(
                f"hash_algo = {self.algo!r} without a seed: vLLM then seeds each engine at "
                "random and no one can rebuild its hashes; run the engines with "
                "PYTHONHASHSEED set and give the same value as the seed, or use sha256"
            )
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_none", fn(DEFAULT_SEED if self.seed is None else self.seed))

    @property
    def none_hash(self) -> bytes:
        """vLLM's ``NONE_HASH``: the parent of every prompt's first block."""
        return self._none

    def block_hashes(self, prompt: Prompt | Sequence[int]) -> list[bytes]:
        """vLLM's ``request.block_hashes`` of ``prompt``'s full blocks."""
        if not isinstance(prompt, Prompt):
            prompt = Prompt(prompt)
        tokens = [int(t) for t in prompt.token_ids]
        lora = [("lora", *prompt.lora)] if prompt.lora else []
        salt = [("cache_salt", prompt.cache_salt)] if prompt.cache_salt else []
        out: list[bytes] = []
        parent = self._none
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            extra = lora + (salt if start == 0 else [])
            block = tuple(tokens[start : start + bs])
            parent = self._fn((parent, block, tuple(extra) if extra else None))
            out.append(parent)
        return out


@dataclass(frozen=True)
class VllmEngineLayout:
    """What names an engine's blocks: its model as the connector fingerprints it
    (``layout_from_vllm``). ``num_kv_heads`` is the model's total (vLLM splits it over
    the tensor-parallel ranks); ``head_dim`` is vLLM's head size (MLA: its latent
    size); ``dtype`` the model's dtype (``cache_dtype`` ``auto``)."""

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bfloat16"
    tensor_parallel_size: int = 1
    cache_dtype: str = "auto"
    mla: bool = False

    def layout(self, rank: int = 0) -> KVLayout:
        """The layout rank ``rank``'s tiers hold blocks under."""
        return vllm_layout(
            model_id=self.model_id,
            where="mla" if self.mla else f"tp{rank}",
            num_layers=self.num_layers,
            num_kv_heads=1 if self.mla else max(1, self.num_kv_heads // self.tensor_parallel_size),
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=self.dtype,
            cache_dtype=self.cache_dtype,
            kv_factor=1 if self.mla else 2,
        )

    def fingerprints(self) -> list[bytes]:
        """One per rank that keeps tiers (MLA: rank 0 alone, its cache is every
        rank's)."""
        ranks = 1 if self.mla else self.tensor_parallel_size
        return [self.layout(r).fingerprint for r in range(ranks)]


def vllm_layout(
    *,
    model_id: str,
    where: str,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    cache_dtype: str,
    kv_factor: int,
) -> KVLayout:
    """The connector's layout of one rank's blocks (``num_kv_heads``: that rank's), the
    one formula ``layout_from_vllm`` and :class:`VllmEngineLayout` share."""
    namespace = f"vllm:{model_id}:{where}"
    if cache_dtype == "auto":
        stored = dtype.removeprefix("torch.")
    elif cache_dtype in FP8_CACHES:
        stored = "uint8"
        namespace += f":cache={FP8_CACHES[cache_dtype]}"
    else:
        raise ConfigError(
            f"cache_dtype = {cache_dtype!r} is not supported by kvoffload yet; use "
            f"cache_dtype='auto' or one of {', '.join(repr(d) for d in FP8_CACHES)}"
        )
    if stored not in DTYPE_NAMES:
        raise ConfigError(f"dtype = {dtype!r}: use one of {', '.join(DTYPE_NAMES)}")
    try:
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=stored,
            kv_factor=kv_factor,
            namespace=namespace,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def server_key(key_prefix: str, fingerprint: bytes, key: bytes) -> bytes:
    """The redis tier's name of block ``key`` under ``fingerprint``
    (``RedisBackend.redis_key``)."""
    return f"{key_prefix}:{fingerprint.hex()}:{key.hex()}".encode()


@dataclass
class TierAnswer:
    """One tier's answer to a batch."""

    tier: str
    blocks: list[int]
    """Per prompt: the leading full blocks the tier holds (every rank's shard)."""
    round_trips: int
    """Requests this lookup wrote to the tier's server(s): one per node, plus the
    handshake of any connection opened for it."""
    names: int
    """Distinct names asked (``EXISTS`` commands)."""


class PrefixLookup:
    """Asks a config's shared tiers which prefixes they hold; keep one per router (it
    keeps its connections). ``fingerprints``: one per rank that keeps tiers, from
    :meth:`VllmEngineLayout.fingerprints` or as an engine's layout gives them."""

    def __init__(
        self,
        config: KVOffloadConfig,
        hashing: VllmHashing,
        fingerprints: Sequence[bytes] | VllmEngineLayout,
    ) -> None:
        try:
            from kvoffload.backends.redis import RedisBackend
        except ImportError:
            raise ConfigError(
                "the lookup asks a redis tier: install kvoffload's redis extra "
                "(pip install 'kvoffload[redis]')"
            ) from None

        # Any layout will do for the client (names are built here, per fingerprint);
        # rank 0's, where known, so that the tier's log names its fingerprint.
        layout = KVLayout(1, 1, 1, 1, "uint8", kv_factor=1, namespace="kvoffload-lookup")
        if isinstance(fingerprints, VllmEngineLayout):
            if fingerprints.block_size != hashing.block_size:
                raise ConfigError(
                    f"block_size: the layout's is {fingerprints.block_size}, the hashing's "
                    f"{hashing.block_size}; both are the engines' block_size"
                )
            layout = fingerprints.layout(0)
            fingerprints = fingerprints.fingerprints()
        fps = [bytes(f) for f in fingerprints]
        if not fps or any(len(f) != 16 for f in fps):
            raise ConfigError(
                "fingerprints: expected one or more 16-byte layout fingerprints (32 hex "
                "digits each), one per tensor-parallel rank"
            )
        self.hashing = hashing
        self.fingerprints = fps
        self.tiers: list[RedisBackend] = []
        for tier in config.resolved_tiers():
            if tier.backend == "redis":
                backend = RedisBackend(tier, layout)
                self.tiers.append(backend)
        if not self.tiers:
            names = ", ".join(f"{t.name} ({t.backend})" for t in config.tiers)
            raise ConfigError(
                f"tiers: no redis tier among {names}; the lookup asks the shared tier, so "
                "give the connector's config with its redis tier"
            )

    def keys(self, prompt: Prompt | Sequence[int]) -> list[list[bytes]]:
        """Per full block of ``prompt``: the connector's key on each rank."""
        return [
            [bytes(namespaced(key_from_hash(h), fp)) for fp in self.fingerprints]
            for h in self.hashing.block_hashes(prompt)
        ]

    def lookup(self, prompts: Iterable[Prompt | Sequence[int]]) -> list[TierAnswer]:
        """Per shared tier, the leading full blocks of each prompt it holds: every
        name of the batch in one pipeline, one round trip per node."""
        per_prompt = [self.keys(p) for p in prompts]
        return [self._ask(backend, per_prompt) for backend in self.tiers]

    def _ask(self, backend: RedisBackend, per_prompt: list[list[list[bytes]]]) -> TierAnswer:
        head = backend.redis_config.key_prefix
        index: dict[bytes, int] = {}
        # Per prompt, per block: the indices of its ranks' names in the batch.
        asked = [
            [
                [
                    index.setdefault(server_key(head, fp, key), len(index))
                    for fp, key in zip(self.fingerprints, ranks, strict=True)
                ]
                for ranks in blocks
            ]
            for blocks in per_prompt
        ]
        names = list(index)

        def queue(pipe: Any) -> None:
            for name in names:
                pipe.exists(name)

        before = backend.round_trips
        # One pipeline, as the tier's own batches: RedisBackend.run_batch sends it (the
        # cluster client groups it per master) and turns any failure into one
        # BackendError line without credentials.
        found = [bool(r) for r in backend.run_batch("lookup", len(names), queue)] if names else []
        trips = backend.round_trips - before
        out: list[int] = []
        for blocks_asked in asked:
            n = 0
            for ranks_asked in blocks_asked:
                if not all(found[i] for i in ranks_asked):
                    break
                n += 1
            out.append(n)
        return TierAnswer(backend.name, out, trips, len(names))

    def close(self) -> None:
        for backend in self.tiers:
            backend.close()

    def __enter__(self) -> PrefixLookup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def lookup_prefixes(
    config: KVOffloadConfig,
    prompts: Iterable[Prompt | Sequence[int]],
    hashing: VllmHashing,
    fingerprints: Sequence[bytes] | VllmEngineLayout,
) -> list[TierAnswer]:
    """One batch's lookup (:class:`PrefixLookup`, opened and closed for it)."""
    with PrefixLookup(config, hashing, fingerprints) as lookup:
        return lookup.lookup(prompts)

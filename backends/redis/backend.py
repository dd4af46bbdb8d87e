"""The ``redis`` backend: one tier on a Redis server or cluster that many engines share.

Runs wherever the tier's bytes move (the transfer worker). Unlike the other tiers, the
store is not this process's: any number of engine replicas read and write the same
server, and the server alone decides what stays (``maxmemory`` with ``allkeys-lru``,
``ttl_s``). So this backend keeps no books of its own:

- **One value per block**: the 128-byte record header of :mod:`kvoffload.record`
  (magic, key, length, layout fingerprint, xxh3 checksum of the payload, header CRC)
  followed by the payload. Value and metadata are evicted, expire and are overwritten
  together, so no half of a pair can be orphaned (LMCache keeps two keys per chunk and
  can lose one). Every value read is verified: one that is torn, of another layout or
  key, or not ours at all is a miss, never data.
- **Key** ``{key_prefix}:{layout fingerprint hex}:{block key hex}``. The fingerprint
  covers the model's shape, dtype and namespace (model name, TP rank), so engines of
  different models or ranks share a server without ever seeing each other's blocks.
  No hash tag: keys spread over a cluster's slots, so load spreads over its masters.
- **One round trip per node per batch**: writes, reads, :meth:`RedisBackend.exists`
  and :meth:`RedisBackend.delete` each send their whole batch as one pipeline
  (``transaction=False``); a cluster pipeline groups the commands per master and
  writes to all of them before reading any reply. :attr:`RedisBackend.round_trips`
  counts the requests actually written to sockets, so tests and metrics see the real
  number, retries and redirections included.
- **Slots are nominal.** The base class's allocator still runs (the manager contract
  needs it) and ``capacity`` bounds it, but a slot names no place on the server:
  writes and reads address blocks by key only, and :meth:`RedisBackend.recover`
  returns nothing, since the server's contents are not this process's to adopt.

Failures: every error of the client or the server (unreachable, timeout, ``OOM``
under ``noeviction``, ``CLUSTERDOWN``, a redirection that failed) becomes one
:class:`~kvoffload.exceptions.BackendError` with a one-line message that never
carries credentials; the Offloader turns it into a failed store or a miss. Nothing is
retried at length: one immediate retry of a stale connection (a restarted server),
then the error, so an engine step never waits on a dead server for more than the
configured timeouts. The next batch reconnects by itself.

Secrets: ``password`` and ``username`` are :class:`~pydantic.SecretStr`, so they
appear in no repr, log or validation error; credentials written into ``url`` are
moved out of it when the config is validated, for the same reason.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, cast

import numpy as np
import redis.exceptions
import torch
from kvoffload.backends.redis.client import SOCKET_READ_BYTES as SOCKET_READ_BYTES
from kvoffload.backends.redis.client import RedisClient, ServerLink
from kvoffload.backends.redis.client import make_client as make_client
from kvoffload.backends.redis.read import ReadSink, Sinks, Sunk
from kvoffload.backends.redis.settings import RedisTierConfig as RedisTierConfig
from redis.cluster import RedisCluster

from kvoffload.backend import Backend, BackendStats
from kvoffload.codec import Packer, codec_named
from kvoffload.config import TierConfig
from kvoffload.exceptions import ConfigError
from kvoffload.hostcopy import Buffers
from kvoffload.keys import MAX_KEY_BYTES, BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES, check_headers, key_bytes, pack_values

logger = logging.getLogger(__name__)


SCAN_BATCH: Final = 1000
"""Keys asked of each ``SCAN`` call (its ``COUNT``) and handed out per list by
:meth:`RedisBackend.scan`: one round trip per thousand keys, replies of ~100 KB."""

_SPARE_PACK_BYTES: Final = 32 * (2 * 1024 * 1024 + 1024)
"""Largest pack buffer kept between batches (see ``RedisBackend._take_buffer``): a
batch of 32 blocks of 2 MiB with their headers. At 64 MiB flat, that batch (64 MiB
plus 32 headers) was never kept, and each one faulted 64 MiB of fresh pages in:
stores of 2 MiB ran at 0.37x the tuned raw loop (2026-11-26)."""


class RedisBackend(Backend):
    """A tier on a Redis server or cluster; see the module docs for the format."""

    config_model = RedisTierConfig
    persistent = True
    """The server's contents outlive this process (and are other engines' too)."""
    server_booked = True
    """The server keeps the books (it evicts by itself, other engines write it): the
    tier's manager asks :meth:`exists` at lookup instead of keeping an LRU."""

    def __init__(self, config: TierConfig, layout: KVLayout) -> None:
        if not isinstance(config, RedisTierConfig):
            raise ConfigError(
                f"tier {config.name!r}: the redis backend takes a RedisTierConfig (url or "
                f"nodes, key_prefix, ttl_s, ...), got {type(config).__name__}"
            )
        super().__init__(config, layout)
        self.redis_config = config
        self.value_bytes = HEADER_BYTES + layout.bytes_per_block
        self._key_head = f"{config.key_prefix}:{layout.fingerprint.hex()}:".encode()
        self._sinks = Sinks()
        self._link = ServerLink(config, self._key_head, self._sinks)
        """The connection: the client, its pipelines, its failures."""
        self._lock = threading.Lock()
        """Guards the write sequence and the stored sizes."""
        self._stats_lock = threading.Lock()
        """Guards the read counters."""
        self._seq = itertools.count(1)
        self.packer = Packer(codec_named(config.compression), layout.itemsize)
        self._buffers = Buffers(self.value_bytes, keep_bytes=_SPARE_PACK_BYTES)
        """Pack buffers (see :data:`_SPARE_PACK_BYTES`)."""
        self._stored = np.zeros(self.num_slots, dtype=np.int64)
        """Payload bytes as stored of what this client last wrote into each slot."""
        self.missing_blocks = 0
        """Blocks asked for that the server did not have (evicted, expired, never
        stored): plain misses, the normal fate of a block in a shared cache."""
        self.corrupt_blocks = 0
        """Values found under our keys that failed verification (served as misses)."""

    @classmethod
    def slot_bytes(cls, layout: KVLayout) -> int:
        """A value is the header plus the payload; the capacity counts both."""
        return HEADER_BYTES + layout.bytes_per_block

    @classmethod
    def existing_config(cls, config: TierConfig, *, write: bool) -> TierConfig | None:
        """The config itself: the tier is wherever its server is, and opening it
        creates and reformats nothing (a client connects on first use; a server that
        cannot be reached fails the first request with its one-line error)."""
        return config

    @property
    def round_trips(self) -> int:
        """Requests written to the server(s) so far: one per node per batch, plus the
        handshake of each new connection and any retry or redirection."""
        return self._link.tally.value

    @property
    def failed_batches(self) -> int:
        """Batches that raised :class:`BackendError` (server or connection errors)."""
        return self._link.failed_batches

    def stats(self, *, held: bool = True) -> BackendStats:
        """The tier's ``round_trips`` (:attr:`round_trips`) and ``server_errors``
        (:attr:`failed_batches`) with the stored bytes, the codec's figures, and what
        this client wrote into the slots it holds (the server may have evicted some
        since: it keeps the books); a few reads, no I/O."""
        counters = {
            "round_trips": self._link.tally.value,
            "server_errors": self.failed_batches,
            **self.stored_counters(),
        }
        if not held:
            return BackendStats(counters, self.packer.stats())
        with self._lock:
            used = self._stored[self._stored > 0]
            footprint = len(used) * self.layout.bytes_per_block, int(used.sum())
        return BackendStats(counters, self.packer.stats(), footprint)

    def redis_key(self, key: bytes) -> bytes:
        """The server-side key of block ``key`` under this tier's prefix and layout."""
        return self._key_head + bytes(key).hex().encode()

    def _get_client(self) -> RedisClient:
        """The client, created on first use (see :meth:`ServerLink.client`)."""
        return self._link.client()

    def run_batch(
        self, op: str, n: int, queue: Callable[[Any], None], *, wrong_type_ok: bool = False
    ) -> list[Any]:
        """A batch's commands, queued by ``queue(pipeline)``, sent as one pipeline; the
        replies (see :meth:`ServerLink.run`). :mod:`kvoffload.lookup` sends its
        ``EXISTS`` batches through it too."""
        return self._link.run(op, n, queue, wrong_type_ok=wrong_type_ok)

    # -- data ---------------------------------------------------------------------
    def write(self, slots: Sequence[int], keys: Sequence[BlockKey], src: torch.Tensor) -> None:
        self.check_batch(slots, keys, src)
        if not slots:
            return
        key_list = key_bytes(self.name, keys)
        rows = (src if src.device.type == "cpu" else src.to("cpu")).numpy()
        # The whole batch is packed before the pipeline is sent (its values are views
        # of the buffer), so the buffer is as big as the batch; the pool keeps up to
        # _SPARE_PACK_BYTES for the next one, so it does not fault fresh pages in.
        held = self._buffers.acquire(len(key_list), spare_rows=1)
        try:
            buf = held.numpy()
            with self._lock:
                first = next(self._seq)
                self._seq = itertools.count(first + len(key_list))
            lens = pack_values(
                key_list,
                rows,
                buf,
                packer=self.packer,
                layout_fp=self.layout.fingerprint,
                first_seq=first,
                now=time.time(),
            )
            ttl = self.redis_config.ttl_s

            def queue(pipe: Any) -> None:
                for i, key in enumerate(key_list):
                    # A memoryview of the packed value: sent as it is, never copied.
                    pipe.set(self.redis_key(key), buf[i, : lens[i]].data, ex=ttl)

            self.run_batch("write", len(key_list), queue)
            with self._lock:
                self._stored[list(slots)] = [v - HEADER_BYTES for v in lens]
            self.count_stored(
                len(lens) * self.layout.bytes_per_block, sum(lens) - len(lens) * HEADER_BYTES
            )
        finally:
            self._buffers.release(held)

    def read(self, slots: Sequence[int], keys: Sequence[BlockKey], dst: torch.Tensor) -> list[bool]:
        self.check_batch(slots, keys, dst)
        if not slots:
            return []
        key_list = [bytes(k) for k in keys]

        def queue(pipe: Any) -> None:
            for key in key_list:
                pipe.get(self.redis_key(key))

        # Payloads go straight from each reply into the caller's rows as the replies
        # arrive (one copy, see ReadSink); a device or strided ``dst`` is filled
        # through a host buffer.
        direct = dst.device.type == "cpu" and dst.stride(1) == 1
        out = dst if direct else torch.empty(dst.shape, dtype=torch.uint8)
        sink = ReadSink(out.numpy(), key_list, self.value_bytes, self.packer)
        self._sinks.active = sink
        try:
            values = self.run_batch("read", len(key_list), queue, wrong_type_ok=True)
        finally:
            self._sinks.active = None
        valid = self._verify(key_list, values, sink)
        if out is not dst:
            dst.copy_(out)
        return valid

    def _verify(self, keys: list[bytes], values: list[Any], sink: ReadSink) -> list[bool]:
        """Which replies hold an intact value of the asked key under this layout.

        A value the sink took (:class:`Sunk`) was checksummed and copied on arrival;
        one it did not (another key's value, read into a row claimed by its own key's
        value, or the sink's failure) is done here. Then the headers are checked as
        one array (field access on numpy scalars costs ~20 us a header, see
        :func:`~kvoffload.record.build_headers`) against what was computed of each
        value. The server is shared, so anything may be stored under our keys: a stale
        value of an older format, a foreign writer's bytes, a value cut short by a
        client that died mid-write."""
        n = len(keys)
        absent = 0
        checked: list[int] = []
        for i, value in enumerate(values):
            if value is None:
                absent += 1
            elif type(value) is Sunk:
                if value.row == i:  # else: a value filed under key i that names another
                    checked.append(i)
            elif isinstance(value, bytes) and sink.takes(len(value)):
                sink.fill(i, value)
                checked.append(i)
        ok = np.zeros(n, dtype=bool)
        if checked:
            match = check_headers(
                sink.headers[checked],
                [keys[i] for i in checked],
                layout_fp=self.layout.fingerprint,
                length=self.layout.bytes_per_block,
                checksums=np.array(sink.sums, dtype=np.uint64)[checked],
                crcs=np.array(sink.crcs, dtype=np.uint32)[checked],
                stored=np.array(sink.stored, dtype=np.int64)[checked],
            )
            ok[checked] = match & ~np.isin(checked, list(sink.undecodable))
        bad = n - absent - int(ok.sum())
        with self._stats_lock:
            self.missing_blocks += absent
            self.corrupt_blocks += bad
            first = bad > 0 and self.corrupt_blocks == bad
        if bad:
            (logger.warning if first else logger.debug)(
                "tier %s: %d of %d values under this tier's keys failed verification and "
                "are served as misses (foreign, damaged or of another format)",
                self.name,
                bad,
                n,
            )
        return cast(list[bool], ok.tolist())

    # -- lookups and deletion, for a manager whose books are the server's ---------
    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether the server holds a value under each key, in one pipelined
        ``EXISTS`` per node. Presence only: a value is verified when read, so a hit
        here may still be a miss there (evicted meanwhile, or foreign)."""
        if not keys:
            return []
        key_list = [bytes(k) for k in keys]

        def queue(pipe: Any) -> None:
            for key in key_list:
                pipe.exists(self.redis_key(key))

        return [bool(r) for r in self.run_batch("lookup", len(key_list), queue)]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks from the server (one pipelined ``UNLINK`` per node, which frees
        big values off the server's main thread); returns how many were there."""
        if not keys:
            return 0
        key_list = [bytes(k) for k in keys]

        def queue(pipe: Any) -> None:
            for key in key_list:
                pipe.unlink(self.redis_key(key))

        return sum(int(r) for r in self.run_batch("delete", len(key_list), queue))

    # -- maintenance: what the tools see of the server --------------------------------
    def scan(self, batch: int = SCAN_BATCH) -> Iterator[list[BlockKey]]:
        """This tier's blocks on the server, in lists of up to ``batch`` keys: the keys
        under its prefix and this layout's fingerprint, found with ``SCAN MATCH
        prefix:fingerprint:* COUNT batch`` on the server, or on each master of a
        cluster in turn. For ``kvoffload inspect`` and ``verify``: a full pass over the
        keyspace, never for the engine's path. SCAN's guarantees hold: a key present
        throughout is returned (twice, rarely, while the server resizes its table); one
        written or removed meanwhile may or may not be. A name under the pattern that
        is no block key (not lowercase hex of 1-64 bytes) is skipped."""
        client = self._get_client()
        head = len(self._key_head)
        names = iter(client.scan_iter(match=self._key_head + b"*", count=batch))
        out: list[BlockKey] = []
        while True:
            try:
                name = next(names, None)
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                raise self._link.failure("scan", 0, exc) from None
            if name is None:
                break
            key = _block_key(name[head:])
            if key is not None:
                out.append(key)
            if len(out) >= batch:
                yield out
                out = []
        if out:
            yield out

    def server_info(self) -> dict[str, Any]:
        """What ``kvoffload inspect`` reports of the server: its address (no
        credentials), this tier's key prefix, and from ``INFO`` (summed over a
        cluster's masters) ``used_memory``, ``maxmemory`` (0: no limit),
        ``maxmemory_policy`` (each master's, comma-joined where they differ) and
        ``evicted_keys`` / ``expired_keys`` since each server started."""
        client = self._get_client()
        try:
            if isinstance(client, RedisCluster):
                masters = client.get_primaries()  # type: ignore[no-untyped-call]
                infos = [client.info(target_nodes=node) for node in masters]
            else:
                infos = [client.info()]
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise self._link.failure("info", 0, exc) from None

        def total(field: str) -> int:
            return sum(int(info.get(field, 0)) for info in infos)

        return {
            "server": self.redis_config.where(),
            "key_prefix": self.redis_config.key_prefix,
            "nodes": len(infos),
            "used_memory": total("used_memory"),
            "maxmemory": total("maxmemory"),
            "maxmemory_policy": ",".join(
                sorted({str(info.get("maxmemory_policy", "?")) for info in infos})
            ),
            "evicted_keys": total("evicted_keys"),
            "expired_keys": total("expired_keys"),
        }

    def discard(self, slots: Sequence[int]) -> None:
        """Nothing to do: a slot names no value on the server (see the module docs).
        A block found corrupt is left to be overwritten or evicted, since another
        engine may be rewriting it; :meth:`delete` removes blocks by key."""
        with self._lock:
            self._stored[list(slots)] = 0

    def close(self) -> None:
        """Close the connections. Idempotent; the backend is unusable afterwards."""
        self._link.close()


def _block_key(tail: bytes) -> BlockKey | None:
    """The block key a server-side name ends with (see :meth:`RedisBackend.redis_key`),
    or ``None`` where it is none (another writer's name under our pattern)."""
    try:
        text = tail.decode("ascii")
        raw = bytes.fromhex(text)
    except ValueError:  # UnicodeDecodeError too
        return None
    if not 0 < len(raw) <= MAX_KEY_BYTES or raw.hex() != text:
        return None
    return BlockKey(raw)

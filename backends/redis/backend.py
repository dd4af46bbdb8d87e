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
import redis
import redis.exceptions
import torch
from kvoffload.backends.redis.read import ReadSink, Sinks, Sunk, direct_get_parser
from kvoffload.backends.redis.settings import MASK, NODE_RE, RedisTierConfig
from redis._parsers import Encoder
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import (
    BlockingConnectionPool,
    Connection,
    PythonRespSerializer,
    SSLConnection,
)
from redis.retry import Retry
from redis.utils import HIREDIS_AVAILABLE

from kvoffload.backend import Backend
from kvoffload.codec import CodecStats, Packer, codec_named
from kvoffload.config import TierConfig
from kvoffload.exceptions import BackendError, ConfigError
from kvoffload.hostcopy import Buffers
from kvoffload.keys import MAX_KEY_BYTES, BlockKey
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES, check_headers, key_bytes, pack_values

logger = logging.getLogger(__name__)


SOCKET_READ_BYTES: Final = 1024 * 1024
"""Bytes asked of each ``recv``. redis-py's default (64 KiB) read 2 MiB values at
0.46 GB/s on loopback, 1 MiB at 0.76 GB/s (2026-11-23, this 2-CPU machine); the
buffer is per connection, so ``max_connections`` of them at most."""

_PACK_CUTOFF: Final = 6000
"""redis-py's own cutoff: arguments above it are sent as separate buffers."""

SCAN_BATCH: Final = 1000
"""Keys asked of each ``SCAN`` call (its ``COUNT``) and handed out per list by
:meth:`RedisBackend.scan`: one round trip per thousand keys, replies of ~100 KB."""

_SPARE_PACK_BYTES: Final = 32 * (2 * 1024 * 1024 + 1024)
"""Largest pack buffer kept between batches (see ``RedisBackend._take_buffer``): a
batch of 32 blocks of 2 MiB with their headers. At 64 MiB flat, that batch (64 MiB
plus 32 headers) was never kept, and each one faulted 64 MiB of fresh pages in:
stores of 2 MiB ran at 0.37x the tuned raw loop (2026-11-26)."""


class _Tally:
    """A thread-safe counter: requests are sent from the transfer worker's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.value = 0

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


_ZERO_COPY_PACKER: Final = PythonRespSerializer(
    _PACK_CUTOFF,
    Encoder("utf-8", "strict", False).encode,  # type: ignore[no-untyped-call]
)
"""redis-py's pure-Python command packer. With hiredis installed redis-py packs with
hiredis, which copies every value twice (``bytes(memoryview)``, then into one request
buffer); this one sends a large value as the caller's own buffer. Pipelined SETs of
2 MiB values: 0.78 GB/s with hiredis packing, 1.64 GB/s with this (2026-11-23). Replies
are parsed by :mod:`~kvoffload.backends.redis.read` and hiredis. Stateless, so one
instance serves every connection."""


def _counting_connection(base: type[Connection], tally: _Tally, sinks: Sinks) -> type[Connection]:
    """A connection class that counts each request it writes in ``tally``, packs
    without copies (:data:`_ZERO_COPY_PACKER`) and parses a read's replies with
    :func:`~kvoffload.backends.redis.read.direct_get_parser`, which receives each value
    straight into the row its read's :class:`ReadSink` holds for it. A value that
    reaches this class as ``bytes`` anyway (parsed by hiredis, or by redis-py's own
    parser where hiredis is missing) is handed to the sink as soon as it is parsed.

    Counted here, at the socket, rather than per pipeline: a cluster pipeline's
    per-node requests, a retry after a stale connection, the commands redis-py resends
    one by one after a ``MOVED`` and the handshake of a new connection are all real
    round trips, and only the connection sees every one of them. A class per backend,
    because a cluster client builds its connections from a class, not a factory."""

    parser = direct_get_parser(sinks)

    def init(self: Connection, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", _ZERO_COPY_PACKER)
        if HIREDIS_AVAILABLE:  # else redis-py's own parser, as the client would pick
            kwargs.setdefault("parser_class", parser)
        base.__init__(self, **kwargs)  # type: ignore[no-untyped-call]

    def send_packed_command(self: Connection, command: Any, check_health: bool = True) -> None:
        tally.add()
        base.send_packed_command(self, command, check_health)  # type: ignore[no-untyped-call]

    def read_response(self: Connection, *args: Any, **kwargs: Any) -> Any:
        reply = base.read_response(self, *args, **kwargs)
        sink = sinks.active
        if sink is not None and type(reply) is bytes and sink.takes(len(reply)):
            return sink.take(reply)
        return reply

    namespace = {
        "__init__": init,
        "send_packed_command": send_packed_command,
        "read_response": read_response,
    }
    return cast(type[Connection], type(f"Counting{base.__name__}", (base,), namespace))


def make_client(cfg: RedisTierConfig, sinks: Sinks, tally: _Tally | None = None) -> _RedisClient:
    """A client of ``cfg``'s server with the tier's settings: 1 MiB socket reads
    (:data:`SOCKET_READ_BYTES`), zero-copy packing (:data:`_ZERO_COPY_PACKER`), the
    values of the read ``sinks`` holds received straight into its rows, requests
    counted in ``tally``, and the tier's timeouts and retry. The tier's own client, and
    the benchmark's tuned raw loop (:mod:`kvoffload.tools.bench_redis`), so that the
    loop the tier is measured against has the same client settings."""
    tls = cfg.url is not None and cfg.url.startswith("rediss://")
    kwargs: dict[str, Any] = {
        "connection_class": _counting_connection(
            SSLConnection if tls else Connection, tally or _Tally(), sinks
        ),
        "max_connections": cfg.max_connections,
        "socket_timeout": cfg.socket_timeout_ms / 1000,
        "socket_connect_timeout": cfg.connect_timeout_ms / 1000,
        "socket_read_size": SOCKET_READ_BYTES,
        "client_name": f"kvoffload-{cfg.name}",
        "username": cfg.username.get_secret_value() if cfg.username else None,
        "password": cfg.password.get_secret_value() if cfg.password else None,
    }
    # One immediate retry, on connection errors only: enough for a pooled connection
    # a server restart left dead, never a wait (redis-py's default backs off for
    # seconds). A timeout is not retried: the server was slow, it will be again.
    retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
    if cfg.url is not None:
        # A blocking pool: threads beyond max_connections wait for a connection
        # (up to the socket timeout) instead of failing at once.
        pool = BlockingConnectionPool.from_url(
            cfg.url, timeout=cfg.socket_timeout_ms / 1000, retry=retry, **kwargs
        )
        return redis.Redis(connection_pool=pool)
    nodes = [_split_node(n) for n in cfg.nodes or []]
    # Built "from a url" (the first node's) so that redis-py creates each node's pool
    # from connection_class and connection_pool_class; given only startup nodes it
    # would ignore both.
    host, port = nodes[0]
    return RedisCluster(
        url=f"redis://{_url_host(host)}:{port}",
        startup_nodes=[ClusterNode(h, p) for h, p in nodes[1:]],  # type: ignore[no-untyped-call]
        retry=retry,
        connection_pool_class=BlockingConnectionPool,
        timeout=cfg.socket_timeout_ms / 1000,
        **kwargs,
    )


def _describe(exc: BaseException, secrets: Sequence[str]) -> str:
    """``exc`` as one short line with any secret masked. redis-py's messages carry
    host:port but no credentials; the masking is for whatever a server might echo."""
    text = " ".join(str(exc).split()) or "no message"
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}"


def _hint(exc: BaseException) -> str:
    """What an operator can do about the common failures."""
    if isinstance(exc, redis.exceptions.OutOfMemoryError) or str(exc).startswith("OOM"):
        return (
            "; the server is at maxmemory and does not evict: set maxmemory-policy "
            "allkeys-lru (or raise maxmemory)"
        )
    if isinstance(exc, redis.exceptions.ClusterDownError):
        return "; the cluster serves no slot of some keys (a master down with no replica?)"
    if isinstance(exc, redis.exceptions.RedisClusterException):
        return "; no node listed in nodes answered (it is retried on the next batch)"
    if isinstance(exc, redis.exceptions.AuthenticationError | redis.exceptions.NoPermissionError):
        return "; check the tier's username and password"
    if isinstance(exc, redis.exceptions.TimeoutError):
        return "; the server answered slower than socket_timeout_ms"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return (
            "; the server's TLS certificate is not trusted: give its CA in the url "
            "(rediss://host:port/0?ssl_ca_certs=/path/ca.pem)"
        )
    if isinstance(exc, redis.exceptions.ConnectionError):
        return "; the server is unreachable (it is retried on the next batch)"
    return ""


_WRONG_VALUE: Final = ("WRONGTYPE",)
"""Per-key replies that mean "another kind of value is stored here": a foreign value,
so a miss for that block, not a failure of the batch."""

_RedisClient = redis.Redis | RedisCluster


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
        self._secrets = [
            s.get_secret_value() for s in (config.password, config.username) if s is not None
        ]
        self._tally = _Tally()
        self._sinks = Sinks()
        self._lock = threading.Lock()
        """Guards the client's creation and the pack buffer."""
        self._stats_lock = threading.Lock()
        """Guards the counters, apart from ``_lock``: a failure to connect is counted
        while ``_lock`` is held."""
        self._client: _RedisClient | None = None
        self._closed = False
        self._seq = itertools.count(1)
        self.packer = Packer(codec_named(config.compression), layout.itemsize)
        self._buffers = Buffers(self.value_bytes, keep_bytes=_SPARE_PACK_BYTES)
        """Pack buffers (see :data:`_SPARE_PACK_BYTES`)."""
        self._stored = np.zeros(self.num_slots, dtype=np.int64)
        """Payload bytes as stored of what this client last wrote into each slot."""
        self._failing = 0
        self.missing_blocks = 0
        """Blocks asked for that the server did not have (evicted, expired, never
        stored): plain misses, the normal fate of a block in a shared cache."""
        self.corrupt_blocks = 0
        """Values found under our keys that failed verification (served as misses)."""
        self.failed_batches = 0
        """Batches that raised :class:`BackendError` (server or connection errors)."""

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
        return self._tally.value

    def io_counters(self) -> dict[str, int]:
        """The tier's ``round_trips`` (:attr:`round_trips`) and ``server_errors``
        (:attr:`failed_batches`), for the Offloader's stats; two reads, no I/O."""
        return {
            "round_trips": self._tally.value,
            "server_errors": self.failed_batches,
            **self.stored_counters(),
        }

    def codec_stats(self) -> CodecStats:
        return self.packer.stats()

    def redis_key(self, key: bytes) -> bytes:
        """The server-side key of block ``key`` under this tier's prefix and layout."""
        return self._key_head + bytes(key).hex().encode()

    # -- the client ---------------------------------------------------------------
    def _get_client(self) -> _RedisClient:
        """The client, created on first use: a cluster client asks the cluster for its
        slot map when built, and a server that is down at start must be a failed
        batch (retried next time), not an engine that cannot start."""
        client = self._client
        if client is not None:
            return client
        with self._lock:
            if self._closed:
                raise BackendError(f"tier {self.name!r} is closed")
            if self._client is None:
                try:
                    self._client = self._make_client()
                except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                    raise self._failure("connect", 0, exc) from None
                logger.info(
                    "tier %s: redis at %s, key prefix %s, ttl %s, %d connections per server",
                    self.name,
                    self.redis_config.where(),
                    self._key_head.decode(),
                    f"{self.redis_config.ttl_s} s" if self.redis_config.ttl_s else "none",
                    self.redis_config.max_connections,
                )
            return self._client

    def _make_client(self) -> _RedisClient:
        return make_client(self.redis_config, self._sinks, self._tally)

    def _run(
        self, op: str, n: int, queue: Callable[[Any], None], *, wrong_type_ok: bool = False
    ) -> list[Any]:
        """Queue a batch's commands with ``queue(pipeline)``, send them as one pipeline
        and return the replies. Where ``wrong_type_ok``, a per-key ``WRONGTYPE`` reply
        stays in the list (as its exception: a foreign value, which the caller counts
        as such); every other error raises :class:`BackendError`."""
        client = self._get_client()
        try:
            pipe = client.pipeline(transaction=False)
            queue(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise self._failure(op, n, exc) from None
        for reply in replies:
            if isinstance(reply, Exception):
                if (
                    wrong_type_ok
                    and isinstance(reply, redis.exceptions.ResponseError)
                    and str(reply).startswith(_WRONG_VALUE)
                ):
                    continue
                raise self._failure(op, n, reply)
        if self._failing:
            with self._stats_lock:
                failed, self._failing = self._failing, 0
            if failed:
                logger.info(
                    "tier %s: redis at %s answers again after %d failed batches",
                    self.name,
                    self.redis_config.where(),
                    failed,
                )
        return replies

    def _failure(self, op: str, n: int, exc: BaseException) -> BackendError:
        """The one-line error of a failed batch, logged (the first of a run of failures
        at warning level, the rest at debug, as the Offloader counts them all)."""
        with self._stats_lock:
            self.failed_batches += 1
            self._failing += 1
            first = self._failing == 1
        what = f"{op} of {n} blocks" if n else op
        message = (
            f"tier {self.name!r}: redis {what} at {self.redis_config.where()} failed: "
            f"{_describe(exc, self._secrets)}{_hint(exc)}"
        )
        (logger.warning if first else logger.debug)("%s", message)
        return BackendError(message)

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

            self._run("write", len(key_list), queue)
            with self._lock:
                self._stored[list(slots)] = [v - HEADER_BYTES for v in lens]
            self.count_stored(
                len(lens) * self.layout.bytes_per_block, sum(lens) - len(lens) * HEADER_BYTES
            )
        finally:
            self._buffers.release(held)

    def footprint(self) -> tuple[int, int]:
        """Logical and stored payload bytes of what this client wrote into the slots it
        holds: the server may have evicted some since (it keeps the books)."""
        with self._lock:
            held = self._stored[self._stored > 0]
            return len(held) * self.layout.bytes_per_block, int(held.sum())

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
            values = self._run("read", len(key_list), queue, wrong_type_ok=True)
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

        return [bool(r) for r in self._run("lookup", len(key_list), queue)]

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Remove blocks from the server (one pipelined ``UNLINK`` per node, which frees
        big values off the server's main thread); returns how many were there."""
        if not keys:
            return 0
        key_list = [bytes(k) for k in keys]

        def queue(pipe: Any) -> None:
            for key in key_list:
                pipe.unlink(self.redis_key(key))

        return sum(int(r) for r in self._run("delete", len(key_list), queue))

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
                raise self._failure("scan", 0, exc) from None
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
            raise self._failure("info", 0, exc) from None

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
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()


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


def _split_node(node: str) -> tuple[str, int]:
    m = NODE_RE.match(node)
    assert m is not None, "validated by RedisTierConfig"
    return m["host"].strip("[]"), int(m["port"])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host

"""The ``redis`` tier's client: how it connects to a server or cluster, sends, counts
and fails.

:func:`make_client` builds a redis-py client with the tier's settings: 1 MiB socket
reads, values sent from the caller's buffers without copies, a read's replies received
straight into its rows (:mod:`~kvoffload.backends.redis.read`), every request written to
a socket counted, and the tier's timeouts with one immediate retry. The tier's backend
(:mod:`~kvoffload.backends.redis.backend`) and the benchmark's tuned raw loop use it, so
both talk to the server alike. :class:`ServerLink` is the backend's use of it: the
client made on first use (a server down at start is a failed batch, not an engine that
cannot start), each batch sent as one pipeline, and each error of the client or the
server made one logged, counted, credential-free line (:func:`describe_error`,
:func:`error_hint`) raised as :class:`~kvoffload.exceptions.BackendError`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, Final, cast

import redis
import redis.exceptions
from kvoffload.backends.redis.read import Sinks, direct_get_parser
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

from kvoffload.exceptions import BackendError

logger = logging.getLogger(__name__)

SOCKET_READ_BYTES: Final = 1024 * 1024
"""Bytes asked of each ``recv``. redis-py's default (64 KiB) read 2 MiB values at
0.46 GB/s on loopback, 1 MiB at 0.76 GB/s (2026-11-23, this 2-CPU machine); the
buffer is per connection, so ``max_connections`` of them at most."""

_PACK_CUTOFF: Final = 6000
"""redis-py's own cutoff: arguments above it are sent as separate buffers."""

RedisClient = redis.Redis | RedisCluster
"""The client :func:`make_client` returns: of one server, or of a cluster."""


class Tally:
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


def _counting_connection(base: type[Connection], tally: Tally, sinks: Sinks) -> type[Connection]:
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


def make_client(cfg: RedisTierConfig, sinks: Sinks, tally: Tally | None = None) -> RedisClient:
    """A client of ``cfg``'s server with the tier's settings: 1 MiB socket reads
    (:data:`SOCKET_READ_BYTES`), zero-copy packing (:data:`_ZERO_COPY_PACKER`), the
    values of the read ``sinks`` holds received straight into its rows, requests
    counted in ``tally``, and the tier's timeouts and retry. The tier's own client, and
    the benchmark's tuned raw loop (:mod:`kvoffload.tools.bench.redis`), so that the
    loop the tier is measured against has the same client settings."""
    tls = cfg.url is not None and cfg.url.startswith("rediss://")
    kwargs: dict[str, Any] = {
        "connection_class": _counting_connection(
            SSLConnection if tls else Connection, tally or Tally(), sinks
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


def describe_error(exc: BaseException, secrets: Sequence[str]) -> str:
    """``exc`` as one short line with any secret masked. redis-py's messages carry
    host:port but no credentials; the masking is for whatever a server might echo."""
    text = " ".join(str(exc).split()) or "no message"
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    if len(text) > 200:
        text = text[:197] + "..."
    return f"{type(exc).__name__}: {text}"


def error_hint(exc: BaseException) -> str:
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


def _split_node(node: str) -> tuple[str, int]:
    m = NODE_RE.match(node)
    assert m is not None, "validated by RedisTierConfig"
    return m["host"].strip("[]"), int(m["port"])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


_WRONG_VALUE: Final = ("WRONGTYPE",)
"""Per-key replies that mean "another kind of value is stored here": a foreign value,
so a miss for that block, not a failure of the batch."""


class ServerLink:
    """A tier's connection to its server or cluster: the client, made on first use;
    each batch sent as one pipeline; each failure made one line, logged and counted.

    The failures of a run are logged once at warning level (the rest at debug, as the
    Offloader counts them all), and the first batch that succeeds after them says how
    many there were."""

    def __init__(self, config: RedisTierConfig, key_head: bytes, sinks: Sinks) -> None:
        self.config = config
        self.name = config.name
        self._key_head = key_head
        self._secrets = [
            s.get_secret_value() for s in (config.password, config.username) if s is not None
        ]
        self.tally = Tally()
        """Requests written to the server(s), counted at the socket (see
        :func:`make_client`)."""
        self._sinks = sinks
        self._lock = threading.Lock()
        """Guards the client's creation."""
        self._stats_lock = threading.Lock()
        """Guards the counters, apart from ``_lock``: a failure to connect is counted
        while ``_lock`` is held."""
        self._client: RedisClient | None = None
        self._closed = False
        self._failing = 0
        self.failed_batches = 0
        """Batches that raised :class:`BackendError` (server or connection errors)."""

    def client(self) -> RedisClient:
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
                    self._client = make_client(self.config, self._sinks, self.tally)
                except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
                    raise self.failure("connect", 0, exc) from None
                logger.info(
                    "tier %s: redis at %s, key prefix %s, ttl %s, %d connections per server",
                    self.name,
                    self.config.where(),
                    self._key_head.decode(),
                    f"{self.config.ttl_s} s" if self.config.ttl_s else "none",
                    self.config.max_connections,
                )
            return self._client

    def run(
        self, op: str, n: int, queue: Callable[[Any], None], *, wrong_type_ok: bool = False
    ) -> list[Any]:
        """Queue a batch's commands with ``queue(pipeline)``, send them as one pipeline
        and return the replies. Where ``wrong_type_ok``, a per-key ``WRONGTYPE`` reply
        stays in the list (as its exception: a foreign value, which the caller counts
        as such); every other error raises :class:`BackendError`."""
        client = self.client()
        try:
            pipe = client.pipeline(transaction=False)
            queue(pipe)
            replies: list[Any] = pipe.execute(raise_on_error=False)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            raise self.failure(op, n, exc) from None
        for reply in replies:
            if isinstance(reply, Exception):
                if (
                    wrong_type_ok
                    and isinstance(reply, redis.exceptions.ResponseError)
                    and str(reply).startswith(_WRONG_VALUE)
                ):
                    continue
                raise self.failure(op, n, reply)
        if self._failing:
            with self._stats_lock:
                failed, self._failing = self._failing, 0
            if failed:
                logger.info(
                    "tier %s: redis at %s answers again after %d failed batches",
                    self.name,
                    self.config.where(),
                    failed,
                )
        return replies

    def failure(self, op: str, n: int, exc: BaseException) -> BackendError:
        """The one-line error of a failed batch, logged (the first of a run of failures
        at warning level, the rest at debug, as the Offloader counts them all)."""
        with self._stats_lock:
            self.failed_batches += 1
            self._failing += 1
            first = self._failing == 1
        what = f"{op} of {n} blocks" if n else op
        message = (
            f"tier {self.name!r}: redis {what} at {self.config.where()} failed: "
            f"{describe_error(exc, self._secrets)}{error_hint(exc)}"
        )
        (logger.warning if first else logger.debug)("%s", message)
        return BackendError(message)

    def close(self) -> None:
        """Close the connections. Idempotent; the link is unusable afterwards."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
        if client is not None:
            client.close()

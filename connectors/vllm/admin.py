"""The operator endpoint: ``/health``, ``/ready``, ``/tiers`` and ``/query`` over HTTP.

Opt-in (``admin_port`` in kvoffload's config; docs/operator.md). The tiers live in
each rank's worker process (docs/architecture.md, "Where the parts run"), so the
endpoint does too: the worker of rank ``r`` serves its own tiers on ``admin_port +
r``, bound to ``admin_host`` (the loopback interface by default: it has no
authentication). A rank that keeps no tiers (MLA's ranks above 0) serves nothing.

It runs on threads of its own: the stdlib's :class:`ThreadingHTTPServer`, one thread
per connection. Nothing it does waits on the engine's step, and the engine never
waits on it: it reads the Offloader's books (short transactions under their lock,
:mod:`.tierview`), and the readiness canary runs on a thread per tier, bounded by
``admin_ready_timeout_ms`` (:mod:`.canary`), so a frozen tier makes ``/ready`` answer
503 in time instead of hanging a probe.

- ``GET /health``: 200 ``{"status": "alive"}`` while the process serves HTTP;
- ``GET /ready``: 200 when a canary block was stored, loaded and verified on every
  tier within the deadline, else 503; the body names each tier's result;
- ``GET /tiers``: per tier, blocks and bytes held, hit rate, breaker, errors, and
  every counter;
- ``POST /query`` (and ``/query_by_hash``): :mod:`.query`.

A bad request gets a 4xx with one line of plain text naming what was wrong (404 for
an unknown path, 405 for a known one with another method, 400 for a bad body).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Final

from kvoffload.config import KVOffloadConfig
from kvoffload.exceptions import ConfigError
from kvoffload.keys import generation_keys
from kvoffload.lookup import VllmHashing

from .canary import Canary
from .query import BadRequestError, answer, parse
from .tierview import BooksView, tiers_report

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .shared import Shared

logger = logging.getLogger(__name__)

MAX_BODY: Final = 8 << 20
"""Largest ``/query`` body read (8 MiB: about a million token ids as JSON)."""

ROUTES: Final = {
    "/health": "GET",
    "/ready": "GET",
    "/tiers": "GET",
    "/query": "POST",
    "/query_by_hash": "POST",
}


@dataclass(frozen=True)
class AdminSpec:
    """What the endpoint needs from the engine's config, read once at start."""

    port: int
    host: str
    ready_timeout_s: float
    engine_id: str
    block_size: int
    dp_rank: int
    hashing: VllmHashing | str
    """vLLM's hashing of token ids, or why it cannot be rebuilt here (``/query`` then
    takes block hashes only)."""


def admin_spec(
    config: KVOffloadConfig, vllm_config: VllmConfig, engine_id: str
) -> AdminSpec | None:
    """The endpoint's settings, ``None`` when ``admin_port`` is unset. Token ids are
    hashed as the engine hashes them: its ``block_size``, ``prefix_caching_hash_algo``
    and ``PYTHONHASHSEED`` (every process of one engine has the same environment)."""
    if config.admin_port is None:
        return None
    cache = vllm_config.cache_config
    algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
    hashing: VllmHashing | str
    try:
        hashing = VllmHashing(cache.block_size, algo, os.environ.get("PYTHONHASHSEED"))
    except ConfigError as exc:
        hashing = f"this engine's block hashes cannot be rebuilt here ({exc}); send block_hashes"
    return AdminSpec(
        port=config.admin_port,
        host=config.admin_host,
        ready_timeout_s=config.admin_ready_timeout_ms / 1e3,
        engine_id=engine_id,
        block_size=cache.block_size,
        dp_rank=int(getattr(vllm_config.parallel_config, "data_parallel_rank", 0) or 0),
        hashing=hashing,
    )


class AdminServer:
    """The endpoint of one rank's worker side (see the module docstring); serving once
    built, until :meth:`close`."""

    def __init__(self, shared: Shared, spec: AdminSpec, rank: int) -> None:
        self.shared = shared
        self.spec = spec
        self.rank = rank
        self.view = BooksView(shared.offloader)
        self.canary = Canary(shared.offloader, shared.namespace)
        port = spec.port + rank
        if port > 65535:
            raise ConfigError(
                f"admin_port = {spec.port}: rank {rank} would serve on {port}, past 65535; "
                "give a lower admin_port (each rank serves on admin_port + rank)"
            )
        try:
            self.httpd = ThreadingHTTPServer((spec.host, port), _handler(self))
        except OSError as exc:
            raise ConfigError(
                f"admin_port = {spec.port}: rank {rank} cannot listen on "
                f"{spec.host}:{port} ({exc.strerror or exc}); give a free admin_port "
                "(each rank serves on admin_port + rank) or unset it"
            ) from None
        self.httpd.daemon_threads = True
        self.address: tuple[str, int] = self.httpd.server_address[:2]  # type: ignore[assignment]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, name=f"kvoffload-admin-{rank}", daemon=True
        )
        self._thread.start()
        logger.info(
            "kvoffload: operator endpoint of rank %d on http://%s:%d (/health /ready /tiers "
            "/query)",
            rank,
            self.address[0],
            self.address[1],
        )

    def close(self) -> None:
        """Stop serving (idempotent). A canary round still running finishes on its own
        thread; the tiers are closed by the worker side after this."""
        if self._thread.is_alive():
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    # The routes: each returns (status, JSON body).
    def health(self) -> tuple[int, dict[str, Any]]:
        return 200, {"status": "alive", "engine_id": self.spec.engine_id, "rank": self.rank}

    def ready(self) -> tuple[int, dict[str, Any]]:
        tiers = self.canary.probe(self.spec.ready_timeout_s)
        failing = [t["name"] for t in tiers if not t["ok"]]
        body = {
            "ready": not failing,
            "failing": failing,
            "tiers": tiers,
            "engine_id": self.spec.engine_id,
            "rank": self.rank,
        }
        return (503 if failing else 200), body

    def tiers(self) -> tuple[int, dict[str, Any]]:
        off = self.shared.offloader
        return 200, {
            "engine_id": self.spec.engine_id,
            "rank": self.rank,
            "block_bytes": off.bpb,
            "tiers": tiers_report(off, self.view),
        }

    def query(self, body: Any, *, by_hash: bool) -> tuple[int, dict[str, Any]]:
        spec = self.spec
        hashes = parse(body, block_size=spec.block_size, hashing=spec.hashing, by_hash=by_hash)
        found = answer(
            self.shared.offloader,
            self.view,
            hashes,
            lambda keys: self.shared.ns(generation_keys(keys, self.shared.generation)),
            instance=spec.engine_id,
            dp_rank=spec.dp_rank,
            block_size=spec.block_size,
        )
        return 200, found


def _handler(admin: AdminServer) -> type[BaseHTTPRequestHandler]:
    """The request handler class bound to ``admin``."""

    class Handler(BaseHTTPRequestHandler):
        server_version = "kvoffload-admin"
        # HTTP/1.0 (the default): one request per connection, so a refused request's
        # unread body never reads as the next request.

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def _serve(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            allowed = ROUTES.get(path)
            try:
                if allowed is None:
                    raise _RefusedError(404, f"{path}: no such endpoint; try {', '.join(ROUTES)}")
                if method != allowed:
                    raise _RefusedError(405, f"{method} {path}: use {allowed}")
                if path == "/health":
                    status, body = admin.health()
                elif path == "/ready":
                    status, body = admin.ready()
                elif path == "/tiers":
                    status, body = admin.tiers()
                else:
                    status, body = admin.query(self._json(), by_hash=path == "/query_by_hash")
            except BadRequestError as exc:
                self._send(400, str(exc))
            except _RefusedError as exc:
                self._send(exc.status, exc.line)
            except Exception:  # the boundary: the engine goes on, the client hears 500
                logger.exception("kvoffload: operator endpoint: %s %s failed", method, path)
                self._send(500, f"{method} {path}: internal error (see the engine's log)")
            else:
                self._send(status, body)

        def _json(self) -> Any:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise _RefusedError(411, f"Content-Length = {length!r}: send the body's length")
            if int(length) > MAX_BODY:
                raise _RefusedError(413, f"Content-Length = {length}: at most {MAX_BODY} bytes")
            raw = self.rfile.read(int(length))
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequestError(f"body: not JSON ({exc}); send a JSON object") from None

        def _send(self, status: int, body: dict[str, Any] | str) -> None:
            if isinstance(body, str):
                data, kind = (body + "\n").encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(body).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("kvoffload: operator endpoint: %s", format % args)

    return Handler


class _RefusedError(Exception):
    """A request refused with ``status`` and one line."""

    def __init__(self, status: int, line: str) -> None:
        super().__init__(line)
        self.status = status
        self.line = line

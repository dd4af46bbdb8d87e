"""Real ``redis-server`` processes for the Redis tier's tests (imported, not collected).

Each server runs on a free loopback port in its own temporary directory, with no
persistence (``--save '' --appendonly no``), and is killed when its test or session
ends; under Linux it also dies with the test process (``PR_SET_PDEATHSIG``), so a
crashed run leaves no server behind. A cluster is three masters joined with
``redis-cli --cluster create``, exactly as an operator makes one.

:class:`TurnProxy` sits between a client and a server and counts the client's request
turns on the wire, so a test can check a round-trip count without trusting the
client's own. No mock anywhere: without ``redis-server`` the tests skip (and fail
under ``CI=true``, see ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import pytest
import redis

REDIS_SERVER: Final = shutil.which("redis-server")
REDIS_CLI: Final = shutil.which("redis-cli")
START_TIMEOUT_S: Final = 10.0


def require_redis() -> None:
    """Skip the calling test unless the server and ``redis-cli`` are installed."""
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip(
            "redis-server/redis-cli not installed (Debian package redis-server; "
            ".ci/run installs it)"
        )


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies (Linux only)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def free_port(*, bus: bool = False) -> int:
    """A loopback port nobody listens on; with ``bus``, ``port + 10000`` is free too
    (a cluster node's bus port)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port")


@dataclass(frozen=True)
class TlsFiles:
    """A test CA and a certificate it signed for 127.0.0.1, as PEM files."""

    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A fresh CA and a server certificate for IP 127.0.0.1 under ``directory``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key: Any, issuer: str, signer: Any, *, ca: bool) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = cert("kvoffload test CA", ca_key, "kvoffload test CA", ca_key, ca=True)
    key = ec.generate_private_key(ec.SECP256R1())
    server = cert("127.0.0.1", key, "kvoffload test CA", ca_key, ca=False)
    files = TlsFiles(directory / "ca.pem", directory / "server.pem", directory / "server.key")
    files.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    files.cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    files.key.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    return files


@dataclass
class RedisServer:
    """One ``redis-server`` process; :meth:`start` again after :meth:`kill` reuses its
    port, as a restarted server would."""

    workdir: Path
    maxmemory: str = "256mb"
    policy: str = "allkeys-lru"
    password: str | None = None
    cluster: bool = False
    announce_port: int | None = None
    """Cluster only: the port to advertise to clients (a proxy in front of this node)."""
    port: int = 0
    tls: TlsFiles | None = None
    """Serve TLS only (``--tls-port``; the plain port is off), with these files."""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _stats: redis.Redis | None = field(default=None, repr=False)

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(5):
            fresh = self.port == 0
            if fresh:
                self.port = free_port(bus=self.cluster)
            try:
                self._spawn()
                return self
            except _PortTakenError:
                # Another process took the port between free_port() and the bind.
                if not fresh or attempt == 4:
                    raise
                self.port = 0
        raise AssertionError("unreachable")

    def _spawn(self) -> None:
        assert REDIS_SERVER is not None
        listen = ["--port", str(self.port)]
        if self.tls is not None:
            listen = [
                "--port", "0",
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.cert),
                "--tls-key-file", str(self.tls.key),
                "--tls-ca-cert-file", str(self.tls.ca),
                "--tls-auth-clients", "no",
            ]  # fmt: skip
        args = [
            REDIS_SERVER,
            *listen,
            "--bind", "127.0.0.1",
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", self.policy,
            "--enable-debug-command", "local",
            "--logfile", "redis.log",
        ]  # fmt: skip
        if self.password is not None:
            args += ["--requirepass", self.password]
        if self.cluster:
            args += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", f"nodes-{self.port}.conf",
                "--cluster-node-timeout", "3000",
            ]  # fmt: skip
            if self.announce_port is not None:
                args += [
                    "--cluster-announce-ip", "127.0.0.1",
                    "--cluster-announce-port", str(self.announce_port),
                    "--cluster-announce-bus-port", str(self.port + 10000),
                ]  # fmt: skip
        log = self.workdir / "redis.log"
        log.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            args,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                text = log.read_text(errors="replace") if log.exists() else ""
                if "Address already in use" in text:
                    raise _PortTakenError(text)
                raise RuntimeError(f"redis-server on port {self.port} exited: {text[-2000:]}")
            with contextlib.suppress(redis.exceptions.RedisError):
                if self.client().ping():
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING")
            time.sleep(0.02)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def url(self, *, with_password: bool = False) -> str:
        auth = f":{self.password}@" if with_password and self.password else ""
        if self.tls is not None:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls.ca}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain client straight to this server (not through any proxy)."""
        tls: dict[str, Any] = {}
        if self.tls is not None:
            tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca)}
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **tls
        )

    def info(self, section: str) -> dict[str, Any]:
        with self.client() as c:
            return c.info(section)  # type: ignore[no-any-return]

    def calls(self) -> dict[str, int]:
        """``INFO commandstats``: command name -> calls served so far. Asked on one
        connection kept open, so that between two snapshots the only commands of ours
        are the ``info`` calls (a new connection would add its handshake)."""
        if self._stats is None:
            self._stats = redis.Redis(
                host="127.0.0.1",
                port=self.port,
                password=self.password,
                socket_timeout=5,
                single_connection_client=True,
            )
        return {
            name.removeprefix("cmdstat_"): int(stats["calls"])
            for name, stats in self._stats.info("commandstats").items()
        }

    def kill(self) -> None:
        """SIGKILL, as a crash would; nothing is saved."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None
        if self._stats is not None:
            self._stats.close()
            self._stats = None


class _PortTakenError(RuntimeError):
    pass


def diff_calls(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands served between two :meth:`RedisServer.calls` snapshots (the ``info``
    commands of the snapshots themselves left out)."""
    out = {k: v - before.get(k, 0) for k, v in after.items()}
    out.pop("info", None)
    return {k: v for k, v in out.items() if v}


@dataclass
class RedisClusterProcs:
    """Three masters (no replicas) behind one :class:`TurnProxy` each, which is what
    they advertise to clients: all client traffic, redirections included, can be
    counted on the wire, while the nodes talk to each other directly."""

    workdir: Path
    maxmemory: str = "256mb"
    servers: list[RedisServer] = field(default_factory=list)
    proxies: list[TurnProxy] = field(default_factory=list)

    def start(self, masters: int = 3) -> RedisClusterProcs:
        assert REDIS_CLI is not None
        for i in range(masters):
            port = free_port(bus=True)
            proxy = TurnProxy(port)
            self.proxies.append(proxy)
            server = RedisServer(
                self.workdir / f"node{i}",
                maxmemory=self.maxmemory,
                cluster=True,
                announce_port=proxy.port,
                port=port,
            )
            self.servers.append(server.start())
        addresses = [s.address for s in self.servers]
        create = [REDIS_CLI, "--cluster", "create", *addresses, "--cluster-replicas", "0"]
        subprocess.run(
            [*create, "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every node reports ``cluster_state:ok``, knows every master and has
        the same slot map as the others (after a reshard, nodes not involved learn the
        new owners by gossip, a little later)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states, maps = [], []
            for s in self.servers:
                with s.client() as c:
                    info = c.cluster("INFO")
                    slots = c.execute_command("CLUSTER", "SLOTS")
                states.append(
                    info.get("cluster_state") == "ok"
                    and int(info.get("cluster_known_nodes", 0)) == len(self.servers)
                    and int(info.get("cluster_slots_ok", 0)) == 16384
                )
                # [[start, end, [ip, port, id, ...], ...], ...] -> (start, end, master id)
                maps.append(sorted((r[0], r[1], r[2][2]) for r in slots))
            if all(states) and all(m == maps[0] for m in maps):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok after {timeout_s} s: {states}")
            time.sleep(0.05)

    @property
    def nodes(self) -> list[str]:
        """What a client is configured with: the advertised (proxy) addresses."""
        return [f"127.0.0.1:{p.port}" for p in self.proxies]

    def node_id(self, i: int) -> str:
        with self.servers[i].client() as c:
            myid = c.cluster("MYID")
        return myid.decode() if isinstance(myid, bytes) else str(myid)

    def reshard(self, src: int, dst: int, slots: int) -> None:
        """Move ``slots`` hash slots, keys included, from master ``src`` to ``dst``
        with ``redis-cli --cluster reshard``, as an operator rebalancing would."""
        assert REDIS_CLI is not None
        move = ["--cluster-from", self.node_id(src), "--cluster-to", self.node_id(dst)]
        subprocess.run(
            [REDIS_CLI, "--cluster", "reshard", self.servers[src].address, *move,
             "--cluster-slots", str(slots), "--cluster-yes"],
            check=True,
            capture_output=True,
            timeout=60,
        )  # fmt: skip
        self.wait_ok()

    def stop(self) -> None:
        for s in self.servers:
            s.kill()
        for p in self.proxies:
            p.close()


class TurnProxy:
    """A loopback TCP proxy to ``127.0.0.1:upstream`` that counts request turns.

    A turn is a burst of client bytes that follows a reply. To tell a pipeline (one
    burst, then all replies) from a client that waits for each reply, replies are held
    back while :attr:`quiet_s` > 0 until the client has sent nothing for that long:
    a server answering the first commands of a large pipelined write while the rest
    is still arriving is then not mistaken for the end of a turn. With ``quiet_s = 0``
    (the default) bytes pass straight through and :attr:`turns` means nothing.
    """

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.quiet_s = 0.0
        self.turns = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"turnproxy-{upstream}")
        self._thread.daemon = True
        self._thread.start()

    @contextlib.contextmanager
    def counting(self, quiet_s: float = 0.03) -> Iterator[None]:
        """Count turns from zero inside the block."""
        self.turns, self.quiet_s = 0, quiet_s
        try:
            yield
        finally:
            self.quiet_s = 0.0

    def _loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        pairs: list[_Pair] = []
        while not self._stop.is_set():
            pending = any(p.to_client or p.to_server for p in pairs)
            for key, _ in sel.select(timeout=0.001 if pending else 0.02):
                if key.data is None:
                    self._accept(sel, pairs)
                    continue
                pair, from_client = key.data
                sock = pair.client if from_client else pair.server
                try:
                    data = sock.recv(1 << 20)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    pair.close(sel)
                    pairs.remove(pair)
                    continue
                if from_client:
                    if pair.answered:
                        self.turns += 1
                        pair.answered = False
                    pair.last_client = time.monotonic()
                    pair.to_server += data
                else:
                    pair.to_client += data
            for pair in list(pairs):
                try:
                    self._flush(pair)
                except OSError:
                    pair.close(sel)
                    pairs.remove(pair)
        for pair in pairs:
            pair.close(sel)
        sel.close()

    def _accept(self, sel: selectors.BaseSelector, pairs: list[_Pair]) -> None:
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        try:
            server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            client.close()
            return
        for s in (client, server):
            s.setblocking(False)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(client, server)
        sel.register(client, selectors.EVENT_READ, (pair, True))
        sel.register(server, selectors.EVENT_READ, (pair, False))
        pairs.append(pair)

    def _flush(self, pair: _Pair) -> None:
        if pair.to_server:
            sent = _send_some(pair.server, pair.to_server)
            del pair.to_server[:sent]
        release = self.quiet_s <= 0 or time.monotonic() - pair.last_client >= self.quiet_s
        if pair.to_client and release:
            sent = _send_some(pair.client, pair.to_client)
            del pair.to_client[:sent]
            if sent:
                pair.answered = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()


def _send_some(sock: socket.socket, buf: bytearray) -> int:
    try:
        return sock.send(buf)
    except (BlockingIOError, InterruptedError):
        return 0


@dataclass(eq=False)
class _Pair:
    client: socket.socket
    server: socket.socket
    to_client: bytearray = field(default_factory=bytearray)
    to_server: bytearray = field(default_factory=bytearray)
    answered: bool = True
    last_client: float = 0.0

    def close(self, sel: selectors.BaseSelector) -> None:
        for s in (self.client, self.server):
            with contextlib.suppress(KeyError, ValueError):
                sel.unregister(s)
            s.close()

"""The ``redis`` backend against real servers: the contract, then what a shared remote
tier must do.

Everything runs on real ``redis-server`` processes (``redisserver.py``): one
standalone server and one 3-master cluster for the session, plus servers of a test's
own where the test kills, blocks or fills them. Round trips are counted twice: by the
backend (:attr:`RedisBackend.round_trips`) and on the wire, by a proxy in front of
every server (:class:`redisserver.TurnProxy`); commands per node come from the
server's ``INFO commandstats``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.retry
import torch
from kvoffload.backends.redis import RedisBackend, RedisTierConfig
from pydantic import SecretStr, ValidationError
from redis.cluster import ClusterNode, RedisCluster
from support.redisserver import (
    RedisClusterProcs,
    RedisServer,
    TurnProxy,
    diff_calls,
    free_port,
    make_tls_files,
    require_redis,
)
from support.waiting import returns, wait_until

from kvoffload.config import CPUTierConfig
from kvoffload.exceptions import BackendError, ConfigError
from kvoffload.keys import BlockKey, namespaced
from kvoffload.layout import KVLayout
from kvoffload.record import HEADER_BYTES
from kvoffload.testing import BackendContract, BackendFactory

# 1 KiB blocks: small enough to be fast, big enough to be a real payload.
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype="bfloat16")
# 16 KiB blocks, to fill a small server quickly.
MID = KVLayout(num_layers=4, num_kv_heads=4, head_dim=32, block_size=8, dtype="bfloat16")
SECRET = "s3cr3t-Pa55"
_prefixes = itertools.count()


def _keys(n: int, salt: int = 0) -> list[BlockKey]:
    return [namespaced(b"redis-%d" % salt, i.to_bytes(4, "little")) for i in range(n)]


def _payload(n: int, seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, layout.bytes_per_block), dtype=torch.uint8, generator=gen)


def _read(be: RedisBackend, keys: list[BlockKey]) -> tuple[list[bool], torch.Tensor]:
    out = torch.zeros((len(keys), be.layout.bytes_per_block), dtype=torch.uint8)
    return be.read(range(len(keys)), keys, out), out


def _write(be: RedisBackend, keys: list[BlockKey], data: torch.Tensor) -> None:
    be.write(list(range(len(keys))), keys, data)


# -- servers ------------------------------------------------------------------------


@dataclass
class Deployment:
    """A server or cluster as the tests reach it: the settings a tier names it by, its
    processes (for commandstats) and the proxies in front of them (for turns)."""

    name: str
    settings: dict[str, Any]
    servers: list[RedisServer]
    proxies: list[TurnProxy]
    procs: RedisClusterProcs | None = None

    def raw(self) -> redis.Redis | RedisCluster:
        """A plain redis-py client, to look at or tamper with what the tier stored."""
        if self.name == "standalone":
            return self.servers[0].client()
        nodes = [ClusterNode("127.0.0.1", p.port) for p in self.proxies]  # type: ignore[no-untyped-call]
        return RedisCluster(startup_nodes=nodes, socket_timeout=5)


@pytest.fixture(scope="session")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("redis-standalone")).start()
    proxy = TurnProxy(server.port)
    yield Deployment("standalone", {"url": f"redis://127.0.0.1:{proxy.port}/0"}, [server], [proxy])
    proxy.close()
    server.kill()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    require_redis()
    procs = RedisClusterProcs(tmp_path_factory.mktemp("redis-cluster")).start()
    yield Deployment("cluster", {"nodes": procs.nodes}, procs.servers, procs.proxies, procs)
    procs.stop()


@pytest.fixture(params=["standalone", "cluster"])
def deployment(request: pytest.FixtureRequest) -> Deployment:
    return request.getfixturevalue(request.param)  # type: ignore[no-any-return]


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """``own_server(**settings)``: a started server for this test alone, which it may
    kill, restart or fill; killed at teardown."""
    require_redis()
    servers: list[RedisServer] = []

    def start(**settings: Any) -> RedisServer:
        server = RedisServer(tmp_path / f"server{len(servers)}", **settings)
        servers.append(server)
        return server.start()

    yield start
    for server in servers:
        server.kill()


@pytest.fixture
def make() -> Iterator[Callable[..., RedisBackend]]:
    """``make(layout=..., num_slots=..., **tier settings)``: a backend with a key prefix
    of its own, closed after the test."""
    made: list[RedisBackend] = []

    def build(layout: KVLayout = LAYOUT, num_slots: int = 4096, **settings: Any) -> RedisBackend:
        settings.setdefault("key_prefix", f"t{next(_prefixes)}")
        config = RedisTierConfig(
            name="remote", capacity=num_slots * RedisBackend.slot_bytes(layout), **settings
        )
        be = RedisBackend(config, layout)
        made.append(be)
        return be

    yield build
    for be in made:
        be.close()


# -- the contract ---------------------------------------------------------------------


class TestRedisContract(BackendContract):
    @pytest.fixture
    def backend_factory(
        self, deployment: Deployment, make: Callable[..., RedisBackend]
    ) -> BackendFactory:
        return lambda layout, num_slots: make(layout, num_slots, **deployment.settings)


class TestRedisContractCompressed(BackendContract):
    """On a standalone server only: compression is the client's, the same on a cluster."""

    @pytest.fixture
    def backend_factory(
        self, standalone: Deployment, make: Callable[..., RedisBackend]
    ) -> BackendFactory:
        return lambda layout, num_slots: make(
            layout, num_slots, compression="zstd", **standalone.settings
        )


# -- data ---------------------------------------------------------------------------


def test_big_blocks_round_trip_bit_exact(
    deployment: Deployment, make: Callable[..., RedisBackend]
) -> None:
    """256 KiB blocks (values far past redis-py's packing cutoff, sent as views of the
    pack buffer), read into a strided destination."""
    big = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=32)
    assert big.bytes_per_block == 256 * 1024
    be = make(big, **deployment.settings)
    keys, data = _keys(12, salt=1), _payload(12, seed=1, layout=big)
    _write(be, keys, data)
    wide = torch.zeros((12, 2 * big.bytes_per_block), dtype=torch.uint8)
    dst = wide[:, 1 : 1 + big.bytes_per_block]
    assert be.read(list(range(12)), keys[::-1], dst) == [True] * 12
    assert torch.equal(dst, data.flip(0))


def test_tls_server_round_trip_and_an_untrusted_one_is_a_one_line_error(
    own_server: Callable[..., RedisServer], make: Callable[..., RedisBackend], tmp_path: Path
) -> None:
    """A server that speaks only TLS, reached by ``rediss://`` with the CA given as a
    query option (passed through to redis-py): 256 KiB blocks round-trip bit-exact
    through the read path that receives straight into the rows (a TLS record is at
    most 16 KiB, so every payload arrives in many pieces). Without the CA the
    certificate is refused: a one-line error that names the tier, never a hang."""
    tls = make_tls_files(tmp_path / "tls")
    server = own_server(password=SECRET, tls=tls)
    big = KVLayout(num_layers=2, num_kv_heads=8, head_dim=128, block_size=32)
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tls.ca}"
    be = make(big, url=url, password=SECRET)
    keys, data = _keys(8, salt=21), _payload(8, seed=21, layout=big)
    _write(be, keys, data)
    valid, out = _read(be, keys[::-1])
    assert valid == [True] * 8
    assert torch.equal(out, data.flip(0))
    assert be.exists(keys) == [True] * 8
    with server.client() as raw:  # what is on the server is the tier's own value
        stored = raw.get(be.redis_key(keys[0]))
    assert isinstance(stored, bytes)
    assert len(stored) == be.value_bytes

    untrusted = make(big, url=f"rediss://127.0.0.1:{server.port}/0", password=SECRET)
    with pytest.raises(BackendError) as err:
        _read(untrusted, keys)
    message = str(err.value)
    assert "\n" not in message
    assert "remote" in message
    assert "certificate is not trusted" in message
    assert "ssl_ca_certs" in message
    assert SECRET not in message


def test_batch_of_256_is_one_round_trip_per_node(
    deployment: Deployment, make: Callable[..., RedisBackend]
) -> None:
    """Write, read, lookup and delete of 256 blocks: one request per node, counted by
    the backend and, independently, on the wire; each node serves its keys' commands
    and nothing else."""
    be = make(**deployment.settings)
    keys, data = _keys(256, salt=2), _payload(256, seed=2)
    # Warm up: open a connection to every node and learn the cluster's slot map.
    warm = _keys(256, salt=3)
    _write(be, warm, data)
    assert _read(be, warm)[0] == [True] * 256
    nodes = len(deployment.servers)

    def measured(op: Callable[[], Any], command: str) -> Any:
        before_calls = [s.calls() for s in deployment.servers]
        before = be.round_trips
        with contextlib.ExitStack() as stack:
            for proxy in deployment.proxies:
                stack.enter_context(proxy.counting())
            result = op()
            turns = [p.turns for p in deployment.proxies]
        assert be.round_trips - before == nodes, command
        assert turns == [1] * nodes, command
        served = [
            diff_calls(b, s.calls()) for b, s in zip(before_calls, deployment.servers, strict=True)
        ]
        assert all(set(d) == {command} for d in served), served
        assert sum(d[command] for d in served) == 256
        return result

    measured(lambda: _write(be, keys, data), "set")
    valid, out = measured(lambda: _read(be, keys), "get")
    assert valid == [True] * 256
    assert torch.equal(out, data)
    assert measured(lambda: be.exists(keys), "exists") == [True] * 256
    assert measured(lambda: be.delete(keys), "unlink") == 256
    assert be.exists(keys) == [False] * 256


def test_values_that_fail_verification_are_misses(
    deployment: Deployment, make: Callable[..., RedisBackend]
) -> None:
    """Whatever sits under our keys is verified: garbage, a flipped payload or header
    byte, a truncated value, another block's value, another layout's value of the
    same size, another type of value. Each is a miss, the intact blocks still load."""
    be = make(**deployment.settings)
    other = make(
        dataclasses.replace(LAYOUT, namespace="tp1"),
        key_prefix=be.redis_config.key_prefix,
        **deployment.settings,
    )
    keys, data = _keys(10, salt=4), _payload(10, seed=4)
    _write(be, keys, data)
    _write(other, keys[5:6], data[5:6])
    raw = deployment.raw()
    rk = [be.redis_key(k) for k in keys]
    value: dict[int, bytes] = {}
    for i in range(10):
        stored = raw.get(rk[i])
        assert isinstance(stored, bytes)
        assert len(stored) == be.value_bytes
        value[i] = stored
    foreign = raw.get(other.redis_key(keys[5]))
    assert isinstance(foreign, bytes)

    def flip(v: bytes, at: int) -> bytes:
        return v[:at] + bytes([v[at] ^ 0x01]) + v[at + 1 :]

    raw.set(rk[0], b"not a kv block")
    raw.set(rk[1], flip(value[1], HEADER_BYTES + 100))  # payload: checksum mismatch
    raw.set(rk[2], flip(value[2], 24))  # header (wtime): header CRC mismatch
    raw.set(rk[3], value[4])  # another block's intact value
    raw.set(rk[4], value[4][:-1])  # cut short
    raw.set(rk[5], foreign)  # same key, another layout (TP rank)
    raw.delete(rk[6])
    raw.rpush(rk[6], b"x")  # another type: WRONGTYPE for GET
    raw.set(rk[7], value[7] + b"tail")  # too long
    valid, out = _read(be, keys)
    assert valid == [False] * 8 + [True] * 2
    assert torch.equal(out[8:], data[8:])
    assert be.corrupt_blocks == 8
    assert be.missing_blocks == 0
    # A lookup sees presence only; the load is what verifies.
    assert be.exists(keys) == [True] * 10
    raw.close()


def test_layouts_never_mix(deployment: Deployment, make: Callable[..., RedisBackend]) -> None:
    """Same server, same prefix, same block keys: another TP rank or model sees none of
    these blocks, because the key carries the layout fingerprint."""
    rank0 = make(dataclasses.replace(LAYOUT, namespace="m:tp0"), **deployment.settings)
    prefix = rank0.redis_config.key_prefix
    rank1 = make(
        dataclasses.replace(LAYOUT, namespace="m:tp1"),
        key_prefix=prefix,
        **deployment.settings,
    )
    keys, data = _keys(8, salt=5), _payload(8, seed=5)
    _write(rank0, keys, data)
    assert rank0.redis_key(keys[0]) != rank1.redis_key(keys[0])
    assert rank0.redis_key(keys[0]).startswith(
        f"{prefix}:{rank0.layout.fingerprint.hex()}:".encode()
    )
    assert rank1.exists(keys) == [False] * 8
    assert _read(rank1, keys)[0] == [False] * 8
    assert rank1.missing_blocks == 8
    assert _read(rank0, keys)[0] == [True] * 8


def test_scan_lists_this_layouts_keys_on_every_master(
    deployment: Deployment, make: Callable[..., RedisBackend]
) -> None:
    """What ``kvoffload inspect`` and ``verify`` list: every key of this prefix and
    layout, from each master of a cluster, in batches; nothing of another layout, and
    no name under the pattern that is not a block key."""
    be = make(**deployment.settings)
    other = make(MID, key_prefix=be.redis_config.key_prefix, **deployment.settings)
    keys = _keys(150, salt=11)
    _write(be, keys, _payload(150, seed=11))
    _write(other, keys[:5], torch.zeros((5, MID.bytes_per_block), dtype=torch.uint8))
    with deployment.raw() as raw:
        raw.set(be.redis_key(b"") + b"not-hex", b"x")
    batches = list(be.scan(batch=64))
    assert all(0 < len(b) <= 64 for b in batches)
    found = [k for b in batches for k in b]
    assert sorted(found) == sorted(keys)
    info = be.server_info()
    assert info["nodes"] == len(deployment.servers)
    assert info["maxmemory_policy"] == "allkeys-lru"
    assert info["used_memory"] > 150 * LAYOUT.bytes_per_block
    assert info["key_prefix"] == be.redis_config.key_prefix
    assert be.stats().counters["round_trips"] == be.round_trips


def test_ttl_is_honoured(standalone: Deployment, make: Callable[..., RedisBackend]) -> None:
    """Values carry the tier's ``ttl_s`` and read as misses once it has passed; without
    it they stay. (Whether a 1 s TTL has passed by a given check is up to the machine's
    speed: only an hour's TTL is checked as still running.)"""
    short = make(ttl_s=1, **standalone.settings)
    hour = make(ttl_s=3600, **standalone.settings)
    forever = make(**standalone.settings)
    keys, data = _keys(4, salt=6), _payload(4, seed=6)
    for be in (short, hour, forever):
        _write(be, keys, data)
    raw = standalone.raw()
    ttl = raw.pttl(short.redis_key(keys[0]))
    assert ttl == -2 or 0 < ttl <= 1000, ttl  # -2: expired already
    assert 1000 < raw.pttl(hour.redis_key(keys[0])) <= 3_600_000
    assert raw.ttl(forever.redis_key(keys[0])) == -1  # no ttl_s: only eviction removes it
    assert _read(hour, keys)[0] == [True] * 4
    wait_until(lambda: not any(short.exists(keys)), "the 1 s TTL's values expired", poll=0.05)
    assert _read(short, keys)[0] == [False] * 4
    assert _read(hour, keys)[0] == [True] * 4
    assert _read(forever, keys)[0] == [True] * 4
    raw.close()


# -- faults -------------------------------------------------------------------------


def _assert_clean_error(exc: BackendError, server: RedisServer) -> None:
    text = str(exc)
    assert "\n" not in text
    assert SECRET not in text
    assert server.address in text, text
    assert text.startswith("tier 'remote': redis ")


def test_server_killed_restarted_and_down_at_start(
    own_server: Callable[..., RedisServer],
    make: Callable[..., RedisBackend],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Killed mid-run: every operation fails with a one-line BackendError (and no other
    exception), never showing the password, and is not retried after a back-off
    (redis-py's retry sleeps none). Back on the same port: the next batch works,
    without anyone reconnecting by hand. A backend made while the server is down
    behaves the same."""
    caplog.set_level(logging.DEBUG)
    server = own_server(password=SECRET)
    be = make(url=server.url(with_password=True), connect_timeout_ms=500, socket_timeout_ms=1000)
    assert SECRET not in be.redis_config.where()
    keys, data = _keys(16, salt=7), _payload(16, seed=7)
    _write(be, keys, data)
    assert _read(be, keys)[0] == [True] * 16

    server.kill()
    late = make(url=server.url(), password=SecretStr(SECRET), connect_timeout_ms=500)
    ops: list[Callable[[RedisBackend], object]] = [
        lambda b: _write(b, keys, data),
        lambda b: _read(b, keys),
        lambda b: b.exists(keys),
        lambda b: b.delete(keys),
    ]
    backoffs: list[float] = []
    with monkeypatch.context() as patch:
        patch.setattr(redis.retry, "sleep", backoffs.append)
        for backend in (be, late):
            for op in ops:
                with pytest.raises(BackendError) as err:
                    returns(functools.partial(op, backend), "an operation on a dead server")
                _assert_clean_error(err.value, server)
    assert backoffs == [], "a failed batch was retried after a back-off"
    assert be.failed_batches == 4

    server.start()  # same port; no persistence, so the blocks are gone
    for backend in (be, late):
        assert _read(backend, keys)[0] == [False] * 16
        _write(backend, keys, data)
        valid, out = _read(backend, keys)
        assert valid == [True] * 16
        assert torch.equal(out, data)
    assert SECRET not in caplog.text
    assert "answers again after 4 failed batches" in caplog.text


def test_slow_server_is_a_timeout_and_leaves_no_stale_reply(
    own_server: Callable[..., RedisServer], make: Callable[..., RedisBackend]
) -> None:
    """A server that stopped answering (its process stopped, until the test continues
    it after the check: a read that waited for it would have succeeded, late) fails
    the batch by socket_timeout_ms; the replies it sends late are never taken for a
    later batch's."""
    server = own_server()
    be = make(url=server.url(), socket_timeout_ms=300)
    keys, data = _keys(32, salt=8), _payload(32, seed=8)
    _write(be, keys, data)
    assert server.proc is not None
    server.proc.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(BackendError, match="TimeoutError") as err:
            returns(lambda: _read(be, keys), "a read from a stopped server")
    finally:
        server.proc.send_signal(signal.SIGCONT)
    assert "socket_timeout_ms" in str(err.value)
    other_keys, other = _keys(32, salt=9), _payload(32, seed=9)
    _write(be, other_keys, other)
    valid, out = _read(be, other_keys)
    assert valid == [True] * 32
    assert torch.equal(out, other)


@pytest.fixture
def small_server(own_server: Callable[..., RedisServer]) -> RedisServer:
    return own_server(maxmemory="4mb", policy="noeviction")


def test_full_server_without_eviction_fails_stores(
    small_server: RedisServer, make: Callable[..., RedisBackend]
) -> None:
    """``noeviction`` at maxmemory: stores fail with an OOM BackendError that says what
    to change; loads of what was stored keep working. Once the server may evict,
    stores work again."""
    be = make(MID, url=small_server.url())
    stored: list[BlockKey] = []
    data = _payload(32, seed=10, layout=MID)

    def fill() -> None:
        for batch in range(64):  # 32 MiB into 4 MiB
            keys = _keys(32, salt=100 + batch)
            _write(be, keys, data)
            stored.extend(keys)

    with pytest.raises(BackendError) as err:
        fill()
    text = str(err.value)
    assert "OutOfMemoryError" in text
    assert "maxmemory-policy allkeys-lru" in text
    assert "\n" not in text
    assert stored, "not even one batch fitted"
    valid, _ = _read(be, stored)
    assert all(valid)
    small_server.client().config_set("maxmemory-policy", "allkeys-lru")
    _write(be, _keys(32, salt=99), data)


def test_evictions_are_misses_not_errors(
    small_server: RedisServer, make: Callable[..., RedisBackend]
) -> None:
    small_server.client().config_set("maxmemory-policy", "allkeys-lru")
    be = make(MID, url=small_server.url())
    all_keys: list[BlockKey] = []
    datas: list[torch.Tensor] = []
    for batch in range(24):  # 12 MiB into 4 MiB
        keys, data = _keys(32, salt=200 + batch), _payload(32, seed=200 + batch, layout=MID)
        _write(be, keys, data)
        all_keys += keys
        datas.append(data)
    valid, out = _read(be, all_keys)
    assert 0 < sum(valid) < len(valid)
    expected = torch.cat(datas)
    for i, ok in enumerate(valid):
        if ok:
            assert torch.equal(out[i], expected[i])
    assert be.missing_blocks == len(valid) - sum(valid)
    assert be.corrupt_blocks == 0
    assert be.failed_batches == 0
    assert int(small_server.info("stats")["evicted_keys"]) > 0


def test_resharding_is_followed(cluster: Deployment, make: Callable[..., RedisBackend]) -> None:
    """Slots move to another master under a live client (``MOVED``): the batch still
    loads every block, and once redis-py has the new slot map a batch is back to one
    request per node."""
    be = make(**cluster.settings)
    keys, data = _keys(256, salt=11), _payload(256, seed=11)
    _write(be, keys, data)
    assert _read(be, keys)[0] == [True] * 256
    procs = cluster.procs
    assert procs is not None
    procs.reshard(0, 1, 500)
    valid, out = _read(be, keys)
    assert valid == [True] * 256
    assert torch.equal(out, data)
    # redis-py patches each moved slot as it meets it, and rereads the whole map after
    # a few redirections: within a few batches every batch is one request per node.
    costs = []
    for _ in range(5):
        before = be.round_trips
        assert _read(be, keys)[0] == [True] * 256
        costs.append(be.round_trips - before)
        if costs[-1] == len(cluster.servers):
            break
    assert costs[-1] == len(cluster.servers), costs
    procs.reshard(1, 0, 500)  # put the slots back for the other tests


def test_cluster_down_at_start_then_found(
    cluster: Deployment, make: Callable[..., RedisBackend]
) -> None:
    """A cluster none of whose listed nodes answers fails each batch (the client is
    built again on the next one); a listed node that is down is skipped for one that
    answers."""
    dead = f"127.0.0.1:{free_port()}"
    lost = make(nodes=[dead], password=SecretStr(SECRET))
    keys, data = _keys(4, salt=12), _payload(4, seed=12)
    for _ in range(2):
        with pytest.raises(BackendError, match="no node listed in nodes answered") as err:
            lost.exists(keys)
        assert SECRET not in str(err.value)
        assert dead in str(err.value)
    found = make(nodes=[dead, *cluster.settings["nodes"]])
    _write(found, keys, data)
    valid, out = _read(found, keys)
    assert valid == [True] * 4
    assert torch.equal(out, data)


# -- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "expect"),
    [
        ({"url": "redis://h:6379/0", "nodes": ["h:7000"]}, "exactly one of url"),
        ({}, "got neither"),
        ({"url": "http://h:6379"}, "must start with redis://"),
        ({"url": "redis://"}, "names no valid host"),
        ({"url": "redis://h:notaport/0"}, "names no valid host"),
        ({"nodes": []}, "nodes is empty"),
        ({"nodes": ["h"]}, "is not host:port"),
        ({"nodes": ["h:0"]}, "is not host:port"),
        ({"nodes": ["h:70000"]}, "is not host:port"),
        ({"url": "redis://h", "key_prefix": "a:b"}, "key_prefix = 'a:b'"),
        ({"url": "redis://h", "key_prefix": "{tag}"}, "one cluster slot"),
        ({"url": "redis://h", "key_prefix": ""}, "key_prefix = ''"),
        ({"url": "redis://h", "key_prefix": "x" * 65}, "1-64 letters"),
        ({"url": "redis://h", "ttl_s": 0}, "greater than 0"),
        ({"url": "redis://h", "max_connections": 0}, "greater than or equal to 1"),
        ({"url": "redis://h", "max_connections": 1025}, "less than or equal to 1024"),
        ({"url": "redis://h", "socket_timeout_ms": 0}, "greater than 0"),
        ({"url": "redis://h", "connect_timeout_ms": -1}, "greater than 0"),
    ],
)
def test_config_errors(settings: dict[str, Any], expect: str) -> None:
    with pytest.raises(ValidationError) as err:
        RedisTierConfig(name="remote", **settings)
    errors = err.value.errors()
    assert len(errors) == 1
    msg = errors[0]["msg"]
    assert expect in msg
    assert "\n" not in msg
    if errors[0]["type"] == "value_error":  # ours: they name the tier
        assert "tier 'remote'" in msg


def test_config_accepts_both_forms() -> None:
    single = RedisTierConfig(name="remote", url="rediss://cache.internal:6380/2")
    many = RedisTierConfig(name="remote", nodes=["10.0.0.1:7000", "[::1]:7001"], ttl_s=60)
    assert single.nodes is None
    assert many.url is None
    assert many.where() == "cluster 10.0.0.1:7000,[::1]:7001"


def test_secrets_are_never_shown() -> None:
    """Credentials in the url move to the secret fields, and no repr, dump or error of
    the config shows a secret."""
    cfg = RedisTierConfig(name="remote", url=f"redis://bob:{SECRET}%21@h:6379/0")
    assert cfg.url == "redis://h:6379/0"
    assert cfg.password is not None
    assert cfg.password.get_secret_value() == SECRET + "!"
    assert cfg.username is not None
    assert cfg.username.get_secret_value() == "bob"
    for text in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.model_dump())):
        assert SECRET not in text
        assert "bob" not in text
    failures: list[dict[str, Any]] = [
        # given twice: the url keeps a masked placeholder, and its error says so
        {"url": f"redis://:{SECRET}@h:6379", "password": "other"},
        # an error elsewhere in a tier that has a password
        {"url": "redis://h", "nodes": ["h:1"], "password": SECRET},
        {"url": "redis://h", "key_prefix": "a:b", "password": SECRET},
        # YAML reads an all-digit password as a number
        {"url": "redis://h", "password": 12345678},
    ]
    for settings in failures:
        with pytest.raises(ValidationError) as err:
            RedisTierConfig(name="remote", **settings)
        shown = str(err.value) + repr(
            [(e["loc"], e["msg"], e["input"]) for e in err.value.errors()]
        )
        assert SECRET not in shown
        assert "12345678" not in shown
    with pytest.raises(ValidationError, match="keep only the username and password"):
        RedisTierConfig(name="remote", url=f"redis://:{SECRET}@h:6379", password="other")


def test_backend_needs_its_own_config() -> None:
    with pytest.raises(ConfigError, match="takes a RedisTierConfig"):
        RedisBackend(CPUTierConfig(name="remote"), LAYOUT)


def test_capacity_bounds_the_nominal_slots() -> None:
    """No server is needed to build the backend: it connects on first use."""
    cfg = RedisTierConfig(
        name="remote", url="redis://127.0.0.1:1/0", capacity=10 * (HEADER_BYTES + 1024)
    )
    be = RedisBackend(cfg, LAYOUT)
    assert be.num_slots == 10
    assert be.recover() == []
    assert be.persistent
    be.close()
    with pytest.raises(BackendError, match="closed"):
        be.exists(_keys(1))

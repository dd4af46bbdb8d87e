"""The operator endpoint (connectors/vllm/admin.py) over a real Offloader, real HTTP.

Each test serves one rank's endpoint over real tiers (a cpu tier, an ``mmap`` slab and
a ``redis`` tier on a real ``redis-server``, all written through) and talks to it with
``http.client``: ``/ready``'s canary against a server killed with SIGKILL and frozen
with SIGSTOP, ``/tiers``' counts after known stores and loads, ``/query``'s matches
for prompts hashed as vLLM hashes them, and the one-line refusals. The end-to-end test
with a real engine is tests/e2e/test_admin_engine.py.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvoffload.connectors.vllm.admin import AdminServer, AdminSpec
from kvoffload.connectors.vllm.events import EventBook
from kvoffload.connectors.vllm.shared import Shared
from support.blocks import BPB, LAYOUT, POOL, fill_pool, make_keys
from support.redisserver import RedisServer, require_redis
from support.waiting import returns, wait_until

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.keys import BlockKey, generation_keys, key_from_hash
from kvoffload.lookup import VllmHashing
from kvoffload.metrics import BACKEND_METRICS
from kvoffload.offloader import Offloader

CPU_BLOCKS = 8
HASHING = VllmHashing(LAYOUT.block_size)
"""vLLM 0.32's default hashing (sha256, no PYTHONHASHSEED) of 16-token blocks."""


@dataclass
class Served:
    """One rank's endpoint over its Offloader, and the redis-server under its tier."""

    off: Offloader
    shared: Shared
    admin: AdminServer
    redis: RedisServer

    def get(self, path: str, method: str = "GET", body: bytes | None = None) -> tuple[int, Any]:
        """The status and body (JSON decoded, or the text) of one request; guarded
        against a hang, since an endpoint that waited on a frozen tier would never
        answer."""

        def ask() -> tuple[int, Any]:
            conn = http.client.HTTPConnection(*self.admin.address, timeout=60)
            try:
                conn.request(method, path, body=body)
                response = conn.getresponse()
                data = response.read().decode()
                kind = response.getheader("Content-Type") or ""
                return response.status, json.loads(data) if "json" in kind else data
            finally:
                conn.close()

        return returns(ask, f"{method} {path}")

    def query(self, body: dict[str, Any], path: str = "/query") -> tuple[int, Any]:
        return self.get(path, "POST", json.dumps(body).encode())

    def keys(self, tokens: list[int]) -> list[BlockKey]:
        """The tier keys of ``tokens``' full blocks, as the connector stores them."""
        return self.shared.ns([key_from_hash(h) for h in HASHING.block_hashes(tokens)])

    def store(self, keys: list[BlockKey]) -> None:
        """Store ``keys`` from pool blocks 0.. and wait until every tier has them."""
        assert self.off.pool is not None
        ids = list(range(len(keys)))
        fill_pool(self.off.pool, keys, ids)
        job = self.off.submit_store(keys, ids)
        assert job is not None
        (result,) = self.off.wait([job], timeout=60)
        assert result.success, result.error
        assert self.off.drain(timeout=60)


def _tiers(tmp: Path, redis: RedisServer, **redis_settings: Any) -> list[dict[str, Any]]:
    return [
        {"name": "cpu", "backend": "cpu", "capacity": CPU_BLOCKS * BPB, "max_pending_stores": 64},
        {
            "name": "ssd",
            "backend": "mmap",
            "capacity": 64 * (BPB + 4096),
            "path": str(tmp / "ssd"),
            "max_pending_stores": 64,
        },
        {
            "name": "shared",
            "backend": "redis",
            "url": redis.url(),
            "capacity": 1024 * BPB,
            "socket_timeout_ms": 500,
            "connect_timeout_ms": 300,
            "max_pending_stores": 64,
            **redis_settings,
        },
    ]


def _serve(tmp: Path, redis: RedisServer, timeout_ms: float, **redis_settings: Any) -> Served:
    config = load_config({"tiers": _tiers(tmp, redis, **redis_settings)}, env={})
    off = Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL))
    shared = Shared(off, EventBook(enabled=False, cap=64), LAYOUT.fingerprint)
    spec = AdminSpec(
        port=0,  # any free port: the tests read the one bound
        host="127.0.0.1",
        ready_timeout_s=timeout_ms / 1e3,
        engine_id="engine-a",
        block_size=LAYOUT.block_size,
        dp_rank=0,
        hashing=HASHING,
    )
    return Served(off, shared, AdminServer(shared, spec, rank=0), redis)


def _close(served: Served) -> None:
    served.admin.close()
    served.shared.answers.close()
    served.off.close()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    require_redis()
    redis = RedisServer(tmp_path / "redis").start()
    # A frozen server holds the canary's write until its 60 s socket timeout: only the
    # probe's deadline (3 s) can end that probe.
    one = _serve(tmp_path, redis, 3000.0, socket_timeout_ms=60_000)
    try:
        yield one
    finally:
        if redis.proc is not None:
            os.kill(redis.proc.pid, signal.SIGCONT)
        _close(one)
        redis.kill()


# --------------------------------------------------------------------------- /ready
def test_ready_turns_503_naming_a_killed_or_frozen_redis_tier_and_back(served: Served) -> None:
    """200 with every tier's canary verified; a SIGKILLed server: 503 naming the redis
    tier, the others ok; restarted: 200 again. A SIGSTOPped server: 503 at the deadline
    ("timeout"), the canary's one thread stuck in the server; a second probe joins that
    round rather than starting a thread of its own, and /health, /tiers and the
    Offloader's stores and loads go on meanwhile; SIGCONT: 200 again."""
    # Polled: the 3 s deadline is the probe's, and a loaded machine may miss it once.
    status, body = wait_until(
        lambda: (r := served.get("/ready"))[0] == 200 and r, "ready at start", poll=0.1
    )
    assert [(t["name"], t["ok"]) for t in body["tiers"]] == [
        ("cpu", True),
        ("ssd", True),
        ("shared", True),
    ]
    assert body["failing"] == []

    served.redis.kill()
    status, body = served.get("/ready")
    assert status == 503, body
    assert body["failing"] == ["shared"]
    shared = body["tiers"][2]
    assert shared["error"].startswith("error: "), shared
    assert [t["ok"] for t in body["tiers"][:2]] == [True, True]
    served.redis.start()  # the same port, as a restarted server
    wait_until(lambda: served.get("/ready")[0] == 200, "ready after the restart", poll=0.1)

    assert served.redis.proc is not None
    os.kill(served.redis.proc.pid, signal.SIGSTOP)
    status, body = served.get("/ready")
    assert status == 503, body
    assert body["failing"] == ["shared"]
    assert body["tiers"][2]["error"].startswith("timeout: the canary round has not finished")
    status, again = served.get("/ready")
    assert status == 503, again
    assert "(a round begun before this probe)" in again["tiers"][2]["error"]
    stuck = [t for t in threading.enumerate() if t.name == "kvoffload-canary-shared"]
    assert len(stuck) == 1
    assert served.get("/health")[0] == 200
    assert served.get("/tiers")[0] == 200
    # The engine's path: a store into the cpu tier and its load, while the canary's
    # round sits in the frozen server (the write-through copy to it is dropped or
    # queued, never waited for).
    keys = make_keys(2, salt=7)
    assert served.off.pool is not None
    fill_pool(served.off.pool, keys, [0, 1])
    job = served.off.submit_store(keys, [0, 1])
    assert job is not None
    (stored,) = returns(lambda: served.off.wait([job], timeout=60), "a store")
    assert stored.success
    plan = served.off.prepare_load(keys)
    assert plan.hits == 2
    load = served.off.submit_load(plan, [10, 11])
    assert load is not None
    (loaded,) = returns(lambda: served.off.wait([load], timeout=60), "a load")
    assert loaded.success

    os.kill(served.redis.proc.pid, signal.SIGCONT)
    wait_until(lambda: served.get("/ready")[0] == 200, "ready after SIGCONT", poll=0.1)


def test_the_canary_takes_one_slot_at_most_and_leaves_nothing(
    tmp_path: Path, served: Served
) -> None:
    """Over a tier with room a probe evicts nothing; over the full cpu tier exactly one
    block, the least recent. Afterwards the canary's key is in no tier's books, the
    books are consistent, none of the books' counters moved (the backends count their
    own I/O, the canary's included), and the mmap tier reopened recovers exactly the
    real blocks."""
    keys = make_keys(CPU_BLOCKS, salt=1)
    served.store(keys[:5])
    before, _ = served.off.counters()
    assert served.get("/ready")[0] == 200
    after, _ = served.off.counters()
    assert _books_counters(after) == _books_counters(before)
    assert [len(t.manager) for t in served.off.tiers[:2]] == [5, 5]  # type: ignore[arg-type]
    served.store(keys[5:])
    assert served.get("/ready")[0] == 200
    assert len(served.off.tiers[0].manager) == CPU_BLOCKS - 1  # type: ignore[arg-type]
    assert served.off.tiers[0].manager.lookup(keys) == 0  # keys[0], the least recent
    assert served.off.tiers[1].manager.lookup(keys) == CPU_BLOCKS
    for tier in served.off.tiers[:2]:
        assert served.admin.canary.key not in tier.manager.held_keys()
    assert served.off.check() == []
    assert served.off.pinned() == [0, 0, 0]
    served.admin.close()
    served.off.close()
    reopened = _serve(tmp_path, served.redis, 1000.0)
    try:
        assert sorted(reopened.off.tiers[1].manager.held_keys()) == sorted(keys)
    finally:
        _close(reopened)


def _books_counters(tiers: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The counters the books keep (those the backends count themselves left out)."""
    return {
        name: {k: v for k, v in values.items() if k not in BACKEND_METRICS}
        for name, values in tiers.items()
    }


# --------------------------------------------------------------------------- /tiers
def test_tiers_counts_are_exact_after_known_stores_and_loads(served: Served) -> None:
    """Five blocks stored through all three tiers, three of them loaded: each local
    tier holds 5 blocks (5 x 16 KiB, logical and stored: none compresses), the redis
    tier's count is the server's (null), every tier counts 5 stored; the cpu tier 3
    hits and no miss (hit rate 1.0), the others none (no rate); breakers closed, no
    errors."""
    keys = make_keys(5, salt=2)
    served.store(keys)
    plan = served.off.prepare_load(keys[:3])
    job = served.off.submit_load(plan, [20, 21, 22])
    assert job is not None
    (loaded,) = served.off.wait([job], timeout=60)
    assert loaded.success
    status, body = served.get("/tiers")
    assert status == 200, body
    assert body["engine_id"] == "engine-a"
    assert body["block_bytes"] == BPB
    got = {
        t["name"]: (
            t["medium"],
            t["blocks"],
            t["logical_bytes"],
            t["stored_bytes"],
            t["hit_rate"],
            t["breaker"],
            t["errors"],
            t["counters"]["blocks_stored"],
            t["counters"]["hits"],
            t["counters"]["misses"],
        )
        for t in body["tiers"]
    }
    assert got == {
        "cpu": ("cpu", 5, 5 * BPB, 5 * BPB, 1.0, "closed", 0, 5, 3, 0),
        "ssd": ("disk", 5, 5 * BPB, 5 * BPB, None, "closed", 0, 5, 0, 0),
        "shared": ("disk", None, None, None, None, "closed", 0, 5, 0, 0),
    }


# --------------------------------------------------------------------------- /query
PROMPT = list(range(1, 4 * 16 + 9))  # 4 full blocks of 16 tokens and 8 more
UNSEEN = list(range(500, 500 + 4 * 16))


def _entry(cpu: int, disk: int, remote: int) -> dict[str, Any]:
    """The instance entry of a walk that reached ``cpu``, ``disk``, ``remote`` tokens:
    Dynamo's fields, its ``gpu`` and ``dp`` 0 (the worker side cannot see vLLM's prefix
    cache), ``longest_matched`` the walk's end."""
    return dict(longest_matched=remote, gpu=0, dp={"0": 0}, cpu=cpu, disk=disk, remote=remote)


def test_query_matches_each_tier_exactly_and_claims_nothing(served: Served) -> None:
    """A prompt whose first 3 of 4 blocks were stored: 48 tokens on every tier, by
    token ids and by vLLM's block hashes alike; an unseen prompt 0. After the cpu tier
    evicted them the walk reaches 48 tokens on disk, 0 in memory. No query pins a
    block or moves a counter."""
    keys = served.keys(PROMPT)
    assert len(keys) == 4
    served.store(keys[:3])
    before, _ = served.off.counters()
    hashes = [h.hex() for h in HASHING.block_hashes(PROMPT)]
    expected = {
        "instances": {"engine-a": _entry(48, 48, 48)},
        "tiers": {"cpu": 48, "ssd": 48, "shared": 48},
        "block_size": 16,
        "blocks": 4,
    }
    assert served.query({"token_ids": PROMPT}) == (200, expected)
    assert served.query({"block_hashes": hashes}) == (200, expected)
    assert served.query({"block_hashes": hashes}, "/query_by_hash") == (200, expected)
    unseen = served.query({"token_ids": UNSEEN, "model": "m", "block_size": 16})
    zeros = {"instances": {"engine-a": _entry(0, 0, 0)}, "tiers": {"cpu": 0, "ssd": 0, "shared": 0}}
    assert unseen == (200, {**expected, **zeros})
    served.store(make_keys(CPU_BLOCKS, salt=3))  # the cpu tier evicts the prompt's
    status, body = served.query({"token_ids": PROMPT})
    assert status == 200, body
    assert body["instances"]["engine-a"] == _entry(0, 48, 48)
    assert body["tiers"] == {"cpu": 0, "ssd": 48, "shared": 48}
    assert served.off.pinned() == [0, 0, 0]
    after, _ = served.off.counters()
    assert {t: (v["hits"], v["misses"]) for t, v in after.items()} == {
        t: (v["hits"], v["misses"]) for t, v in before.items()
    }


def test_query_walks_cpu_then_disk_then_the_shared_tier(served: Served) -> None:
    """Dynamo's walk, cumulative: the prompt's 3 blocks pushed out of the cpu and mmap
    tiers by more blocks than the mmap tier has slots (the shared tier keeps them):
    cpu 0, disk 0, remote 48 tokens. Then its first block stored again (all three
    tiers): cpu 16, disk 16 (the mmap tier holds nothing after the cpu's prefix),
    remote 48 (the shared tier continues it), longest_matched 48; alone, the tiers
    hold 16, 16 and 48."""
    keys = served.keys(PROMPT)
    served.store(keys[:3])
    slots = served.off.tiers[1].manager.capacity
    for salt in range(4, 5 + slots // CPU_BLOCKS):  # past the mmap's slots, 8 at a time
        served.store(make_keys(CPU_BLOCKS, salt=salt))
    status, body = served.query({"token_ids": PROMPT})
    assert status == 200, body
    assert body["tiers"] == {"cpu": 0, "ssd": 0, "shared": 48}
    assert body["instances"]["engine-a"] == _entry(0, 0, 48)
    served.store(keys[:1])
    status, body = served.query({"token_ids": PROMPT})
    assert status == 200, body
    assert body["tiers"] == {"cpu": 16, "ssd": 16, "shared": 48}
    assert body["instances"]["engine-a"] == _entry(16, 16, 48)


def test_query_after_a_connector_reset_looks_where_the_engine_looks(served: Served) -> None:
    """A connector reset moves the engine's lookups to a new key generation: the
    prompt's blocks stored before it answer 0 on every tier (the lower tiers still
    hold them, but no lookup would find them), and the same prompt stored under the
    new generation answers its 48 tokens again."""
    keys = [key_from_hash(h) for h in HASHING.block_hashes(PROMPT)]
    served.store(served.shared.ns(keys[:3]))
    assert served.query({"token_ids": PROMPT})[1]["tiers"] == {"cpu": 48, "ssd": 48, "shared": 48}
    served.shared.reset()
    assert served.shared.generation == 1
    status, body = served.query({"token_ids": PROMPT})
    assert status == 200, body
    assert body["tiers"] == {"cpu": 0, "ssd": 0, "shared": 0}
    assert body["instances"]["engine-a"]["longest_matched"] == 0
    served.store(served.shared.ns(generation_keys(keys[:3], 1)))
    status, body = served.query({"token_ids": PROMPT})
    assert body["tiers"] == {"cpu": 48, "ssd": 48, "shared": 48}
    assert body["instances"]["engine-a"]["longest_matched"] == 48


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("method", "path", "body", "status", "needle"),
    [
        ("GET", "/nope", None, 404, "/nope: no such endpoint"),
        ("POST", "/health", b"{}", 405, "POST /health: use GET"),
        ("GET", "/query", None, 405, "GET /query: use POST"),
        ("POST", "/query", b"{not json", 400, "body: not JSON"),
        ("POST", "/query", b"[1, 2]", 400, "body = [1, 2]: expected a JSON object"),
        ("POST", "/query", b"{}", 400, "fields none: expected exactly one of"),
        (
            "POST",
            "/query",
            b'{"token_ids": [1, "x"]}',
            400,
            "token_ids[1] = 'x': expected a non-negative integer token id",
        ),
        ("POST", "/query", b'{"token_ids": 5}', 400, "token_ids = 5: expected a JSON array"),
        (
            "POST",
            "/query",
            b'{"token_ids": [1], "block_hashes": []}',
            400,
            "expected exactly one of token_ids or block_hashes",
        ),
        (
            "POST",
            "/query",
            b'{"block_hashes": [123]}',
            400,
            "block_hashes[0] = 123: an int is a KV event's last 8 bytes",
        ),
        ("POST", "/query", b'{"block_hashes": ["zz"]}', 400, "block_hashes[0] = 'zz': expected"),
        (
            "POST",
            "/query",
            b'{"token_ids": [1], "block_size": 32}',
            400,
            "block_size = 32: this engine's blocks are 16 tokens",
        ),
        (
            "POST",
            "/query",
            b'{"token_ids": [1], "lora_name": "sql"}',
            400,
            "lora_name = 'sql': LoRA prompts are not supported",
        ),
        (
            "POST",
            "/query",
            b'{"token_ids": [1], "cache_salt": 7}',
            400,
            "cache_salt = 7: expected a string",
        ),
        (
            "POST",
            "/query_by_hash",
            b'{"token_ids": [1]}',
            400,
            "/query_by_hash: expected",
        ),
    ],
)
def test_bad_requests_get_a_4xx_and_one_line(
    served: Served, method: str, path: str, body: bytes | None, status: int, needle: str
) -> None:
    """Each refusal: its status, and one line of text that names what was wrong."""
    got, text = served.get(path, method, body)
    assert got == status, text
    assert isinstance(text, str)
    assert text.endswith("\n")
    assert text.count("\n") == 1, text
    assert needle in text, text

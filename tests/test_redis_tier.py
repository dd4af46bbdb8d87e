"""The redis tier inside the Offloader, against real ``redis-server`` processes: the
cascade (cpu -> redis, cpu -> mmap -> redis), hits promoted into the cpu tier, two
Offloaders (replicas) sharing one server, books that live on the server (one round
trip per lookup, no local LRU), and the server down at start, killed mid-run and
restarted: misses and counted errors, never an exception, hits back within 5 s."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import BPB, LAYOUT, POOL, block_content, fill_pool, make_keys
from support.redisserver import RedisServer, require_redis

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.server_manager import ServerBookedManager


def _redis(server: RedisServer, **settings: Any) -> dict[str, Any]:
    return {
        "name": "shared",
        "backend": "redis",
        "url": server.url(),
        "capacity": 4096 * BPB,
        "socket_timeout_ms": 500,
        "connect_timeout_ms": 300,
        **settings,
    }


def _offloader(tiers: list[dict[str, Any]]) -> Offloader:
    config = load_config({"tiers": tiers}, env={})
    return Offloader(config, LAYOUT, BlockPool.allocate(LAYOUT, POOL))


def _cpu(blocks: int = 8) -> dict[str, Any]:
    return {"name": "cpu", "backend": "cpu", "capacity": blocks * BPB}


def _store(off: Offloader, keys: list[BlockKey]) -> None:
    assert off.pool is not None
    ids = list(range(len(keys)))
    fill_pool(off.pool, keys, ids)
    job = off.submit_store(keys, ids)
    assert job is not None
    off.wait([job], timeout=30)
    assert off.drain(timeout=30)


def _claim_and_load(off: Offloader, keys: list[BlockKey], owner: str = "r") -> int:
    """Claim ``keys`` as a request would (waiting for prefetches), load the hit into
    pool blocks 32.., check it bit-exact; the number of blocks loaded."""
    assert off.pool is not None
    deadline = time.monotonic() + 30
    plan = off.claim(owner, keys)
    while plan is None:
        assert time.monotonic() < deadline
        time.sleep(0.005)
        plan = off.claim(owner, keys)
    ids = list(range(32, 32 + plan.hits))
    n = 0
    if plan.hits:
        job = off.submit_load(plan, ids)
        assert job is not None
        (res,) = off.wait([job], timeout=30)
        n = res.nbytes // BPB
        got = off.pool.gather(ids[:n])
        for i in range(n):
            assert torch.equal(got[i], block_content(keys[i])), f"block {i} differs"
    else:
        off.unclaim(plan)
    off.release(owner)
    assert off.drain(timeout=30)
    return n


def test_cpu_then_redis_cascade_and_promotion(server: RedisServer) -> None:
    with _offloader([_cpu(8), _redis(server)]) as off:
        assert isinstance(off.tiers[1].manager, ServerBookedManager)
        wanted, other = make_keys(8, 1), make_keys(8, 2)
        _store(off, wanted)
        _store(off, other)  # pushes `wanted` out of the 8-block cpu tier
        assert off.stats[1].blocks_stored == 16
        assert off.lookup(wanted) == 8  # the server has them
        assert _claim_and_load(off, wanted) == 8
        assert off.stats[0].promotions >= 4  # prefetched up, then loaded from cpu
        assert off.stats[1].blocks_stored == 16  # not written back where they came from
        assert off.check() == []
        assert off.pinned() == [0, 0]


def test_cpu_mmap_redis_chain(server: RedisServer, tmp_path: Path) -> None:
    mmap = {"name": "ssd", "backend": "mmap", "capacity": 16 * (BPB + 4096)}
    tiers = [_cpu(8), {**mmap, "path": str(tmp_path / "m")}, _redis(server)]
    with _offloader(tiers) as off:
        batches = [make_keys(8, 10 + b) for b in range(4)]  # 32 blocks: past cpu and mmap
        for batch in batches:
            _store(off, batch)
        assert off.stats[2].blocks_stored == 32
        for batch in batches:
            assert _claim_and_load(off, batch) == 8
        assert off.stats[2].hits > 0  # the oldest came from the server
        assert off.check() == []


def test_what_one_replica_stored_is_a_hit_in_another(server: RedisServer) -> None:
    keys = make_keys(8, 3)
    with _offloader([_cpu(8), _redis(server)]) as a:
        _store(a, keys)
    with _offloader([_cpu(8), _redis(server)]) as b:
        assert b.lookup(keys) == 8  # its own cpu tier is empty: the server's books
        assert _claim_and_load(b, keys) == 8


def test_a_lookup_is_one_round_trip(server: RedisServer) -> None:
    keys = make_keys(256, 4)
    with _offloader([_cpu(8), _redis(server)]) as off:
        backend: Any = off.tiers[1].backend
        off.lookup(keys[:1])  # connect (the handshake is a few round trips of its own)
        before = backend.round_trips
        trips = off.counters()[0]["shared"]["round_trips"]
        assert off.lookup(keys) == 0
        assert backend.round_trips - before == 1
        # ... and the tier's stats count it (the cpu tier has no server: 0).
        tiers, _ = off.counters()
        assert tiers["shared"]["round_trips"] - trips == 1
        assert off.stats[1].round_trips == backend.round_trips
        assert tiers["cpu"]["round_trips"] == tiers["cpu"]["server_errors"] == 0


def test_a_shared_server_cannot_be_the_first_tier(server: RedisServer) -> None:
    with pytest.raises(ConfigError, match=r"cannot be the first tier.*cpu tier in front"):
        _offloader([_redis(server)])


def test_server_down_killed_and_restarted(tmp_path: Path) -> None:
    """The server is down when the engine starts, comes up, is killed mid-run and comes
    back: stores and loads never raise, the cpu tier keeps serving, failures are
    counted, and hits from the server resume within 5 s of its return."""
    require_redis()
    srv = RedisServer(tmp_path / "redis")
    from support.redisserver import free_port

    srv.port = free_port()
    tiers = [_cpu(8), _redis(srv, breaker_errors=3, breaker_backoff_ms=1000)]
    with _offloader(tiers) as off:
        early = make_keys(8, 5)
        _store(off, early)  # the server is down: the copy down fails, counted
        assert off.stats[1].store_errors > 0
        assert _claim_and_load(off, early) == 8  # the cpu tier still has them
        srv.start()
        try:
            t0 = time.monotonic()
            first = make_keys(8, 6)
            while True:  # stores reach the server once the breaker probes it
                _store(off, first)
                if off.lookup(first) == 8 and off.tiers[0].manager.lookup(first) == 8:
                    break
                assert time.monotonic() - t0 < 5, "the server's return went unnoticed"
                time.sleep(0.05)
            server_errors = off.stats[1].server_errors
            srv.kill()  # mid-run
            gone = make_keys(8, 7)
            _store(off, gone)  # nothing raises; the failures are counted
            errors = off.stats[1].store_errors
            assert errors > 0
            assert off.stats[1].server_errors > server_errors  # the tier's stat
            assert _claim_and_load(off, gone) == 8  # from the cpu tier
            srv.start()  # same port
            back = time.monotonic()
            hits = off.stats[1].hits
            later = make_keys(8, 8)
            while True:
                _store(off, later)
                _store(off, make_keys(8, 9))  # pushes `later` out of cpu
                if _claim_and_load(off, later, owner="again") == 8:
                    break
                assert time.monotonic() - back < 5, "hits did not resume within 5 s"
                time.sleep(0.05)
            assert off.stats[1].hits > hits  # served by the restarted server
            print(f"hits resumed {time.monotonic() - back:.2f} s after the restart")
            assert off.check() == []
        finally:
            srv.kill()


def test_on_evict_and_admission_into_the_server(server: RedisServer) -> None:
    """``on_evict``: blocks reach the server only when the cpu tier evicts them; with
    ``admit_after_hits: 1`` only blocks loaded once before are let in."""
    with _offloader([_cpu(8), _redis(server, write_policy="on_evict")]) as off:
        first = make_keys(8, 20)
        _store(off, first)
        assert off.stats[1].blocks_stored == 0  # nothing evicted yet
        _store(off, make_keys(8, 21))  # evicts `first` down to the server
        assert off.stats[1].blocks_stored == 8
        assert _claim_and_load(off, first) == 8
    with _offloader([_cpu(8), _redis(server, key_prefix="adm", admit_after_hits=1)]) as off:
        keys = make_keys(8, 22)
        _store(off, keys)
        assert off.stats[1].blocks_stored == 0
        assert off.stats[1].not_admitted == 8
        assert _claim_and_load(off, keys) == 8  # a hit from the cpu tier: counted
        _store(off, make_keys(8, 23))
        _store(off, keys)  # stored again after one load: admitted this time
        assert off.stats[1].blocks_stored > 0

"""The redis tier inside the Offloader, against real ``redis-server`` processes: the
cascade (cpu -> redis, cpu -> mmap -> redis), hits promoted into the cpu tier, two
Offloaders (replicas) sharing one server, books that live on the server (one round
trip per lookup, no local LRU; a block the server lost is stored again, and under
server eviction two replicas hit as often as an LRU of the server would), and the
server down at start, killed mid-run and restarted: misses and counted errors, never
an exception, and hits again once it is back."""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from support.blocks import BPB, LAYOUT, POOL, block_content, fill_pool, make_keys
from support.redisserver import RedisServer, require_redis
from support.waiting import wait_until

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey
from kvoffload.offloader import Offloader
from kvoffload.server_manager import ServerBookedManager
from kvoffload.tools.workloads import make_workload


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
    plan = wait_until(lambda: off.claim(owner, keys), "the claim decided")
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
    counted, and hits from the server resume once it is back."""
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
            first = make_keys(8, 6)

            def stored_there() -> bool:  # once the breaker probes the server
                _store(off, first)
                return off.lookup(first) == 8 and off.tiers[0].manager.lookup(first) == 8

            wait_until(stored_there, "stores reach the returned server", poll=0.05)
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

            def hit_again() -> bool:
                _store(off, later)
                _store(off, make_keys(8, 9))  # pushes `later` out of cpu
                return _claim_and_load(off, later, owner="again") == 8

            wait_until(hit_again, "hits from the restarted server", poll=0.05)
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


def test_a_block_the_server_lost_is_stored_again(server: RedisServer) -> None:
    """Issue 23: 8 blocks stored through a cpu tier of 8 into the server; the server
    loses them (flushed, as an eviction would) and the cpu tier evicts them; the engine
    asks for them (a miss everywhere), computes and stores them again: they must reach
    the server, where a second Offloader finds all 8."""
    keys = make_keys(8, 30)
    with _offloader([_cpu(8), _redis(server)]) as off:
        _store(off, keys)
        assert off.lookup(keys) == 8
        stored = off.stats[1].blocks_stored
        server.client().flushall()
        _store(off, make_keys(8, 31))  # pushes `keys` out of the cpu tier
        assert off.lookup(keys) == 0  # the engine's lookup: gone everywhere
        _store(off, keys)  # computed again
        assert off.stats[1].blocks_stored == stored + 16
    with _offloader([_cpu(8), _redis(server)]) as other:
        assert other.lookup(keys) == 8
        assert _claim_and_load(other, keys) == 8


class _ServerLru:
    """What a Redis server under ``allkeys-lru`` holds, simulated for a replayed request
    stream. Recency is the server's own clock, which counts whole seconds (Redis
    stamps a key with its LRU clock, of 1 s resolution): among the keys of the oldest
    second, the victim is drawn at random (``seed``), as the server's sampling draws
    it. The capacity is what the real server held after the same request (its
    ``DBSIZE``), so that memory overhead and client buffers cost both the same."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.stamp: dict[BlockKey, int] = {}
        self.seconds: OrderedDict[int, dict[BlockKey, None]] = OrderedDict()

    def _put(self, key: BlockKey, second: int) -> None:
        old = self.stamp.get(key)
        if old is not None:
            del self.seconds[old][key]
        self.stamp[key] = second
        self.seconds.setdefault(second, {})[key] = None

    def request(self, keys: list[BlockKey], second: int, capacity: int) -> int:
        """Serve one request as the tier does: ``GET`` the held prefix (a use), ``SET``
        the computed blocks the server lacks (those it holds past a gap are not
        rewritten), then evict down to ``capacity``; the prefix length."""
        hit = 0
        while hit < len(keys) and keys[hit] in self.stamp:
            hit += 1
        for i, key in enumerate(keys):
            if i < hit or key not in self.stamp:
                self._put(key, second)
        while len(self.stamp) > capacity:
            oldest = next(iter(self.seconds))
            bucket = self.seconds[oldest]
            if not bucket:
                del self.seconds[oldest]
                continue
            victim = self.rng.choice(list(bucket))
            del bucket[victim], self.stamp[victim]
        return hit


def test_two_replicas_under_server_eviction_match_a_simulated_lru(tmp_path: Path) -> None:
    """Issue 23: a server under ``allkeys-lru`` with a working set several times its
    ``maxmemory``, two replicas (Offloaders) taking turns on one zipf request stream.
    Each request empties the replica's cpu tier first, so every hit is the server's.
    Their hit rate must match an LRU of the server simulated on the same stream within
    0.02: a replica that kept believing the server held blocks it had evicted would
    never store them again, and lose the hits an LRU keeps."""
    require_redis()
    srv = RedisServer(tmp_path / "redis", maxmemory="7mb").start()
    try:
        stats = srv.client()
        # A finer clock for the LRU stamps' seconds (cron updates it), and samples
        # enough that the victim is one of the oldest second's keys.
        stats.config_set("hz", 100)
        stats.config_set("maxmemory-samples", 64)
        stream = make_workload(
            "zipf", prefixes=200, prefix_blocks=4, suffix_blocks=1, zipf_alpha=0.9, seed=7
        )
        requests = [stream.next() for _ in range(1400)]
        real: list[tuple[int, int, int, int]] = []  # (second, hit, blocks, dbsize)
        tiers = [_cpu(8), _redis(srv)]
        with _offloader(tiers) as a, _offloader(tiers) as b:
            t0 = time.monotonic()
            for i, keys in enumerate(requests):
                off = (a, b)[i % 2]
                second = int(time.time())
                off.clear_first_tier()
                hit = _claim_and_load(off, keys)
                if hit < len(keys):
                    _store(off, keys[hit:])
                real.append((second, hit, len(keys), int(stats.dbsize())))
            took = time.monotonic() - t0
            evicted = int(srv.info("stats")["evicted_keys"])
            lost = a.stats[1].lost_blocks + b.stats[1].lost_blocks
        start = len(requests) // 3  # counted once the server is full (checked below)
        got = sum(r[1] for r in real[start:]) / sum(r[2] for r in real[start:])
        rates = []
        for seed in range(5):
            sim = _ServerLru(seed)
            hits = [sim.request(k, r[0], r[3]) for k, r in zip(requests, real, strict=True)]
            rates.append(sum(hits[start:]) / sum(r[2] for r in real[start:]))
        want = sum(rates) / len(rates)
        exact = _ServerLru(0)  # for the record: an LRU by request order, not seconds
        pairs = enumerate(zip(requests, real, strict=True))
        ideal = [exact.request(k, i, r[3]) for i, (k, r) in pairs]
        print(
            f"{len(requests)} requests in {took:.1f} s, server full from request {start}, "
            f"{evicted} evicted, {lost} lost between lookup and read, capacity "
            f"{min(r[3] for r in real[start:])}..{max(r[3] for r in real[start:])} keys; "
            f"hit rate {got:.4f}, simulated LRU {want:.4f} "
            f"({', '.join(f'{r:.4f}' for r in rates)}; by request order: "
            f"{sum(ideal[start:]) / sum(r[2] for r in real[start:]):.4f})"
        )
        assert real[start][3] >= 0.9 * max(r[3] for r in real)  # full by then
        assert evicted > 2 * real[-1][3]  # the working set is well past maxmemory
        assert abs(got - want) <= 0.02
    finally:
        srv.kill()

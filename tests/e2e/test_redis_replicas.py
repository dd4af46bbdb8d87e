"""Issue 14, end to end: two vLLM engines share one real Redis.

Engine A (CPU build, the dummy-weight tiny Llama, in the session's engine server as in
``test_verified_hits.py``) serves a batch over ``cpu -> redis``: its blocks are written
through to a ``redis-server`` on a loopback port. Engine B is a new engine with an
empty cpu tier of its own (nothing of A's connector is left once A shuts down): the
same batch is a hit for it, served from the server, as its counters show (every
block a hit of the redis tier, prefetched into the cpu tier and loaded, no load
error), and both engines' outputs equal those of an engine without the connector. B
loads the model from a path of its own, as a replica on another host would: the
engines share blocks because each names the weights the same way (``model_id``).
Then the server is killed and engine C runs the batch once more: every block is
recomputed, no request fails, and the errors of the dead server are counted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.e2e import (
    BATCH,
    BATCH_BLOCKS,
    EngineServer,
    assert_loaded,
    connector_tiers,
    failures,
    outputs,
    redis_tier,
)
from support.redisserver import RedisServer, require_redis

pytestmark = pytest.mark.slow  # real vLLM engines
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

MODEL_ID = "tiny-llama-dummy@e2e"
"""The weights' name every engine here gives (``model_id``): the same on each, so
engines that load the model from different paths share blocks."""


def _redis_tiers(server: RedisServer) -> dict[str, Any]:
    """cpu -> redis (write_through), room in both store queues for a whole batch."""
    conn = connector_tiers(None)
    conn["model_id"] = MODEL_ID
    conn["config"]["tiers"].append(redis_tier(server.url()))
    return conn


@pytest.fixture(scope="module")
def engine_a(
    engines: EngineServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, RedisServer, Any]]:
    """A real server, and engine A's run of the batch over it (its own process)."""
    require_redis()
    tmp = tmp_path_factory.mktemp("redis-replicas")
    server = RedisServer(tmp / "redis").start()
    try:
        (a,) = engines.results(tmp, kvoffload=_redis_tiers(server), rounds=[BATCH])
        yield tmp, server, a
    finally:
        server.kill()


def _counters(result: dict[str, Any]) -> str:
    c = result["kvoffload"]
    keys = [k for k in c if k.startswith("tier.redis.")] + [
        "blocks_loaded",
        "prefetched_blocks",
        "load_errors",
    ]
    return json.dumps({k: c.get(k) for k in keys})


def test_a_router_finds_what_engine_a_stored(
    engine_a: tuple[Path, RedisServer, Any],
) -> None:
    """A router that never ran an engine asks the server (``kvoffload.lookup``) how much
    of each prompt of the batch it holds: it rebuilds vLLM's block hashes and the
    connector's names from the token ids, the model's shape and ``model_id``, and finds
    every full block engine A stored (four prompts of 13 blocks, one of 9), in one
    pipeline of ``EXISTS``, one per distinct block."""
    import os

    from kvoffload.config import load_config
    from kvoffload.lookup import VllmEngineLayout, VllmHashing, lookup_prefixes

    _, server, _ = engine_a
    config = load_config(_redis_tiers(server)["config"])
    layout = VllmEngineLayout(
        model_id=MODEL_ID, num_layers=2, num_kv_heads=2, head_dim=32, block_size=32
    )
    hashing = VllmHashing(block_size=32, seed=os.environ.get("PYTHONHASHSEED"))
    (answer,) = lookup_prefixes(config, BATCH, hashing, layout)
    assert answer.blocks == [13, 13, 13, 13, 9], answer
    assert answer.names == BATCH_BLOCKS, answer


def test_what_engine_a_stored_is_a_hit_in_engine_b(
    engines: EngineServer, engine_a: tuple[Path, RedisServer, Any], reference: list[list[int]]
) -> None:
    tmp, server, a = engine_a
    assert a["failed"] == 0, failures(a)
    assert outputs(a) == reference
    assert a["kvoffload"]["tier.redis.blocks_stored"] >= BATCH_BLOCKS, _counters(a)
    held = server.client().dbsize()
    assert held == BATCH_BLOCKS, f"the server holds {held} blocks; {_counters(a)}"

    elsewhere = tmp / "replica-b"  # B's own copy of the model, at another path
    elsewhere.mkdir(exist_ok=True)
    (b,) = engines.results(elsewhere, kvoffload=_redis_tiers(server), rounds=[BATCH])
    c = b["kvoffload"]
    print(
        "A:",
        _counters(a),
        "\nB:",
        _counters(b),
        "\nB cached:",
        [r["cached"] for r in b["rounds"][0]],
    )
    assert b["failed"] == 0, failures(b)
    assert outputs(b) == reference
    # B's cpu tier started empty: every block of the batch came from the server,
    # prefetched into it, and was loaded from there.
    assert c["tier.redis.hits"] == BATCH_BLOCKS, _counters(b)
    assert c["prefetched_blocks"] == BATCH_BLOCKS, _counters(b)
    # Each once: a prompt that finds the shared prefix in vLLM's own cache (loaded
    # there for another prompt of the batch) loads only its own blocks.
    assert_loaded(b, BATCH_BLOCKS)
    assert c["tier.redis.corrupt_blocks"] == c["tier.redis.lost_blocks"] == 0, _counters(b)
    assert all(r["cached"] > 0 for r in b["rounds"][0]), b["rounds"][0]


def test_server_killed_between_engines_means_recompute(
    engines: EngineServer, engine_a: tuple[Path, RedisServer, Any], reference: list[list[int]]
) -> None:
    """The server dies after A stored the batch: engine C serves everything by
    recompute, under vLLM's default ``kv_load_failure_policy`` ("fail"): no request
    fails, outputs equal the reference, the server's errors are counted."""
    tmp, server, _ = engine_a
    server.kill()
    (c_run,) = engines.results(tmp, kvoffload=_redis_tiers(server), rounds=[BATCH])
    c = c_run["kvoffload"]
    print("C (server down):", _counters(c_run))
    assert c_run["failed"] == 0, failures(c_run)
    assert outputs(c_run) == reference
    assert c["tier.redis.hits"] == 0, _counters(c_run)
    # Its lookups and writes met the dead server: counted, and the breaker then kept
    # the remaining stores from trying (bypassed, counted too).
    assert c["tier.redis.server_errors"] > 0, _counters(c_run)
    assert c["tier.redis.store_errors"] + c["tier.redis.bypassed_stores"] > 0, _counters(c_run)

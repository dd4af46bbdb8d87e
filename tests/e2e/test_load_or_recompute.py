"""Issue 22, end to end: a hit is loaded only when loading beats recomputing it, and a
tier that hangs costs a miss.

Real engines (the CPU build, the dummy-weight tiny Llama) in the session's engine
server:

- **A slow disk.** Engine 1 stores the batch on a disk tier. Engines 2 and 3 start
  with empty cpu tiers over the same files, through the test plugin's ``faultymmap``
  with every read taking 2 s (``read_hang``). Engine 2 first computes a prompt of its
  own (its prefill is measured), then one stored prompt (9 blocks on the disk, whose
  reads are not measured yet: its lookup waits for their prefetch, and stops waiting
  once it has waited longer than computing them would take), then the batch's four
  prompts (19 blocks; the disk now known to be slower than recomputing, by that wait
  and by the read that ends 2 s later): with the choice on nothing is loaded, the
  skipped blocks counted in ``skipped_slower_than_recompute``. Engine 3, with it off
  (``load_or_recompute: false``), runs the same prompts and loads every hit from the
  disk, each claim waiting for its prefetches (2 s reads, ``load_timeout_ms`` 10 s):
  the prompt of its own (6 blocks: engine 2 stored it), the 9, the four's 19.
  Outputs equal an engine without the connector either way. Recomputing a block of
  this model takes milliseconds against the disk's 2 s, so the choice does not
  depend on this machine's speed.
- **A shared tier that hangs.** A multi-process engine (the scheduler in its own
  process, asking the worker's books over the socket) over ``cpu -> redis`` with a
  real ``redis-server``: for one round the server is frozen (``kill -STOP``), and a
  new prompt's lookup, which asks the server which blocks it holds, hangs in the
  socket for ``socket_timeout_ms``. The lookup is given up after ``books_timeout_ms``
  (``lookups_given_up``), the prompt is computed, nothing fails, and after the server
  thaws the batch is served as before: its four prompts sharing a prefix load the 19
  blocks the cpu tier holds of them (the prefix once: the other three find it in
  vLLM's own cache), the fifth, never stored, is computed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support.e2e import (
    BATCH,
    EngineServer,
    assert_loaded,
    connector_tiers,
    failures,
    outputs,
    redis_tier,
    tokens,
)
from support.redisserver import RedisServer, require_redis

pytestmark = pytest.mark.slow  # real vLLM engines
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

OWN = [tokens(300, 200)]
"""A prompt of the engine's own: computed, so the engine's prefill is measured."""
SINGLE = [BATCH[4]]
"""The batch's prompt of its own (9 full blocks): the first load from the slow disk."""
SHARED = BATCH[:4]
"""The batch's four prompts sharing a prefix (19 blocks in all)."""


def _slow_disk(path: Path, **options: Any) -> dict[str, Any]:
    conn = connector_tiers("faultymmap", path, read_hang=1.0, hang_s=2.0, breaker_errors=0)
    conn.update(options)
    return conn


def test_a_slower_than_recompute_tier_is_computed_not_loaded(
    engines: EngineServer, tmp_path: Path, reference: list[list[int]]
) -> None:
    disk = tmp_path / "disk"
    rounds = [OWN, SINGLE, SHARED]
    fill, choice, always = engines.results(
        tmp_path,
        engines=[
            {"kvoffload": connector_tiers("faultymmap", disk), "rounds": [BATCH]},
            {"kvoffload": _slow_disk(disk), "rounds": rounds},
            {"kvoffload": _slow_disk(disk, load_or_recompute=False), "rounds": rounds},
        ],
    )
    keys = (
        "blocks_loaded",
        "load_errors",
        "prefetched_blocks",
        "skipped_slower_than_recompute",
        "tier.disk.hits",
    )
    report = json.dumps(
        {i: {k: r["kvoffload"].get(k) for k in keys} for i, r in enumerate([fill, choice, always])}
    )
    for result in (fill, choice, always):
        assert result["failed"] == 0, f"{failures(result)}\n{report}"
    assert outputs(fill) == reference
    for result in (choice, always):
        assert outputs(result, 1) == reference[4:], report
        assert outputs(result, 2) == reference[:4], report
    c, a = choice["kvoffload"], always["kvoffload"]
    # Nothing came from the disk: the first prompt stopped waiting for its prefetch,
    # the four then were not even waited for; each lookup counts what it skipped. No
    # exact count: vLLM asks again at each step while a lookup waits for its prefetch,
    # and how many steps that is depends on this machine's speed (one run: 113).
    assert c["blocks_loaded"] == 0, report
    assert c["skipped_slower_than_recompute"] >= 9 + 19, report
    assert c["load_errors"] == 0, report
    # Without the choice, every hit was loaded from the disk, each block once (the
    # four's prefix for one of them: the other three find it in vLLM's own cache).
    assert a["skipped_slower_than_recompute"] == 0, report
    assert a["blocks_loaded"] == 6 + 9 + 19, report
    assert a["load_errors"] == 0, report


def test_a_hanging_shared_tier_costs_a_miss(
    engines: EngineServer, tmp_path: Path, reference: list[list[int]]
) -> None:
    require_redis()
    server = RedisServer(tmp_path / "redis").start()
    try:
        assert server.proc is not None
        pid = str(server.proc.pid)
        conn = connector_tiers(None)
        conn["config"]["books_timeout_ms"] = 300
        conn["config"]["tiers"].append(
            redis_tier(server.url(), socket_timeout_ms=5000, breaker_errors=0)
        )
        (result,) = engines.results(
            tmp_path,
            single_process=False,
            kvoffload=conn,
            rounds=[SHARED, [tokens(400, 300)], BATCH],
            before_round={"1": [["kill", "-STOP", pid]]},
            after_round={"1": [["kill", "-CONT", pid]]},
        )
    finally:
        server.kill()
    prom = result["prometheus"]
    report = json.dumps(prom)
    assert result["failed"] == 0, f"{failures(result)}\n{report}"
    assert outputs(result, 0) == reference[:4]
    assert outputs(result, 2) == reference, report
    # The frozen server's lookups were given up, the prompt computed meanwhile: at
    # least the frozen round's prompt's (its lookup and its prefetch on arrival share
    # one thread, and how many of them the frozen socket holds past books_timeout_ms
    # depends on when the round ends).
    assert prom["lookups_given_up"] >= 1, report
    # After the thaw the batch's four prompts sharing a prefix were hits again, from
    # the cpu tier: 13 blocks loaded for one, its own 2 for each of the other three.
    assert not result["kvoffload"]  # multi-process: only Prometheus has them
    assert_loaded(result, 13 + 3 * 2)

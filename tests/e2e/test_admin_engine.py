"""The operator endpoint in a real engine: vLLM with the connector over a real Redis.

One engine (the tiny dummy-weight Llama, vLLM's single-process mode) runs the batch
over ``cpu -> redis`` (written through) with ``admin_port`` set, then holds
(``engine_run.py``'s ``hold``) while this test asks its endpoint, over HTTP, what an
operator and a router would: ``/tiers`` counts every stored block exactly, ``/query``
matches every prompt's full blocks on both tiers (its token ids hashed as vLLM
hashed them; the walk cpu, then disk, then the shared tier, cumulative, as Dynamo's
indexer counts) and nothing for an unseen prompt, and ``/ready`` turns 503 naming the
redis tier when its ``redis-server`` is frozen (SIGSTOP) or killed (SIGKILL), and
200 again once it is back.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from support.e2e import (
    BATCH,
    BATCH_BLOCKS,
    BLOCK,
    ENGINE_RUN,
    engine_env,
    redis_tier,
    tokens,
    write_spec,
)
from support.redisserver import RedisServer, free_port, require_redis
from support.waiting import returns, wait_until

pytestmark = pytest.mark.slow  # a real vLLM engine
pytest.importorskip("vllm")

HANG_GUARD_S = 600.0
"""A guard against a hang of the engine's start, never a measure."""


def _ask(port: int, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    def ask() -> tuple[int, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request("GET" if body is None else "POST", path, body=data)
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    return returns(ask, path)


def _full(prompt: list[int]) -> int:
    """Tokens of ``prompt``'s full blocks."""
    return len(prompt) // BLOCK * BLOCK


def _entry(n: int) -> dict[str, Any]:
    """The ``/query`` entry of a prompt whose first ``n`` tokens both tiers hold:
    Dynamo's walk reaches ``n`` in the cpu tier, goes no further on disk (there is no
    disk tier: ``disk`` stays ``n``) nor in the shared tier (``remote``); ``gpu`` and
    ``dp`` are 0 (the worker side cannot see vLLM's prefix cache)."""
    return {"longest_matched": n, "gpu": 0, "dp": {"0": 0}, "cpu": n, "disk": n, "remote": n}


def test_the_engines_endpoint_counts_matches_and_probes_its_tiers(tmp_path: Path) -> None:
    """Exact counts, exact matches per tier and medium, and readiness through a frozen
    and a killed redis-server, from a real engine's worker."""
    require_redis()
    redis = RedisServer(tmp_path / "redis").start()
    port = free_port()
    tiers = [
        {"name": "cpu", "backend": "cpu", "capacity": "64MiB", "max_pending_stores": 256},
        redis_tier(redis.url(), socket_timeout_ms=60_000),
    ]
    config = {"tiers": tiers, "admin_port": port, "admin_ready_timeout_ms": 3000}
    spec = write_spec(tmp_path, kvoffload={"config": config}, rounds=[BATCH], hold=True)
    sockets = Path(tempfile.mkdtemp(prefix="kvo-"))
    env = {**os.environ, **engine_env(single_process=True), "TMPDIR": str(sockets)}
    log = tmp_path / "engine.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(ENGINE_RUN), str(spec)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tmp_path,
            start_new_session=True,
        )

    def tail() -> str:
        return log.read_text(errors="replace")[-6000:]

    try:
        # The batch ran, its requests are done and the engine holds, serving nothing
        # but the endpoint; a guard against a hang, never a measure.
        wait_until(
            lambda: "E2E-HOLD" in log.read_text(errors="replace") or proc.poll() is not None,
            "the engine's batch",
            timeout=HANG_GUARD_S,
            poll=0.2,
        )
        assert proc.poll() is None, tail()
        assert _ask(port, "/health")[0] == 200

        def stored() -> dict[str, int]:
            _, body = _ask(port, "/tiers")
            return {t["name"]: t["counters"]["blocks_stored"] for t in body["tiers"]}

        wait_until(
            lambda: stored() == {"cpu": BATCH_BLOCKS, "redis": BATCH_BLOCKS},
            "every block stored in both tiers",
            poll=0.1,
        )
        _, body = _ask(port, "/tiers")
        cpu, shared = body["tiers"]
        assert (cpu["blocks"], cpu["errors"], cpu["breaker"]) == (BATCH_BLOCKS, 0, "closed")
        assert (shared["blocks"], shared["errors"], shared["breaker"]) == (None, 0, "closed")

        for prompt in BATCH:
            status, found = _ask(port, "/query", {"token_ids": prompt})
            assert status == 200, found
            (entry,) = found["instances"].values()
            n = _full(prompt)
            assert entry == _entry(n)
            assert found["tiers"] == {"cpu": n, "redis": n}
        status, found = _ask(port, "/query", {"token_ids": tokens(999, 300)})
        assert status == 200, found
        assert list(found["instances"].values()) == [_entry(0)]

        # Polled: the 3 s deadline is the probe's, and a busy engine may miss it once.
        wait_until(lambda: _ask(port, "/ready")[0] == 200, "ready at start", poll=0.1)
        assert redis.proc is not None
        os.kill(redis.proc.pid, signal.SIGSTOP)
        status, ready = _ask(port, "/ready")
        assert (status, ready["failing"]) == (503, ["redis"]), ready
        assert ready["tiers"][1]["error"].startswith("timeout"), ready
        os.kill(redis.proc.pid, signal.SIGCONT)
        wait_until(lambda: _ask(port, "/ready")[0] == 200, "ready after SIGCONT", poll=0.1)
        redis.kill()
        status, ready = _ask(port, "/ready")
        assert (status, ready["failing"]) == (503, ["redis"]), ready
        redis.start()
        wait_until(lambda: _ask(port, "/ready")[0] == 200, "ready after the restart", poll=0.1)
        assert proc.poll() is None, tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        redis.kill()
        shutil.rmtree(sockets, ignore_errors=True)

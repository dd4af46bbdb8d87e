"""Issue 23 item 3, end to end: prefill/decode disaggregation through the shared tier.

Two vLLM engines (CPU build, the dummy-weight tiny Llama) run at once, each in a
process of its own (``support/pd_engine.py``), and share one real ``redis-server``: a
prefill engine (``kv_role="kv_producer"``: stores its blocks, written through into the
server, and loads nothing) and a decode engine (``kv_role="kv_consumer"``: loads, and
stores nothing). A small proxy here sends each request to the prefill engine with
``max_tokens=1``, then the same prompt to the decode engine, as a P/D router would:
the decode engine's lookup may come while the prefill engine's stores are still on
their way to the server, and it waits for them (``None``: "not yet") until the
prompt's whole loadable prefix is there, or ``producer_wait_ms`` (500 ms here) has
passed since its first lookup.

What it shows: the decode engine's outputs equal an engine's without the connector;
it computes at most 5% of the prompt tokens (vLLM's ``num_cached_tokens``); the
connector's counters show every block the prefill engine stored loaded once, without
a load error (each of the batch's 28 full blocks: the first prompt's 13, then each
prompt's own, the shared prefix found in the decode engine's own prefix cache); the
prefill engine loads nothing, the decode engine stores nothing. Then the prefill
engine is SIGKILLed while it runs a request: the proxy sends that prompt and the next
to the decode engine alone, which waits ``producer_wait_ms`` for blocks that never come
and computes them; no request fails and the outputs are still the reference's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
from support.checkout import SUPPORT
from support.e2e import (
    BATCH,
    BATCH_BLOCKS,
    PREFIX,
    EngineServer,
    failing_loads,
    outputs,
    redis_tier,
    tokens,
)
from support.engine_run import write_tiny_llama
from support.redisserver import RedisServer, require_redis

pytestmark = pytest.mark.slow  # real vLLM engines
pytest.importorskip("vllm")

MODEL_ID = "tiny-llama-dummy@pd"
MAX_TOKENS = 8
WAIT_MS = 500
START_TIMEOUT_S = 240.0
ASK_TIMEOUT_S = 120.0
# After the kill: prompts of their own (nothing of them on the server).
AFTER = [tokens(400 + i, 200) for i in range(3)]
BLOCK = 32


class Engine:
    """One ``pd_engine.py`` process (a process group of its own); under
    ``E2E_FAIL_EVERY_LOAD=1`` its loads fail (``support/e2e.py``)."""

    def __init__(self, tmp: Path, model: Path, role: str, conn: dict[str, Any]) -> None:
        spec = {
            "model": str(model),
            "role": role,
            "engine_id": role,
            "kvoffload": failing_loads(conn),
        }
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "TMPDIR": tempfile.mkdtemp(prefix="kvo-pd-"),
        }
        self.log = tmp / f"{role}.log"
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(SUPPORT / "pd_engine.py"), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                cwd=tmp,
                env=env,
                start_new_session=True,
            )
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.stdin: IO[str] = self.proc.stdin
        self.stdout: IO[str] = self.proc.stdout

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def _line(self, tag: str) -> str | None:
        """The next line starting with ``tag``; ``None`` if the process ended first."""
        for line in self.stdout:
            if line.startswith(tag):
                return line[len(tag) :]
        return None

    def wait_ready(self) -> None:
        assert self._line("PD-READY") is not None, f"engine died at start:\n{self.tail()}"

    def send(self, prompts: list[list[int]], max_tokens: int) -> None:
        self.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.stdin.flush()

    def answer(self) -> dict[str, Any] | None:
        """The last request's result; ``None`` if the engine died."""
        line = self._line("PD-RESULT ")
        return None if line is None else dict(json.loads(line))

    def ask(self, prompts: list[list[int]], max_tokens: int) -> dict[str, Any] | None:
        try:
            self.send(prompts, max_tokens)
        except (BrokenPipeError, OSError):
            return None
        return self.answer()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            with contextlib.suppress(OSError):  # a write left in the buffer: EPIPE
                pipe.close()


@pytest.fixture
def pd(tmp_path: Path) -> Iterator[tuple[Engine, Engine, RedisServer]]:
    """A redis server, the prefill and the decode engine over it (started, not yet
    ready: the reference engine starts meanwhile)."""
    require_redis()
    server = RedisServer(tmp_path / "redis").start()
    model = write_tiny_llama(tmp_path / "model")
    cpu = {"name": "cpu", "backend": "cpu", "capacity": "64MiB", "max_pending_stores": 256}
    conn = {
        "model_id": MODEL_ID,
        "config": {"tiers": [cpu, redis_tier(server.url())], "producer_wait_ms": WAIT_MS},
    }
    started: list[Engine] = []
    try:
        for role in ("kv_producer", "kv_consumer"):
            started.append(Engine(tmp_path, model, role, conn))
        yield started[0], started[1], server
    finally:
        for engine in started:
            engine.kill()
        server.kill()


def test_prefill_decode_through_redis(
    pd: tuple[Engine, Engine, RedisServer], engines: EngineServer, tmp_path: Path
) -> None:
    prefill, decode, _ = pd
    t0 = time.monotonic()
    (ref,) = engines.results(
        tmp_path / "ref", kvoffload=None, rounds=[BATCH + AFTER], max_tokens=MAX_TOKENS
    )
    reference = outputs(ref)
    prefill.wait_ready()
    decode.wait_ready()
    started = time.monotonic() - t0

    # The proxy: each request to the prefill engine (one token), then to the decode one.
    decoded: list[dict[str, Any]] = []
    p = None
    for prompt in BATCH:
        p = prefill.ask([prompt], 1)
        assert p is not None, f"the prefill engine died:\n{prefill.tail()}"
        d = decode.ask([prompt], MAX_TOKENS)
        assert d is not None, f"the decode engine died:\n{decode.tail()}"
        decoded.append(d)
    assert p is not None
    pc, dc = p["kvoffload"], decoded[-1]["kvoffload"]
    detail = json.dumps({"prefill": pc, "decode": dc})
    print("started in", round(started, 1), "s;", detail)
    outs = [d["outputs"][0] for d in decoded]
    assert [o["tokens"] for o in outs] == reference[: len(BATCH)]
    assert not any(o["failed"] for o in outs)
    # The producer loads nothing and writes every full block through to the server.
    assert pc["blocks_loaded"] == 0, detail
    assert pc["lookups"] == 0, detail
    # (Read while its last stores may still run: the decode side's redis hits below
    # prove every block reached the server.)
    assert 0 < pc["tier.cpu.blocks_stored"] <= BATCH_BLOCKS, detail
    # The consumer stores nothing, loads without an error.
    assert dc["tokens_stored"] == 0, detail
    assert dc["load_errors"] == 0, detail
    # Every block the prefill engine stored came to the decode engine from the server
    # (its lookups waited for those still on their way there).
    assert dc["tier.redis.hits"] == BATCH_BLOCKS, detail
    prompt_tokens = sum(len(q) for q in BATCH)
    cached = sum(o["cached"] for o in outs)
    computed = prompt_tokens - cached
    # Every token vLLM reports cached past the shared prefix (which prompts 2 to 4 find
    # in the decode engine's own prefix cache) was loaded by the connector: the
    # batch's every full block, once.
    assert cached - (len(BATCH) - 2) * len(PREFIX) == BATCH_BLOCKS * BLOCK, detail
    assert dc["blocks_loaded"] == BATCH_BLOCKS, detail
    assert dc["tokens_loaded"] == BATCH_BLOCKS * BLOCK, detail
    share = computed / prompt_tokens
    print(f"decode computed {computed} of {prompt_tokens} prompt tokens ({share:.1%})")
    assert share <= 0.05, detail

    # The prefill engine dies while it runs a request: the proxy sends the prompt to
    # the decode engine alone (as it does the next ones), which waits for blocks that
    # never come, then computes them.
    loaded_before = dc["tokens_loaded"]
    prefill.send([AFTER[0]], 1)
    prefill.kill()
    after: list[dict[str, Any]] = []
    for prompt in AFTER:
        alive = prefill.proc.poll() is None
        assert not alive or prefill.ask([prompt], 1) is not None
        d = decode.ask([prompt], MAX_TOKENS)  # the prefill engine is dead: decode alone
        assert d is not None, f"the decode engine died:\n{decode.tail()}"
        after.append(d)
    outs = [d["outputs"][0] for d in after]
    seconds = [round(d["seconds"], 2) for d in after]
    final = after[-1]["kvoffload"]
    print("after the kill: seconds", seconds, "loaded", final["tokens_loaded"] - loaded_before)
    assert not any(o["failed"] for o in outs)
    assert [o["tokens"] for o in outs] == reference[len(BATCH) :]
    # Nothing of the later prompts was ever stored: the decode engine, once its wait
    # for a producer (producer_wait_ms) was over, computed each whole. The first is the
    # one the prefill engine was running when killed: it may have stored some of its
    # blocks first (one CI run: all 6), which the decode engine then loads, and
    # nothing else: the tokens loaded since are exactly those vLLM reports cached.
    assert all(o["cached"] == 0 for o in outs[1:]), outs
    assert outs[0]["cached"] % BLOCK == 0, outs
    assert outs[0]["cached"] <= (len(AFTER[0]) - 1) // BLOCK * BLOCK, outs
    assert final["tokens_loaded"] - loaded_before == outs[0]["cached"], json.dumps(final)
    assert final["load_errors"] == 0
    print("test took", round(time.monotonic() - t0, 1), "s")

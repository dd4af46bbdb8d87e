"""The Grafana dashboard (configs/grafana/kvoffload.json) against a real Prometheus
scraping a real engine.

A dashboard whose queries name a metric that does not exist, or a label it does not
carry, shows empty panels and no error: nothing but evaluating it finds that. This
test starts ``vllm serve``'s OpenAI server (``python -m vllm.entrypoints.openai.
api_server``, the tiny dummy-weight Llama, block size 32) with the connector over a
cpu tier of 16 blocks and an ``mmap`` tier written through with zstd compression, and
Debian's ``prometheus`` scraping its ``/metrics`` every second. The load:

- prompts A, B and C (10 full blocks each, no block in common) are computed and
  stored: 30 blocks in the disk tier; the cpu tier keeps the last 16, none of A's;
- vLLM's prefix cache reset, A again: its 10 blocks come from the disk tier
  (prefetched into the cpu tier and loaded from there: disk hits);
- reset, A again: its 10 blocks come from the cpu tier (cpu hits).

Once Prometheus has scraped the final counts, every query of every panel of the
dashboard is evaluated through ``/api/v1/query`` with Grafana's variables replaced
(``$__rate_interval`` by 5m, longer than the test; ``$tier`` and ``$model_name`` by
``.*``, Grafana's "All"). Each must return at least one series with a finite value;
the variables' own queries must list both tiers and the model. Under ``CI=true`` a
missing ``prometheus`` binary or vLLM fails the test (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.checkout import REPO
from support.engine_run import write_tiny_llama
from support.prometheus import MISSING, PROMETHEUS, Prometheus, dashboard_targets
from support.waiting import wait_until

pytestmark = pytest.mark.slow  # a real engine

DASHBOARD: Final = REPO / "configs" / "grafana" / "kvoffload.json"
BLOCK: Final = 32
PROMPT_BLOCKS: Final = 10
VARIABLES: Final = {"__rate_interval": "5m", "tier": ".*", "model_name": ".*"}
START_TIMEOUT_S: Final = 420.0  # import, engine start and warm-up on a busy 2-core machine
METRICS_TIMEOUT_S: Final = 60.0


def _prompt(seed: int) -> list[int]:
    """10 full blocks and 6 tokens more (a prompt's last token is never cached)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(PROMPT_BLOCKS * BLOCK + 6)]


A, B, C = (_prompt(seed) for seed in (1, 2, 3))


def _real_server() -> Any:
    """scripts/real_server.py: the serving benchmarks' server helpers."""
    spec = importlib.util.spec_from_file_location("real_server", REPO / "scripts/real_server.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("real_server", module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    """The OpenAI server over cpu (16 blocks) -> mmap (written through, zstd)."""
    if PROMETHEUS is None:  # a runtime skip: under CI=true it fails
        pytest.skip(MISSING)
    pytest.importorskip("vllm")
    real_server = _real_server()
    config = real_server.write_config(
        tmp_path / "kvoffload.yaml",
        [
            {"name": "cpu", "backend": "cpu", "capacity": 16 * 16384, "max_pending_stores": 64},
            {
                "name": "disk",
                "backend": "mmap",
                "path": str(tmp_path / "disk"),
                "capacity": "4MiB",
                "write_policy": "write_through",
                "compression": "zstd",
                "max_pending_stores": 64,
            },
        ],
    )
    srv = real_server.Server(
        write_tiny_llama(tmp_path / "model"),
        config,
        tmp_path / "server.log",
        # Every hit loaded, whatever the measured speed of its tier: a count of the
        # test may not depend on how fast this machine is (the skip counter's series
        # is there all the same, at 0).
        options={"load_or_recompute": False},
        max_model_len=2048,
        kvcache_gib=1,
        extra_args=["--load-format", "dummy", "--skip-tokenizer-init"],
    )
    try:
        srv.wait_healthy(timeout=START_TIMEOUT_S)
        yield srv
    finally:
        srv.kill()


def _complete(url: str, prompt: list[int]) -> int:
    """One greedy completion of 4 tokens; the prompt tokens it found cached."""
    response = httpx.post(
        f"{url}/v1/completions",
        json={
            "model": "smollm2",  # scripts/real_server.py's --served-model-name
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "ignore_eos": True,
        },
        timeout=300,
    )
    response.raise_for_status()
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` with ``labels`` (over engines)."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _wait_metrics(url: str, done: Callable[[str], bool], what: str) -> str:
    """``/metrics`` once ``done`` holds (the stats reach the API process with the
    engine's step outputs, a little after the responses)."""
    texts: list[str] = []

    def check() -> bool:
        texts.append(httpx.get(f"{url}/metrics", timeout=10).text)
        return done(texts[-1])

    try:
        wait_until(check, what, timeout=METRICS_TIMEOUT_S, poll=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_ours(texts[-1])}") from None
    return texts[-1]


def _ours(text: str) -> str:
    """Our series of a ``/metrics`` text (failure messages)."""
    return "\n".join(line for line in text.splitlines() if line.startswith("vllm:kvoffload_"))


def _hits(text: str, tier: str) -> float:
    return _metric(text, "vllm:kvoffload_tier_hits_total", tier=tier)


def _finite(series: list[dict[str, Any]]) -> list[float]:
    return [v for v in (float(s["value"][1]) for s in series) if math.isfinite(v)]


def test_every_panel_of_the_dashboard_returns_data(tmp_path: Path, server: Any) -> None:
    url = server.url
    prom = Prometheus(tmp_path / "prometheus", [url.removeprefix("http://")])
    try:
        prom.wait_ready()
        # Scraped before the load, at 0 (the configured tiers' series exist from the
        # start): a rate needs a sample before the rise, or every panel reads 0.
        wait_until(
            lambda: len(prom.query("vllm:kvoffload_tier_hits_total == 0")) == 2,
            "Prometheus's first scrape of the engine",
            timeout=30,
            poll=0.2,
        )
        t0 = time.monotonic()
        cached = [_complete(url, p) for p in (A, B, C)]
        stored = PROMPT_BLOCKS * 3
        _wait_metrics(
            url,
            lambda t: _metric(t, "vllm:kvoffload_tier_blocks_stored_total", tier="disk") >= stored,
            f"{stored} blocks stored in the disk tier",
        )
        server.reset_prefix_cache()
        cached.append(_complete(url, A))  # from the disk tier
        _wait_metrics(url, lambda t: _hits(t, "disk") >= PROMPT_BLOCKS, "the disk tier's hits")
        server.reset_prefix_cache()
        cached.append(_complete(url, A))  # from the cpu tier
        final = _wait_metrics(url, lambda t: _hits(t, "cpu") >= PROMPT_BLOCKS, "cpu hits")
        load_seconds = time.monotonic() - t0

        # Prometheus has scraped the final counts: its totals equal /metrics'.
        def scraped() -> bool:
            for name in ("vllm:kvoffload_tier_hits_total", "vllm:kvoffload_blocks_loaded_total"):
                series = prom.query(f"sum({name})")
                if not series or float(series[0]["value"][1]) != _metric(final, name):
                    return False
            return True

        wait_until(scraped, "Prometheus's scrape of the final counts", timeout=30, poll=0.5)
        targets = dashboard_targets(DASHBOARD, VARIABLES)
        results = {t: prom.query(t.expr) for t in targets}
        tiers = prom.label_values("tier", "vllm:kvoffload_tier_hits_total")
        models = prom.label_values("model_name", "vllm:kvoffload_lookups_total")
    finally:
        prom.stop()

    report = "\n".join(
        f"{t.panel} [{t.ref}]: "
        + ", ".join(f"{s['metric'].get('tier', s['metric'])}={s['value'][1]}" for s in r)
        for t, r in results.items()
    )
    print(f"load {load_seconds:.1f} s; cached tokens per request {cached}\n{report}")
    kv = _ours(final)
    # The load did what it is for: A, B, C computed; A from the disk tier, then the cpu.
    assert cached == [0, 0, 0, PROMPT_BLOCKS * BLOCK, PROMPT_BLOCKS * BLOCK], kv
    assert _hits(final, "disk") == PROMPT_BLOCKS, kv
    assert _hits(final, "cpu") == PROMPT_BLOCKS, kv
    assert sorted(tiers) == ["cpu", "disk"]
    assert models == ["smollm2"]
    panels = {t.panel for t in targets}
    assert len(panels) == 15, sorted(panels)
    assert len(targets) == 31, targets
    empty = [f"{t.panel} [{t.ref}]: {t.expr}" for t, r in results.items() if not _finite(r)]
    assert not empty, "queries with no finite value:\n" + "\n".join(empty) + f"\n{report}"
    # Per tier where each tier has traffic: both tiers' hits, the disk's compression.
    by_title = {(t.panel, t.ref): r for t, r in results.items()}
    hits = {s["metric"]["tier"]: float(s["value"][1]) for s in by_title["Hits", "A"]}
    assert hits["cpu"] > 0, report
    assert hits["disk"] > 0, report
    ratio = {s["metric"]["tier"]: float(s["value"][1]) for s in by_title["Compression ratio", "A"]}
    assert ratio["cpu"] == 1.0, report  # stores raw bytes
    assert ratio["disk"] > 1.0, report  # zstd shrinks the dummy model's KV
    # Blocks per GiB, one series per tier, labelled with the codec the config gives it.
    per_gib = {
        (s["metric"]["tier"], s["metric"]["codec"]): float(s["value"][1])
        for s in by_title["Blocks per GiB of capacity", "A"]
    }
    assert set(per_gib) == {("cpu", "none"), ("disk", "zstd")}, report
    assert all(v > 0 for v in per_gib.values()), report  # both tiers hold blocks

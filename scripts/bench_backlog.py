"""Backlog (issue 22): TTFT under a backlog whose hits are on disk, with prefetch on arrival
and without.

SmolLM2-135M (a real model, ``scripts/real_server.py``) behind vLLM's OpenAI-compatible
server, the connector over a cpu tier and an mmap disk tier (written through):

1. **fill**: a server runs vLLM's own serving benchmark (``scripts/vllm_bench_serve.py``,
   the ``prefix_repetition`` dataset: ``--num-prefixes`` random prefixes shared by
   ``--num-prompts`` prompts) once, storing every prompt's blocks through to disk, and
   is stopped with SIGTERM (the connector finishes its queued writes);
2. for each setting of ``prefetch_on_arrival`` (``on``, ``off``): a new server (its cpu
   tier and vLLM's prefix cache empty, so the hits are on disk) runs the same dataset
   (same seed, so the same prompts) at ``--request-rate``, above what the engine
   serves (the report's ``request_throughput`` shows it), and is stopped.

**The serving floor** (issue 31): the settings ``alone_big``, ``alone_small``,
``cpu_warm`` and ``mmap_restart`` compare, on the same dataset at the same rate:

- ``alone_big``: vLLM alone with a KV cache that holds the whole working set (the
  default 2 GiB), warmed by the same dataset in the same server first: every prompt's
  full blocks are vLLM's own prefix-cache hits. The floor.
- ``alone_small``: vLLM alone with ``--small-blocks`` KV cache blocks (far less than
  the working set), warmed the same way: what the tiers are there to fix.
- ``cpu_warm``: the small cache and the connector over a cpu tier that holds the working
  set, warmed the same way in the same server.
- ``mmap_restart``: the small cache and the connector in a new server whose cpu tier is
  empty, over the disk tier the fill wrote (a restart).

``vs_floor`` is each one's mean TTFT over ``alone_big``'s (target <= 1.2 for
``cpu_warm`` and ``mmap_restart``), ``vs_small`` over ``alone_small``'s::

    .venv/bin/python scripts/bench_backlog.py --settings \
        alone_big,alone_small,cpu_warm,mmap_restart,mmap_restart,cpu_warm,alone_small,alone_big \
        --json out/bench_serving_floor.json

Reported per run: vLLM's mean / median / p99 TTFT, request throughput, and the
connector's counters (``prefetches_on_arrival``, ``prefetch_hits``, disk hits); per
setting the mean over its runs (``--settings`` on,off,off,on by default, so that the
order of the servers cancels out). ``gain`` = 1 - mean TTFT on / mean TTFT off; target
>= 0.20. The disk tier is read from the page cache unless ``--drop-caches`` (root)
drops it before each server; ``--slow-s`` makes the measured servers' disk tier the
test plugin's ``faultymmap`` over the same files, each I/O first sleeping that long (a
slow volume)::

    .venv/bin/python scripts/bench_backlog.py --json out/bench_backlog.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from real_server import (
    BLOCK_BYTES,
    MODEL_NAME,
    REPO,
    Server,
    delta,
    machine,
    model_dir,
    serving,
    write_config,
)

from kvoffload.tools.bench.harness import save_report

SETTINGS: dict[str, dict[str, Any]] = {
    "on": {"options": {"prefetch_on_arrival": True}},
    "off": {"options": {"prefetch_on_arrival": False}},
    "alone_big": {"connector": None, "warm": True},
    "alone_small": {"connector": None, "warm": True, "small": True},
    "cpu_warm": {"connector": "cpu", "warm": True, "small": True},
    "mmap_restart": {"connector": "disk", "small": True},
}
"""Per measured run: the connector's config (``disk``: cpu and the filled mmap tier, the
default; ``cpu``: a cpu tier alone; ``None``: vLLM alone), whether the server first runs
the same dataset itself (``warm``), whether vLLM's KV cache is ``--small-blocks``, and
the connector's ``options``."""
FLOOR = "alone_big"


def bench_serve(
    server: Server, model: Path, args: argparse.Namespace, rate: str, out: Path
) -> dict[str, Any]:
    """vLLM's serving benchmark through the wrapper; its saved JSON report."""
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "vllm_bench_serve.py"),
        "--backend",
        "vllm",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/completions",
        "--model",
        MODEL_NAME,
        "--tokenizer",
        str(model),
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-prefix-len",
        str(args.prefix_len),
        "--prefix-repetition-suffix-len",
        str(args.suffix_len),
        "--prefix-repetition-num-prefixes",
        str(args.num_prefixes),
        "--prefix-repetition-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        rate,
        "--seed",
        str(args.seed),
        "--ignore-eos",
        "--temperature",
        "0",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    log = out.with_suffix(".log")
    with log.open("wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"vllm_bench_serve.py exited {rc}:\n{log.read_text()[-4000:]}")
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def _settle_stores(server: Server, key: str = "tier_blocks_stored{disk}") -> float:
    """Wait until the disk tier's stored count stops rising; the count."""
    last, still = -1.0, 0
    while still < 4:
        now = server.metrics().get(key, 0.0)
        server.complete("Hi", 1)  # a step, which brings the connector's latest counts
        still = still + 1 if now == last else 0
        last = now
        time.sleep(0.5)
    return last


def _drop(args: argparse.Namespace) -> bool | None:
    if not args.drop_caches:
        return None
    from kvoffload.tools.bench.raw import drop_page_cache

    return drop_page_cache()


SUMMARY = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_e2el_ms",
    "request_throughput",
    "completed",
    "duration",
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=16)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--request-rate", default="8", help="requests/s of the measured runs")
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--settings", default="on,off,off,on", help="the measured runs, in order (ABBA)")
    p.add_argument(
        "--slow-s",
        type=float,
        default=0.0,
        help="measured runs: the disk tier as faultymmap, each I/O first sleeping this long "
        "(a slow volume); 0: plain mmap",
    )
    p.add_argument(
        "--small-blocks",
        type=int,
        default=128,
        help="vLLM's KV cache blocks in the settings with a small cache (max_model_len "
        "2048 there, so that 64 blocks hold one request)",
    )
    p.add_argument("--drop-caches", action="store_true", help="drop the page cache (root)")
    p.add_argument("--work", type=Path, default=Path("out/bench_backlog"))
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--extra-config",
        default="{}",
        help="JSON merged into the kvoffload config's top level (e.g. async_load_min_bytes)",
    )
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    disk = work / "disk"
    if disk.exists():
        import shutil

        shutil.rmtree(disk)
    model = model_dir()
    room = {"max_pending_stores": 1024}
    cpu = {"name": "cpu", "backend": "cpu", "capacity": "1GiB", **room}
    disk_tier = {
        "name": "disk",
        "backend": "mmap",
        "path": str(disk),
        "capacity": "4GiB",
        "write_policy": "write_through",
        **room,
    }
    extra = json.loads(args.extra_config)
    config = write_config(work / "kvoffload.yaml", [cpu, disk_tier], **extra)
    measured = config
    if args.slow_s > 0:  # the same files, every disk I/O first sleeping slow_s
        slow = {"backend": "faultymmap", "slow": 1.0, "slow_s": args.slow_s}
        measured = write_config(work / "slow.yaml", [cpu, {**disk_tier, **slow}], **extra)
    report: dict[str, Any] = {
        "machine": machine(),
        "dataset": {
            "name": "prefix_repetition",
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "num_prefixes": args.num_prefixes,
            "num_prompts": args.num_prompts,
            "output_len": args.output_len,
            "seed": args.seed,
            "block_bytes": BLOCK_BYTES,
        },
        "request_rate": args.request_rate,
        "disk_slow_s": args.slow_s,
        "runs": [],
    }
    t0 = time.monotonic()
    with serving(model, config, work / "server-fill.log") as server:
        fill = bench_serve(server, model, args, "inf", work / "fill.json")
        stored = _settle_stores(server)
    report["fill"] = {
        "seconds": round(time.monotonic() - t0, 1),
        "disk_blocks_stored": stored,
        "request_throughput": fill.get("request_throughput"),
    }
    print("fill", json.dumps(report["fill"]), flush=True)
    cpu_only = write_config(work / "cpu.yaml", [cpu], **extra)
    configs = {"disk": measured, "cpu": cpu_only, None: None}
    for i, name in enumerate(args.settings.split(",")):
        setting = SETTINGS[name]
        dropped = _drop(args)
        log = work / f"server-{i}-{name}.log"
        small = ["--num-gpu-blocks-override", str(args.small_blocks)]
        with serving(
            model,
            configs[setting.get("connector", "disk")],
            log,
            options=setting.get("options"),
            extra_args=small if setting.get("small") else None,
            # A small cache must still hold one request of the model's length.
            max_model_len=2048 if setting.get("small") else 8192,
        ) as server:
            if setting.get("warm"):  # the same prompts first, in this server
                bench_serve(server, model, args, "inf", work / f"{i}-{name}-warm.json")
                if setting.get("connector"):
                    _settle_stores(server, "tier_blocks_stored{cpu}")
            before = server.metrics()
            result = bench_serve(server, model, args, args.request_rate, work / f"{i}-{name}.json")
            time.sleep(2)  # the last steps' stats
            counters = delta(server.metrics(), before)
        run = {"setting": name, **{k: result.get(k) for k in SUMMARY}}
        run.update(page_cache_dropped=dropped, counters=counters)
        report["runs"].append(run)
        print(name, json.dumps(run), flush=True)
    # Per setting, the mean over its runs (--settings on,off,off,on cancels an order bias).
    summary: dict[str, dict[str, float]] = {}
    for name in SETTINGS:
        mine = [r for r in report["runs"] if r["setting"] == name]
        if mine:
            summary[name] = {
                k: round(sum(r[k] for r in mine) / len(mine), 1)
                for k in ("mean_ttft_ms", "p99_ttft_ms", "request_throughput")
            }
    report["summary"] = summary
    if FLOOR in summary:
        floor = summary[FLOOR]["mean_ttft_ms"]
        small_ttft = summary.get("alone_small", {}).get("mean_ttft_ms")
        for figures in summary.values():
            figures["vs_floor"] = round(figures["mean_ttft_ms"] / floor, 2)
            if small_ttft:
                figures["vs_small"] = round(figures["mean_ttft_ms"] / small_ttft, 2)
    if "on" in summary and "off" in summary:
        on, off = summary["on"], summary["off"]
        report["gain_mean_ttft"] = round(1 - on["mean_ttft_ms"] / off["mean_ttft_ms"], 3)
        report["gain_p99_ttft"] = round(1 - on["p99_ttft_ms"] / off["p99_ttft_ms"], 3)
    save_report(args.json, report, echo=True)


if __name__ == "__main__":
    main()

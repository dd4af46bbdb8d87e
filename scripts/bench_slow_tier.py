"""A slow tier (issue 22): TTFT of a hit from a disk tier slower than recomputing, vs cold.

SmolLM2-135M (a real model, ``scripts/real_server.py``) behind vLLM's OpenAI-compatible
server, the connector over a cpu tier and a disk tier at the same path:

1. **fill**: a server over a plain ``mmap`` disk tier (written through) computes two
   prompts (``--tokens`` of real text each: ``primer`` and ``hit``) and is stopped with
   SIGTERM: their blocks are on disk;
2. **measure**: a new server over the same files as ``faultymmap`` (the test plugin's
   mmap tier with faults, ``tests/plugin_dist``; ``make dev`` installs it), every read
   and write first sleeping ``--slow-s``, so loading is slower than recomputing. It
   computes a third prompt of the same length (``cold``: a miss everywhere; the
   connector measures the engine's prefill rate), then ``primer`` (a disk hit: the
   connector measures the tier's read rate; the choice loads a hit whole until both
   estimates exist), then ``hit`` (on disk only, its cpu tier and vLLM's prefix
   cache empty).

Reported: TTFT cold and hit, ``ratio`` = hit / cold (target with the load-or-recompute
choice on: <= 1.05), and the connector's counters of the measuring server (for the
choice: ``skipped_slower_than_recompute``; for the waits: ``prefetch_*``,
``load_timeouts``). Any connector option or config field can be set, so the same
script measures the choice on and off::

    .venv/bin/python scripts/bench_slow_tier.py --json out/bench_slow_tier.json
    .venv/bin/python scripts/bench_slow_tier.py --option load_or_recompute=false
    .venv/bin/python scripts/bench_slow_tier.py --extra-config '{"load_timeout_ms": 60000}'
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

from real_server import (
    BLOCK,
    BLOCK_BYTES,
    delta,
    machine,
    model_dir,
    real_text_tokens,
    serving,
    tokenizer,
    write_config,
)

from kvoffload.tools.bench.harness import save_report


def _option(text: str) -> tuple[str, Any]:
    key, _, value = text.partition("=")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="prompt length")
    p.add_argument("--slow-s", type=float, default=12.0, help="sleep before each disk I/O")
    p.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="a connector option (kv_connector_extra_config), e.g. load_or_recompute=false",
    )
    p.add_argument("--extra-config", default="{}", help="JSON merged into the config's top")
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("out/bench_slow_tier"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    disk = work / "disk"
    shutil.rmtree(disk, ignore_errors=True)
    options = dict(_option(o) for o in args.option)
    extra = json.loads(args.extra_config)
    model = model_dir()
    text = real_text_tokens(tokenizer(model), 3 * args.tokens)
    n = args.tokens
    hit_prompt, cold_prompt, primer = text[:n], text[n : 2 * n], text[2 * n :]
    blocks = (args.tokens - 1) // BLOCK
    cpu = {"name": "cpu", "backend": "cpu", "capacity": "1GiB", "max_pending_stores": 512}
    disk_tier = {
        "name": "disk",
        "path": str(disk),
        "capacity": "2GiB",
        "write_policy": "write_through",
        "max_pending_stores": 512,
    }
    fill_config = write_config(work / "fill.yaml", [cpu, {**disk_tier, "backend": "mmap"}], **extra)
    slow = {"backend": "faultymmap", "slow": 1.0, "slow_s": args.slow_s}
    slow_config = write_config(work / "slow.yaml", [cpu, {**disk_tier, **slow}], **extra)
    report: dict[str, Any] = {
        "machine": machine(),
        "tokens": args.tokens,
        "hit_blocks": blocks,
        "hit_bytes": blocks * BLOCK_BYTES,
        "slow_s": args.slow_s,
        "options": options,
        "extra_config": extra,
    }
    with serving(model, fill_config, work / "server-fill.log", options=options) as server:
        fill = server.complete(hit_prompt, args.max_tokens)
        server.complete(primer, args.max_tokens)
        stored = server.wait_metric("tier_blocks_stored{disk}", 2 * blocks, 120, poke=True)
    report["fill"] = {
        "ttft_ms": round(fill["seconds"] * 1e3, 1),
        "disk_blocks_stored": stored.get("tier_blocks_stored{disk}", 0),
    }
    print("fill", json.dumps(report["fill"]), flush=True)
    with serving(model, slow_config, work / "server-slow.log", options=options) as server:
        server.complete("Hello", 2)  # warm-up
        before = server.metrics()
        cold = server.complete(cold_prompt, args.max_tokens)
        primed = server.complete(primer, args.max_tokens)
        hit = server.complete(hit_prompt, args.max_tokens)
        time.sleep(2)  # the last steps' stats
        counters = delta(server.metrics(), before)
        log = server.tail(20000)
    details = hit["usage"].get("prompt_tokens_details") or {}
    report.update(
        cold_ttft_ms=round(cold["seconds"] * 1e3, 1),
        primer_ttft_ms=round(primed["seconds"] * 1e3, 1),
        hit_ttft_ms=round(hit["seconds"] * 1e3, 1),
        ratio=round(hit["seconds"] / cold["seconds"], 3),
        hit_cached_tokens=details.get("cached_tokens"),
        same_text=hit["choices"][0]["text"] == fill["choices"][0]["text"],
        counters=counters,
        connector_log=[
            line[:400]
            for line in log.splitlines()
            if "kvoffload" in line and "non-default args" not in line and "config:" not in line
        ][-10:],
    )
    save_report(args.json, report, echo=True)


if __name__ == "__main__":
    main()

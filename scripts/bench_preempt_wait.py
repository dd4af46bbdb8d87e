"""A step's wait in ``handle_preemptions`` while a large prefill's stores are in flight.

vLLM calls the connector's ``handle_preemptions(metadata)`` on every step, before the
forward pass. Until issue 29 the worker side waited there for every store in flight to
read the engine's blocks (up to ``store_timeout_ms``), so the stores of one large
prefill were added to the next step of every request. Now it waits only for fenced
stores and for the stores of the requests the step's metadata names as preempted
(whose blocks this step may reuse).

This script drives the connector's worker side (``TieredOffloadWorker``, the real
Offloader and cpu tier, vLLM 0.32's CPU KV cache shape for SmolLM2-135M: 30 layers, 3
KV heads of 64, 32-token blocks of 720 KiB) through the two calls that matter:
``wait_for_save`` hands it a prefill's stores (``--tokens`` tokens), then the next
step's ``handle_preemptions`` is timed, three ways in the same run, interleaved:

- ``idle``: no store in flight (the baseline: the least a step can cost here);
- ``stores in flight``: the step's metadata names no preemption (every step now);
- ``preempted``: the metadata names the storing request as preempted, so the step
  waits for its stores to read its blocks (what every step paid before issue 29).

Ratios are against ``idle``, medians of ``--repeats``::

    .venv/bin/python scripts/bench_preempt_wait.py --json out/bench_preempt_wait.json
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import uuid
from functools import partial
from pathlib import Path
from typing import Any

import torch
from kvoffload.connectors.vllm.metadata import Store, TieredOffloadMetadata
from kvoffload.connectors.vllm.shared import _close
from kvoffload.connectors.vllm.worker import TieredOffloadWorker

from kvoffload.config import load_config
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.tools.bench.harness import run_facts, timed, write_json

LAYERS, HEADS, HEAD, BLOCK = 30, 3, 64, 32


def _worker(num_blocks: int, capacity: int) -> tuple[TieredOffloadWorker, str]:
    layout = KVLayout(
        num_layers=LAYERS, num_kv_heads=HEADS, head_dim=HEAD, block_size=BLOCK, namespace="bench"
    )
    config = load_config({"tiers": [{"name": "cpu", "backend": "cpu", "capacity": capacity}]})
    engine_id = f"bench-preempt-{uuid.uuid4().hex[:8]}"
    worker = TieredOffloadWorker(
        config=config,
        layout=layout,
        engine_id=engine_id,
        rank=0,
        ranks=1,
        slot=engine_id,
        block_size=BLOCK,
        events=False,
        load_or_recompute=False,
    )
    gen = torch.Generator().manual_seed(0)
    caches = {
        f"layer{i}": torch.randint(
            -100, 100, (num_blocks, 2, BLOCK, HEADS, HEAD), generator=gen, dtype=torch.int16
        ).view(torch.bfloat16)
        for i in range(LAYERS)
    }
    worker.register_kv_caches(caches)
    return worker, engine_id


def _drain(worker: TieredOffloadWorker, req_id: str) -> None:
    """Finish the request and wait until the worker says its stores are done."""
    finished = {req_id}
    while True:
        sending, _ = worker.get_finished(finished)
        finished = set()
        if sending and req_id in sending:
            return
        time.sleep(0.001)


def run(tokens: int, repeats: int) -> dict[str, Any]:
    blocks = tokens // BLOCK
    block_bytes = LAYERS * 2 * BLOCK * HEADS * HEAD * 2
    worker, engine_id = _worker(blocks + 8, capacity=4 * blocks * block_bytes)
    times: dict[str, list[float]] = {"idle": [], "stores in flight": [], "preempted": []}
    try:
        for rep in range(repeats):
            for mode in times:
                req_id = f"r{rep}-{mode}"
                if mode != "idle":
                    keys = [BlockKey(uuid.uuid4().bytes) for _ in range(blocks)]
                    store = Store(req_id, keys, list(range(blocks)))
                    worker.wait_for_save(TieredOffloadMetadata(stores=[store]))
                step = TieredOffloadMetadata(preempted={req_id} if mode == "preempted" else set())
                times[mode].append(timed(partial(worker.handle_preemptions, step)))
                if mode != "idle":
                    _drain(worker, req_id)
    finally:
        _close(engine_id)
    medians = {mode: statistics.median(ts) for mode, ts in times.items()}
    base = medians["idle"]
    return {
        "tokens": blocks * BLOCK,
        "blocks": blocks,
        "store_bytes": blocks * block_bytes,
        "repeats": repeats,
        "median_ms": {m: round(v * 1e3, 3) for m, v in medians.items()},
        "ratio_to_idle": {m: round(v / base, 2) for m, v in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="the prefill's tokens")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory():
        result = run(args.tokens, args.repeats)
    mib = result["store_bytes"] / 2**20
    print(f"handle_preemptions after a {result['tokens']}-token prefill's stores ({mib:.0f} MiB)")
    for mode, ms in result["median_ms"].items():
        print(f"  {mode:18s} {ms:9.3f} ms  {result['ratio_to_idle'][mode]:8.2f}x idle")
    if args.json:
        write_json(args.json, result, facts=run_facts())


if __name__ == "__main__":
    main()

"""A real model's cpu-tier hit, loaded into vLLM's CPU KV cache, against its memcpy floor.

SmolLM2-135M on vLLM 0.32's CPU build: 30 layers, each its own ``[num_blocks, 3 KV
heads, block_size, 2 x 64]`` bf16 tensor (CPU attention's LBHNC cache: K and V side by
side in the last dimension), so a 32-token block is 30 pieces of 24 KiB, 720 KiB in
all. The connector (one KV cache group) builds its block pool over those tensors as
``register_kv_caches`` does, stores the prompt's blocks the way the engine hands them
over (a store job per prefill chunk), and a hit loads them back the way
``start_load_kv`` does (claim, ``submit_load``, wait) into other blocks of the cache.
The floor is a plain copy of the same bytes in the same run (the fastest of torch's
``copy_`` on all threads, on one, and numpy's ``copyto``); the ratio is load time over
floor time, both best of ``--repeats``. The loaded bytes are checked against the stored
ones after every load::

    .venv/bin/python scripts/bench_real_load.py --json out/bench_real_load.json

Defaults: the 5,915-token prompt of issue 22 (184 blocks of 32 tokens, 136 MB).
``--layerwise`` times the connector's layer-wise load (``layerwise_loads``) instead.

``--beside gil`` (the default) runs, during every timing, loads and floor alike, a
thread that steps Python code without pause, as the engine's thread does while a hit
loads in the background (vLLM's asynchronous load: the engine keeps stepping). Every
time the load's thread hands the GIL back between two calls, it waits for that thread
(up to ``sys.getswitchinterval()``, 5 ms): the cost that made the issue's hit slow,
and which a load measured alone never shows (``--beside none``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvoffload.blockpool import BlockPool
from kvoffload.config import load_config
from kvoffload.datapath import LayerProgress
from kvoffload.keys import BlockKey
from kvoffload.layout import KVLayout
from kvoffload.offloader import Offloader
from kvoffload.tools.bench.harness import gbps, run_facts, write_json

LAYERS, HEADS, HEAD = 30, 3, 64


def vllm_cpu_caches(num_blocks: int, block_size: int) -> list[torch.Tensor]:
    """Per-layer caches shaped as vLLM 0.32 CPU attention's, filled with random bytes
    (each layer its own allocation, as vLLM's per-layer raw tensors)."""
    gen = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(LAYERS):
        raw = torch.randint(
            0,
            256,
            (num_blocks * HEADS * block_size * 2 * HEAD * 2,),
            dtype=torch.uint8,
            generator=gen,
        )
        caches.append(raw.view(torch.bfloat16).view(num_blocks, HEADS, block_size, 2 * HEAD))
    return caches


@contextlib.contextmanager
def beside(kind: str) -> Iterator[None]:
    """Run a thread holding the GIL in short Python steps (``kind`` ``"gil"``), or
    nothing (``"none"``), while the block runs."""
    stop = threading.Event()

    def steps() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=steps, daemon=True) if kind == "gil" else None
    if thread is not None:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def floor_seconds(nbytes: int, repeats: int) -> tuple[float, str]:
    """The fastest plain copy of ``nbytes`` (best of ``repeats`` per variant)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    threads = torch.get_num_threads()
    best: tuple[float, str] = (float("inf"), "")
    variants = {
        f"torch copy_ ({threads} threads)": (threads, lambda: dst.copy_(src)),
        "torch copy_ (1 thread)": (1, lambda: dst.copy_(src)),
        "numpy copyto": (threads, lambda: np.copyto(dst.numpy(), src.numpy())),
    }
    try:
        for name, (n, fn) in variants.items():
            torch.set_num_threads(n)
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = min(best, (time.perf_counter() - t0, name))
    finally:
        torch.set_num_threads(threads)
    return best


def measure(
    blocks: int,
    block_size: int,
    chunk: int,
    repeats: int,
    layerwise: bool,
    seed: int,
    beside_kind: str = "gil",
) -> dict[str, Any]:
    num_blocks = 2 * blocks + 16
    caches = vllm_cpu_caches(num_blocks, block_size)
    pool = BlockPool(caches)  # the connector's pool of a one-group model
    layout = KVLayout(
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD,
        block_size=block_size,
        dtype="bfloat16",
        namespace="smollm2",
    )
    pool.check_layout(layout)
    bpb = layout.bytes_per_block
    rng = np.random.default_rng(seed)
    ids = rng.permutation(num_blocks).tolist()
    src_ids, dst_ids = ids[:blocks], ids[blocks : 2 * blocks]
    tiers = [{"name": "cpu", "capacity": (blocks + 8) * bpb, "max_pending_stores": 64}]
    off = Offloader(load_config({"tiers": tiers}, env={}), layout, pool)
    keys = [BlockKey(i.to_bytes(4, "big") * 4) for i in range(blocks)]
    try:
        for s in range(0, blocks, chunk):  # one store job per prefill chunk
            job = off.submit_store(keys[s : s + chunk], src_ids[s : s + chunk])
            assert job is not None
            (res,) = off.wait([job], 120)
            assert res.success, res.error
        off.drain()
        want = pool.gather(src_ids)
        loads = []
        for r in range(repeats):
            for c in caches:  # the target blocks hold something else before each load
                c[dst_ids].zero_()
            owner = ("bench", r)
            plan = off.claim(owner, keys)
            assert plan is not None
            assert plan.hits == blocks, plan.hits
            with beside(beside_kind):
                t0 = time.perf_counter()
                layers = LayerProgress(pool.num_layers) if layerwise else None
                load = off.submit_load(plan, dst_ids, layers=layers)
                assert load is not None
                (res,) = off.wait([load], 120)
                loads.append(time.perf_counter() - t0)
            assert res.success, res.error
            assert res.nbytes == blocks * bpb, res.nbytes
            off.release(owner)
            if not torch.equal(pool.gather(dst_ids), want):
                raise AssertionError("loaded bytes differ from the stored ones")
    finally:
        off.close()
    nbytes = blocks * bpb
    load_s = min(loads)
    with beside(beside_kind):
        floor_s, floor_name = floor_seconds(nbytes, repeats)
    return {
        "model": "SmolLM2-135M (30 layers, 3 KV heads, head 64, bf16)",
        "cache_shape": [num_blocks, HEADS, block_size, 2 * HEAD],
        "blocks": blocks,
        "block_size": block_size,
        "tokens": blocks * block_size,
        "bytes_per_block": bpb,
        "piece_bytes": pool.layer_bytes[0],
        "mb": nbytes / 1e6,
        "store_chunk_blocks": chunk,
        "layerwise": layerwise,
        "beside": beside_kind,
        "flat_copy": pool._flat is not None if hasattr(pool, "_flat") else False,
        "threads": torch.get_num_threads(),
        "load_ms": load_s * 1e3,
        "load_ms_all": [round(t * 1e3, 2) for t in loads],
        "load_gbps": gbps(nbytes, load_s),
        "floor": floor_name,
        "floor_ms": floor_s * 1e3,
        "floor_gbps": gbps(nbytes, floor_s),
        "ratio_to_floor": load_s / floor_s,
        "verified": True,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=184, help="blocks of the hit")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per block")
    parser.add_argument("--chunk", type=int, default=64, help="blocks per store job")
    parser.add_argument("--repeats", type=int, default=7, help="best of this many")
    parser.add_argument("--layerwise", action="store_true", help="layer-wise loads")
    parser.add_argument(
        "--beside", choices=("gil", "none"), default="gil", help="what runs beside the load"
    )
    parser.add_argument("--seed", type=int, default=0, help="block ids drawn with it")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args()
    row = measure(
        args.blocks,
        args.block_size,
        args.chunk,
        args.repeats,
        args.layerwise,
        args.seed,
        args.beside,
    )
    print(json.dumps(row, indent=1))
    if args.json:
        write_json(args.json, row, facts=run_facts(), indent=1)


if __name__ == "__main__":
    main()

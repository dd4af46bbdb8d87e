"""TTFT on a real vLLM engine: cold prefill vs hits from our tiers vs vLLM's ExampleConnector.

Everything is measured in one run, on this machine, with one dummy-weight Llama big
enough that prefill costs real time on a CPU (hidden 1024, 8 layers, 8 KV heads of
128; block size 32). The dtype is float32 by default: on a CPU without AVX-512 BF16
(this one) vLLM's bf16 prefill is 5x slower than fp32, which would flatter every hit;
one fp32 block is 32 tokens x 64 KiB = 2 MiB of KV::

    sudo .venv/bin/python scripts/bench_vllm.py --json out/bench_vllm.json

Parts (each engine runs in its own process; vLLM spawns workers and keeps memory):

1. **Repeated long prompt** (2K, 4K, 8K tokens; ``--lengths``), TTFT of one request:

   - ``cold``: no connector;
   - ``cpu``: our cpu tier, after ``reset_prefix_cache()`` in the engine that stored it;
   - ``mmap`` / ``lmdb``: our disk tier, in a new engine after the storing engine shut
     down (its cpu tier is empty);
   - ``example``: vLLM's ``ExampleConnector`` (one safetensors file per layer and
     prompt), in a new engine after the storing engine shut down.

   Before every disk-tier measurement, ours and ``example`` alike, the page cache is
   dropped (needs root; the report says when it could not be). Each disk hit is then
   measured again with the page cache warm (``*_warm``).

   Each hit also gets its **floor**: the KV bytes it loads divided by the tier's read
   bandwidth as ``kvoffload bench`` measures it (``bench_tier`` at this model's block
   size for the disk tiers, ``bench_layout``'s cpu-tier read for the cpu tier). A hit
   also computes the prompt's last block (vLLM must compute at least its last token),
   which no load removes: ``gpu`` is the TTFT of the same prompt served from vLLM's own
   prefix cache (the cold engine, run again without a reset), the hit's compute
   floor. ``load_ms`` = hit - ``gpu`` is what the load costs, compared to the floor.

2. **Shared prefix** (``--requests`` 32 requests, one ``--prefix`` 2K-token prefix, each
   with its own ``--suffix`` 256-token suffix), all submitted at once; mean and p90 TTFT
   in a new engine, for ``cold``, ``ours`` (the disk tier: an earlier engine served the
   same prefix with *other* suffixes, then shut down) and ``example`` (same history).
   ``ExampleConnector`` keys whole prompts, so it misses by design here.

Ratios printed: each hit to ``cold`` and to ``example``, and to its floor. The JSON
report (``--json``) has every figure; docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvoffload.tools.bench.harness import ratio, run_facts, write_json

MODEL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}
BLOCK_SIZE = 32
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def kv_bytes_per_token(dtype: str) -> int:
    """K and V, 8 layers, 8 heads of 128."""
    return 2 * 8 * 8 * 128 * DTYPE_BYTES[dtype]


RESULT = "BENCH-RESULT "


# ------------------------------------------------------------------ prompts
def tokens(seed: int, n: int) -> list[int]:
    """``n`` deterministic pseudo-random token ids (no tokenizer: ids go straight in)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(100, MODEL["vocab_size"] - 100) for _ in range(n)]


def loaded_bytes(n_tokens: int, dtype: str) -> int:
    """KV bytes a hit loads: every full block but the one holding the last token."""
    return (n_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE * kv_bytes_per_token(dtype)


# ------------------------------------------------------------- engine phase
def run_phase(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine's life: start it, run ``spec["steps"]``, report timings."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvoffload.tools.bench.raw import drop_page_cache

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": spec["dtype"],
        "block_size": BLOCK_SIZE,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": spec["max_model_len"],
        # One prefill chunk per prompt: ExampleConnector saves each chunk over the
        # last (its file then holds the last chunk only, and its load fails), so no
        # engine here chunks; the same for every engine.
        "max_num_batched_tokens": spec["max_model_len"],
        "gpu_memory_utilization": 0.2,
        "disable_log_stats": True,
    }
    conn = spec.get("connector")
    if conn is not None and conn["kind"] == "kvoffload":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"config": conn["config"], **conn.get("options", {})},
            kv_load_failure_policy="recompute",
        )
    elif conn is not None and conn["kind"] == "example":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"shared_storage_path": conn["path"]},
        )
    started = time.perf_counter()
    llm = LLM(**kwargs)
    out: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "steps": []}
    one = SamplingParams(temperature=0.0, max_tokens=1)
    engine = llm.llm_engine

    def settle() -> None:
        """Wait until no block is held (stores done) and the prefix cache is empty."""
        for i in range(200):
            if llm.reset_prefix_cache():
                return
            llm.generate([{"prompt_token_ids": tokens(10_000 + i, 8)}], one, use_tqdm=False)
            time.sleep(0.05)
        raise RuntimeError("prefix cache never became resettable")

    for i, step in enumerate(spec["steps"]):
        result: dict[str, Any] = {"label": step["label"]}
        dropped = drop_page_cache() if step.get("drop_cache") else None
        result["page_cache_dropped"] = dropped
        if dropped is not None:
            # drop_caches also drops the engine's own code pages (torch, vLLM): fault
            # them back in with a short prompt of other tokens, so that the timed step
            # pays for its data, not for reloading libraries. Ours and ExampleConnector
            # alike; it misses both (other tokens).
            llm.generate([{"prompt_token_ids": tokens(50_000 + i, 64)}], one, use_tqdm=False)
        prompts = step["prompts"]
        if len(prompts) == 1:
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": prompts[0]}], one, use_tqdm=False)
            result["ttft_s"] = [time.perf_counter() - t0]
            result["cached_tokens"] = [outs[0].num_cached_tokens or 0]
        else:
            # A burst: every request arrives at t0; a request's TTFT is the end of the
            # engine step that produced its (only) token.
            t0 = time.perf_counter()
            ids = []
            for i, p in enumerate(prompts):
                rid = f"{step['label']}-{i}"
                engine.add_request(rid, {"prompt_token_ids": p}, one)
                ids.append(rid)
            done: dict[str, tuple[float, int]] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        done[o.request_id] = (time.perf_counter() - t0, o.num_cached_tokens or 0)
            result["ttft_s"] = [done[r][0] for r in ids]
            result["cached_tokens"] = [done[r][1] for r in ids]
        if step.get("settle", True):
            settle()
        out["steps"].append(result)
    return out


def phase_main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    print(RESULT + json.dumps(run_phase(spec)), flush=True)


# ------------------------------------------------------------------- driver
class Runner:
    """Runs engine phases as subprocesses and keeps their steps by label."""

    def __init__(self, work: Path, max_model_len: int, dtype: str, verbose: bool) -> None:
        self.work = work
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.verbose = verbose
        self.model = work / "model"
        self.model.mkdir(parents=True, exist_ok=True)
        (self.model / "config.json").write_text(json.dumps(MODEL))
        self.steps: dict[str, dict[str, Any]] = {}
        self.starts: list[float] = []
        self.saved = work / "steps.json"
        if self.saved.is_file():  # --resume: keep the phases an earlier run finished
            self.steps = json.loads(self.saved.read_text())

    def phase(self, name: str, connector: dict[str, Any] | None, steps: list[Any]) -> None:
        spec = {
            "model": str(self.model),
            "max_model_len": self.max_model_len,
            "dtype": self.dtype,
            "connector": connector,
            "steps": steps,
        }
        if all(st["label"] in self.steps for st in steps if st["label"] != "warmup"):
            print(f"bench_vllm: engine {name}: kept from the earlier run", flush=True)
            return
        path = self.work / f"{name}.json"
        path.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        # The same OpenMP threads for every engine. Left to itself, vLLM's CPU build
        # keeps cores back for its scheduler: one without a KV connector, two with one,
        # and on a machine of two cores the second case falls back to using both. The
        # engine without a connector would then prefill on half the threads, and every
        # ratio to cold would flatter us by about 1.8x.
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{(os.cpu_count() or 1) - 1}")
        print(f"bench_vllm: engine {name} ({len(steps)} step(s))", flush=True)
        proc = subprocess.run(
            [sys.executable, __file__, "--phase", str(path)],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stdout[-5000:] + proc.stderr[-5000:])
            raise SystemExit(f"bench_vllm: engine {name} failed (exit {proc.returncode})")
        if self.verbose:
            sys.stderr.write(proc.stderr[-3000:])
        result = json.loads(lines[-1][len(RESULT) :])
        self.starts.append(result["engine_start_s"])
        for step in result["steps"]:
            self.steps[step["label"]] = step
        self.saved.write_text(json.dumps(self.steps))
        for step in result["steps"]:
            ttft = step["ttft_s"]
            print(
                f"  {step['label']:<28} ttft {statistics.mean(ttft) * 1e3:9.1f} ms"
                f"  cached {statistics.mean(step['cached_tokens']):7.0f}"
                + ("" if step["page_cache_dropped"] is None else "  (page cache dropped)"),
                flush=True,
            )

    def mean(self, label: str) -> float:
        return statistics.mean(self.steps[label]["ttft_s"])


def step(
    label: str, prompts: list[list[int]], drop: bool = False, settle: bool = True
) -> dict[str, Any]:
    """One timed step; ``settle=False`` keeps vLLM's prefix cache for the next one."""
    return {"label": label, "prompts": prompts, "drop_cache": drop, "settle": settle}


def tiers(kind: str, root: Path) -> list[dict[str, Any]]:
    """cpu in front of the disk tier, write-through (a stored block survives a restart)."""
    cpu: dict[str, Any] = {"name": "cpu", "backend": "cpu", "capacity": "2GiB"}
    if kind == "cpu":
        return [cpu]
    disk = {
        "name": kind,
        "backend": kind,
        "path": str(root / kind),
        "capacity": "4GiB",
        "write_policy": "write_through",
        "max_pending_stores": 64,
    }
    return [{**cpu, "max_pending_stores": 64}, disk]


def floors(work: Path, kinds: list[str], dtype: str) -> dict[str, float]:
    """Read bandwidth (GB/s) of each tier at this model's block size, as
    ``kvoffload bench`` measures it."""
    from kvoffload.config import load_config
    from kvoffload.layout import KVLayout
    from kvoffload.tools.bench import bench_tier
    from kvoffload.tools.bench.cpu import bench_layout

    layout = KVLayout(
        num_layers=8,
        num_kv_heads=8,
        head_dim=128,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        namespace="bench",
    )
    bpb = layout.bytes_per_block
    cpu_row = bench_layout(layout, 256 * 1024 * 1024, 5)
    # A cpu-tier hit reads the slab into a staging buffer, then scatters it into the
    # pool; the tier's figure is the read, the path's the two.
    out = {"cpu": cpu_row["tier_read_gbps"], "cpu_scatter": cpu_row["scatter_gbps"]}
    out["memcpy"] = cpu_row["copy_gbps"]
    for kind in kinds:
        cfg = load_config({"tiers": tiers(kind, work / "floors")})
        tier = cfg.resolved_tiers()[1]
        row = bench_tier(tier, bpb, 256 * 1024 * 1024, reps=2)
        out[kind] = row["load_gbps"]
        out[f"{kind}_raw_read"] = row["raw_read_gbps"]
        out[f"{kind}_page_cache_dropped"] = row["page_cache_dropped"]
    shutil.rmtree(work / "floors", ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--work", type=Path, default=Path("out/bench_vllm"))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    ap.add_argument("--skip-shared", action="store_true", help="only the repeated prompt")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument(
        "--resume", action="store_true", help="keep the engines an earlier run in --work finished"
    )
    args = ap.parse_args()
    if args.phase:
        phase_main(args.phase)
        return 0

    lengths = [int(x) for x in args.lengths.split(",")]
    if not args.resume:
        shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True, exist_ok=True)
    run = Runner(
        args.work, max([*lengths, args.prefix + args.suffix]) + 64, args.dtype, args.verbose
    )
    # Warm-up prompt per engine: kernels, allocator and thread pools before timing.
    warm = step("warmup", [tokens(1, 512)])
    long = {n: tokens(100 + n, n) for n in lengths}
    disk_kinds = ["mmap", "lmdb"]

    print("bench_vllm: floors (kvoffload bench at this block size)", flush=True)
    bw = floors(args.work, disk_kinds, args.dtype)
    print("  " + ", ".join(f"{k} {v:.2f}" for k, v in bw.items() if isinstance(v, float)))

    # 1. repeated long prompt
    cold_steps = [warm]
    for n in lengths:
        cold_steps += [step(f"cold-{n}", [long[n]], settle=False), step(f"gpu-{n}", [long[n]])]
    run.phase("cold", None, cold_steps)
    # The cpu tier alone: hits with no disk copies running beside them.
    conn = {"kind": "kvoffload", "config": {"tiers": tiers("cpu", args.work)}}
    cpu_steps = [warm]
    for n in lengths:
        cpu_steps += [step(f"cpu-store-{n}", [long[n]]), step(f"cpu-{n}", [long[n]])]
    run.phase("cpu", conn, cpu_steps)
    for kind in disk_kinds:
        conn = {"kind": "kvoffload", "config": {"tiers": tiers(kind, args.work)}}
        # Engine 1 stores each prompt (its first run), then serves it from the cpu tier
        # while the write-through copies to the disk tier may still be running.
        first = [warm]
        for n in lengths:
            first += [step(f"{kind}-store-{n}", [long[n]]), step(f"cpu-{kind}-{n}", [long[n]])]
        run.phase(f"{kind}-store", conn, first)
        # Engine 2: a restart; the cpu tier is empty, the disk tier holds the prompts.
        second = [warm]
        for n in lengths:
            second += [
                step(f"{kind}-{n}", [long[n]], drop=True),
                step(f"{kind}-warm-{n}", [long[n]]),
            ]
        run.phase(f"{kind}-restart", conn, second)
    ex = {"kind": "example", "path": str(args.work / "example")}
    (args.work / "example").mkdir(exist_ok=True)
    run.phase(
        "example-store", ex, [warm, *(step(f"example-store-{n}", [long[n]]) for n in lengths)]
    )
    second = [warm]
    for n in lengths:
        second += [
            step(f"example-{n}", [long[n]], drop=True),
            step(f"example-warm-{n}", [long[n]]),
        ]
    run.phase("example-restart", ex, second)

    report: dict[str, Any] = {
        "model": MODEL,
        "dtype": args.dtype,
        "floors_gbps": bw,
        "repeated": [],
        "shared": None,
    }
    print("\nrepeated prompt: TTFT ms, ratio to cold / to example / to floor")
    for n in lengths:
        cold = run.mean(f"cold-{n}")
        example = run.mean(f"example-{n}")
        gpu = run.mean(f"gpu-{n}")
        nbytes = loaded_bytes(n, args.dtype)
        row: dict[str, Any] = {
            "tokens": n,
            "loaded_bytes": nbytes,
            "cold_ms": cold * 1e3,
            "gpu_prefix_cache_ms": gpu * 1e3,
        }
        print(
            f"  {n:>5} {'gpu':<13} {gpu * 1e3:9.1f} ms  {gpu / cold:5.3f}x cold (vLLM prefix cache)"
        )
        busy = min((f"cpu-{k}-{n}" for k in disk_kinds), key=run.mean)
        first_runs = [run.mean(f"{k}-store-{n}") for k in ["cpu", *disk_kinds]]
        row["first_run_with_connector_ms"] = min(first_runs) * 1e3
        hits = {
            "cpu": (f"cpu-{n}", bw["cpu"]),
            "cpu_disk_copies_running": (busy, bw["cpu"]),
            "mmap": (f"mmap-{n}", bw["mmap"]),
            "lmdb": (f"lmdb-{n}", bw["lmdb"]),
            "mmap_warm": (f"mmap-warm-{n}", bw["cpu"]),
            "lmdb_warm": (f"lmdb-warm-{n}", bw["cpu"]),
            "example": (f"example-{n}", None),
            "example_warm": (f"example-warm-{n}", None),
        }
        for name, (label, gbps) in hits.items():
            t = run.mean(label)
            floor = nbytes / (gbps * 1e9) if gbps else None
            row[name] = {
                "ms": t * 1e3,
                "load_ms": (t - gpu) * 1e3,
                "load_vs_floor": ratio(t - gpu, floor),
                "vs_cold": ratio(t, cold),
                "vs_example": ratio(t, example),
                "floor_ms": floor * 1e3 if floor else None,
                "vs_floor": ratio(t, floor),
                "cached_tokens": run.steps[label]["cached_tokens"][0],
                "page_cache_dropped": run.steps[label]["page_cache_dropped"],
            }
            print(
                f"  {n:>5} {name:<13} {t * 1e3:9.1f} ms  {t / cold:5.3f}x cold"
                f"  {t / example:5.3f}x example"
                + (
                    f"  floor {floor * 1e3:6.1f} ms: hit {t / floor:5.2f}x,"
                    f" load (hit - gpu) {(t - gpu) / floor:5.2f}x"
                    if floor
                    else ""
                )
            )
        report["repeated"].append(row)

    if not args.skip_shared:
        shared_part(run, args, report, warm, disk_kinds[0])
    report["engine_start_s"] = run.starts
    if args.json:
        write_json(args.json, report, facts=run_facts())
    return 0


def shared_part(
    run: Runner, args: argparse.Namespace, report: dict[str, Any], warm: Any, kind: str
) -> None:
    """32 requests, one shared prefix, own suffixes; the earlier engine saw the prefix
    with other suffixes."""
    prefix = tokens(7, args.prefix)
    before = [prefix + tokens(20_000 + i, args.suffix) for i in range(args.requests)]
    burst = [prefix + tokens(30_000 + i, args.suffix) for i in range(args.requests)]
    run.phase("shared-cold", None, [warm, step("shared-cold", burst)])
    conn = {"kind": "kvoffload", "config": {"tiers": tiers(kind, args.work / "shared")}}
    run.phase("shared-ours-store", conn, [warm, step("shared-ours-before", before)])
    run.phase("shared-ours", conn, [warm, step("shared-ours", burst, drop=True)])
    ex = {"kind": "example", "path": str(args.work / "shared-example")}
    (args.work / "shared-example").mkdir(exist_ok=True)
    run.phase("shared-example-store", ex, [warm, step("shared-example-before", before)])
    run.phase("shared-example", ex, [warm, step("shared-example", burst, drop=True)])

    def stats(label: str) -> dict[str, float]:
        ttft = sorted(run.steps[label]["ttft_s"])
        p90 = statistics.quantiles(ttft, n=10, method="inclusive")[-1]
        return {"mean_ms": statistics.mean(ttft) * 1e3, "p90_ms": p90 * 1e3}

    cold, ours, example = stats("shared-cold"), stats("shared-ours"), stats("shared-example")
    report["shared"] = {
        "requests": args.requests,
        "prefix": args.prefix,
        "suffix": args.suffix,
        "tier": kind,
        "cold": cold,
        "ours": ours,
        "example": example,
        "ours_vs_cold_mean": ours["mean_ms"] / cold["mean_ms"],
        "ours_vs_example_mean": ours["mean_ms"] / example["mean_ms"],
        "ours_cached_tokens_mean": statistics.mean(run.steps["shared-ours"]["cached_tokens"]),
    }
    print(f"\nshared prefix ({args.requests} x {args.prefix}+{args.suffix}): mean / p90 TTFT ms")
    for name, s in (("cold", cold), (f"ours ({kind})", ours), ("example", example)):
        print(f"  {name:<13} {s['mean_ms']:9.1f} {s['p90_ms']:9.1f}")
    print(
        f"  ours / cold {ours['mean_ms'] / cold['mean_ms']:.3f}x,"
        f" ours / example {ours['mean_ms'] / example['mean_ms']:.3f}x (mean)"
    )


if __name__ == "__main__":
    sys.exit(main())

"""Decode stall (issue 22): does a long cpu-tier hit stall the requests already decoding?

SmolLM2-135M (a real model, ``scripts/real_server.py``) behind vLLM's OpenAI-compatible
server with the connector over a cpu tier. Four requests stream (decode); once all four
are decoding, a request arrives whose long prefix (``--prefix-tokens``, 6,144 by
default: 191 blocks, 134 MiB) is a cpu-tier hit: it was stored by an earlier request,
then vLLM's own prefix cache was reset. Measured, per mode, in one server each:

- ``no_arrival``: the four streams alone; the worst inter-token gap of the four
  (after all four have their first token, until the first finishes);
- ``arrival``: the same four streams, and the arrival; the worst gap of the four that
  ends between the arrival's send and its answer (plus ``--after-s``), and the
  arrival's TTFT (``max_tokens`` 1, not streamed);
- ``vllm_hit``: the same again without a reset, the arrival now a hit of vLLM's own
  prefix cache (nothing loaded): what an arrival costs the others without any load;
- ``cold``: the same streams, and an arrival of as many tokens that nobody has seen
  (another slice of the same text): served by nobody, computed whole.

The two floors of a cpu-tier hit, from the same run (issue 31): ``ttft_vs_vllm_hit``,
its TTFT over the vLLM hit's (medians over the trials; target <= 1.2), and
``gap_vs_vllm_hit``, the streams' worst gap during it over theirs during the vLLM hit
(target <= 1.1).

Modes: ``in_step`` (``async_load_min_bytes`` 1 TiB: every hit loads inside the engine
step, which every running request waits for), ``async`` (``async_load_min_bytes`` 1
byte: every hit loads in the background while the others decode) and ``measured`` (the
config's default, unset: each hit placed by measurement, :mod:`connectors.vllm.hitpath`).
Each cpu-tier arrival's hit path, phase by phase (``hit_path_ms``: the lookup, the
schedule, a background load and its requeue, the step that computes it), comes from the
connector's ``hit_*_seconds`` counters, with the copy the step waited for
(``in_step_load_ms``). ``ratio`` = the worst gap
during the arrival over the worst without; target for ``async`` <= 1.2. Each mode
runs ``--trials`` of both phases, alternating; each phase's figure is the worst over its
trials, so every ratio comes from one server run::

    .venv/bin/python scripts/bench_decode_stall.py --json out/bench_decode_stall.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from real_server import (
    BLOCK,
    BLOCK_BYTES,
    MODEL_NAME,
    Server,
    delta,
    machine,
    model_dir,
    real_text_tokens,
    serving,
    tokenizer,
    write_config,
)

from kvoffload.tools.bench.harness import save_report

MODES: dict[str, dict[str, Any]] = {
    "in_step": {"async_load_min_bytes": 1 << 40},
    "async": {"async_load_min_bytes": 1},
    "measured": {},
}
PHASES = ("lookup", "schedule", "load", "requeue", "step")
STREAM_PROMPTS = [
    "Write a long story about a lighthouse keeper and a storm.",
    "Explain, step by step and at length, how bread is made.",
    "Describe a journey across a desert, in great detail.",
    "Tell the history of the bicycle, in a long essay.",
]


def _stream(url: str, prompt: str, max_tokens: int, times: list[float]) -> None:
    """One streamed greedy completion; the arrival time of each chunk into ``times``."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    """(end time, gap) of each inter-token gap."""
    return [(b, b - a) for a, b in itertools.pairwise(times)]


def _phase(
    server: Server, args: argparse.Namespace, prompt: list[int] | None, loads: bool = True
) -> dict[str, Any]:
    """Four streams, and the arrival of ``prompt`` once they decode (``None``: none);
    ``loads``: whether the arrival is a hit the connector loads."""
    times: list[list[float]] = [[] for _ in STREAM_PROMPTS]
    threads = [
        threading.Thread(target=_stream, args=(server.url, p, args.stream_tokens, t))
        for p, t in zip(STREAM_PROMPTS, times, strict=True)
    ]
    for t in threads:
        t.start()
    while min(len(t) for t in times) < args.warm_tokens:  # all four decoding
        time.sleep(0.005)
    out: dict[str, Any] = {}
    if prompt is not None:
        before = server.metrics()
        t_send = time.perf_counter()
        answer = server.complete(prompt, 1)
        t_done = time.perf_counter()
        details = answer["usage"].get("prompt_tokens_details") or {}
        out["arrival"] = {
            "ttft_ms": round(answer["seconds"] * 1e3, 1),
            "cached_tokens": details.get("cached_tokens"),
            "prompt_tokens": answer["usage"]["prompt_tokens"],
        }
    for t in threads:
        t.join()
    start = max(t[0] for t in times)
    end = min(t[-1] for t in times)
    all_gaps = [g for t in times for g in _gaps(t)]
    steady = [gap for at, gap in all_gaps if start < at <= end]
    out["steady_worst_gap_ms"] = round(max(steady) * 1e3, 1)
    out["steady_median_gap_ms"] = round(sorted(steady)[len(steady) // 2] * 1e3, 1)
    if prompt is not None:
        window = [gap for at, gap in all_gaps if t_send < at <= t_done + args.after_s]
        if end < t_done + args.after_s:
            out["warning"] = "a stream ended before the window closed: raise --stream-tokens"
        out["window_worst_gap_ms"] = round(max(window) * 1e3, 1)
        # The counters reach the front end with the engine's step outputs, a little later.
        loaded = before.get("blocks_loaded", 0.0) + (len(prompt) - 1) // BLOCK * loads
        out["counters"] = counters = delta(server.wait_metric("blocks_loaded", loaded, 10), before)
        timed = counters.get("hits_timed", 0)
        if loads and timed:
            out["hit_path_ms"] = {
                p: round(counters.get(f"hit_{p}_seconds", 0) / timed * 1e3, 1) for p in PHASES
            }
            out["in_step_load_ms"] = round(counters.get("in_step_load_seconds", 0) * 1e3, 1)
    return out


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def run_mode(
    mode: str,
    args: argparse.Namespace,
    model: Path,
    prompt: list[int],
    cold: list[list[int]],
    work: Path,
) -> dict[str, Any]:
    config = write_config(
        work / f"{mode}.yaml",
        [{"name": "cpu", "backend": "cpu", "capacity": "1GiB", "max_pending_stores": 512}],
        **MODES[mode],
    )
    full_blocks = (len(prompt) - 1) // BLOCK
    with serving(model, config, work / f"server-{mode}.log") as server:
        result: dict[str, Any] = {"start_s": round(server.start_seconds, 1)}
        server.complete("Hello", 4)  # warm-up
        # Store the long prompt in the cpu tier (stored as vLLM hands its blocks over).
        t0 = time.perf_counter()
        server.complete(prompt, 1)
        result["cold_ttft_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        server.wait_metric("tier_blocks_stored{cpu}", full_blocks, poke=True)
        trials = []
        for trial in range(args.trials):
            server.reset_prefix_cache()
            no_arrival = _phase(server, args, None)
            server.reset_prefix_cache()  # the arrival's prefix: only in the cpu tier
            arrival = _phase(server, args, prompt)
            # The same arrival again, now a hit of vLLM's own prefix cache: what the
            # arrival costs the others with no load at all (the floor of ``arrival``).
            local = _phase(server, args, prompt, loads=False)
            # An arrival of as many tokens nobody has seen: the cold ceiling.
            unseen = _phase(server, args, cold[trial], loads=False)
            trials.append(
                {"no_arrival": no_arrival, "arrival": arrival, "vllm_hit": local, "cold": unseen}
            )
        worst_without = max(t["no_arrival"]["steady_worst_gap_ms"] for t in trials)
        worst_during = max(t["arrival"]["window_worst_gap_ms"] for t in trials)
        worst_local = max(t["vllm_hit"]["window_worst_gap_ms"] for t in trials)
        worst_cold = max(t["cold"]["window_worst_gap_ms"] for t in trials)
        ttft = {k: [t[k]["arrival"]["ttft_ms"] for t in trials] for k in ("arrival", "vllm_hit")}
        result.update(
            trials=trials,
            worst_gap_no_arrival_ms=worst_without,
            worst_gap_during_arrival_ms=worst_during,
            ratio=round(worst_during / worst_without, 2),
            worst_gap_during_vllm_hit_ms=worst_local,
            ratio_vllm_hit=round(worst_local / worst_without, 2),
            arrival_ttft_ms=[t["arrival"]["arrival"]["ttft_ms"] for t in trials],
            vllm_hit_ttft_ms=[t["vllm_hit"]["arrival"]["ttft_ms"] for t in trials],
            cold_arrival_ttft_ms=[t["cold"]["arrival"]["ttft_ms"] for t in trials],
            hit_path_ms=[t["arrival"].get("hit_path_ms") for t in trials],
            in_step_load_ms=[t["arrival"].get("in_step_load_ms") for t in trials],
            worst_gap_during_cold_ms=worst_cold,
            ttft_vs_vllm_hit=round(_median(ttft["arrival"]) / _median(ttft["vllm_hit"]), 2),
            gap_vs_vllm_hit=round(worst_during / worst_local, 2),
            final_counters=server.metrics(),
        )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=6144)
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--warm-tokens", type=int, default=12, help="tokens each stream has first")
    p.add_argument("--after-s", type=float, default=0.3, help="window past the arrival's answer")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--modes", default="in_step,async,measured")
    p.add_argument("--work", type=Path, default=Path("out/bench_decode_stall"))
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = model_dir()
    n = args.prefix_tokens
    text = real_text_tokens(tokenizer(model), n * (args.trials + 1))
    prompt = text[:n]
    cold = [text[n * (k + 1) : n * (k + 2)] for k in range(args.trials)]
    report: dict[str, Any] = {
        "machine": machine(),
        "prefix_tokens": len(prompt),
        "hit_blocks": (len(prompt) - 1) // BLOCK,
        "hit_bytes": (len(prompt) - 1) // BLOCK * BLOCK_BYTES,
        "modes": {},
    }
    for mode in args.modes.split(","):
        report["modes"][mode] = run_mode(mode, args, model, prompt, cold, args.work)
        summary = {k: v for k, v in report["modes"][mode].items() if k != "trials"}
        summary.pop("final_counters", None)
        print(mode, json.dumps(summary), flush=True)
    save_report(args.json, report, echo=True)


if __name__ == "__main__":
    main()

"""TTFT with layer-wise loads on and off (``layerwise_loads``), from our cpu tier.

The engine, model and step timing of ``scripts/bench_vllm.py`` (dummy-weight 8-layer
Llama, fp32, block size 32, one request at a time). Each engine stores one prompt
(a cold prefill), then times, with vLLM's prefix cache reset before each:

- ``hit``: the same prompt again: every block but the last is loaded, the last computed;
- ``part``: the prompt's first ``--part`` tokens followed by ``--suffix`` new tokens:
  the prefix is loaded, the suffix computed, so there is compute for the load of
  later layers to overlap with.

Engines alternate off / on (on / off in odd rounds), ``--rounds`` times, so that the
machine's drift hits both alike::

    .venv/bin/python scripts/bench_layerwise.py --json out/bench_layerwise.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_vllm import Runner, step, tiers, tokens

from kvoffload.tools.bench.harness import ratio, run_facts, write_json


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--part", type=int, default=2048, help="prefix tokens of a part hit")
    ap.add_argument("--suffix", type=int, default=1024, help="new tokens of a part hit")
    ap.add_argument("--hits", type=int, default=4, help="timed hits of each kind per engine")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-layerwise-"))
    run = Runner(work, args.length + 64, args.dtype, args.verbose)
    prompt = tokens(1, args.length)
    ttft: dict[str, dict[str, list[float]]] = {m: {"hit": [], "part": []} for m in ("off", "on")}
    for r in range(args.rounds):
        for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):
            conn = {
                "kind": "kvoffload",
                "config": {"tiers": tiers("cpu", work)},
                "options": {"layerwise_loads": mode == "on"},
            }
            name = f"{mode}-r{r}"
            steps: list[dict[str, Any]] = [step(f"{name}-store", [prompt])]
            steps += [step(f"{name}-hit{k}", [prompt]) for k in range(args.hits)]
            steps += [
                step(f"{name}-part{k}", [prompt[: args.part] + tokens(100 + k, args.suffix)])
                for k in range(args.hits)
            ]
            run.phase(name, conn, steps)
            for kind, want in (("hit", args.length - 1), ("part", args.part)):
                for k in range(args.hits):
                    got = run.steps[f"{name}-{kind}{k}"]
                    cached = got["cached_tokens"][0]
                    if cached < want // 32 * 32:
                        raise SystemExit(f"{name}-{kind}{k}: only {cached} tokens cached")
                    ttft[mode][kind].append(got["ttft_s"][0] * 1e3)
    report: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    print("\nTTFT ms: median (min-max) over all rounds; ratio on / off of the medians")
    for kind in ("hit", "part"):
        off, on = (statistics.median(ttft[m][kind]) for m in ("off", "on"))
        report[kind] = {
            "off_ms": ttft["off"][kind],
            "on_ms": ttft["on"][kind],
            "ratio": ratio(on, off),
        }
        span = {m: f"{min(ttft[m][kind]):.1f}-{max(ttft[m][kind]):.1f}" for m in ttft}
        print(
            f"  {kind:<5} off {off:7.1f} ({span['off']})  on {on:7.1f} ({span['on']})"
            f"  on/off {on / off:.2f}"
        )
    if args.json:
        write_json(args.json, report, facts=run_facts(), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

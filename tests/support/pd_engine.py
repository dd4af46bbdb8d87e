"""One engine of the prefill/decode test (``tests/e2e/test_pd.py``), kept up between
requests: the test's proxy talks to two of these at once (a prefill and a decode
engine), where ``engine_run.py`` runs its engines one after the other.

Started with a JSON spec as its argument (``model``, ``role``, ``engine_id``,
``kvoffload``); prints ``PD-READY`` once the engine is up, then answers each line of
standard input (``{"prompts": [[ids...]], "max_tokens": n}``) with one ``PD-RESULT``
line: per prompt its tokens, ``num_cached_tokens``, whether it failed and its seconds,
and the connector's counters after the batch (single-process mode: the worker side
runs in this process).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def main(spec: dict[str, Any]) -> int:
    from kvoffload.connectors.vllm import connector_counters
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    transfer = KVTransferConfig(
        kv_connector="TieredOffloadConnector",
        kv_connector_module_path="kvoffload.connectors.vllm",
        kv_role=spec["role"],
        engine_id=spec["engine_id"],
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=spec["kvoffload"],
    )
    llm = LLM(
        model=spec["model"],
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        block_size=32,
        enforce_eager=True,
        seed=0,
        max_model_len=2048,
        gpu_memory_utilization=0.2,
        kv_transfer_config=transfer,
    )
    print("PD-READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        ask = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=ask["max_tokens"])
        t0 = time.monotonic()
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in ask["prompts"]], params, use_tqdm=False
        )
        seconds = time.monotonic() - t0
        results = []
        for o in outs:
            completion = o.outputs[0] if o.outputs else None
            reason = None if completion is None else completion.finish_reason
            results.append(
                {
                    "tokens": [] if completion is None else list(completion.token_ids),
                    "cached": o.num_cached_tokens or 0,
                    "failed": bool(not o.finished or reason == "error"),
                }
            )
        counters = connector_counters().get(spec["engine_id"], {})
        result = {"outputs": results, "seconds": seconds, "kvoffload": counters}
        print("PD-RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))

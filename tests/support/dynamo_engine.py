"""One real engine driven step by step, for the router test (tests/e2e/test_dynamo_indexer.py).

``engine_run.py`` runs a spec's rounds to the end; a test of what a router sees needs
an engine that stays up while the test asks the router between phases, so this one
reads a command per line of standard input and answers each with one
``DYN <json>`` line:

- ``{"op": "generate", "prompts": [[token ids]...]}``: the prompts, 1 new token each;
  answers ``{"cached": [num_cached_tokens...]}``;
- ``{"op": "held"}``: once the tiers' queued jobs are done and a one-token request has
  stepped the engine (which publishes the events of everything before it): what each
  tier holds (``engine_run._tiers_held``: ``namespace``, ``held`` keys per tier), the
  hashes vLLM's own prefix cache holds (``gpu``, as vLLM publishes them), the
  connector's reset ``generation`` and its counters;
- ``{"op": "reset_external"}``: vLLM's ``reset_prefix_cache(reset_connector=True)``
  (what ``POST /reset_prefix_cache?reset_external=true`` calls);
- ``{"op": "quit"}``: shut the engine down and exit.

Usage: ``python dynamo_engine.py SPEC.json`` (``model``, ``kvoffload``,
``kv_events``, ``engine``: as ``engine_run.py``'s), in vLLM's single-process mode.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import engine_run

BLOCK = 32


def _scheduler(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler


def _gpu_hashes(llm: Any) -> list[Any]:
    """The blocks vLLM's prefix cache holds, as its KV events name them."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, maybe_convert_block_hash

    pool = _scheduler(llm).kv_cache_manager.block_pool
    return sorted(
        maybe_convert_block_hash(get_block_hash(k)) for k in pool.cached_block_hash_to_block._cache
    )


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig

    spec = json.loads(Path(spec_path).read_text())
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 2048,
        "kv_events_config": KVEventsConfig(**spec["kv_events"]),
        "kv_transfer_config": KVTransferConfig(
            kv_connector="TieredOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec["kvoffload"],
        ),
    }
    llm = LLM(**{**kwargs, **spec.get("engine", {})})
    engine_id = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    print("DYN " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        answer: dict[str, Any]
        if op == "generate":
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in cmd["prompts"]], one, use_tqdm=False
            )
            answer = {"cached": [o.num_cached_tokens or 0 for o in outs]}
        elif op == "held":
            answer = engine_run._tiers_held(llm, engine_id)
            answer["gpu"] = _gpu_hashes(llm)
            answer["generation"] = _scheduler(llm).connector._scheduler_side().generation
            answer["counters"] = engine_run._connector_state(engine_id)[0]
        elif op == "reset_external":
            answer = {"reset": llm.reset_prefix_cache(reset_connector=True)}
        elif op == "quit":
            break
        else:
            answer = {"error": f"unknown op {op!r}"}
        print("DYN " + json.dumps(answer), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

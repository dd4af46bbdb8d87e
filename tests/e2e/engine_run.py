"""Run a real vLLM engine (CPU build, tiny dummy-weight Llama) and print JSON results.

Used by the end-to-end tests as a subprocess, because vLLM spawns processes and needs
a ``__main__`` guard. Usage::

    python engine_run.py SPEC.json

SPEC: ``model`` (a directory holding config.json), ``kvoffload`` (the
``kv_connector_extra_config``, or null for no connector), ``rounds`` (lists of prompts
as token-id lists; the prefix cache is reset between rounds), ``max_tokens``, and
optional ``engine`` (extra ``LLM(...)`` arguments). Prints one JSON line with
``rounds``: per prompt, its output token ids and ``num_cached_tokens``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def write_tiny_llama(directory: Path, **overrides: Any) -> Path:
    """A model directory vLLM can load with ``load_format="dummy"``: config only."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return directory


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    spec = json.loads(Path(spec_path).read_text())
    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "block_size": 32,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 2048,
        **spec.get("engine", {}),
    }
    if spec.get("kvoffload") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="TieredOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=spec["kvoffload"],
            kv_load_failure_policy="recompute",
        )
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8))
    rounds = []
    for prompts in spec["rounds"]:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        rounds.append(
            [
                {"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens or 0}
                for o in outs
            ]
        )
        llm.reset_prefix_cache()
    counters: dict[str, Any] = {}
    if spec.get("kvoffload") is not None:
        # Single-process mode: the connector's worker side lives in this process.
        from kvoffload.connectors.vllm import connector_counters

        counters = next(iter(connector_counters().values()), {})
    print("E2E-RESULT " + json.dumps({"rounds": rounds, "kvoffload": counters}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])

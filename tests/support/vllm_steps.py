"""vLLM's objects as the connector tests' hand-driven engines build them: the config of
a tiny model with our connector, a step that schedules one new request, and vLLM's
metric classes bound to a private registry.

The connector tests drive both halves of the connector themselves, without vLLM's
scheduler; these are the pieces of vLLM's side they all build the same way. Import only
from a test module that has already called ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from vllm.config import CacheConfig, KVEventsConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.request import Request


def connector_config(
    model_dir: str,
    block_size: int,
    extra: dict[str, Any],
    *,
    kv_role: str = "kv_both",
    events: KVEventsConfig | None = None,
    **transfer: Any,
) -> VllmConfig:
    """vLLM's config for the tiny model in ``model_dir`` (a config only: no tokenizer,
    no weights) with ``TieredOffloadConnector`` as its KV connector: ``extra`` its
    ``kv_connector_extra_config``, ``transfer`` any further ``KVTransferConfig`` fields
    (``engine_id``, ``kv_load_failure_policy``)."""
    return VllmConfig(
        model_config=ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
        ),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TieredOffloadConnector",
            kv_connector_module_path="kvoffload.connectors.vllm",
            kv_role=kv_role,
            kv_connector_extra_config=extra,
            **transfer,
        ),
        kv_events_config=events,
    )


def new_request_step(
    req: Request, block_ids: list[int], computed: int, scheduled: int
) -> SchedulerOutput:
    """A scheduler step whose one request is ``req``, new to the step: ``computed`` of its
    tokens already in ``block_ids`` (the engine's prefix cache or the connector's hit),
    ``scheduled`` more to compute in it, as vLLM's scheduler writes it."""
    out = SchedulerOutput.make_empty()
    out.scheduled_new_reqs = [
        NewRequestData(
            req_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            mm_features=[],
            sampling_params=req.sampling_params,
            pooling_params=None,
            block_ids=(block_ids,),
            num_computed_tokens=computed,
            lora_request=None,
        )
    ]
    out.num_scheduled_tokens = {req.request_id: scheduled}
    out.total_num_scheduled_tokens = scheduled
    return out


def metric_types(registry: CollectorRegistry) -> dict[type[Any], type[Any]]:
    """vLLM's metric classes, registered in ``registry`` instead of the global one."""

    class RCounter(Counter):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class RGauge(Gauge):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    class RHistogram(Histogram):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, registry=registry, **kwargs)

    return {Counter: RCounter, Gauge: RGauge, Histogram: RHistogram}

"""vLLM 0.33's real scheduler with our connector attached, stepped without a model.

Run by ``tests/connector/test_vllm033.py`` in vLLM 0.33 (``support/vllm033.py`` sets the path):
``python vllm033_walk.py WORKDIR``. Prints one ``VLLM033-RESULT <json>`` line.

What is real: vLLM 0.33's ``Scheduler`` (and ``AsyncScheduler``, 0.33's default), its
KV cache manager and its connector factory, which builds ``TieredOffloadConnector``'s
scheduler side from the ``kv_transfer_config``; our connector's worker side, built in
this process (as vLLM's single-process mode builds it), over a CPU KV cache of torch
tensors, with a real Offloader and cpu tier. What stands in for the model: each step,
the blocks the scheduler scheduled are "computed" by filling them with bytes derived
from their vLLM block hash, and the step's output samples token 7. The worker side's
hooks are called in the order vLLM's model runner calls them (``handle_preemptions``,
bind the metadata, ``start_load_kv``, ``wait_for_save``, the transfer results, the load
errors, the stats, the events), and their results go back to the scheduler in a
``ModelRunnerOutput``. Before each phase's counters are read, the connector's threads
finish their queued work and one empty step collects it (:meth:`Walk.settle`).

Per mode of :data:`MODES`, in order:

- ``store``: a prompt of 3 full blocks and one token, run to its end;
- ``hit``: vLLM's own prefix cache reset, the same prompt again: a hit of 3 blocks
  from the cpu tier, loaded into blocks first filled with garbage, and compared with
  the stored bytes (in the ``background`` mode, ``unregister_mid_load``: the worker's
  ``unregister_kv_caches`` in the step that starts that load, right after
  ``wait_for_save``; it must return with the load done);
- ``abort_running``: a prompt of 6 blocks chunked at 4 blocks a step, aborted after its
  first chunk's stores were submitted: its blocks are held until the worker reports
  the stores done, then freed;
- ``abort_waiting``: the first prompt again, aborted before it is scheduled;
- ``unregister_mid_step``: in the step that submits the next prompt's stores, right
  after ``wait_for_save``, the worker's ``unregister_kv_caches`` (which vLLM calls only
  once its transfers are drained): it must return with no store still reading;
- ``sleep``: what vLLM 0.33's multi-process engine does for ``sleep(level=1)``, the
  worker's allocator aside: a request mid-prefill aborted (``pause_scheduler("abort")``),
  steps until the scheduler has no requests (its idle wait), ``reset_prefix_cache``
  with the connector, then the worker's ``unregister_kv_caches``; the KV cache
  overwritten (the memory the sleep released comes back with other bytes), then
  ``restore_kv_caches``; the first prompt again (a miss: stored before the reset), and
  once more after vLLM's prefix cache is reset (a hit, loaded from what was stored
  after the wake). Before the idle wait, ``reset_prefix_cache`` as vLLM's in-process
  engine calls it (no wait) is tried too, and what it raised is reported.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

BLOCK = 16
NUM_BLOCKS = 64
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, DIM = 2, 32  # the tiny Llama's KV heads and head size
BPB = len(LAYERS) * 2 * BLOCK * HEADS * DIM * 2  # bytes of a block: K, V in bf16
MAX_BATCHED = 4 * BLOCK
EOS = 50256
HANG_MS = 60_000.0
STEP_WAIT_S = 120.0
"""Steps of one phase, from its start until its condition holds: longer is a hang."""
MODES = ("sync", "async", "background")
"""``Scheduler``; ``AsyncScheduler`` (vLLM 0.33's default); ``Scheduler`` with every hit
loaded in the background (``async_load_min_bytes: 1``: vLLM's asynchronous loads, the
request waiting for ``finished_recving``)."""
GARBAGE = -1000.0
"""What a block to be loaded holds before its load: no hash-derived value."""


def main(workdir: Path) -> dict[str, Any]:
    import vllm
    from kvoffload.connectors.vllm import TieredOffloadConnector, check_vllm_version
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from support.engine_run import write_tiny_llama
    from support.vllm033 import base_api

    model = write_tiny_llama(workdir / "tiny-llama")
    result: dict[str, Any] = {
        "version": vllm.__version__,
        "file": vllm.__file__,
        "checked": check_vllm_version(),
        "base": base_api(KVConnectorBase_V1),
        "abstract": sorted(KVConnectorBase_V1.__abstractmethods__),
        "ours_abstract": sorted(TieredOffloadConnector.__abstractmethods__),
        "ours_overrides": sorted(
            name for name in base_api(KVConnectorBase_V1) if name in vars(TieredOffloadConnector)
        ),
        "modes": {},
    }
    for mode in MODES:
        result["modes"][mode] = Walk(model, mode).run()
    return result


class Walk:
    """One scheduler (sync or async) and one worker side, stepped together."""

    def __init__(self, model: Path, mode: str) -> None:
        from kvoffload.connectors.vllm import TieredOffloadConnector
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        self.engine_id = f"vllm033-{uuid.uuid4().hex[:12]}"
        self.mode = mode
        async_scheduling = mode == "async"
        tiers: dict[str, Any] = {
            "tiers": [{"name": "cpu", "capacity": NUM_BLOCKS * BPB}],
            # A question, load or store this late is a hang, not a slow machine: no
            # count below may depend on the machine's speed.
            "books_timeout_ms": HANG_MS,
            "load_timeout_ms": HANG_MS,
            "store_timeout_ms": HANG_MS,
        }
        # Every hit in the background, or every one in the step: the measured choice
        # (the default) depends on the machine's speed, and no count may.
        tiers["async_load_min_bytes"] = 1 if mode == "background" else 1 << 40
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=4,
                max_num_batched_tokens=MAX_BATCHED,
                max_model_len=2048,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TieredOffloadConnector",
                kv_connector_module_path="kvoffload.connectors.vllm",
                kv_role="kv_both",
                engine_id=self.engine_id,
                kv_load_failure_policy="recompute",
                # Nothing is computed here: a prefill rate timed from these steps would
                # mean nothing, so every hit is loaded whole (exact counts).
                kv_connector_extra_config={"config": tiers, "load_or_recompute": False},
            ),
        )
        self.config = config
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    LAYERS,
                    FullAttentionSpec(
                        block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16
                    ),
                )
            ],
        )
        config.cache_config.num_gpu_blocks = NUM_BLOCKS
        # The worker side first: it registers the Offloader the scheduler side finds
        # in this process.
        self.worker = TieredOffloadConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        self.caches = {
            name: torch.zeros((NUM_BLOCKS, 2, BLOCK, HEADS, DIM), dtype=torch.bfloat16)
            for name in LAYERS
        }
        self.worker.register_kv_caches(self.caches)
        cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=True,
        )
        init_none_hash(sha256)
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.facts: dict[str, Any] = {
            "scheduler": type(self.scheduler).__name__,
            "connector": type(self.scheduler.connector).__name__,
            "role": self.scheduler.connector.role.name,
            "requires_kv_delivery": self.scheduler.requires_kv_delivery,
            "supports_sleep_mode": type(self.scheduler.connector).supports_sleep_mode(
                config.kv_transfer_config
            ),
        }
        self.external: dict[str, int] = {}
        """Per request, the tokens vLLM counted as loaded by the connector (its
        prefill stats' ``num_external_cached_tokens``)."""
        self.sent: list[str] = []
        """Requests the worker reported done sending, in order."""
        self.verified = 0
        self.mismatched = 0
        self.steps = 0
        self.hits = {"queries": 0, "hits": 0}
        self.hits_by_source: dict[str, int] = {}
        self.probe: tuple[str, Callable[[], None]] | None = None
        """``("stores" or "loads", f)``: ``f`` is called once, right after
        ``wait_for_save``, in the next step whose metadata has such work."""
        self.unchecked: dict[str, list[int]] = {}
        """Background loads not yet reported received: their target blocks."""

    # ------------------------------------------------------------------ pieces
    def request(self, rid: str, tokens: list[int], max_tokens: int = 1) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens)
        params.update_from_generation_config({}, EOS)
        return Request(rid, tokens, params, None, block_hasher=self.hasher)

    def expected(self, block_hash: Any, layer: str) -> torch.Tensor:
        seed = int.from_bytes(bytes(block_hash)[:8], "little")
        gen = torch.Generator().manual_seed(seed)
        shape = self.caches[layer].shape[1:]
        return torch.randn(shape, generator=gen).to(torch.bfloat16)

    def step(self) -> Any:
        """One engine step: schedule, the worker's hooks, the output back."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        s, w = self.scheduler, self.worker
        out = s.schedule()
        meta = out.kv_connector_metadata
        self.steps += 1
        for new in out.scheduled_new_reqs:  # "compute" the full blocks scheduled
            req = s.requests[new.req_id]
            ids = new.block_ids[0]
            first = new.num_computed_tokens // BLOCK
            end = new.num_computed_tokens + out.num_scheduled_tokens[new.req_id]
            for j in range(first, min(end // BLOCK, len(req.block_hashes))):
                for layer in LAYERS:
                    self.caches[layer][ids[j]] = self.expected(req.block_hashes[j], layer)
        loads = [(load.req_id, load.block_ids[0]) for load in meta.loads]
        for _, targets in loads:
            for b in targets:
                for layer in LAYERS:
                    self.caches[layer][b].fill_(GARBAGE)
        # The model runner's order (gpu_model_runner.py, the connector mixin); no
        # forward pass between the load and the save.
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        w.wait_for_save()
        if self.probe is not None and getattr(meta, self.probe[0]):
            self.probe[1]()
            self.probe = None
        results = w.get_transfer_results(set(out.finished_req_ids))
        errors = w.get_block_ids_with_load_errors()
        stats = w.get_kv_connector_stats()
        events = w.get_kv_connector_kv_cache_events()
        w.build_connector_worker_meta()
        w.clear_connector_metadata()
        # A load within the step is in the KV cache now; one in the background, once
        # the worker reports it received.
        landed = [(load.req_id, load.block_ids[0]) for load in meta.loads if not load.background]
        self.unchecked.update(
            (load.req_id, load.block_ids[0]) for load in meta.loads if load.background
        )
        landed += [(r, self.unchecked.pop(r)) for r in sorted(results.finished_recving)]
        for req_id, targets in landed:
            hashes = s.requests[req_id].block_hashes
            table = s.kv_cache_manager.get_block_ids(req_id)[0]
            for b in targets:
                same = all(
                    torch.equal(self.caches[layer][b], self.expected(hashes[table.index(b)], layer))
                    for layer in LAYERS
                )
                self.verified += int(same)
                self.mismatched += int(not same)
        self.sent.extend(sorted(results.finished_sending))
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        ids = [i for i in ids if out.num_scheduled_tokens.get(i)]
        output = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=results.finished_sending or None,
                finished_recving=results.finished_recving or None,
                failed_recving=results.failed_recving,
                invalid_block_ids=errors,
                kv_connector_stats=stats,
                kv_cache_events=events,
            ),
        )
        for outputs in s.update_from_output(out, output).values():
            for o in outputs.outputs:
                if o.prefill_stats is not None:
                    self.external[o.request_id] = o.prefill_stats.num_external_cached_tokens
            stats_now = outputs.scheduler_stats
            cps = None if stats_now is None else stats_now.connector_prefix_cache_stats
            if cps is not None:
                self.hits["queries"] += cps.queries
                self.hits["hits"] += cps.hits
                for source, n in cps.hits_by_source.items():
                    key = str(getattr(source, "value", source))
                    self.hits_by_source[key] = self.hits_by_source.get(key, 0) + n
        return out

    def until(self, what: str, done: Callable[[], bool]) -> int:
        """Step until ``done()``; the steps it took."""
        start = self.steps
        deadline = time.monotonic() + STEP_WAIT_S
        while True:
            self.step()
            if done():
                return self.steps - start
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not done after {self.steps - start} steps")
            time.sleep(0.002)  # the lanes' threads store meanwhile

    def idle(self) -> bool:
        return not self.scheduler.has_requests()

    def settle(self) -> None:
        """Let the connector's threads finish what the phase gave them: the lookup
        thread's questions (a prefetch on arrival is counted there), the Offloader's
        queued jobs (a store is written after vLLM got its blocks back), then one empty
        step, whose ``get_finished`` counts the finished jobs."""
        half = self.worker._worker
        assert half is not None
        shared = half._registered()
        assert shared is not None
        shared.answers._pool.submit(lambda: None).result(timeout=STEP_WAIT_S)
        if not shared.offloader.drain(STEP_WAIT_S):
            raise AssertionError("the Offloader's lanes did not drain")
        self.step()

    def snapshot(self) -> dict[str, Any]:
        from kvoffload.connectors.vllm import connector_counters, connector_health

        self.settle()
        counts = connector_counters()[self.engine_id]
        health = connector_health()[self.engine_id]
        pool = self.scheduler.kv_cache_manager.block_pool
        return {
            "counters": {k: v for k, v in counts.items() if not k.endswith("seconds")},
            "health": health,
            "requests": len(self.scheduler.requests),
            "free_blocks": pool.get_num_free_blocks(),
            "external": dict(self.external),
            "sent": list(self.sent),
            "verified": self.verified,
            "mismatched": self.mismatched,
            "hits": dict(self.hits),
            "hits_by_source": dict(self.hits_by_source),
        }

    def pending_on_worker(self) -> dict[str, int]:
        """What of the worker side may still touch the KV cache."""
        half = self.worker._worker
        assert half is not None
        return {
            "store_gates": len(half._store_gates),
            "fences": len(half._fences),
            "layer_loads": len(half.loads.layer_loads),
            "background": len(half.loads.background),
        }

    # ------------------------------------------------------------------ phases
    def run(self) -> dict[str, Any]:
        from vllm.v1.request import RequestStatus

        s = self.scheduler
        first = list(range(1, 3 * BLOCK + 2))
        phases: dict[str, Any] = {"facts": self.facts}

        s.add_request(self.request("A", first))
        self.until("store", self.idle)
        phases["store"] = self.snapshot()

        def unregister_mid_load() -> None:
            before = self.pending_on_worker()
            self.worker.unregister_kv_caches()
            phases["unregister_mid_load"] = {"before": before, "after": self.pending_on_worker()}
            self.worker.restore_kv_caches()

        phases["local_reset"] = s.reset_prefix_cache()
        s.add_request(self.request("B", first))
        if self.mode == "background":
            self.probe = ("loads", unregister_mid_load)
        self.until("hit", self.idle)
        phases["hit"] = self.snapshot()

        c = self.request("C", list(range(1000, 1000 + 6 * BLOCK + 1)), max_tokens=4)
        s.add_request(c)
        self.until("abort_running: first chunk", lambda: c.num_computed_tokens > 0)
        phases["abort_running_scheduled"] = c.num_computed_tokens
        s.finish_requests("C", RequestStatus.FINISHED_ABORTED)
        phases["abort_running_held"] = len(s.requests)
        self.until("abort_running", self.idle)
        phases["abort_running"] = self.snapshot()

        s.reset_prefix_cache()
        s.add_request(self.request("D", first))
        s.finish_requests("D", RequestStatus.FINISHED_ABORTED)
        self.until("abort_waiting", self.idle)
        phases["abort_waiting"] = self.snapshot()

        def unregister_mid_step() -> None:
            before = self.pending_on_worker()
            self.worker.unregister_kv_caches()
            phases["unregister_mid_step"] = {"before": before, "after": self.pending_on_worker()}
            self.worker.restore_kv_caches()

        e = self.request("E", list(range(2000, 2000 + 6 * BLOCK + 1)), max_tokens=4)
        s.add_request(e)
        self.probe = ("stores", unregister_mid_step)
        self.until("sleep: first chunk", lambda: e.num_computed_tokens > 0)
        s.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        try:  # vLLM's in-process engine resets right after the abort
            s.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
            phases["inproc_reset_error"] = None
        except RuntimeError as exc:
            phases["inproc_reset_error"] = str(exc)
        phases["sleep_idle_steps"] = self.until("sleep: idle", self.idle)
        phases["sleep_reset"] = s.reset_prefix_cache(
            reset_running_requests=True, reset_connector=True
        )
        self.worker.unregister_kv_caches()
        self.worker.unregister_kv_caches()  # idempotent, as vLLM asks
        phases["asleep_pending"] = self.pending_on_worker()
        for tensor in self.caches.values():
            tensor.fill_(GARBAGE)
        self.worker.restore_kv_caches()
        self.worker.restore_kv_caches()
        phases["slept"] = self.snapshot()
        s.add_request(self.request("F", first))
        self.until("after wake: miss", self.idle)
        phases["wake_miss"] = self.snapshot()
        s.reset_prefix_cache()
        s.add_request(self.request("G", first))
        self.until("after wake: hit", self.idle)
        phases["wake_hit"] = self.snapshot()
        self.worker.shutdown()
        return phases


if __name__ == "__main__":
    out = main(Path(sys.argv[1]))
    print("VLLM033-RESULT " + json.dumps(out, default=str), flush=True)

"""A model of vLLM's engine around the connector: vLLM's own scheduler, our model runner.

The scheduler is vLLM's :class:`~vllm.v1.core.sched.scheduler.Scheduler` (pure Python),
with the connector's scheduler side built by it (``role=SCHEDULER``); the worker side
(``role=WORKER``) runs in the same process over a CPU KV cache of torch tensors,
registered with ``register_kv_caches``, and real tiers. Both roles meet in
``connectors/vllm/shared.py``'s registry, as in vLLM's single-process mode.

The model runner replaces the forward pass: for every token vLLM schedules it writes,
into that token's slot of every layer, a deterministic function of the weights
version, the token ids up to that position, the position and the layer
(:func:`slot_words`). So any block vLLM treats as computed can be checked bit for bit
(:meth:`Engine.check_computed_blocks_current`): a block loaded from a tier holds what
the forward pass would have written under the *current* weights, or the connector
served something stale or unwritten.

Each step follows what vLLM's worker does around a forward pass
(``kv_connector_model_runner_mixin.py`` and ``gpu_model_runner.py`` in vLLM 0.32):
``handle_preemptions``, bind the metadata, ``start_load_kv`` (before the forward pass
when the step has synchronous loads, after it otherwise), the forward pass,
``wait_for_save``, ``get_transfer_results``, ``get_block_ids_with_load_errors``, stats
and events, then ``update_from_output`` with the ``KVConnectorOutput``.
Under async scheduling (vLLM's ``AsyncScheduler``) the steps are those of the engine
core's ``step_with_batch_queue``: step N+1 is scheduled and executed (its worker calls
included) before step N's output is applied, and the model runner takes a decode's
input token from its own last sampled token, as vLLM's does.

The invariants are methods named ``check_*``, so a failure names the one it broke.
"""

from __future__ import annotations

import atexit
import collections
import functools
import itertools
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from kvoffload.connectors.vllm import (
    REGISTRY,
    TieredOffloadConnector,
    connector_counters,
    connector_health,
)
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from .engine_run import write_tiny_llama

BLOCK = 16
"""Tokens per block. vLLM's CPU attention wants 32, but no attention runs here, and
the scheduler and the connector take 16 (as ``tests/connector/test_connector_threads.py``)."""
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 32  # the tiny Llama of support.engine_run
WORDS = KV_HEADS * HEAD_DIM
"""int16 words of one token's K (and as many of its V) in one layer (bf16)."""
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
BLOCK_BYTES = LAYERS * 2 * BLOCK * WORDS * 2
MASK64 = (1 << 64) - 1
STORE_TIMEOUT_MS = 10_000.0

_CONFIGS: dict[tuple[Any, ...], VllmConfig] = {}
_WORKDIR: Path | None = None
_HASH_READY = False


def workdir() -> Path:
    """One directory per process for the model config and the tiers' files (each
    engine its own subdirectory)."""
    global _WORKDIR
    if _WORKDIR is None:
        _WORKDIR = Path(tempfile.mkdtemp(prefix="kvoffload-contract-"))
        # Hundreds of MB of tier files per process: removed when the process ends.
        atexit.register(shutil.rmtree, _WORKDIR, ignore_errors=True)
        write_tiny_llama(_WORKDIR / "model")
    return _WORKDIR


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def rolling(tokens: list[int], have: list[int]) -> list[int]:
    """Extend ``have`` (a hash of the token ids up to each position) over ``tokens``."""
    r = have[-1] if have else 0x51ED
    for tok in tokens[len(have) :]:
        r = _splitmix(r ^ (tok + 1))
        have.append(r)
    return have


@functools.lru_cache(maxsize=1 << 16)
def slot_words(version: int, prefix_hash: int, position: int, layer: int) -> list[int]:
    """What the forward pass writes into one token's slot of one layer: four signed
    16-bit words (repeated over the slot), from the weights version, the hash of the
    token ids up to the position, the position and the layer."""
    h = _splitmix(prefix_hash ^ _splitmix(version * 1_000_003 + position * 131 + layer))
    return [((h >> (16 * i)) & 0xFFFF) - 0x8000 for i in range(4)]


@dataclass(frozen=True)
class Variant:
    """One engine's configuration: which tiers, which vLLM settings."""

    tiers: str = "cpu+mmap"
    """``cpu``, ``cpu+mmap``, ``cpu+lmdb`` or ``flakycpu+mmap`` (``cpu+faultymmap`` builds,
    but its faults' timing makes Hypothesis' replays disagree: not yet a variant)."""
    log_stats: bool = True
    gpu_blocks: int = 8
    """vLLM's KV cache (blocks): few make preemptions."""
    async_loads: bool = False
    """``async_load_min_bytes`` of one block: every hit is vLLM's asynchronous load."""
    kv_role: str = "kv_both"
    load_timeout_ms: float = 2000.0
    cpu_blocks: int = 24
    disk_blocks: int = 256
    max_num_batched_tokens: int = 64
    max_num_seqs: int = 4
    prefetch_on_arrival: bool = True
    async_scheduling: bool = False
    """vLLM's ``AsyncScheduler``, driven as the engine core's ``step_with_batch_queue``
    drives it: one step in flight while the next is scheduled."""


def _tiers(variant: Variant, where: Path) -> list[dict[str, Any]]:
    first, *rest = variant.tiers.split("+")
    cpu: dict[str, Any] = {"name": "cpu", "capacity": variant.cpu_blocks * BLOCK_BYTES}
    if first == "flakycpu":
        cpu.update(backend="flakycpu", fail_every=3)
    tiers = [cpu]
    for kind in rest:
        disk: dict[str, Any] = {
            "name": kind,
            "backend": kind,
            "path": str(where / kind),
            "capacity": variant.disk_blocks * BLOCK_BYTES,
            "fsync": False,
        }
        if kind in ("mmap", "faultymmap"):
            disk["preallocate"] = False
        if kind == "faultymmap":
            disk.update(read_error=0.2, write_error=0.1)
        tiers.append(disk)
    return tiers


def _vllm_config(variant: Variant) -> VllmConfig:
    """vLLM's config for ``variant``, built once per process (ModelConfig reads the
    model's config.json: tens of milliseconds); each engine then sets its own engine id
    and tiers on it before vLLM builds the connector from it."""
    key = (variant.kv_role, variant.max_num_batched_tokens, variant.max_num_seqs)
    config = _CONFIGS.get(key)
    if config is None:
        model = ModelConfig(
            model=str(workdir() / "model"),
            skip_tokenizer_init=True,
            dtype="bfloat16",
            max_model_len=1024,
        )
        config = VllmConfig(
            model_config=model,
            scheduler_config=SchedulerConfig(
                max_num_seqs=variant.max_num_seqs,
                max_num_batched_tokens=variant.max_num_batched_tokens,
                max_model_len=1024,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TieredOffloadConnector",
                kv_connector_module_path="kvoffload.connectors.vllm",
                kv_role=variant.kv_role,
                engine_id="contract",
                kv_load_failure_policy="recompute",
                kv_connector_extra_config={},
            ),
        )
        _CONFIGS[key] = config
    return config


_KV: dict[int, dict[str, torch.Tensor]] = {}


def _kv_caches(blocks: int) -> dict[str, torch.Tensor]:
    """The KV cache of an engine of ``blocks`` blocks. Allocating it costs more than the
    rest of an engine, so engines (one at a time, each closed before the next) reuse
    one, poisoned first: a block never written holds no token's KV."""
    kv = _KV.get(blocks)
    if kv is None:
        kv = {
            name: torch.empty((blocks, 2, BLOCK, KV_HEADS, HEAD_DIM), dtype=torch.bfloat16)
            for name in LAYER_NAMES
        }
        _KV[blocks] = kv
    for t in kv.values():
        t.view(torch.int16).fill_(0x5A5A)
    return kv


@dataclass
class StepRecord:
    """What one step did, for the invariants and for a failure's report."""

    scheduled: dict[str, int] = field(default_factory=dict)
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    hits: int = 0
    preempted_hits: int = 0
    hits_by_source: dict[Any, int] = field(default_factory=dict)


class InvariantError(AssertionError):
    """An invariant broke: the message starts with the invariant's name."""


def _fail(name: str, message: str) -> None:
    raise InvariantError(f"{name}: {message}")


class Engine:
    """vLLM's scheduler, the connector's two sides and our model runner (see the
    module docstring). One per Hypothesis example: a fresh engine id and tier
    directory each time."""

    IDLE_WAIT_S = 10.0
    """Longest wait for the tiers' threads to settle once idle (a bound far above what
    it measures: a leak never settles)."""

    def __init__(self, variant: Variant) -> None:
        global _HASH_READY
        if not _HASH_READY:
            init_none_hash(sha256)
            _HASH_READY = True
        self.variant = variant
        # The tensors here are tiny: torch's intra-op threads cost more waking up than
        # they save (on 2 shared cores, most of an engine's time). Restored at close.
        self._threads = torch.get_num_threads()
        torch.set_num_threads(1)
        self.engine_id = f"contract-{uuid.uuid4().hex[:12]}"
        self.where = workdir() / self.engine_id
        self.where.mkdir()
        config = _vllm_config(variant)
        transfer = config.kv_transfer_config
        assert transfer is not None
        transfer.engine_id = self.engine_id
        transfer.kv_connector_extra_config = {
            "config": {
                "tiers": _tiers(variant, self.where),
                "load_timeout_ms": variant.load_timeout_ms,
                "store_timeout_ms": STORE_TIMEOUT_MS,
                "async_load_min_bytes": BLOCK_BYTES if variant.async_loads else 1 << 40,
            },
            # No prefill to time here: every hit is loaded (exact tallies).
            "load_or_recompute": False,
            "prefetch_on_arrival": variant.prefetch_on_arrival,
        }
        config.cache_config.num_gpu_blocks = variant.gpu_blocks
        self.config = config
        spec = FullAttentionSpec(
            block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16
        )
        self.kv_cache_config = KVCacheConfig(
            num_blocks=variant.gpu_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
        )
        self.kv = _kv_caches(variant.gpu_blocks)
        self.worker = TieredOffloadConnector(config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.kv)
        scheduler_cls = AsyncScheduler if variant.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config=config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=BLOCK,
            log_stats=variant.log_stats,
        )
        self.hasher = get_request_block_hasher(BLOCK, sha256)
        self.version = 0
        self.steps = 0
        self.counter = itertools.count()
        self._prefix: dict[str, list[int]] = {}
        self._want: dict[str, tuple[int, list[torch.Tensor]]] = {}
        self._pending: dict[str, list[int]] = {}
        """Per request, the tokens our model runner sampled in steps whose output the
        scheduler has not applied yet."""
        self._queue: collections.deque[
            tuple[SchedulerOutput, ModelRunnerOutput, StepRecord, float]
        ] = collections.deque()
        """Async scheduling: the steps executed, their output not yet applied (newest
        first, as the engine core's ``batch_queue``)."""
        self._recomputing: set[int] = set()
        """Blocks whose load failed in the last step (see the first invariant)."""
        self.loading: dict[str, float] = {}
        """Requests in WAITING_FOR_REMOTE_KVS: when their load was submitted (at the
        latest: the end of the step that scheduled it)."""
        self.late_steps: dict[str, int] = {}
        self.total_hits = 0
        self.total_preempted_hits = 0
        self.finished: set[str] = set()
        self.closed = False

    # ------------------------------------------------------------------ driving
    def add(self, prompt: list[int], max_tokens: int) -> str:
        req_id = f"r{next(self.counter)}"
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = Request(
            request_id=req_id,
            prompt_token_ids=list(prompt),
            sampling_params=params,
            pooling_params=None,
            block_hasher=self.hasher,
        )
        self.scheduler.add_request(request)
        return req_id

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def unfinished(self) -> list[str]:
        return [r for r, req in self.scheduler.requests.items() if not req.is_finished()]

    def reset_prefix_cache(self) -> bool:
        return bool(self.scheduler.reset_prefix_cache())

    def update_weights(self) -> bool:
        """vLLM's weight update: reset the prefix cache and the connector's
        (``reset_prefix_cache(reset_connector=True)``); once both succeed, the model
        computes under new weights, and all KV computed before is wrong."""
        ok = bool(self.scheduler.reset_prefix_cache(reset_connector=True))
        if ok:
            self.version += 1
        return ok

    def _tokens(self, request: Request) -> list[int]:
        """The request's tokens as the model runner knows them: the scheduler's, then
        those sampled in steps whose output has not reached the scheduler yet (async
        scheduling: the scheduler holds placeholders for them)."""
        return list(request.all_token_ids) + self._pending.get(request.request_id, [])

    def _prefix_hashes(self, request: Request, upto: int) -> list[int]:
        have = self._prefix.setdefault(request.request_id, [])
        if len(have) < upto:
            tokens = self._tokens(request)
            if len(tokens) < upto:
                _fail(
                    "model_runner_tokens",
                    f"request {request.request_id}: position {upto - 1} scheduled or "
                    f"computed, but only {len(tokens)} tokens known",
                )
            rolling(tokens[:upto], have)
        return have

    def _expected(self, request: Request, n: int) -> list[torch.Tensor]:
        """Per layer, the four words of each of ``request``'s first ``n`` tokens under
        the current weights (kept per request and extended as it grows)."""
        cached = self._want.get(request.request_id)
        if cached is None or cached[0] != self.version:
            cached = (self.version, [torch.empty((0, 4), dtype=torch.int16)] * LAYERS)
        have = cached[1][0].shape[0]
        if have < n:
            hashes = self._prefix_hashes(request, n)
            more = [
                torch.tensor(
                    [slot_words(self.version, hashes[p], p, layer) for p in range(have, n)],
                    dtype=torch.int16,
                )
                for layer in range(LAYERS)
            ]
            cached = (self.version, [torch.cat(pair) for pair in zip(cached[1], more, strict=True)])
            self._want[request.request_id] = cached
        return cached[1]

    def _slots(self, req_id: str, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (block, offset) of ``req_id``'s tokens ``[first, stop)`` in vLLM's KV
        cache."""
        ids = torch.tensor(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        pos = torch.arange(first, stop)
        return ids[pos // BLOCK], pos % BLOCK

    def _layer(self, layer: int) -> torch.Tensor:
        """Layer ``layer`` of the KV cache as (block, K/V, offset, words)."""
        return self.kv[LAYER_NAMES[layer]].view(torch.int16).view(-1, 2, BLOCK, WORDS)

    def _forward(self, out: SchedulerOutput) -> dict[str, list[int]]:
        """Write every scheduled token's KV; the sampled token of each request whose
        scheduled tokens reach its end."""
        sampled: dict[str, list[int]] = {}
        starts = {n.req_id: n.num_computed_tokens for n in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            starts[req_id] = cached.num_computed_tokens[i]
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = starts[req_id]
            want = self._expected(request, start + n)
            b, o = self._slots(req_id, start, start + n)
            for layer in range(LAYERS):
                vals = want[layer][start : start + n].repeat(1, WORDS // 4)
                self._layer(layer)[b, :, o] = vals.unsqueeze(1).expand(-1, 2, -1)
            if start + n >= len(self._tokens(request)):
                last = self._prefix[req_id][start + n - 1]
                sampled[req_id] = [2 + (last ^ (self.version * 7919)) % 1000]
        return sampled

    def step(self) -> StepRecord:
        """One engine step: schedule, the worker's connector calls around our forward
        pass, ``update_from_output``; then every per-step invariant. Under async
        scheduling (:attr:`Variant.async_scheduling`), one call of vLLM's
        ``EngineCore.step_with_batch_queue`` instead (see :meth:`_step_async`)."""
        if self.variant.async_scheduling:
            return self._step_async()
        rec, out, step_began = self._schedule()
        runner = self._execute(out, rec)
        self._apply(out, runner, rec, step_began)
        return rec

    BATCH_QUEUE = 2
    """vLLM's ``max_concurrent_batches`` under async scheduling (no pipeline
    parallelism): one step in flight while the next is scheduled."""

    def _step_async(self) -> StepRecord:
        """``step_with_batch_queue`` of vLLM 0.32's engine core with a queue of two:
        schedule a step and execute it (the worker side's connector calls and our
        forward pass run when the executor gets it), and return without applying
        anything while the queue has room and there is work; otherwise apply the
        oldest step's output (``update_from_output``) and check the invariants. So
        step N+1 is scheduled, and its worker calls run, before step N's output
        reaches the scheduler. The scheduler is vLLM's ``AsyncScheduler``: a decode's
        input token is a placeholder when it is scheduled, and our model runner,
        like vLLM's, takes it from its own last sampled token (:meth:`_tokens`).

        One liberty: with no request and nothing in flight, a step is still scheduled
        (an empty one), as the synchronous harness does, so that drains and idle waits
        see the worker's finished transfers."""
        sched = self.scheduler
        queue = self._queue
        rec = StepRecord()
        if sched.has_requests() or not queue:
            rec, out, step_began = self._schedule()
            runner = self._execute(out, rec)
            queue.appendleft((out, runner, rec, step_began))
            executed = out.total_num_scheduled_tokens > 0
            if len(queue) < self.BATCH_QUEUE and (executed or sched.has_requests()):
                return rec
        out, runner, rec, step_began = queue.pop()
        self._apply(out, runner, rec, step_began)
        return rec

    def _schedule(self) -> tuple[StepRecord, SchedulerOutput, float]:
        rec = StepRecord()
        sched = self.scheduler
        out = sched.schedule()
        self.steps += 1
        step_began = time.monotonic()
        received = sched.finished_recving_kv_req_ids  # reported, not yet resumed
        for req_id, req in sched.requests.items():
            if (
                req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and req_id not in self.loading
                and req_id not in received
            ):
                self.loading[req_id] = float("inf")  # submitted below, this step
        return rec, out, step_began

    def _execute(self, out: SchedulerOutput, rec: StepRecord) -> ModelRunnerOutput:
        """The worker side of one step: the connector's calls around our forward pass."""
        worker = self.worker
        meta = out.kv_connector_metadata
        assert meta is not None
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        sync_first = bool(getattr(out, "has_sync_kv_loads", True))
        if sync_first:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        sampled = self._forward(out)
        if not sync_first:
            worker.start_load_kv(None)  # type: ignore[arg-type]
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        kv_out = KVConnectorOutput(
            finished_sending=results.finished_sending or None,
            finished_recving=results.finished_recving or None,
            failed_recving=set(results.failed_recving or ()),
            invalid_block_ids=set(invalid),
            kv_connector_stats=worker.get_kv_connector_stats(),
            kv_cache_events=worker.get_kv_connector_kv_cache_events(),
        )
        worker.clear_connector_metadata()
        now = time.monotonic()
        for req_id, since in self.loading.items():
            if since == float("inf"):
                self.loading[req_id] = now
        rec.scheduled = dict(out.num_scheduled_tokens)
        rec.finished_sending = set(results.finished_sending or ())
        rec.finished_recving = set(results.finished_recving or ())
        rec.failed_recving = set(results.failed_recving or ())
        rec.invalid_block_ids = set(invalid)
        req_ids = list(out.num_scheduled_tokens)
        for r, toks in sampled.items():
            self._pending.setdefault(r, []).extend(toks)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in req_ids],
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=kv_out,
        )

    def _apply(
        self, out: SchedulerOutput, runner: ModelRunnerOutput, rec: StepRecord, step_began: float
    ) -> None:
        """``update_from_output`` with one step's output, then the invariants."""
        sched = self.scheduler
        # The hits vLLM counted since its last stats (``update_from_output`` takes and
        # resets them: under async scheduling, those of two schedules).
        stats = sched.connector_prefix_cache_stats
        if stats is not None:
            rec.hits = stats.hits
            rec.preempted_hits = stats.preempted_hits
            rec.hits_by_source = dict(stats.hits_by_source)
        self.total_hits += rec.hits
        self.total_preempted_hits += rec.preempted_hits
        before = {r: sched.requests[r].num_tokens for r in runner.req_ids if r in sched.requests}
        engine_outputs = sched.update_from_output(out, runner)
        for r, toks in zip(runner.req_ids, runner.sampled_token_ids, strict=True):
            if not toks:
                continue
            pending = self._pending.get(r, [])
            del pending[: len(toks)]
            if not pending:
                self._pending.pop(r, None)
            req = sched.requests.get(r)
            if req is not None and req.num_tokens != before.get(r, -1) + len(toks):
                # The scheduler dropped (some of) them: forget what was computed from
                # the worker's view of its tokens.
                self._prefix.pop(r, None)
                self._want.pop(r, None)
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    self.finished.add(o.request_id)
        self._recomputing = set(rec.invalid_block_ids)
        for req_id in list(self._prefix):
            if req_id not in sched.requests:
                del self._prefix[req_id]
                self._want.pop(req_id, None)
        for req_id in list(self._pending):
            if req_id not in sched.requests:
                del self._pending[req_id]
        self.check_loads_end_once(rec)
        self.check_remote_wait_bounded(step_began)
        self.check_hit_sources(rec)
        self.check_computed_blocks_current()

    DRAIN_S = 30.0
    """Longest a drain waits (wall time) for the connector to give back finished
    requests' blocks: three times ``store_timeout_ms``, after which a store not begun
    is abandoned and its request's blocks freed anyway."""

    def drain(self, max_steps: int = 2000) -> None:
        """Step until no request is left, then a few empty steps (finished stores and
        loads reported). Once only finished requests are left (their blocks held for
        their stores), steps are spaced by a millisecond."""
        deadline = time.monotonic() + self.DRAIN_S
        steps = 0
        while self.scheduler.requests or self.scheduler.has_requests() or self._queue:
            if steps >= max_steps and time.monotonic() > deadline:
                left = [(r, q.status.name) for r, q in self.scheduler.requests.items()]
                _fail("drains", f"requests left after {steps} steps and {self.DRAIN_S} s: {left}")
            if not self.unfinished():
                time.sleep(0.001)
            self.step()
            steps += 1
        for _ in range(3):
            self.step()

    # --------------------------------------------------------------- invariants
    def check_computed_blocks_current(self) -> None:
        """Every token vLLM treats as computed for a running request holds exactly the
        KV of its tokens under the current weights version."""
        sched = self.scheduler
        for req_id in [r.request_id for r in sched.running]:
            request = sched.requests[req_id]
            n = request.num_computed_tokens
            if n <= 0:
                continue
            want = self._expected(request, n)
            b, o = self._slots(req_id, 0, n)
            # A block whose load failed this step, shared by another request of the
            # step: vLLM has the first request recompute it in its next step and lets
            # the others count it computed meanwhile (``_update_requests_with_invalid_
            # blocks``); it is checked once that step has run.
            pending = torch.tensor([int(x) in self._recomputing for x in b.tolist()])
            for layer in range(LAYERS):
                got = self._layer(layer)[b, :, o]  # (n, 2, WORDS)
                full = want[layer][:n].repeat(1, WORDS // 4).unsqueeze(1)
                bad = (got != full).flatten(1).any(dim=1) & ~pending
                if not bool(bad.any()):
                    continue
                first = int(bad.nonzero()[0])
                hashes = self._prefix_hashes(request, n)
                stale = [
                    v
                    for v in range(self.version)
                    if got[first, 0, :4].tolist() == slot_words(v, hashes[first], first, layer)
                ]
                what = f"stale (weights version {stale[0]})" if stale else "wrong or unwritten"
                _fail(
                    "computed_blocks_current",
                    f"request {req_id}: {int(bad.sum())} of its {n} computed tokens in "
                    f"layer {layer} do not hold weights version {self.version}'s KV; the "
                    f"first at position {first} (block {int(b[first])}): {what}",
                )

    def check_remote_wait_bounded(self, step_began: float) -> None:
        """No request waits in WAITING_FOR_REMOTE_KVS for more than a few steps begun
        after its load's deadline (``load_timeout_ms`` from its submission), whatever
        the wall time: the worker gives up on a late load when it polls."""
        sched = self.scheduler
        timeout = self.variant.load_timeout_ms / 1e3
        for req_id in list(self.loading):
            req = sched.requests.get(req_id)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            if step_began > self.loading[req_id] + timeout:
                self.late_steps[req_id] = self.late_steps.get(req_id, 0) + 1
                if self.late_steps[req_id] > 3:
                    _fail(
                        "remote_wait_bounded",
                        f"request {req_id} still waits for its load "
                        f"{self.late_steps[req_id]} steps after load_timeout_ms",
                    )

    def check_loads_end_once(self, rec: StepRecord) -> None:
        """Every asynchronous load ends once, as received (``finished_recving``) or
        failed (``failed_recving``, also among the received)."""
        if not rec.failed_recving <= rec.finished_recving:
            _fail(
                "loads_end_once",
                f"failed {sorted(rec.failed_recving - rec.finished_recving)} not received",
            )
        for req_id in rec.finished_recving:
            if req_id not in self.loading:
                _fail("loads_end_once", f"request {req_id} received with no load waiting")
            del self.loading[req_id]
            self.late_steps.pop(req_id, None)

    def check_hit_sources(self, rec: StepRecord) -> None:
        """The connector's hits split by source (``get_external_cache_hit_sources``)
        sum to the hits vLLM counted (vLLM files a mismatch under
        ``EXTERNAL_UNSPECIFIED``)."""
        if CacheHitSource.EXTERNAL_UNSPECIFIED in rec.hits_by_source:
            _fail("hit_sources", f"sources {rec.hits_by_source} do not sum to {rec.hits}")
        if sum(rec.hits_by_source.values()) != rec.hits:
            _fail("hit_sources", f"sources {rec.hits_by_source} do not sum to {rec.hits}")

    def counters(self) -> dict[str, Any]:
        return connector_counters().get(self.engine_id, {})

    def check_idle(self) -> None:
        """Once every request is done: no pins, holds, claims, plans, prefetches or
        ``resident`` entries left, the Offloader's check is clean, every load ended,
        and (with stats) the tokens loaded are the hits vLLM counted."""
        self.drain()
        deadline = time.monotonic() + self.IDLE_WAIT_S
        while True:
            health = connector_health()[self.engine_id]
            shared = REGISTRY[self.engine_id]
            with shared.lock:
                resident = dict(shared.resident)
            left = {
                "pinned": [n for n in health["pinned"] if n],
                "holds": health["holds"],
                "plans": health["plans"],
                "prefetches": health["prefetches"],
                "claims": health["claims"],
                "problems": health["problems"],
                "resident": resident,
            }
            if not any(left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
            self.step()
        for name, value in left.items():
            if value:
                _fail(f"idle_{name}", f"{value!r} once idle")
        if self.loading:
            _fail("loads_end_once", f"loads never ended: {sorted(self.loading)}")
        counters = self.counters()
        if (
            self.variant.log_stats
            and not counters.get("load_errors")
            and not counters.get("load_timeouts")
        ):
            hits = self.total_hits + self.total_preempted_hits
            loaded = counters.get("tokens_loaded", 0)
            if loaded != hits:
                _fail("hits_loaded", f"vLLM counted {hits} external hit tokens, {loaded} loaded")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        torch.set_num_threads(self._threads)
        self.worker.shutdown()
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()


@contextmanager
def engine(variant: Variant) -> Iterator[Engine]:
    e = Engine(variant)
    try:
        yield e
    finally:
        e.close()


PREFIXES = [[(p * 97 + i * 13) % 1000 + 5 for i in range(4 * BLOCK)] for p in range(3)]
"""A tiny pool of prompt prefixes (4 blocks each), so that requests share blocks."""


def prompt(prefix: int, prefix_blocks: int, suffix: list[int]) -> list[int]:
    """A prompt of ``prefix_blocks`` blocks of prefix ``prefix``, then ``suffix``."""
    return PREFIXES[prefix][: prefix_blocks * BLOCK] + suffix

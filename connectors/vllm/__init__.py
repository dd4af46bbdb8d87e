"""``TieredOffloadConnector``: kvoffload's tiers behind vLLM's KV connector API (v1).

Loaded by vLLM with ``kv_connector="TieredOffloadConnector"`` and
``kv_connector_module_path="kvoffload.connectors.vllm"``; configured by
``kv_connector_extra_config`` = ``{"config_file": "path.yaml"}``, ``{"config": {...}}``
or, when neither is given, ``$KVOFFLOAD_CONFIG``. A bad config fails engine start-up
with kvoffload's one-line ``ConfigError``.

vLLM builds this class twice: with ``role=WORKER`` next to the KV tensors, and with
``role=SCHEDULER`` beside the scheduler. The worker side owns the :class:`Offloader`
(tiers, lanes, books); the scheduler side asks it what is held and tells the worker,
through the step's metadata, which blocks to load and store. When both sides share a
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler side calls the worker's
Offloader directly, through a process-local registry keyed by the engine id. In vLLM's
default mode the worker runs in its own process (on the CPU build always: its platform
turns the ``uni`` executor into ``mp``), and the scheduler side asks it over a Unix
socket (:mod:`.remote`): ``lookup``, ``plan`` and ``release``, microseconds each.
Under tensor parallelism each rank's worker serves its own books, and the scheduler
side takes the smallest answer of all ranks (``None`` if any is undecided).

- **Keys** are vLLM's own ``request.block_hashes`` (chained, seeded: never rehashed),
  namespaced by the layout fingerprint and the TP rank, so another model's or rank's
  blocks are never read, and by the KV cache group.
- **Every model family.** The connector is ``SupportsHMA``, so vLLM keeps its hybrid KV
  cache manager on: full-attention groups store every block, sliding-window groups the
  window before a boundary, Mamba groups the state vLLM hands over at a boundary, and
  a hit is the longest boundary every group serves (:mod:`.groups`). MLA's latent
  cache, the same on every TP rank, is kept once by rank 0, which sends its loads to
  the other ranks.
- **Verified hits.** A hit is claimed only for blocks the cpu tier holds verified.
  The scheduler's lookup (``get_num_new_matched_tokens``) asks the worker to
  :meth:`~kvoffload.offloader.Offloader.claim` the request's blocks: those only a disk
  tier holds are prefetched into the cpu tier first (read, checksums verified) and the
  lookup answers ``None`` ("not decided yet": vLLM asks again next step, and other
  requests run meanwhile); then it answers the verified prefix, pinned in the cpu tier
  for the request. A corrupt, lost or unreadable disk block shortens the hit *before*
  vLLM allocates anything, whatever ``kv_load_failure_policy`` says. A request that
  ends first (aborted) releases its pins and cancels its prefetches. Prefetches start
  when vLLM queues the request (``on_new_request``), unless ``prefetch_on_arrival``
  is off.
- **Loads** read the cpu tier only. Below ``async_load_min_bytes`` they are
  synchronous within the step (``start_load_kv`` waits for them); from it up, and for
  every hit of a model with several KV cache groups, they are vLLM's asynchronous
  loads: the request waits while the worker loads in the background, reports it
  received (``get_finished``) or failed whole (``get_transfer_results``). With
  ``layerwise_loads: true`` in ``kv_connector_extra_config``, ``start_load_kv`` only
  submits the synchronous ones, the blocks are
  copied in layer by layer, and each attention layer waits for its own layer
  (``wait_for_layer_load``); ``wait_for_save`` collects them. The one failure left is
  an I/O error there; it is reported through ``get_block_ids_with_load_errors``, and
  vLLM recomputes the blocks under ``kv_load_failure_policy="recompute"`` or fails the
  request under ``"fail"``
  (vLLM's default: the connector warns about it at start).
- **Stores** are asynchronous: ``wait_for_save`` submits the blocks that became full
  this step and returns; a finished request's GPU blocks are held
  (``request_finished`` -> True) until its stores are done (``get_finished``).
- **Stats** reach vLLM as :class:`TieredOffloadStats` (deltas from the worker side),
  and Prometheus as ``vllm:kvoffload_*`` counters (:class:`TieredOffloadPromMetrics`).
- **KV events** (with ``kv_events_config.enable_kv_cache_events``): the worker side
  turns its tiers' store and eviction records into self-describing vLLM
  ``BlockStored`` (tokens, parent hash, block size, LoRA, group, medium and locality:
  the blocks' details come from the scheduler side with each store and load) /
  ``BlockRemoved`` events and sends them with its step output
  (``get_kv_connector_kv_cache_events``); the scheduler side collects them in
  ``update_connector_output`` and hands them to vLLM's publisher in ``take_events``.

The package, one role per module (this module only hands each call to its role's half,
as vLLM's own ``OffloadingConnector`` hands off to its scheduler and worker objects):
:mod:`.scheduler` (:class:`TieredOffloadScheduler`, ``role=SCHEDULER``: lookups, load
plans, the request lifecycle, and with :mod:`.stores` the blocks each step stores),
:mod:`.worker` (:class:`TieredOffloadWorker`, ``role=WORKER``: the Offloader, stores,
finished requests, and with :mod:`.loads` the loads), :mod:`.metadata` (the step's
:class:`TieredOffloadMetadata` from one to the other), :mod:`.shared` (the worker side's
state, and the process-wide registry where a scheduler side in the same process finds
it: :func:`connector_counters`, :func:`connector_health`), :mod:`.remote` and
:mod:`.channel` (the books over a Unix socket, for a scheduler side in another
process), :mod:`.metrics` (the counters, :class:`TieredOffloadStats`,
:class:`TieredOffloadPromMetrics`), :mod:`.events` (KV events), :mod:`.groups` (vLLM's
KV cache groups and the one block pool over them), :mod:`.affinity` (the CPUs the
worker side's threads start on) and :mod:`.config` (vLLM's config read into
kvoffload's: config, layout, version check).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from .admin import admin_spec
from .affinity import rank_affinity, rank_cpus
from .config import (
    CONSUMER,
    PRODUCER,
    SUPPORTED,
    async_min_bytes,
    check_vllm_version,
    config_from_vllm,
    events_enabled,
    layout_from_vllm,
    lower_source,
    options_from_vllm,
    per_rank,
    role_from_vllm,
    warn_about_late_failures,
    warn_about_unshared_roles,
)
from .events import MAX_EVENT_HASHES, BlockHash, TieredOffloadKVEvents
from .groups import groups_from_vllm, refuse_unservable, unkeyable
from .metrics import (
    COUNTERS,
    PREFETCH_COUNTERS,
    PROM_PREFIX,
    TIER_STATS,
    TieredOffloadPromMetrics,
    TieredOffloadStats,
)
from .scheduler import TieredOffloadMetadata, TieredOffloadScheduler
from .shared import REGISTRY, close_slot, connector_counters, connector_health, registry_key
from .worker import TieredOffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# What the single module ``kvoffload.connectors.vllm`` exported, plus the two halves.
__all__ = [
    "COUNTERS",
    "MAX_EVENT_HASHES",
    "PREFETCH_COUNTERS",
    "PROM_PREFIX",
    "REGISTRY",
    "SUPPORTED",
    "TIER_STATS",
    "BlockHash",
    "TieredOffloadConnector",
    "TieredOffloadKVEvents",
    "TieredOffloadMetadata",
    "TieredOffloadPromMetrics",
    "TieredOffloadScheduler",
    "TieredOffloadStats",
    "TieredOffloadWorker",
    "check_vllm_version",
    "config_from_vllm",
    "connector_counters",
    "connector_health",
    "layout_from_vllm",
    "rank_affinity",
    "rank_cpus",
]


class TieredOffloadConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]  # vLLM: Any
    """See the module docstring. Reads the engine's config (either role), then hands
    each call to its role's half: :class:`TieredOffloadScheduler` or
    :class:`TieredOffloadWorker` (the other half is ``None``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        check_vllm_version()
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        extra = dict(transfer.kv_connector_extra_config or {})
        self.config = config_from_vllm(extra)
        self.options = options_from_vllm(extra)
        self.block_size = vllm_config.cache_config.block_size
        hash_block = getattr(kv_cache_config, "hash_block_size", None) or getattr(
            vllm_config.cache_config, "hash_block_size", None
        )
        self.groups = groups_from_vllm(kv_cache_config, self.block_size)
        self.inert = unkeyable(
            self.groups, self.block_size, hash_block, warn=role == KVConnectorRole.SCHEDULER
        )
        mla = bool(getattr(vllm_config.model_config, "use_mla", False))
        self.layout = layout_from_vllm(vllm_config, mla=mla)
        self.engine_id = str(transfer.engine_id)
        parallel = vllm_config.parallel_config
        self.ranks = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.rank = parallel.rank if role == KVConnectorRole.WORKER else 0
        # MLA's latent cache is the same on every tensor-parallel rank: rank 0 keeps it
        # (in the tiers a one-rank engine uses) and sends loads to the others.
        self.replicated = mla and self.ranks > 1 and parallel.pipeline_parallel_size == 1
        refuse_unservable(
            self.groups,
            mla=mla,
            tensor_parallel=parallel.tensor_parallel_size,
            pipeline_parallel=parallel.pipeline_parallel_size,
        )
        self._slot = registry_key(self.engine_id, self.rank)
        if self.ranks > 1 and role == KVConnectorRole.WORKER and not self.replicated:
            # One process per rank, each with its own tiers: a disk tier of one rank
            # must not share its directory with another's.
            self.config = per_rank(self.config, self.rank)
        self._events_enabled = events_enabled(vllm_config)
        self._scheduler: TieredOffloadScheduler | None = None
        self._worker: TieredOffloadWorker | None = None
        self.kv_role = role_from_vllm(transfer)
        if role == KVConnectorRole.SCHEDULER:
            warn_about_late_failures(self.config, transfer)
            warn_about_unshared_roles(self.config, self.kv_role)
            self._scheduler = TieredOffloadScheduler(
                engine_id=self.engine_id,
                slot=self._slot,
                ranks=self.ranks,
                asked=1 if self.replicated else self.ranks,
                block_size=self.block_size,
                events=self._events_enabled,
                groups=self.groups,
                inert=self.inert,
                books_timeout_s=self.config.books_timeout_ms / 1e3,
                prefetch_on_arrival=self.options["prefetch_on_arrival"],
                block_bytes=self.layout.bytes_per_block,
                # A cache every rank holds alike is sent by rank 0 within the step.
                async_min_bytes=async_min_bytes(self.config.async_load_min_bytes, self.replicated),
                first_tier=self.config.tiers[0].name if self.config.tiers else "cpu",
                role=self.kv_role,
                producer_wait_s=self.config.producer_wait_ms / 1e3,
                lower_source=lower_source(self.config),
            )
        else:
            self._worker = TieredOffloadWorker(
                config=self.config,
                layout=self.layout,
                engine_id=self.engine_id,
                rank=self.rank,
                ranks=self.ranks,
                slot=self._slot,
                block_size=self.block_size,
                events=self._events_enabled,
                layerwise=self.options["layerwise_loads"],
                groups=self.groups,
                replicated=self.replicated,
                # A consumer (a decode engine) loads every hit: computing a prompt's
                # blocks is the prefill engine's work, and a hit cut short would look
                # like one whose blocks the producer is still storing.
                load_or_recompute=self.options["load_or_recompute"] and self.kv_role != CONSUMER,
                admin=admin_spec(self.config, vllm_config, self.engine_id),
            )

    def _scheduler_side(self) -> TieredOffloadScheduler:
        if self._scheduler is None:
            raise RuntimeError("TieredOffloadConnector: a scheduler-side call on the worker side")
        return self._scheduler

    def _worker_side(self) -> TieredOffloadWorker:
        if self._worker is None:
            raise RuntimeError("TieredOffloadConnector: a worker-side call on the scheduler side")
        return self._worker

    # ----------------------------------------------------------- scheduler side
    def on_new_request(self, request: Request) -> None:
        self._scheduler_side().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler_side().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler_side().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler_side().build_connector_meta(scheduler_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler_side().request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` under vLLM's hybrid KV cache manager: the request's
        blocks per KV cache group (:class:`SupportsHMA`, which keeps the hybrid
        manager on with this connector)."""
        return self._scheduler_side().request_finished(request, block_ids)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """The tokens of this request's hit by the tier they came from: found in the
        cpu tier at its first mention (``host``), else brought up from a local disk
        tier (``disk``) or a shared one (``external_unspecified``)."""
        return self._scheduler_side().hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool | None:
        """``/reset_prefix_cache?reset_external=true``, and vLLM's cache clearing
        around a weight update: no block stored before it is loaded again by this
        engine, from any tier (a new reset generation in the keys: docs/vllm.md)."""
        return self._scheduler_side().reset_cache()

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler_side().update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._scheduler_side().take_events()

    # -------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker_side().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker_side().start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._worker_side().wait_for_layer_load(layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return

    def wait_for_save(self) -> None:
        self._worker_side().wait_for_save(self._get_connector_metadata())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._worker_side().handle_preemptions(kv_connector_metadata)

    @property
    def requires_kv_delivery(self) -> bool:
        """Only a producer (a P/D prefill engine) hands off KV that must arrive: its
        consumer waits for it. For ``kv_both`` the tiers are a best-effort cache (a
        store lost to a preemption is a later miss), so vLLM need not drop a request's
        in-flight output at a preemption under asynchronous scheduling (its default,
        ``is_kv_producer``, is true for ``kv_both`` too)."""
        return self.kv_role == PRODUCER

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker_side().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished stores and loads, and failed loads: a hit of an engine with several
        KV cache groups loads as vLLM's asynchronous load, which fails whole."""
        sending, received, failed = self._worker_side().get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=received, failed_recving=failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker_side().get_block_ids_with_load_errors()

    # -------------------------------------------------------------- both sides
    def get_kv_connector_stats(self) -> TieredOffloadStats | None:
        """Counts since the previous call: the scheduler side reports its hit-path
        timings alone (:data:`.hitpath.HIT_COUNTERS`), the worker side everything
        else. When both share a process the scheduler side would find the same
        Offloader: were both to report its counts, every one would be doubled."""
        if self._scheduler is not None:
            timed = self._scheduler.step_stats()
            return TieredOffloadStats(data=timed) if timed else None
        return None if self._worker is None else self._worker.get_kv_connector_stats()

    def get_kv_connector_kv_cache_events(self) -> TieredOffloadKVEvents | None:
        """The tiers' KV events since the previous step (worker side only; ``None``
        when there are none, or events are off)."""
        return None if self._worker is None else self._worker.get_kv_connector_kv_cache_events()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise loads wait inside the attention layers: Python that a full CUDA
        graph would skip on replay, so vLLM must run graphs piecewise then."""
        return extra_config.get("layerwise_loads") is True

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> TieredOffloadStats | None:
        return TieredOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> TieredOffloadPromMetrics:
        return TieredOffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def shutdown(self) -> None:
        """Close the worker-side state registered in this process under this
        connector's engine id and rank. vLLM calls this on both roles; when they share
        a process, whichever comes first closes it (the worker side's operator
        endpoint stops first)."""
        if self._worker is not None:
            self._worker.close_admin()
        close_slot(self._slot)

    def unregister_kv_caches(self) -> None:
        """vLLM 0.33's sleep mode, before the KV cache's memory is released: wait until
        nothing of ours touches it (:meth:`TieredOffloadWorker.unregister_kv_caches`)."""
        self._worker_side().unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM 0.33's wake-up of the KV cache: nothing to redo. The hook hands over no
        new tensors: vLLM's sleep backend maps the memory back at the same virtual
        addresses (cumem), so the block pool's views and device addresses stay valid.
        The bytes there are new, but vLLM reset its prefix cache and the connector
        before the sleep: no request and no planned load counts on them."""
        return

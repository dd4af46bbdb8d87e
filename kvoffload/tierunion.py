"""The config's ``tiers`` list: one tier whatever its backend (the union each entry
validates as), and the rules the list follows as a whole (:func:`check_tier_list`).

A tier naming a built-in backend (``cpu``, ``mmap``, ``lmdb``) validates with that
tier's settings model; any other is a :class:`PluginTierConfig`, checked against the
settings model its plugin declares (:func:`plugin_config_model`), and what the backend
receives is that typed model (:func:`resolve_tier_config`).

Secrets: once a plugin tier is validated it holds the plugin model's validated values
of its own fields, so a secret is a ``SecretStr`` in the tier too: masked in every
``repr``, ``str`` and JSON dump, and intact in a Python ``model_dump()`` (which
re-validates, e.g. for ``kvoffload stress``'s replicas) and in the typed config the
backend receives. A validation error about a secret field shows
:data:`~kvoffload.redact.SECRET_MASK` for its value, and one that quotes a whole tier
masks its secrets (:func:`~kvoffload.redact.scrub`).

An error found inside a tier about one of its fields travels as a :func:`tier_error`,
which the config's loader places under the tier's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Final, Union

from pydantic import ConfigDict, Discriminator, Tag, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from kvoffload import plugins
from kvoffload.backends.cpu.settings import CPUTierConfig
from kvoffload.backends.lmdb.settings import LmdbTierConfig
from kvoffload.backends.mmap.settings import MmapTierConfig
from kvoffload.exceptions import RegistryError
from kvoffload.redact import SECRET_MASK, scrub, secret_fields
from kvoffload.tierconfig import TierConfig

TIER_FIELD_ERROR: Final = "tier_field"
"""The pydantic error type of a :func:`tier_error`; its context holds the real one."""


def tier_error(
    loc: tuple[int | str, ...],
    value: Any,
    message: str,
    kind: str = "value_error",
    allowed: list[str] | None = None,
) -> PydanticCustomError:
    """An error about the field ``loc`` inside a tier: pydantic would report it at the
    tier (or the tier list), so the field's own path, value, error type and allowed keys
    ride in the context for the config's loader to place."""
    ctx = {"message": message, "loc": loc, "value": value, "kind": kind, "allowed": allowed}
    return PydanticCustomError(TIER_FIELD_ERROR, "{message}", ctx)


BUILTIN_TIERS: Final[dict[str, type[TierConfig]]] = {
    "cpu": CPUTierConfig,
    "mmap": MmapTierConfig,
    "lmdb": LmdbTierConfig,
}
"""Backend name -> settings model of the tiers the union names one by one (the
discriminator's tags, besides ``plugin``)."""


def _exclude_builtins(schema: dict[str, Any]) -> None:
    """In the JSON Schema, a plugin tier is one whose backend is not built in, so each
    tier matches exactly one branch of ``oneOf``."""
    backend = schema["properties"]["backend"]
    backend["not"] = {"enum": sorted(BUILTIN_TIERS)}


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
            raise tier_error(("backend",), self.backend, str(exc)) from None
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
                    value = scrub(value, secrets)
                raise tier_error(loc, value, msg, err["type"], allowed) from None
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
            raise tier_error(
                (key,),
                self.model_extra[key],
                f"unknown keys {sorted(self.model_extra)} for backend {self.backend!r}, "
                "which takes only name, backend and capacity",
            )
        return self


def _tier_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        # A tier without ``backend`` gets the default one, so validate it as that.
        backend = value.get("backend", TierConfig.model_fields["backend"].default)
    elif isinstance(value, TierConfig):
        backend = value.backend
    else:
        return None  # not a mapping: reported with the custom error below
    return backend if isinstance(backend, str) and backend in BUILTIN_TIERS else "plugin"


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
"""A tier of the ``tiers`` list: the built-in tier its ``backend`` names, else a plugin's."""


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


def check_tier_list(tiers: list[TierConfig]) -> list[TierConfig]:
    """The rules the ``tiers`` list follows as a whole, in order: unique names, a
    directory of its own for each disk tier, and no lower-tier-only setting on the
    first tier."""
    _unique_names(tiers)
    _separate_directories(tiers)
    _first_tier_takes_every_store(tiers)
    return tiers


def _unique_names(tiers: list[TierConfig]) -> None:
    first: dict[str, int] = {}
    for i, tier in enumerate(tiers):
        if tier.name in first:
            raise ValueError(
                f"duplicate tier name {tier.name!r} at tiers[{first[tier.name]}] and "
                f"tiers[{i}]; give every tier a unique name"
            )
        first[tier.name] = i


def _separate_directories(tiers: list[TierConfig]) -> None:
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
                raise tier_error(
                    (i, "path"),
                    raw,
                    f"{how} tiers[{j}].path = {other_raw!r} (tier {tiers[j].name!r}); "
                    f"give each disk tier a directory of its own, neither inside another",
                )
        seen.append((i, raw, here))


def _first_tier_takes_every_store(tiers: list[TierConfig]) -> None:
    first = tiers[0]
    for field_name, default in (("admit_after_hits", 0), ("write_policy", "write_through")):
        if field_name in first.model_fields_set and getattr(first, field_name) != default:
            raise ValueError(
                f"tiers[0].{field_name} = {getattr(first, field_name)!r}: the first tier "
                f"takes every store from the engine, so {field_name} applies only to "
                f"lower tiers; remove it from tiers[0] or move it to tiers[1]"
            )

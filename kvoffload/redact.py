"""What a config error, repr or log may show of a secret: the fields that are secrets,
and values with them masked.

A plugin's settings field typed :class:`~pydantic.SecretStr` (the ``redis`` tier's
``password`` and ``username``) is a secret. The config's errors quote the value they
refuse, sometimes a whole tier: :func:`scrub` is what they quote instead, so no
password reaches a terminal or a log through a typo in a neighbouring field. Kept
apart from the config's loading so that the tier union, which validates a plugin tier
with the plugin's own model and reports its errors, masks the same way without
depending on the loader.
"""

from __future__ import annotations

import contextlib
import re
import typing
from collections.abc import Mapping
from typing import Any, Final

from pydantic import BaseModel, Secret, SecretBytes, SecretStr

from kvoffload import plugins
from kvoffload.exceptions import RegistryError
from kvoffload.tierconfig import TierConfig

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
        name for name, field in model.model_fields.items() if is_secret(field.annotation)
    )


def is_secret(annotation: Any) -> bool:
    """Whether a field annotated ``annotation`` holds a pydantic secret, at any depth
    (``SecretStr | None``, ``list[SecretStr]``)."""
    if isinstance(annotation, type) and issubclass(annotation, _SECRET_TYPES):
        return True
    return any(is_secret(arg) for arg in typing.get_args(annotation))


def backend_secret_fields(backend: str) -> frozenset[str]:
    """The secret fields of the settings model of the tier ``backend`` (found as the
    config finds it, through :func:`kvoffload.plugins.settings_model`); none for a name
    that is not a backend's (an error quoting it names what is wrong with it)."""
    with contextlib.suppress(RegistryError):  # an unknown backend: names only
        model = plugins.settings_model(backend)
        if isinstance(model, type) and issubclass(model, TierConfig):
            return secret_fields(model)
    return frozenset()


def scrub(value: Any, secrets: frozenset[str] = frozenset()) -> Any:
    """``value`` as an error may quote it: in every mapping inside it, the values of
    secret keys masked (``secrets``, the tier's plugin's own, found from its
    ``backend``, and any key named like a password or token), and credentials cut out
    of url-like strings. Other values are returned as they are."""
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(r"\1***@", value)
    if isinstance(value, list | tuple):
        return type(value)(scrub(v, secrets) for v in value)
    if not isinstance(value, Mapping):
        return value
    hidden = set(secrets)
    backend = value.get("backend")
    if isinstance(backend, str):
        hidden |= backend_secret_fields(backend)
    return {
        k: SECRET_MASK
        if v is not None and (k in hidden or (isinstance(k, str) and _SECRET_NAME.search(k)))
        else scrub(v)
        for k, v in value.items()
    }

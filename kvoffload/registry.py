"""Backend registry: names -> :class:`~kvoffload.backend.Backend` classes.

Built-in and third-party backends alike register under the ``kvoffload.backends``
entry-point group; the group is read on first use and each class is imported only
when asked for (fsspec's lazy registry). Failures are loud: an unknown name lists the
installed ones, and an entry point that fails to import or is not a ``Backend``
raises a :class:`~kvoffload.exceptions.RegistryError` naming the entry point,
instead of a tier quietly disappearing.

The name table itself lives in :mod:`kvoffload.plugins`, below the config, so that
validating a plugin tier's settings needs no import of this backend layer; this module
adds what makes a name a backend: the ``Backend`` subclass check, and construction.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from kvoffload import plugins
from kvoffload.exceptions import RegistryError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvoffload.backend import Backend
    from kvoffload.config import TierConfig
    from kvoffload.layout import KVLayout

GROUP: Final = plugins.GROUP


def known_backends() -> Mapping[str, str]:
    """Read-only view: backend name -> ``"module:Class"`` it resolves to."""
    return plugins.targets()


def get_backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``, imported on first use."""
    # Imported here, not at the top: kvoffload.backend imports torch, and listing the
    # backends (``kvoffload backends``) should not pay for that.
    from kvoffload.backend import Backend

    loaded = plugins.lookup(name)
    if not (isinstance(loaded, type) and issubclass(loaded, Backend)):
        raise plugins.not_a_backend(name, loaded)
    return loaded


def register_backend(name: str, cls: type[Backend], *, clobber: bool = False) -> None:
    """Register a class at run time (tests, embedded use); duplicates are errors."""
    from kvoffload.backend import Backend

    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise RegistryError(f"cannot register {cls!r} as {name!r}: not a Backend subclass")
    plugins.register(name, cls, clobber=clobber)


def create_backend(config: TierConfig, layout: KVLayout) -> Backend:
    """Instantiate the backend a tier config names."""
    return get_backend_class(config.backend)(config, layout)


def reset() -> None:
    """Forget the scanned table, so the entry points are read again (tests)."""
    plugins.reset()

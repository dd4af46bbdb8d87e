"""Backend registry: names -> :class:`~kvoffload.backend.Backend` classes.

Built-in and third-party backends alike register under the ``kvoffload.backends``
entry-point group; the group is read on first use and each class is imported only
when asked for (fsspec's lazy registry). Failures are loud: an unknown name lists the
installed ones, and an entry point that fails to import or is not a ``Backend``
raises a :class:`~kvoffload.exceptions.RegistryError` naming the entry point,
instead of a tier quietly disappearing.
"""

from __future__ import annotations

import threading
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from kvoffload.exceptions import RegistryError

if TYPE_CHECKING:
    from collections.abc import Mapping

    from kvoffload.backend import Backend
    from kvoffload.config import TierConfig
    from kvoffload.layout import KVLayout

GROUP: Final = "kvoffload.backends"

_lock = threading.Lock()
# name -> entry point not yet imported, or the class once imported / registered
_table: dict[str, EntryPoint | type[Backend]] | None = None


def _describe(ep: EntryPoint) -> str:
    dist = ep.dist.name if ep.dist is not None else "unknown distribution"
    return f"entry point {ep.name!r} = {ep.value!r} (group {GROUP}, from {dist})"


def _scan() -> dict[str, EntryPoint | type[Backend]]:
    table: dict[str, EntryPoint | type[Backend]] = {}
    for ep in entry_points(group=GROUP):
        seen = table.get(ep.name)
        # The same distribution can be visible twice (an egg-info in the checkout and a
        # dist-info in site-packages); identical targets are one backend, not a clash.
        if isinstance(seen, EntryPoint) and seen.value != ep.value:
            raise RegistryError(
                f"backend name {ep.name!r} is registered twice: {_describe(seen)} and "
                f"{_describe(ep)}; uninstall one of them"
            )
        table[ep.name] = ep
    return table


def _get_table() -> dict[str, EntryPoint | type[Backend]]:
    global _table
    with _lock:
        if _table is None:
            _table = _scan()
        return _table


def known_backends() -> Mapping[str, str]:
    """Read-only view: backend name -> ``"module:Class"`` it resolves to."""
    view: dict[str, str] = {}
    for name, target in sorted(_get_table().items()):
        view[name] = (
            target.value
            if isinstance(target, EntryPoint)
            else f"{target.__module__}:{target.__qualname__}"
        )
    return MappingProxyType(view)


def get_backend_class(name: str) -> type[Backend]:
    """The class registered as ``name``, imported on first use."""
    from kvoffload.backend import Backend

    table = _get_table()
    target = table.get(name)
    if target is None:
        installed = ", ".join(sorted(table)) or "none"
        raise RegistryError(
            f"unknown backend {name!r}; installed backends: {installed} "
            f"(third-party backends register under the {GROUP!r} entry-point group)"
        )
    if not isinstance(target, EntryPoint):
        return target
    try:
        loaded = target.load()
    except Exception as exc:
        raise RegistryError(
            f"{_describe(target)} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    if not (isinstance(loaded, type) and issubclass(loaded, Backend)):
        raise RegistryError(
            f"{_describe(target)} resolves to {loaded!r}, which is not a subclass of "
            "kvoffload.backend.Backend"
        )
    with _lock:
        table[name] = loaded
    return loaded


def register_backend(name: str, cls: type[Backend], *, clobber: bool = False) -> None:
    """Register a class at run time (tests, embedded use); duplicates are errors."""
    from kvoffload.backend import Backend

    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise RegistryError(f"cannot register {cls!r} as {name!r}: not a Backend subclass")
    table = _get_table()
    with _lock:
        if name in table and not clobber:
            raise RegistryError(f"backend name {name!r} is already registered; pass clobber=True")
        table[name] = cls


def create_backend(config: TierConfig, layout: KVLayout) -> Backend:
    """Instantiate the backend a tier config names."""
    return get_backend_class(config.backend)(config, layout)


def reset() -> None:
    """Forget the scanned table, so the entry points are read again (tests)."""
    global _table
    with _lock:
        _table = None

"""Plugins by name: the ``kvoffload.backends`` entry-point group, read once, loaded lazily.

This is the name table under :mod:`kvoffload.registry`, kept apart from it so that the
config can find a plugin tier's settings model (``config_model``) without depending on
the backend layer: it knows entry points and the objects they name, not what a backend
is, and imports neither torch nor :mod:`kvoffload.backend`. Loading an entry point does
import the plugin's own code, which is the point of a plugin; the registry adds the
``Backend`` check on top. The config validates a plugin tier through :func:`lookup`, the
tiers are built through the registry, and both see the same names: the entry points, plus
what :func:`register` added at run time (``kvoffload.registry.register_backend``).

Failures are loud :class:`~kvoffload.exceptions.RegistryError`\\ s: an unknown name lists
the installed ones, and an entry point that fails to import names itself and its
distribution.
"""

from __future__ import annotations

import importlib
import threading
from importlib.metadata import EntryPoint, entry_points
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from kvoffload.exceptions import RegistryError

if TYPE_CHECKING:
    from collections.abc import Mapping

GROUP: Final = "kvoffload.backends"

_lock = threading.Lock()
# name -> its entry point (kept after loading, for messages); None until first use.
_entries: dict[str, EntryPoint] | None = None
# name -> the object an entry point loaded to, or one registered at run time.
_loaded: dict[str, object] = {}


def describe_entry_point(ep: EntryPoint) -> str:
    """``entry point 'name' = 'module:attr' (group ..., from <distribution>)``."""
    dist = ep.dist.name if ep.dist is not None else "unknown distribution"
    return f"entry point {ep.name!r} = {ep.value!r} (group {GROUP}, from {dist})"


def describe(name: str) -> str:
    """Where ``name`` comes from: its entry point, or a run-time registration."""
    ep = _get_entries().get(name)
    return describe_entry_point(ep) if ep is not None else f"run-time registration {name!r}"


def not_a_backend(name: str, target: object) -> RegistryError:
    """The error for a name that resolves to something other than a ``Backend`` class.

    One message for the config (which checks that ``target`` has a settings model) and the
    registry (which checks the class itself)."""
    return RegistryError(
        f"{describe(name)} resolves to {target!r}, which is not a subclass of "
        "kvoffload.backend.Backend"
    )


def _scan() -> dict[str, EntryPoint]:
    table: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        seen = table.get(ep.name)
        # The same distribution can be visible twice (an egg-info in the checkout and a
        # dist-info in site-packages); identical targets are one backend, not a clash.
        if seen is not None and seen.value != ep.value:
            raise RegistryError(
                f"backend name {ep.name!r} is registered twice: {describe_entry_point(seen)} "
                f"and {describe_entry_point(ep)}; uninstall one of them"
            )
        table[ep.name] = ep
    return table


def _get_entries() -> dict[str, EntryPoint]:
    global _entries
    with _lock:
        if _entries is None:
            _entries = _scan()
        return _entries


def names() -> list[str]:
    """Every known name, sorted: entry points and run-time registrations."""
    entries = _get_entries()
    with _lock:
        return sorted(set(entries) | set(_loaded))


def targets() -> Mapping[str, str]:
    """Read-only view: name -> ``"module:attr"`` it resolves to (loaded objects by where
    they live)."""
    entries = _get_entries()
    with _lock:
        loaded = dict(_loaded)
    view: dict[str, str] = {}
    for name in sorted(set(entries) | set(loaded)):
        if name in loaded:
            obj = loaded[name]
            module = getattr(obj, "__module__", "?")
            view[name] = f"{module}:{getattr(obj, '__qualname__', repr(obj))}"
        else:
            view[name] = entries[name].value
    return MappingProxyType(view)


def lookup(name: str) -> object:
    """The object registered as ``name``, importing its entry point on first use."""
    entries = _get_entries()
    with _lock:
        if name in _loaded:
            return _loaded[name]
    ep = entries.get(name)
    if ep is None:
        installed = ", ".join(names()) or "none"
        raise RegistryError(
            f"unknown backend {name!r}; installed backends: {installed} "
            f"(third-party backends register under the {GROUP!r} entry-point group)"
        )
    try:
        loaded = ep.load()
    except Exception as exc:
        raise RegistryError(
            f"{describe_entry_point(ep)} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    with _lock:
        return _loaded.setdefault(name, loaded)


def settings_model(name: str) -> object:
    """What ``name``'s entry point names as its settings model, without loading the
    backend when it can: the ``SETTINGS`` of the entry point's module (a built-in tier's
    package exports it from a torch-free ``settings`` module, and a third-party one may
    do the same), else the loaded object's ``config_model``. ``None`` when neither is
    there; the caller decides what that means. Errors as :func:`lookup`."""
    entries = _get_entries()
    with _lock:
        loaded = _loaded.get(name)
    ep = entries.get(name)
    if loaded is None and ep is not None:
        try:
            module = importlib.import_module(ep.module)
        except Exception as exc:
            raise RegistryError(
                f"{describe_entry_point(ep)} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
        model = getattr(module, "SETTINGS", None)
        if model is not None:
            return model
    return getattr(lookup(name), "config_model", None)


def register(name: str, obj: object, *, clobber: bool = False) -> None:
    """Bind ``name`` to ``obj`` at run time; a name already known is an error unless
    ``clobber``."""
    entries = _get_entries()
    with _lock:
        if (name in entries or name in _loaded) and not clobber:
            raise RegistryError(f"backend name {name!r} is already registered; pass clobber=True")
        _loaded[name] = obj


def reset() -> None:
    """Forget the scanned table and every registration, so the entry points are read
    again (tests)."""
    global _entries
    with _lock:
        _entries = None
        _loaded.clear()

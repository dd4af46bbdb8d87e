"""The kvoffload exception hierarchy.

Every error kvoffload raises on purpose derives from :class:`KVOffloadError`, so an
engine integration can catch one type at its boundary. Errors from tiers never reach
the engine step: the offloading layer turns them into misses or failed jobs; these
exceptions are for configuration, wiring and programming mistakes.
"""

from __future__ import annotations


class KVOffloadError(Exception):
    """Base class of every deliberate kvoffload error."""


class ConfigError(KVOffloadError, ValueError):
    """The configuration is invalid.

    Raised by :func:`kvoffload.config.load_config` and by backends given bad tier
    settings. The message is one line naming the file, the field path, the value and
    what is allowed; show it to the operator as it is and refuse to start.
    """


class RegistryError(KVOffloadError, LookupError):
    """A backend name could not be resolved to a usable :class:`~kvoffload.backend.Backend`.

    Raised for unknown names (the message lists the installed ones), duplicate names,
    entry points that fail to import and entry points that are not ``Backend``
    subclasses. Fix the installation or the config; nothing is retried.
    """


class BackendError(KVOffloadError):
    """A tier failed to read or write.

    Backends raise it from ``write``/``read``; the offloading layer catches it, counts
    it and turns it into a failed store or a miss. Callers outside kvoffload should
    never see it.
    """


class LayoutMismatchError(KVOffloadError, ValueError):
    """Tensors or persisted data do not match the expected :class:`~kvoffload.layout.KVLayout`.

    Raised when a caller hands the block API tensors of the wrong shape or dtype, or
    imports data written under another layout. Fix the caller; the data is not used.
    """


class BlockStateError(KVOffloadError, RuntimeError):
    """A manager primitive was called out of order (e.g. loading a key that is not ready).

    This is a bug in the caller: ``lookup`` first, then ``prepare_load`` on at most the
    prefix it returned.
    """

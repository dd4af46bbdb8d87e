"""The ``lmdb`` tier (one LMDB environment).

``SETTINGS`` comes without torch; the backend's names are imported on first use."""

from kvoffload.backends import lazy_exports
from kvoffload.backends.lmdb.settings import SETTINGS as SETTINGS

__getattr__ = lazy_exports("kvoffload.backends.lmdb.backend")

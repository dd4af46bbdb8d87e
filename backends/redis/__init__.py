"""The ``redis`` tier (a server or cluster replicas share).

``SETTINGS`` comes without torch; the backend's names are imported on first use."""

from kvoffload.backends import lazy_exports
from kvoffload.backends.redis.settings import SETTINGS as SETTINGS

__getattr__ = lazy_exports("kvoffload.backends.redis.backend")

"""The ``cpu`` tier (pinned host memory, one slab).

``SETTINGS`` comes without torch; the backend's names are imported on first use."""

from kvoffload.backends import lazy_exports
from kvoffload.backends.cpu.settings import SETTINGS as SETTINGS

__getattr__ = lazy_exports("kvoffload.backends.cpu.backend")

"""The ``mmap`` tier (the SSD slab, fixed-slot or packed).

``SETTINGS`` comes without torch; the backend's names are imported on first use."""

from kvoffload.backends import lazy_exports
from kvoffload.backends.mmap.settings import SETTINGS as SETTINGS

__getattr__ = lazy_exports("kvoffload.backends.mmap.backend")

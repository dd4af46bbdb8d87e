"""Test support shipped with kvoffload, for built-in and third-party backends alike.

Adopt the backend contract with a ten-line test file::

    import pytest
    from kvoffload.testing import BackendContract, make_backend

    class TestMyBackend(BackendContract):
        @pytest.fixture
        def backend_factory(self, tmp_path):
            return lambda layout, num_slots: make_backend("mine", layout, num_slots, tmp_path)

Needs pytest (the ``dev`` extra).
"""

from kvoffload.testing.contract import BackendContract, BackendFactory, make_backend
from kvoffload.testing.faults import Faults, FaultyBackend
from kvoffload.tools.stress import kv_like

__all__ = [
    "BackendContract",
    "BackendFactory",
    "Faults",
    "FaultyBackend",
    "kv_like",
    "make_backend",
]

"""The shipped backend contract, run over every backend installed in this venv.

That includes the built-in ``cpu`` backend and ``memdict`` from the test distribution
in tests/plugin_dist, which ``make test`` installs like any third-party package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.registry import known_backends
from kvoffload.testing import BackendContract, BackendFactory, make_backend


def test_the_expected_backends_are_installed() -> None:
    assert {"cpu", "memdict"} <= set(known_backends())


# Backends that need a server of their own run the contract against real servers in
# their own test file (redis: tests/backends/test_backend_redis.py).
SERVED: frozenset[str] = frozenset({"redis"})


class TestEveryInstalledBackend(BackendContract):
    @pytest.fixture(params=sorted(set(known_backends()) - SERVED))
    def backend_factory(self, request: pytest.FixtureRequest, tmp_path: Path) -> BackendFactory:
        name = request.param
        return lambda layout, num_slots: make_backend(name, layout, num_slots, tmp_path)


class TestPackedMmap(BackendContract):
    """The contract over a packed ``mmap`` slab (compressed: each block in an extent of
    its stored pages, backends/mmap/extents.py), with O_DIRECT where the filesystem
    allows it and with buffered I/O."""

    @pytest.fixture(params=["zstd", "lz4-buffered"])
    def backend_factory(self, request: pytest.FixtureRequest, tmp_path: Path) -> BackendFactory:
        codec, _, io = str(request.param).partition("-")
        extra = {"compression": codec, **({"direct_io": "off"} if io else {})}
        return lambda layout, num_slots: make_backend("mmap", layout, num_slots, tmp_path, **extra)

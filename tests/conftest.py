"""Shared fixtures. The rules of a CI run (nothing that can run here may be skipped;
tests marked ``cuda`` are deselected where there is no CUDA device) are a plugin of
their own, ``support/ci_rules.py``, so that a test can run them in a pytest of its own."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redisserver import RedisServer, require_redis

from kvoffload import registry

pytest_plugins = ("support.ci_rules",)


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Re-read entry points before and after a test that changes what is installed."""
    registry.reset()
    yield
    registry.reset()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real standalone ``redis-server`` on a free loopback port, killed afterwards."""
    require_redis()
    srv = RedisServer(tmp_path / "redis").start()
    try:
        yield srv
    finally:
        srv.kill()

"""Shared fixtures. The rules of a CI run (nothing that can run here may be skipped;
tests marked ``cuda`` are deselected where there is no CUDA device) are a plugin of
their own, ``support/ci_rules.py``, so that a test can run them in a pytest of its own.

``make test`` runs the suite in two pytest-xdist workers (``-n 2``): each worker gets a
``$TMPDIR`` of its own (:func:`pytest_configure`), so what engines and tiers put there
by name (the connector's Unix sockets, named by engine id) never meets the other
worker's."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.redisserver import RedisServer, require_redis

from kvoffload import registry

pytest_plugins = ("support.ci_rules",)


def pytest_configure(config: pytest.Config) -> None:
    """In an xdist worker, a ``$TMPDIR`` of its own for this process and its children
    (short: a Unix socket's path has at most 107 bytes)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        own = Path(tempfile.gettempdir()) / f"kvo-{os.getpid()}-{worker}"
        own.mkdir(mode=0o700, exist_ok=True)
        os.environ["TMPDIR"] = str(own)
        tempfile.tempdir = None  # recomputed from $TMPDIR on next use
        config.add_cleanup(lambda: shutil.rmtree(own, ignore_errors=True))


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

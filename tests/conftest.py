"""Shared fixtures. Under CI=true nothing that can run here may be skipped; tests marked
``cuda`` are deselected where there is no CUDA device."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from redisserver import RedisServer, require_redis

from kvoffload import registry

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Tests marked ``cuda`` cannot run without a GPU (CI never has one): they are
    # deselected there, not skipped, so the rule below still holds for everything else.
    if not torch.cuda.is_available():
        gpu = [item for item in items if item.get_closest_marker("cuda")]
        if gpu:
            config.hook.pytest_deselected(items=gpu)
            items[:] = [item for item in items if not item.get_closest_marker("cuda")]
    if not IN_CI:
        return
    for item in items:
        if item.get_closest_marker("skip") or item.get_closest_marker("skipif"):
            raise pytest.UsageError(f"{item.nodeid} is marked skip, which CI=true forbids")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        # A runtime pytest.skip()/importorskip under CI is a failure, not a pass.
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true: {report.longrepr}"

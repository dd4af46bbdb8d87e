"""Shared fixtures. Under CI=true nothing that can run here may be skipped."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvoffload import registry

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def fresh_registry() -> Iterator[None]:
    """Re-read entry points before and after a test that changes what is installed."""
    registry.reset()
    yield
    registry.reset()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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

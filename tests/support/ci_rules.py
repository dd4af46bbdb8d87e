"""What ``CI=true`` forbids: a test that could run here and did not.

A plugin (``tests/conftest.py`` loads it through ``pytest_plugins``; a test of the rules
loads it into a pytest of its own with ``-p support.ci_rules``). Under ``CI=true``:

- a test marked ``skip`` or ``skipif`` is refused at collection (a usage error);
- a test that skips at run time (``pytest.skip``, ``importorskip`` in a test or a
  fixture) fails;
- a module that skips at collection (a module-level ``pytest.importorskip("vllm")``)
  is a collection error, so the run fails. That skip is reported through
  ``pytest_make_collect_report``, which the run-time hook never sees: without this
  rule a broken ``import vllm`` made every connector and end-to-end test vanish and
  the run still passed.

Tests marked ``cuda`` cannot run without a GPU (CI never has one): they are
deselected there, not skipped, so the rules above hold for everything else.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = [item for item in items if item.get_closest_marker("cuda")]
    if gpu and not _cuda_available():
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("cuda")]
    if not IN_CI:
        return
    for item in items:
        if item.get_closest_marker("skip") or item.get_closest_marker("skipif"):
            raise pytest.UsageError(f"{item.nodeid} is marked skip, which CI=true forbids")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        # A module that skips as it is imported: under CI, a collection error.
        report.outcome = "failed"
        report.longrepr = (
            f"{collector.nodeid} skipped at collection under CI=true: {report.longrepr}"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if IN_CI and report.skipped:
        # A runtime pytest.skip()/importorskip under CI is a failure, not a pass.
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true: {report.longrepr}"

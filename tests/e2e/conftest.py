"""The end-to-end tests' engines: one engine server for the session (``support/e2e.py``),
and the outputs of the batch on an engine without the connector, which most tests
compare against."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.e2e import BATCH, EngineServer, outputs


@pytest.fixture(scope="session")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    server = EngineServer(tmp_path_factory.mktemp("engine-server"))
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def reference(engines: EngineServer, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """The batch's outputs from an engine without the connector."""
    (ref,) = engines.results(tmp_path_factory.mktemp("ref"), kvoffload=None, rounds=[BATCH])
    assert ref["failed"] == 0
    return outputs(ref)

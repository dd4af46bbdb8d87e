"""A real Prometheus server for the tests, and the queries of our Grafana dashboard.

:class:`Prometheus` runs Debian's ``prometheus`` (``make prometheus`` installs it) on
a free port with its own TSDB directory, scraping the given targets every second, and
answers PromQL through its HTTP API (``/api/v1/query``), as Grafana asks it.
:func:`dashboard_targets` reads every panel's queries out of a dashboard JSON with
Grafana's template variables replaced by concrete values, so that what the test
evaluates is the text the dashboard ships.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import httpx

PROMETHEUS: Final = shutil.which("prometheus")
"""The server binary (Debian's package ``prometheus``), ``None`` when not installed."""
MISSING: Final = "prometheus not installed (Debian package prometheus; `make prometheus`)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    """One Prometheus server scraping ``targets`` (``host:port``, ``/metrics``) every
    second, its data and log under ``workdir``."""

    def __init__(self, workdir: Path, targets: list[str]) -> None:
        assert PROMETHEUS is not None, MISSING
        workdir.mkdir(parents=True, exist_ok=True)
        config = workdir / "prometheus.yml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "scrape_configs": [
                        {"job_name": "vllm", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / "prometheus.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={workdir / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f} s:\n{self.tail()}")

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result at now (``/api/v1/query``): its series, each a
        ``metric`` (labels) and a ``value`` ``[time, "number"]``. A query Prometheus
        rejects raises, with its error."""
        response = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=30)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"{expr}: {body.get('errorType')}: {body.get('error')}")
        assert body["data"]["resultType"] == "vector", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists (``/api/v1/label``)."""
        response = httpx.get(
            f"{self.url}/api/v1/label/{label}/values", params={"match[]": match}, timeout=30
        )
        values: list[str] = response.json()["data"]
        return values

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass(frozen=True)
class Target:
    """One query of one panel, its template variables replaced."""

    panel: str
    ref: str
    expr: str


VARIABLE: Final = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
"""A Grafana template variable in a query: ``$name``, ``${name}`` or ``${name:fmt}``."""


def dashboard_targets(path: Path, values: dict[str, str]) -> list[Target]:
    """Every panel's queries (rows' nested panels included), each variable replaced by
    its entry in ``values``; a variable ``values`` lacks raises ``KeyError``, so a
    query can never reach Prometheus with Grafana syntax left in it."""
    dashboard = json.loads(path.read_text())
    panels: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        panels += [panel, *panel.get("panels", [])]
    return [
        Target(
            panel["title"],
            target["refId"],
            VARIABLE.sub(lambda m: values[m[1] or m[2]], target["expr"]),
        )
        for panel in panels
        for target in panel.get("targets", [])
    ]

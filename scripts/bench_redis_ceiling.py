#!/usr/bin/env python3
"""A real ``redis-server``'s ceiling per master for the shared tier's values.

The shared tier writes one value per block (``128 + bytes_per_block`` bytes) and reads
it back on a hit. Redis runs its commands on one thread, so a master's ceiling for
values this large is set by that thread's copies and the socket, not by the NIC. This
measures it with Redis's own C client (``redis-benchmark``, the strongest client there
is for the server: no Python in the way), for each combination of:

- value size: 256 KiB and 2 MiB (``--sizes``; the tier adds 128 bytes of header);
- ``SET`` and ``GET`` (each ``GET`` run is checked to have hit every key:
  ``keyspace_misses`` stays 0, so no run is a stream of tiny nil replies);
- pipelined ``-P`` (``--pipelines``) from several clients ``-c`` (``--clients``);
- ``io-threads`` off (1, Redis's default) and on (``--io-threads``, with
  ``io-threads-do-reads yes``).

Then the replicas one master serves at an 8B-class block rate: each replica that
writes every block it computes sends ``--replica-gbps`` (0.69 GB/s: Llama-3-8B's
128 KiB of KV per token at about 5,300 prefill tokens/s on an H100, issue 32's fleet
simulation), and with ``admit_after_hits: 1`` ``--admission-cut`` times less
(2.6-3.7x in that simulation; ``scripts/bench_replicas.py --admit-after-hits 1``
measures it on the stress workload).

The client and the server share this machine's cores: on the 2-core CI machine the
figures are this host's, and a master on a host of its own (clients elsewhere)
can only do better. Usage::

    .venv/bin/python scripts/bench_redis_ceiling.py [--sizes 262144,2097152]
        [--clients 4,16] [--pipelines 1,8] [--io-threads 2] [--gib 2] [--json PATH]

Needs ``redis-server`` and ``redis-benchmark`` on the PATH (Debian's redis-server and
redis-tools).
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

from kvoffload.tools.bench.harness import run_facts, write_json

HEADER = 128
"""Bytes of kvoffload's record header in front of each value (docs/remote.md)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """One ``redis-server`` on a free loopback port, no persistence."""

    def __init__(self, workdir: Path, io_threads: int, maxmemory: str) -> None:
        self.port = free_port()
        args = [
            "redis-server",
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(workdir),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            "--io-threads", str(io_threads),
            "--io-threads-do-reads", "yes" if io_threads > 1 else "no",
            "--logfile", "redis.log",
        ]  # fmt: skip
        self.proc = subprocess.Popen(args)
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def run_benchmark(
    port: int, op: str, size: int, keys: int, requests: int, clients: int, pipeline: int
) -> float:
    """Requests per second ``redis-benchmark`` reports for one ``op`` run."""
    cmd = [
        "redis-benchmark", "-p", str(port), "-t", op.lower(),
        "-d", str(size), "-r", str(keys), "-n", str(requests),
        "-c", str(clients), "-P", str(pipeline), "--threads", "2", "--csv", "-q",
    ]  # fmt: skip
    out = subprocess.run(
        cmd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rows = list(csv.reader(io.StringIO(out)))
    (row,) = [r for r in rows if r and r[0].upper() == op]
    return float(row[1])


def fill(client: redis.Redis, keys: int, size: int) -> None:
    """Every key ``GET`` will ask for (redis-benchmark's ``key:__rand_int__``: 12
    digits), so each ``GET`` returns a full value."""
    value = b"\xab" * size
    pipe = client.pipeline(transaction=False)
    for i in range(keys):
        pipe.set(f"key:{i:012d}", value)
        if i % 16 == 15:
            pipe.execute()
    pipe.execute()


def measure(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for io_threads in (1, args.io_threads):
        for size in args.sizes:
            value = size + HEADER
            keys = max(16, int(args.keyspace_gib * (1 << 30)) // value)
            requests = max(64, int(args.gib * (1 << 30)) // value)
            server = Server(tmp, io_threads, f"{int(args.keyspace_gib * 2 * 1024)}mb")
            try:
                fill(server.client, keys, value)
                for clients in args.clients:
                    for pipeline in args.pipelines:
                        for op in ("SET", "GET"):
                            before = server.client.info("stats")
                            rps = run_benchmark(
                                server.port, op, value, keys, requests, clients, pipeline
                            )
                            after = server.client.info("stats")
                            misses = after["keyspace_misses"] - before["keyspace_misses"]
                            if op == "GET" and misses:
                                raise SystemExit(f"GET missed {misses} keys: not a ceiling")
                            row = {
                                "io_threads": io_threads,
                                "value_bytes": value,
                                "op": op,
                                "clients": clients,
                                "pipeline": pipeline,
                                "requests": requests,
                                "rps": rps,
                                "gbps": rps * value / 1e9,
                            }
                            rows.append(row)
                            print(
                                f"io-threads {io_threads}  {value:>8} B  {op:<3}  "
                                f"-c {clients:<3} -P {pipeline:<3}  {rps:>9.0f} req/s  "
                                f"{row['gbps']:6.2f} GB/s",
                                flush=True,
                            )
            finally:
                server.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--sizes", type=ints, default=[262144, 2097152], help="payload bytes")
    ap.add_argument("--clients", type=ints, default=[4, 16])
    ap.add_argument("--pipelines", type=ints, default=[1, 8])
    ap.add_argument("--io-threads", type=int, default=2, help="the 'on' setting")
    ap.add_argument("--gib", type=float, default=2.0, help="GiB moved per run")
    ap.add_argument("--keyspace-gib", type=float, default=0.5, help="GiB of keys GET reads")
    ap.add_argument("--replica-gbps", type=float, default=0.69)
    ap.add_argument("--admission-cut", type=float, default=2.6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found: apt-get install redis-server redis-tools")
    with tempfile.TemporaryDirectory(prefix="kvo-redis-ceiling-") as tmp:
        rows = measure(args, Path(tmp))
    print()
    print(f"{'value':>9} {'op':<3} {'io-threads off':>15} {'io-threads on':>14}  (best GB/s)")
    best: dict[tuple[int, str], float] = {}
    for value in sorted({r["value_bytes"] for r in rows}):
        for op in ("SET", "GET"):
            cells = []
            for io_threads in (1, args.io_threads):
                gbps = max(
                    r["gbps"]
                    for r in rows
                    if r["value_bytes"] == value and r["op"] == op and r["io_threads"] == io_threads
                )
                cells.append(gbps)
                best[value, op] = max(best.get((value, op), 0.0), gbps)
            print(f"{value:>9} {op:<3} {cells[0]:>15.2f} {cells[1]:>14.2f}")
    print()
    for value in sorted({r["value_bytes"] for r in rows}):
        write = best[value, "SET"]
        print(
            f"{value} B values: SET ceiling {write:.2f} GB/s -> "
            f"{write / args.replica_gbps:.1f} replicas writing every block "
            f"({args.replica_gbps} GB/s each), "
            f"{write * args.admission_cut / args.replica_gbps:.1f} with admit_after_hits: 1 "
            f"({args.admission_cut}x fewer writes)"
        )
    if args.json is not None:
        doc = {"rows": rows, "replica_gbps": args.replica_gbps, "cut": args.admission_cut}
        write_json(args.json, doc, facts=run_facts())


if __name__ == "__main__":
    main()

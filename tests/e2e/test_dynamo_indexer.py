"""Issue 32: a real router's indexer, Dynamo's, reads our KV events exactly.

Two real engines (CPU build, dummy-weight tiny Llama, 32-token blocks, a GPU pool of
40 blocks, a cpu tier of 12 blocks and a write-through ``mmap`` tier of 24) publish
their KV events through vLLM's ZMQ publisher; one Dynamo standalone indexer
(``python -m dynamo.indexer``, the ``ai-dynamo-runtime`` dev dependency) is
subscribed to both, as workers 1 and 2. After each phase, once the engine is idle, the
indexer must hold per engine and per tier (its ``device`` / ``host_pinned`` / ``disk``
trees, read with ``GET /dump``) exactly the blocks that engine can serve from there:

- ``gpu``: what vLLM's prefix cache holds;
- ``cpu`` / ``disk``: what the tier's books hold under the connector's current reset
  generation (the keys recomputed here from vLLM's own hashes);

and its ``POST /query`` must answer each prompt, per engine, the prefix Dynamo's walk
reaches through those exact sets (``gpu``, then ``cpu`` continuing it, then ``disk``).
Each engine also serves our operator endpoint (``admin_port``), and its ``/query``
must agree with Dynamo's for that engine: for each prompt whose GPU prefix Dynamo
reports as 0 (the instance absent counts as all zeros), Dynamo's fields (``gpu``,
``dp``, ``cpu``, ``disk``, ``longest_matched``) equal ours exactly (Dynamo's ``dp`` is
checked to hold its ``gpu``, under rank 0, everywhere); where Dynamo's
``gpu`` is above 0, ours (which cannot see vLLM's prefix cache) must equal the same walk
over the true sets with the GPU's emptied. The prompts compared exactly are counted,
all of them and those with a match: per phase and engine, as many as the true sets
give a GPU prefix of 0 (and a match); in the restart phase all 20 of engine 1's (its
GPU cache is empty), some of them with a match (its recovered disk).
The phases: both engines serve workloads larger than every tier (eviction
everywhere); engine 1 asks again for prompts only its disk still holds (promotion
into the cpu tier); engine 2 is reset (``reset_prefix_cache(reset_connector=True)``)
and serves the same prompts again (the new generation's blocks share the old ones'
hashes, and the old ones are evicted after); engine 1 is restarted over the same disk
tier (the indexer told of the restart: ``/unregister``, ``/register``) and its
recovered blocks must be announced, then it serves a restart hit.

No assertion on time: the indexer is polled until it agrees, with a hang guard.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("vllm")
pytest.importorskip("dynamo.indexer")

from kvoffload.connectors.vllm.scheduler import generation_keys
from support.checkout import SUPPORT
from support.e2e import BLOCK, engine_env, tokens, write_tiny_llama
from support.waiting import wait_until
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request

from kvoffload.keys import key_from_hash, namespaced

MODEL = "m"
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 2  # layers x (K, V) x tokens x kv heads x dim x bf16
TIERS = {"gpu": "device", "cpu": "host_pinned", "disk": "disk"}
"""Our name of a tier -> the indexer's tree (vLLM's medium GPU, CPU, STORAGE)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(port: int, method: str, path: str, body: Any = None) -> Any:
    """One JSON request to ``127.0.0.1:port``; its JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=data,
        method=method,
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
    return json.loads(raw) if raw else {}


def docs(seed: int, n: int, blocks: int = 4) -> list[list[int]]:
    """``n`` prompts of ``blocks`` full blocks and 5 tokens more."""
    return [tokens(seed * 1000 + i, blocks * BLOCK + 5) for i in range(n)]


class Indexer:
    """``python -m dynamo.indexer`` with both engines as workers 1 and 2."""

    def __init__(self, tmp: Path, ports: dict[int, int]) -> None:
        self.port = free_port()
        workers = ",".join(f"{w}=tcp://127.0.0.1:{p}" for w, p in ports.items())
        argv = [sys.executable, "-m", "dynamo.indexer", "--block-size", str(BLOCK)]
        argv += ["--model-name", MODEL, "--port", str(self.port), "--workers", workers]
        self.log = tmp / "indexer.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        wait_until(lambda: self._try("GET", "/health") is not None, "the indexer's /health")

    def _try(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return self.call(method, path, body)
        except OSError:
            return None

    def call(self, method: str, path: str, body: Any = None) -> Any:
        return http(self.port, method, path, body)

    def trees(self) -> dict[int, dict[str, set[int]]]:
        """Per worker, per tier: the block hashes the indexer holds (``GET /dump``)."""
        out: dict[int, dict[str, set[int]]] = {}
        for model in self.call("GET", "/dump").values():
            for entry in model["events"]:
                stored = entry["event"]["data"]["stored"]
                tier = out.setdefault(entry["worker_id"], {}).setdefault(
                    entry["storage_tier"], set()
                )
                tier.update(b["block_hash"] for b in stored["blocks"])
        return out

    def connected(self, port: int) -> None:
        """Wait until the indexer holds a TCP connection to the publisher at ``port``
        (Dynamo 1.6's listener gives up on a publisher not bound within seconds of its
        start, and a batch published before a subscriber connects is not sent to it)."""

        def established() -> bool:
            return any(
                c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
                for c in psutil.Process(self.proc.pid).net_connections(kind="tcp")
            )

        wait_until(established, f"the indexer's connection to the publisher at {port}")

    def register(self, worker: int, port: int) -> None:
        """A worker's publisher, bound: registered anew (its stale blocks dropped and
        its batches' sequence numbers counted from scratch), once connected."""
        self.call("POST", "/unregister", {"instance_id": worker, "model_name": MODEL})
        body = {"instance_id": worker, "endpoint": f"tcp://127.0.0.1:{port}"}
        self.call("POST", "/register", {**body, "model_name": MODEL, "block_size": BLOCK})
        self.connected(port)

    def query(self, prompt: list[int]) -> dict[str, Any]:
        return dict(self.call("POST", "/query", {"token_ids": prompt, "model_name": MODEL}))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


class Engine:
    """``support/dynamo_engine.py``: one engine, one command at a time, serving our
    operator endpoint on ``admin`` (rank 0: ``admin_port`` itself)."""

    def __init__(self, tmp: Path, worker: int, port: int, disk: Path) -> None:
        self.worker, self.port, self.admin = worker, port, free_port()
        tiers = [
            {"name": "cpu", "capacity": 12 * BLOCK_BYTES},
            {
                "name": "disk",
                "backend": "mmap",
                "capacity": 24 * BLOCK_BYTES,
                "path": str(disk),
                "write_policy": "write_through",
            },
        ]
        spec = {
            "model": str(write_tiny_llama(tmp / "model")),
            "kvoffload": {"config": {"tiers": tiers, "admin_port": self.admin}},
            "kv_events": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{port}",
            },
            "engine": {
                "num_gpu_blocks_override": 40,
                "max_model_len": 512,
                "gpu_memory_utilization": 0.2,
            },
        }
        path = tmp / f"engine-{worker}.json"
        path.write_text(json.dumps(spec))
        self.stderr = (tmp / f"engine-{worker}.log").open("ab")
        env = {**os.environ, **engine_env(single_process=True)}
        self.proc = subprocess.Popen(
            [sys.executable, str(SUPPORT / "dynamo_engine.py"), str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )

    def answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("DYN "):
                return dict(json.loads(line[4:]))
        raise AssertionError(f"engine {self.worker} exited: {self.proc.wait()}")

    def ask(self, op: str, **args: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def query(self, prompt: list[int]) -> dict[str, Any]:
        """Our endpoint's ``/query`` entry for this engine (its only instance)."""
        (entry,) = http(self.admin, "POST", "/query", {"token_ids": prompt})["instances"].values()
        return dict(entry)

    def quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=120) == 0
        self.close()

    def close(self) -> None:
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None and not pipe.closed:
                pipe.close()
        self.stderr.close()


class Blocks:
    """Every full block of the prompts: vLLM's hash (its hasher, its fixed sha256
    seed), as published and raw, and each prompt's published hashes in order."""

    def __init__(self, prompts: list[list[int]]) -> None:
        init_none_hash(sha256)
        hasher = get_request_block_hasher(BLOCK, sha256)
        self.raw: dict[int, bytes] = {}
        self.chain: list[list[int]] = []
        for prompt in prompts:
            req = Request("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
            ext = [maybe_convert_block_hash(h) for h in req.block_hashes]
            self.raw.update(zip(ext, map(bytes, req.block_hashes), strict=True))
            self.chain.append(ext)

    def truth(self, held: dict[str, Any]) -> dict[str, set[int]]:
        """Per tier, the hashes this engine can serve from there: vLLM's prefix cache,
        and each tier's blocks under the connector's current reset generation."""
        space = bytes.fromhex(held["namespace"])
        gen = held["generation"]
        key_of = {
            ext: namespaced(generation_keys([key_from_hash(raw)], gen)[0], space).hex()
            for ext, raw in self.raw.items()
        }
        out = {"gpu": set(held["gpu"]) & set(self.raw)}
        for tier in ("cpu", "disk"):
            keys = set(held["held"][tier])
            out[tier] = {ext for ext, key in key_of.items() if key in keys}
        return out


def walk(chain: list[int], truth: dict[str, set[int]]) -> dict[str, int]:
    """Dynamo's ``/query`` for one worker: the device prefix, extended through the cpu
    tier, then through the disk tier (tokens; cumulative)."""
    out: dict[str, int] = {}
    at = 0
    for tier in ("gpu", "cpu", "disk"):
        while at < len(chain) and chain[at] in truth[tier]:
            at += 1
        out[tier] = at * BLOCK
    return out


def ours(chain: list[int], truth: dict[str, set[int]]) -> dict[str, Any]:
    """Our endpoint's entry for one engine: Dynamo's walk over ``truth`` with the GPU's
    set emptied (the worker side cannot see vLLM's prefix cache: ``gpu`` and ``dp`` 0),
    and ``remote`` continuing it (no shared tier here: as far as ``disk``)."""
    bare = walk(chain, {**truth, "gpu": set()})
    return {
        "longest_matched": bare["disk"],
        "gpu": 0,
        "dp": {"0": 0},
        "cpu": bare["cpu"],
        "disk": bare["disk"],
        "remote": bare["disk"],
    }


ABSENT: dict[str, Any] = {"longest_matched": 0, "gpu": 0, "dp": {"0": 0}, "cpu": 0, "disk": 0}
"""Dynamo's entry for an instance its ``/query`` leaves out: nothing matched."""


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Indexer, dict[int, Engine]]]:
    """Both engines up (their publishers bound), then the indexer subscribed to both."""
    ports = {1: free_port(), 2: free_port()}
    engines = {w: Engine(tmp_path, w, p, tmp_path / f"disk-{w}") for w, p in ports.items()}
    indexer: Indexer | None = None
    try:
        for engine in engines.values():
            assert engine.answer() == {"ready": True}
        indexer = Indexer(tmp_path, ports)
        for port in ports.values():
            indexer.connected(port)
        yield indexer, engines
    finally:
        for engine in engines.values():
            if engine.proc.poll() is None:
                engine.proc.kill()
                engine.proc.wait()
            engine.close()
        if indexer is not None:
            indexer.close()


def test_dynamo_indexer_holds_exactly_what_each_engines_tiers_hold(
    fleet: tuple[Indexer, dict[int, Engine]], tmp_path: Path
) -> None:
    indexer, engines = fleet
    work = {1: docs(1, 10), 2: docs(2, 10)}
    probes = work[1] + work[2]
    blocks = Blocks(probes)
    seen: dict[str, dict[int, dict[str, int]]] = {}
    compared: dict[str, dict[int, list[int]]] = {}

    def agree(phase: str) -> None:
        """The indexer's trees and answers equal each engine's tiers, exactly, and our
        endpoint's answers equal the indexer's where its GPU prefix is 0, else the walk
        without the GPU's blocks."""
        held = {w: e.ask("held") for w, e in engines.items()}
        truth = {w: blocks.truth(h) for w, h in held.items()}
        assert all(h["counters"]["kv_events_dropped"] == 0 for h in held.values())

        def trees_agree() -> bool:
            trees = indexer.trees()
            return all(
                trees.get(w, {}).get(TIERS[t], set()) == truth[w][t] for w in engines for t in TIERS
            )

        try:
            wait_until(trees_agree, f"{phase}: the indexer's trees equal the tiers")
        except AssertionError:
            trees = indexer.trees()
            detail = {
                (w, t): (len(truth[w][t]), len(trees.get(w, {}).get(TIERS[t], set())))
                for w in engines
                for t in TIERS
            }
            raise AssertionError(f"{phase}: (truth, indexer) blocks per tier: {detail}") from None
        answers: dict[int, dict[str, int]] = {1: {}, 2: {}}
        exact = {w: [0, 0] for w in engines}  # compared exactly: all, with a match
        for chain, prompt in zip(blocks.chain, probes, strict=True):
            got = indexer.query(prompt)["instances"]
            for w, engine in engines.items():
                want = walk(chain, truth[w])
                have = got.get(str(w), ABSENT)
                assert {t: have.get(t) for t in want} == want, (phase, w)
                assert have["dp"] == {"0": have["gpu"]}, (phase, w)  # dp: the GPU's
                mine = engine.query(prompt)
                assert mine == ours(chain, truth[w]), (phase, w, mine)
                if have["gpu"] == 0:  # the same walk: Dynamo's fields equal ours
                    assert {k: mine[k] for k in have} == have, (phase, w, have, mine)
                    exact[w][0] += 1
                    exact[w][1] += have["longest_matched"] > 0
                for t, n in want.items():
                    answers[w][t] = answers[w].get(t, 0) + n
        walks = {w: [walk(c, truth[w]) for c in blocks.chain] for w in engines}
        no_gpu = {
            w: [sum(x["gpu"] == 0 for x in xs), sum(x["gpu"] == 0 < x["disk"] for x in xs)]
            for w, xs in walks.items()
        }
        assert exact == no_gpu, phase
        seen[phase] = answers
        compared[phase] = exact
        print(phase, {w: {t: len(s) for t, s in truth[w].items()} for w in truth}, answers, exact)

    # Eviction: each engine's workload is larger than its GPU pool and its tiers.
    for w, e in engines.items():
        e.ask("generate", prompts=work[w])
    agree("eviction")

    # Promotion: engine 1's first prompts, evicted from the GPU and the cpu tier, are
    # loaded from its disk and stored into the cpu tier again.
    before = engines[1].ask("held")["counters"]
    cached = engines[1].ask("generate", prompts=work[1][:2])["cached"]
    after = engines[1].ask("held")["counters"]
    assert after["tier.cpu.blocks_stored"] > before["tier.cpu.blocks_stored"]
    assert sum(cached) > 0
    agree("promotion")

    # A connector reset: engine 2's blocks become unreachable by it (a new generation),
    # and its new ones share the old ones' hashes.
    assert engines[2].ask("reset_external")["reset"] is True
    agree("reset")
    engines[2].ask("generate", prompts=work[2][:6])
    agree("after reset")

    # A restart over the same disk tier; the indexer is told (as Dynamo's discovery
    # would: a restarted publisher starts its sequence numbers again).
    engines[1].quit()
    engines[1] = Engine(tmp_path, 1, engines[1].port, tmp_path / "disk-1")
    assert engines[1].answer() == {"ready": True}
    indexer.register(1, engines[1].port)
    agree("restart")
    assert seen["restart"][1]["disk"] > 0  # the recovered blocks were announced
    # Engine 1's GPU cache is empty: Dynamo's answer and ours agree for every probe, and
    # for those of its prompts whose first block the disk recovered, on a match.
    assert compared["restart"][1][0] == len(probes)
    assert compared["restart"][1][1] > 0
    cached = engines[1].ask("generate", prompts=work[1][-3:])["cached"]
    assert sum(cached) > 0
    agree("restart hit")
    for e in engines.values():
        e.quit()

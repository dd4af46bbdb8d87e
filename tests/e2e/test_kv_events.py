"""Issue 23: a router rebuilds each tier's blocks from kvoffload's KV events alone.

A real engine (CPU build, dummy-weight tiny Llama, single-process mode) publishes its
KV events through vLLM's own ZMQ publisher; a subscriber here, that decodes them with
vLLM's own ``KVEventBatch`` and knows nothing of kvoffload, keeps per place (``medium``,
``locality``) the block hashes stored and not removed since. A workload
of requests over shared documents, with a cpu tier and a write-through disk tier both
far smaller than it (both evict, hits promote from the disk), must end with:

- every batch received (sequence numbers 0, 1, ... with no gap);
- every ``BlockStored`` of a tier self-describing: its block's tokens, its parent's
  hash, ``block_size``, group, the full-attention kind, the tier's medium and
  locality (what vLLM's own offloading publishes);
- the rebuilt set of each tier equal, block for block, to what the tier holds once the
  engine is idle (the tiers' books, hashes recomputed here with vLLM's own hasher and
  mapped to kvoffload's keys), and the disk tier's size equal to ``kvoffload
  inspect``'s count after the engine has shut down;
- no record without a known hash (``kv_events_dropped`` 0).

``E2E_EVENTS_REQUESTS`` sets the workload's size (default 96; docs/vllm.md
records a run of 1,000).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from support.e2e import BLOCK, EngineServer  # noqa: E402
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    maybe_convert_block_hash,
)
from vllm.v1.request import Request  # noqa: E402

from kvoffload.keys import key_from_hash, namespaced  # noqa: E402

REQUESTS = int(os.environ.get("E2E_EVENTS_REQUESTS", "96"))
PER_ROUND = 16
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 2  # layers x (K, V) x tokens x kv heads x dim x bf16


def workload(n: int) -> list[list[list[int]]]:
    """``n`` prompts in rounds of :data:`PER_ROUND`: each one of 12 documents of 4
    blocks, then a block of its own and 5 tokens (5 full blocks)."""
    rng = random.Random(23)
    docs = [[rng.randrange(1, 1000) for _ in range(4 * BLOCK)] for _ in range(12)]
    prompts = [
        rng.choice(docs) + [rng.randrange(1, 1000) for _ in range(BLOCK + 5)] for _ in range(n)
    ]
    return [prompts[i : i + PER_ROUND] for i in range(0, n, PER_ROUND)]


class Subscriber:
    """A ZMQ SUB socket bound here (vLLM's publisher connects to a ``tcp://host:port``
    endpoint), receiving ``(topic, seq, payload)`` frames in a thread."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.frames: list[tuple[int, bytes]] = []
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.sock.poll(50):
                _, seq, payload = self.sock.recv_multipart()
                self.frames.append((int.from_bytes(seq, "big", signed=True), payload))
                self.last = time.monotonic()

    def close(self, quiet_s: float = 1.0, timeout: float = 15.0) -> None:
        """Stop once nothing has arrived for ``quiet_s`` (the publisher's thread may
        still be sending when the engine's run returns)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() - self.last < quiet_s and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(linger=0)
        self.ctx.term()


Tier = tuple[str | None, str | None, str | None]


def rebuild(batches: list[KVEventBatch]) -> tuple[dict[Tier, set[Any]], list[BlockStored]]:
    """What a router knows from the events alone: per (medium, locality, ownership)
    the hashes stored and not removed since (vLLM's GPU prefix cache left out); and
    every ``BlockStored`` of the tiers."""
    held: dict[Tier, set[Any]] = {}
    stored: list[BlockStored] = []
    for batch in batches:
        for ev in batch.events:
            if not isinstance(ev, BlockStored | BlockRemoved) or ev.medium == "GPU":
                continue
            tier = (ev.medium, ev.locality, ev.ownership)
            if isinstance(ev, BlockStored):
                held.setdefault(tier, set()).update(ev.block_hashes)
                stored.append(ev)
            else:
                held.setdefault(tier, set()).difference_update(ev.block_hashes)
    return held, stored


def blocks_of(rounds: list[list[list[int]]]) -> dict[Any, tuple[bytes, Any, list[int]]]:
    """Every full block of the prompts, by its hash as published: vLLM's own hash
    (its hasher, its fixed sha256 seed), its parent's published hash and its tokens."""
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    out: dict[Any, tuple[bytes, Any, list[int]]] = {}
    for prompt in (p for rnd in rounds for p in rnd):
        req = Request("r", prompt, SamplingParams(max_tokens=1), None, block_hasher=hasher)
        parent = None
        for i, h in enumerate(req.block_hashes):
            ext = maybe_convert_block_hash(h)
            out[ext] = (bytes(h), parent, prompt[i * BLOCK : (i + 1) * BLOCK])
            parent = ext
    return out


def test_a_subscriber_rebuilds_each_tier_from_the_events_alone(
    engines: EngineServer, tmp_path: Path
) -> None:
    t0 = time.monotonic()
    tiers = [
        {"name": "cpu", "capacity": 24 * BLOCK_BYTES, "max_pending_stores": 256},
        {
            "name": "disk",
            "backend": "mmap",
            "capacity": 48 * BLOCK_BYTES,
            "path": str(tmp_path / "disk"),
            "write_policy": "write_through",
            "max_pending_stores": 256,
        },
    ]
    rounds = workload(REQUESTS)
    sub = Subscriber()
    try:
        (result,) = engines.results(
            tmp_path,
            kvoffload={"config": {"tiers": tiers}},
            kv_events={
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://127.0.0.1:{sub.port}",
            },
            rounds=rounds,
            max_tokens=2,
            tiers_held=True,
        )
    finally:
        sub.close()
    assert result["failed"] == 0
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seqs = [seq for seq, _ in sub.frames]
    assert seqs == list(range(len(seqs))), "a batch of events was lost"
    held, stored = rebuild([decoder.decode(payload) for _, payload in sub.frames])

    # Self-describing: each store names its block's tokens and parent, as vLLM does.
    known = blocks_of(rounds)
    assert stored
    for ev in stored:
        (h,) = ev.block_hashes
        _, parent, tokens = known[h]
        assert (ev.parent_block_hash, ev.token_ids, ev.block_size) == (parent, tokens, BLOCK)
        assert (ev.group_idx, ev.kv_cache_spec_kind, ev.lora_id) == (0, "full_attention", None)
    # One place per tier here: (medium, locality) names it (``ownership`` is None).
    tier_of = {("CPU", "LOCAL", None): "cpu", ("STORAGE", "LOCAL", None): "disk"}
    assert set(held) == set(tier_of)

    # The rebuilt tiers are what the tiers hold, block for block.
    dump = result["tiers_held"]
    space = bytes.fromhex(dump["namespace"])
    key_of = {
        ext: namespaced(key_from_hash(raw), space).hex() for ext, (raw, _, _) in known.items()
    }
    for place, hashes in held.items():
        name = tier_of[place]
        assert {key_of[h] for h in hashes} == set(dump["held"][name]), name
    assert len(held["STORAGE", "LOCAL", None]) > 40  # the disk tier is (almost) full
    counters = result["kvoffload"]
    assert counters["kv_events_dropped"] == 0
    assert counters["tier.cpu.evictions"] > 0
    assert counters["tier.disk.evictions"] > 0
    # The workload was served from the tiers too. How many blocks depends on the step
    # each lookup is answered in (the lookups' own thread) and on what vLLM's prefix
    # cache still held then: no exact count. What this test claims is the events.
    assert counters["blocks_loaded"] > 0

    # ``kvoffload inspect`` over the disk tier, the engine shut down, agrees.
    config = tmp_path / "kvoffload.json"
    config.write_text(json.dumps({"tiers": tiers}))
    report = tmp_path / "inspect.json"
    subprocess.run(
        [sys.executable, "-m", "kvoffload", "inspect", "--config", config, "--json", report],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert json.loads(report.read_text())["disk"]["blocks"] == len(held["STORAGE", "LOCAL", None])
    print(
        f"{REQUESTS} requests, {len(seqs)} event batches, {len(stored)} BlockStored: "
        f"{ {tier_of[t]: len(h) for t, h in held.items()} } blocks agree "
        f"({time.monotonic() - t0:.1f} s)"
    )

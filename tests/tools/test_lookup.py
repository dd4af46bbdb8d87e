"""The prefix lookup on the shared tier (``kvoffload.lookup``, ``kvoffload lookup``).

What a router asks: for a batch of token-id prompts, how many leading blocks of each
the redis tier holds. The lookup rebuilds vLLM's block hashes, the connector's keys and
the tier's names without vLLM; each step is checked here against the real thing:
hashes against vLLM's own ``Request.block_hashes`` (every hash algorithm, the seed
set or not, LoRA and cache salt), layouts against ``layout_from_vllm`` on a real
``VllmConfig``, keys against the connector's ``Shared.ns``, names against the blocks
the redis backend wrote. Then 256 prompts against a real server and a real 3-master
cluster: the right prefix lengths, and one request per node, counted on the wire (a
proxy in front of each node), by the backend and by each server's commandstats.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import yaml
from kvoffload.backends.redis import RedisBackend, RedisTierConfig
from support.redisserver import (
    RedisClusterProcs,
    RedisServer,
    TurnProxy,
    diff_calls,
    require_redis,
)

from kvoffload.config import load_config
from kvoffload.exceptions import ConfigError
from kvoffload.keys import BlockKey, key_from_hash
from kvoffload.lookup import (
    HASH_ALGOS,
    PrefixLookup,
    Prompt,
    VllmEngineLayout,
    VllmHashing,
    lookup_prefixes,
)
from kvoffload.tools.cli import main

pytest.importorskip("vllm")

BS = 4
ENGINE = VllmEngineLayout(
    model_id="tiny@lookup", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS
)
"""512-byte blocks: 256 prompts' blocks fill little of a server."""


# -- hashes, layouts, keys: the same as vLLM's and the connector's --------------------


@pytest.fixture
def vllm_hashing(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's kv_cache_utils, its ``NONE_HASH`` restored after the test."""
    from vllm.v1.core import kv_cache_utils

    saved = kv_cache_utils.__dict__.get("NONE_HASH")
    yield kv_cache_utils
    if saved is not None:
        monkeypatch.setattr(kv_cache_utils, "NONE_HASH", saved)


def _vllm_hashes(utils: Any, algo: str, tokens: list[int], **request: Any) -> list[bytes]:
    """``request.block_hashes`` as vLLM 0.32 computes them for a new request."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    utils.init_none_hash(fn)
    req = Request(
        request_id="r",
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        block_hasher=utils.get_request_block_hasher(BS, fn),
        **request,
    )
    return [bytes(h) for h in req.block_hashes]


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_block_hashes_are_vllms(
    algo: str, vllm_hashing: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from vllm.lora.request import LoRARequest

    tokens = [random.Random(1).randrange(50_000) for _ in range(4 * BS + 3)]
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    ours = VllmHashing(BS, algo, seed="1234")
    assert ours.block_hashes(tokens) == _vllm_hashes(vllm_hashing, algo, tokens)
    salted = Prompt(tokens, cache_salt="tenant-7", lora=("ad", "/loras/ad"))
    lora = LoRARequest("ad", 1, "/loras/ad")
    theirs = _vllm_hashes(vllm_hashing, algo, tokens, cache_salt="tenant-7", lora_request=lora)
    assert ours.block_hashes(salted) == theirs
    assert theirs[0] != ours.block_hashes(tokens)[0]
    if algo.startswith("sha256"):  # no seed: vLLM's fixed one, the same everywhere
        monkeypatch.delenv("PYTHONHASHSEED")
        unseeded = VllmHashing(BS, algo).block_hashes(tokens)
        assert unseeded == _vllm_hashes(vllm_hashing, algo, tokens)
        assert unseeded != ours.block_hashes(tokens)
    else:  # no seed: vLLM's is random, and no one can rebuild its hashes
        with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
            VllmHashing(BS, algo)


def test_the_layout_is_the_connectors(tmp_path: Path) -> None:
    """:class:`VllmEngineLayout` fingerprints as ``layout_from_vllm`` on a real
    ``VllmConfig`` of the tiny Llama (its fields: 2 layers, 2 of 4 heads KV, head 32)."""
    from kvoffload.connectors.vllm.config import layout_from_vllm
    from support.engine_run import write_tiny_llama
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    model = write_tiny_llama(tmp_path / "model")
    ours = VllmEngineLayout("tiny@v1", num_layers=2, num_kv_heads=2, head_dim=32, block_size=32)
    for cache_dtype in ("auto", "fp8"):
        config = VllmConfig(
            model_config=ModelConfig(
                model=str(model), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048
            ),
            cache_config=CacheConfig(block_size=32, cache_dtype=cache_dtype),
            kv_transfer_config=KVTransferConfig(
                kv_connector="TieredOffloadConnector",
                kv_connector_module_path="kvoffload.connectors.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"model_id": "tiny@v1"},
            ),
        )
        mine = dataclasses.replace(ours, cache_dtype=cache_dtype)
        assert mine.layout(0) == layout_from_vllm(config)
        assert mine.fingerprints() == [layout_from_vllm(config).fingerprint]
    two = dataclasses.replace(ours, tensor_parallel_size=2)
    assert [two.layout(r).namespace for r in (0, 1)] == ["vllm:tiny@v1:tp0", "vllm:tiny@v1:tp1"]
    assert two.layout(1).num_kv_heads == 1


def test_keys_and_names_are_the_connectors_and_the_tiers() -> None:
    """A key is ``Shared.ns`` of vLLM's hash; its name is the redis tier's."""
    from kvoffload.connectors.vllm.groups import Group
    from kvoffload.connectors.vllm.shared import Shared

    config = load_config({"tiers": [{"name": "r", "backend": "redis", "url": "redis://x:1"}]})
    hashing = VllmHashing(BS)
    tokens = list(range(3 * BS))
    layout = ENGINE.layout(0)
    shared = SimpleNamespace(namespace=layout.fingerprint, groups=[Group(0, "full", None, b"", ())])
    hashes = [key_from_hash(h) for h in hashing.block_hashes(tokens)]
    connector: list[BlockKey] = Shared.ns(shared, hashes)  # type: ignore[arg-type]
    with PrefixLookup(config, hashing, ENGINE) as lookup:
        assert [k[0] for k in lookup.keys(tokens)] == [bytes(k) for k in connector]
        tier = RedisBackend(RedisTierConfig(name="r", url="redis://x:1"), layout)
        from kvoffload.lookup import server_key

        assert [server_key("kvo", layout.fingerprint, k) for k in connector] == [
            tier.redis_key(k) for k in connector
        ]
        tier.close()


# -- 256 prompts against real servers -------------------------------------------------


@dataclass
class Target:
    settings: dict[str, Any]
    servers: list[RedisServer]
    proxies: list[TurnProxy]


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    require_redis()
    server = RedisServer(tmp_path_factory.mktemp("lookup-redis")).start()
    proxy = TurnProxy(server.port)
    yield Target({"url": f"redis://127.0.0.1:{proxy.port}/0"}, [server], [proxy])
    proxy.close()
    server.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    require_redis()
    procs = RedisClusterProcs(tmp_path_factory.mktemp("lookup-cluster")).start()
    yield Target({"nodes": procs.nodes}, procs.servers, procs.proxies)
    procs.stop()


def _config(target: Target, prefix: str) -> dict[str, Any]:
    tier = {"name": "shared", "backend": "redis", "key_prefix": prefix, **target.settings}
    return {"tiers": [{"name": "cpu", "capacity": "1MiB"}, tier]}


def _workload(seed: int) -> list[list[int]]:
    """256 prompts in 32 families: a family shares a prefix of 0-5 blocks, then each
    prompt has 0-7 blocks of its own and a partial block."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(32):
        common = [rng.randrange(30_000) for _ in range(rng.randrange(6) * BS)]
        for _ in range(8):
            own = rng.randrange(8) * BS + rng.randrange(BS)
            prompts.append(common + [rng.randrange(30_000) for _ in range(own)])
    return prompts


def _store(target: Target, prefix: str, keys: list[bytes], layout: Any = None) -> None:
    """Write ``keys`` as the connector's redis tier does (the backend itself)."""
    layout = layout or ENGINE.layout(0)
    tier = RedisTierConfig(name="shared", key_prefix=prefix, **target.settings)
    be = RedisBackend(tier, layout)
    data = torch.zeros((len(keys), layout.bytes_per_block), dtype=torch.uint8)
    be.write(list(range(len(keys))), [BlockKey(k) for k in keys], data)
    be.close()


def _stored_prefixes(
    lookup: PrefixLookup, prompts: list[list[int]], seed: int
) -> tuple[list[bytes], list[int]]:
    """Keys to store: a random prefix of each prompt, and a few blocks past it (holes,
    which must not count); and each prompt's held prefix, found from that set."""
    rng = random.Random(seed)
    stored: set[bytes] = set()
    per_prompt = [[k[0] for k in lookup.keys(p)] for p in prompts]
    for keys in per_prompt:
        n = rng.randrange(len(keys) + 1)
        stored.update(keys[:n])
        if n + 1 < len(keys) and rng.random() < 0.3:
            stored.add(keys[n + 1])
    expected = []
    for keys in per_prompt:
        held = 0
        while held < len(keys) and keys[held] in stored:
            held += 1
        expected.append(held)
    return sorted(stored), expected


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_256_prompts_one_round_trip_per_node(where: str, request: pytest.FixtureRequest) -> None:
    target: Target = request.getfixturevalue(where)
    prefix = f"lk-{where}"
    config = load_config(_config(target, prefix))
    prompts = _workload(seed=5)
    with PrefixLookup(config, VllmHashing(BS), ENGINE) as lookup:
        keys, expected = _stored_prefixes(lookup, prompts, seed=6)
        _store(target, prefix, keys)
        assert sum(expected) > 200  # hits...
        assert 0 in expected  # ...misses, and holes (below)
        lookup.lookup(prompts)  # warm: every node's connection open
        nodes = len(target.servers)
        before = [s.calls() for s in target.servers]
        with contextlib.ExitStack() as stack:
            for proxy in target.proxies:
                stack.enter_context(proxy.counting())
            (answer,) = lookup.lookup(prompts)
            turns = [p.turns for p in target.proxies]
    assert answer.tier == "shared"
    assert answer.blocks == expected
    assert turns == [1] * nodes, turns  # on the wire
    assert answer.round_trips == nodes  # the backend's count
    served = [diff_calls(b, s.calls()) for b, s in zip(before, target.servers, strict=True)]
    assert all(set(d) == {"exists"} for d in served), served
    assert sum(d["exists"] for d in served) == answer.names
    # Shared prefixes are asked once: fewer names than the prompts' blocks.
    assert answer.names < sum(len(p) // BS for p in prompts)


def test_every_rank_must_hold_the_block(standalone: Target) -> None:
    """Tensor parallelism: each rank keeps its shard under its own fingerprint; a
    prefix is held as far as both ranks' shards are."""
    two = dataclasses.replace(ENGINE, tensor_parallel_size=2)
    config = load_config(_config(standalone, "lk-tp"))
    prompt = list(range(6 * BS))
    with PrefixLookup(config, VllmHashing(BS), two) as lookup:
        keys = lookup.keys(prompt)
        _store(standalone, "lk-tp", [k[0] for k in keys], two.layout(0))
        _store(standalone, "lk-tp", [k[1] for k in keys[:4]], two.layout(1))
        assert lookup.lookup([prompt])[0].blocks == [4]
    fps = two.fingerprints()
    assert lookup_prefixes(config, [prompt], VllmHashing(BS), fps[:1])[0].blocks == [6]


# -- the command ----------------------------------------------------------------------


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str, str]:
    try:
        code: object = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_command(
    standalone: Target, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "lk-cli"
    cfg = tmp_path / "kvoffload.yaml"
    cfg.write_text(yaml.safe_dump(_config(standalone, prefix)))
    prompts = [list(range(100, 100 + 5 * BS + 1)), list(range(7 * BS))]
    lines = [json.dumps(prompts[0]), "", json.dumps({"token_ids": prompts[1], "cache_salt": "s"})]
    (tmp_path / "p.jsonl").write_text("\n".join(lines) + "\n")
    with PrefixLookup(load_config(cfg), VllmHashing(BS, seed="42"), ENGINE) as lookup:
        first = [k[0] for k in lookup.keys(prompts[0])]
        second = [k[0] for k in lookup.keys(Prompt(prompts[1], cache_salt="s"))]
    _store(standalone, prefix, first[:3] + second)
    model = ["--model-id", ENGINE.model_id, "--num-layers", "2", "--num-kv-heads", "2"]
    model += ["--head-dim", "8"]
    args = ["lookup", "--config", str(cfg), "--prompts", str(tmp_path / "p.jsonl")]
    args += ["--block-size", str(BS), "--hash-seed", "42", "--json", str(tmp_path / "r.json")]
    code, out, err = _cli([*args, *model], capsys)
    assert (code, err) == (0, "")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["full_blocks"] for r in rows] == [5, 7]
    assert [r["blocks"] for r in rows] == [{"shared": 3}, {"shared": 7}]
    assert rows[0]["tokens"] == {"shared": 3 * BS}
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["tiers"]["shared"]["blocks"] == [3, 7]
    # The fingerprint instead of the model's fields: the same answer.
    fp = ENGINE.layout(0).fingerprint.hex()
    code, out2, _ = _cli([*args, "--fingerprint", fp], capsys)
    assert (code, out2) == (0, out)
    # Another seed names other blocks: nothing held.
    code, out3, _ = _cli([*args[:-4], "--hash-seed", "43", *model], capsys)
    assert code == 0
    assert [json.loads(line)["blocks"]["shared"] for line in out3.splitlines()] == [0, 0]


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"--num-layers": None}, "--num-layers: missing"),
        ({"--fingerprint": "ab" * 16}, "--fingerprint and --model-id"),
        ({"--fingerprint": "ab"}, "--fingerprint 'ab': expected 32 hex digits"),
        ({"--prompts": None}, "--prompts: missing"),
        ({"--block-size": "0"}, "--block-size 0"),
        ({"--head-dim": "-1"}, "--head-dim -1"),
        ({"prompts": '[1, "x"]'}, 'p.jsonl:1: token_ids = [1, "x"]'),
        ({"prompts": "{nope"}, "p.jsonl:1: not JSON"),
        ({"prompts": '{"token_ids": [1], "lora_name": "a"}'}, "lora_name and lora_path"),
        ({"prompts": ""}, "no prompt in it"),
        ({"config": "cpu only"}, "no redis tier among cpu (cpu)"),
        ({"--hash-algo": "xxhash"}, "without a seed"),
    ],
)
def test_errors_are_one_line(
    change: dict[str, str | None],
    names: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    cfg = tmp_path / "c.yaml"
    tiers: list[dict[str, Any]] = [{"name": "cpu", "capacity": "1MiB"}]
    if change.get("config") is None:
        tiers.append({"name": "r", "backend": "redis", "url": "redis://127.0.0.1:1/0"})
    cfg.write_text(yaml.safe_dump({"tiers": tiers}))
    (tmp_path / "p.jsonl").write_text(change.get("prompts", "[1, 2, 3, 4]") or "")
    flags: dict[str, str | None] = {
        "--config": str(cfg),
        "--prompts": str(tmp_path / "p.jsonl"),
        "--block-size": "4",
        "--model-id": "m",
        "--num-layers": "2",
        "--num-kv-heads": "2",
        "--head-dim": "8",
    }
    flags.update({k: v for k, v in change.items() if k.startswith("--")})
    argv = ["lookup"]
    for flag, value in flags.items():
        if value is not None:
            argv += [flag, value]
    code, out, err = _cli(argv, capsys)
    assert (code, out) == (2, "")
    assert len(err.splitlines()) == 1, err
    assert err.startswith("kvoffload: error: "), err
    assert names in err, err

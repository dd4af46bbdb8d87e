"""Request generators of ``kvoffload stress``: determinism, reuse shape, trace replay."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from support.checkout import TRACE as HEAD

from kvoffload.exceptions import ConfigError
from kvoffload.keys import ROOT_KEY, BlockKey, chain_key
from kvoffload.tools.workloads import (
    WORKLOADS,
    MultiTurnWorkload,
    ScanWorkload,
    TraceWorkload,
    Workload,
    ZipfWorkload,
    make_workload,
    prefix_hit_ratio,
)

HEAD_IDEAL_HIT_RATIO = 0.2890632159680346
"""Measured once with prefix_hit_ratio(TraceWorkload(HEAD)); the full conversation
trace gives 0.3664, matching the 0.366 published with the traces."""

GENERATED: dict[str, dict[str, Any]] = {
    "zipf": {"prefixes": 12, "prefix_blocks": 8, "suffix_blocks": 2},
    "multiturn": {"sessions": 4, "turn_blocks": 2, "max_turns": 5},
    "scan": {"blocks": 6},
}


def _take(workload: Workload, n: int) -> list[list[BlockKey]]:
    return [workload.next() for _ in range(n)]


def _write_trace(path: Path, rows: list[Any]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _req(*ids: int) -> dict[str, Any]:
    return {"timestamp": 0, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}


# ------------------------------------------------------------------ all generators
@pytest.mark.parametrize("name", sorted(GENERATED))
def test_a_seed_fixes_the_stream_and_another_seed_changes_it(name: str) -> None:
    params = GENERATED[name]
    first = _take(make_workload(name, **params, seed=1), 100)
    assert first == _take(make_workload(name, **params, seed=1), 100)
    assert first != _take(make_workload(name, **params, seed=2), 100)


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_requests_are_nonempty_and_within_max_blocks(name: str) -> None:
    workload = make_workload(name, **GENERATED[name])
    lengths = [len(keys) for keys in _take(workload, 300)]
    assert min(lengths) >= 1
    assert max(lengths) <= workload.max_blocks
    assert not workload.finite
    assert not workload.exhausted


# ---------------------------------------------------------------------------- zipf
def test_zipf_yields_the_keys_of_the_original_stress_workload() -> None:
    # Digest of the first 200 requests of stress.ZipfPrefixWorkload(StressConfig(), 0),
    # taken before the move: a persistent tier filled by an old run stays warm.
    digest = hashlib.sha256()
    for keys in _take(ZipfWorkload(seed=0), 200):
        for key in keys:
            digest.update(key)
    assert digest.hexdigest() == "e7b779cee6306f1f26794c53ca30919da2cb1e2397b0e33818dc153a182cd920"


def test_zipf_requests_share_prefixes_but_not_suffixes() -> None:
    workload = ZipfWorkload(prefixes=12, prefix_blocks=8, suffix_blocks=2, seed=3)
    requests = _take(workload, 300)
    assert workload.max_blocks == 10
    assert max(len(r) for r in requests) == 10  # the longest prefix is drawn in 300 tries
    first_keys = [r[0] for r in requests]
    # 300 requests over 12 prefixes: first keys repeat, the popular prefix most.
    assert len(set(first_keys)) <= 12
    top = max(set(first_keys), key=first_keys.count)
    assert first_keys.count(top) > 300 / 12
    suffixes = [key for r in requests for key in r[-2:]]
    assert len(set(suffixes)) == len(suffixes)


# ----------------------------------------------------------------------- multiturn
def test_multiturn_request_extends_its_sessions_previous_request() -> None:
    workload = MultiTurnWorkload(sessions=3, turn_blocks=2, max_turns=4, seed=5)
    last: dict[BlockKey, list[BlockKey]] = {}  # first key (= session) -> last request
    new_sessions = 0
    for keys in _take(workload, 200):
        previous = last.get(keys[0])
        if previous is None:
            new_sessions += 1
            assert len(keys) == 2  # a session opens with one turn
        else:
            assert keys[: len(previous)] == previous  # the whole history, unchanged
            assert len(keys) == len(previous) + 2  # plus exactly one turn
        last[keys[0]] = keys
    # 200 requests of at most 4 turns over 3 slots: sessions ended and were replaced.
    assert new_sessions >= 200 // 4
    # A replacement opens when its slot is picked, and 200 picks reach all 3 initial ones.
    assert workload.sessions_started == new_sessions


def test_multiturn_sessions_end_at_max_turns_or_max_blocks() -> None:
    by_turns = MultiTurnWorkload(sessions=2, turn_blocks=3, max_turns=4, seed=0)
    assert by_turns.max_blocks == 12
    assert max(len(k) for k in _take(by_turns, 200)) == 12
    # max_blocks 10 fits 3 whole turns of 3 blocks, not the 4 max_turns allows
    by_blocks = MultiTurnWorkload(sessions=2, turn_blocks=3, max_turns=4, max_blocks=10, seed=0)
    assert by_blocks.max_blocks == 9
    assert max(len(k) for k in _take(by_blocks, 200)) == 9
    with pytest.raises(ValueError, match="one turn must fit"):
        MultiTurnWorkload(turn_blocks=4, max_blocks=3)


def test_multiturn_sessions_never_share_blocks() -> None:
    requests = _take(MultiTurnWorkload(sessions=4, turn_blocks=1, max_turns=3, seed=0), 300)
    owner: dict[BlockKey, BlockKey] = {}  # key -> first key of the session that made it
    for keys in requests:
        for key in keys:
            assert owner.setdefault(key, keys[0]) == keys[0]


# ---------------------------------------------------------------------------- scan
def test_scan_never_reuses_a_block() -> None:
    keys = [key for r in _take(ScanWorkload(blocks=5, seed=0), 200) for key in r]
    assert len(keys) == 1000
    assert len(set(keys)) == 1000
    assert prefix_hit_ratio(ScanWorkload(blocks=5), requests=200) == 0.0


# --------------------------------------------------------------------------- trace
def test_trace_keys_chain_over_hash_ids(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(0, 1, 2, 3), _req(0, 1, 7, 3), _req(9, 1)])
    a, b, c = TraceWorkload(path)
    # a and b share the leading run [0, 1]: exactly two leading keys.
    assert a[:2] == b[:2]
    assert a[2] != b[2]
    # id 3 at the same position, after a different prefix: a different key.
    assert a[3] != b[3]
    # id 1 at position 1 after a different first block: a different key.
    assert c[1] != a[1]
    assert a[0] == chain_key(ROOT_KEY, (0).to_bytes(8, "little"))


def test_trace_head_shares_leading_keys_as_its_ids_do() -> None:
    lines = [json.loads(line)["hash_ids"] for line in HEAD.read_text().splitlines()[:300]]
    requests = list(TraceWorkload(HEAD, limit=300))
    checked = 0
    for i in range(1, 300):
        ids_a, ids_b = lines[0], lines[i]
        common = next(
            (j for j, (x, y) in enumerate(zip(ids_a, ids_b, strict=False)) if x != y),
            min(len(ids_a), len(ids_b)),
        )
        keys_a, keys_b = requests[0], requests[i]
        shared = next(
            (j for j, (x, y) in enumerate(zip(keys_a, keys_b, strict=False)) if x != y),
            min(len(keys_a), len(keys_b)),
        )
        assert shared == common
        checked += common > 0
    assert checked > 0  # the head does share leading blocks (system prompt)


def test_trace_limit_max_blocks_and_exhaustion(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(1, 2, 3), _req(1, 2), _req(4, 5, 6, 7), ""])
    full = TraceWorkload(path)
    assert full.finite
    assert full.max_blocks == 4
    assert len(list(full)) == 3  # the blank line is not a request
    assert full.exhausted
    with pytest.raises(IndexError, match="exhausted after 3 requests"):
        full.next()

    limited = TraceWorkload(path, limit=2)
    assert [len(k) for k in limited] == [3, 2]
    assert limited.max_blocks == 3

    capped = TraceWorkload(path, max_blocks=2)
    assert capped.max_blocks == 2
    requests = list(capped)
    assert [len(k) for k in requests] == [2, 2, 2]
    assert requests[0] == requests[1]  # [1, 2, 3] cut to [1, 2]: the same chain


def test_trace_loop_starts_over(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(1, 2), _req(3)])
    looping = TraceWorkload(path, loop=True)
    assert not looping.finite
    stream = _take(looping, 5)
    assert stream[:2] == stream[2:4] == [stream[0], stream[1]]
    assert stream[4] == stream[0]
    assert looping.passes == 2
    assert not looping.exhausted


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"hash_ids": [1, 2', "invalid JSON"),
        ('{"timestamp": 0, "input_length": 5}', "hash_ids is missing"),
        ('{"hash_ids": [1, "2"]}', r'hash_ids\[1\] = "2": not an integer'),
        ('{"hash_ids": [1.5]}', r"hash_ids\[0\] = 1.5: not an integer"),
        ('{"hash_ids": [true]}', "not an integer"),
        ('{"hash_ids": [-1]}', r"must be in 0\.\.2\*\*64-1"),
        ('{"hash_ids": []}', "hash_ids is empty"),
        ('{"hash_ids": 7}', "must be a list of integers"),
        ("[1, 2]", "must be a JSON object"),
        ('{"hash_ids": [1], "timestamp": "noon"}', "timestamp"),
    ],
)
def test_a_bad_trace_line_names_file_line_and_problem(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = _write_trace(tmp_path / "bad.jsonl", [_req(1), _req(1, 2), line, _req(3)])
    with pytest.raises(ConfigError, match=problem) as info:
        TraceWorkload(path)
    message = str(info.value)
    assert message.startswith(f"{path}: line 3: ")
    assert "\n" not in message


def test_a_bad_line_past_the_limit_is_not_read(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(1), _req(2), "not json"])
    assert len(list(TraceWorkload(path, limit=2))) == 2


def test_unreadable_empty_or_non_utf8_trace_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read trace file"):
        TraceWorkload(tmp_path / "missing.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="holds no requests"):
        TraceWorkload(empty)
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [\xff]}\n')
    with pytest.raises(ConfigError, match=r"line 2: not UTF-8 text: byte 14 is 0xff"):
        TraceWorkload(binary)


def test_the_head_slice_is_the_published_trace_unchanged() -> None:
    lines = HEAD.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2000
    assert json.loads(lines[0])["hash_ids"] == list(range(14))
    assert TraceWorkload(HEAD).max_blocks == 241


# ----------------------------------------------------------------- prefix_hit_ratio
def test_ideal_hit_ratio_of_the_head_slice() -> None:
    ideal = prefix_hit_ratio(TraceWorkload(HEAD))
    assert ideal == pytest.approx(HEAD_IDEAL_HIT_RATIO, abs=1e-9)
    assert prefix_hit_ratio(TraceWorkload(HEAD), 1_000_000) == pytest.approx(ideal)
    small = prefix_hit_ratio(TraceWorkload(HEAD), 1000)
    assert 0 < small < ideal / 2


def test_hit_ratio_counts_prefixes_and_evicts_tails_first(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(1, 2), _req(5), _req(1, 2), _req(2)])
    # capacity 2:
    # [1,2] -> miss miss; touched tail first, so 1 is the most recent: LRU order (2, 1)
    # [5]   -> miss; cache (2, 1, 5) -> evicts 2
    # [1,2] -> 1 hits, 2 misses (evicted), admitted again
    # [2]   -> a different chain (2 at position 0): miss
    assert prefix_hit_ratio(TraceWorkload(path), 2) == pytest.approx(1 / 6)
    # infinite: only the second [1,2] hits, both blocks
    assert prefix_hit_ratio(TraceWorkload(path)) == pytest.approx(2 / 6)


def test_a_block_after_a_miss_is_a_miss_even_if_cached(tmp_path: Path) -> None:
    path = _write_trace(tmp_path / "t.jsonl", [_req(1, 2, 3), _req(1, 2, 3)])
    # capacity 1 keeps only block 0 of the chain: second request hits 1 of 3
    assert prefix_hit_ratio(TraceWorkload(path), 1) == pytest.approx(1 / 6)


def test_generated_workloads_need_a_request_count() -> None:
    with pytest.raises(ValueError, match="never ends; pass requests=N"):
        prefix_hit_ratio(ZipfWorkload())
    multiturn = prefix_hit_ratio(MultiTurnWorkload(turn_blocks=2, max_turns=4), requests=2000)
    # every turn after the first reuses its history: close to (1+2+3)/(1+2+3+4) = 0.6
    assert 0.55 < multiturn < 0.6


# ------------------------------------------------------------------------ registry
def test_make_workload_builds_each_known_name() -> None:
    assert set(WORKLOADS) == {"zipf", "multiturn", "scan", "trace"}
    assert isinstance(make_workload("zipf", seed=1), ZipfWorkload)
    trace = make_workload("trace", path=HEAD, limit=10, max_blocks=8)
    assert isinstance(trace, TraceWorkload)
    assert trace.max_blocks == 8
    assert len(list(trace)) == 10


def test_make_workload_rejects_unknown_names_and_parameters() -> None:
    with pytest.raises(ValueError, match="unknown workload 'zipff'; known workloads: ") as info:
        make_workload("zipff")
    for name in ("zipf", "multiturn", "scan", "trace"):
        assert name in str(info.value)
    with pytest.raises(ValueError, match=r"takes no parameter 'sessions'; it takes: blocks, seed"):
        make_workload("scan", sessions=3)


@pytest.mark.parametrize(
    ("name", "params", "problem"),
    [
        ("zipf", {"prefixes": 0}, "prefixes must be an integer >= 1"),
        ("zipf", {"zipf_alpha": 0.0}, "zipf_alpha must be > 0"),
        ("multiturn", {"sessions": 0}, "sessions must be"),
        ("scan", {"blocks": True}, "blocks must be an integer"),
        ("trace", {"path": HEAD, "limit": 0}, "limit must be"),
    ],
)
def test_bad_parameters_are_refused(name: str, params: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        make_workload(name, **params)

"""The connector against vLLM 0.33, beside the suite's vLLM 0.32.

vLLM 0.33 is what ``pip install vllm`` gives a GPU user; this machine runs vLLM's CPU
build of 0.32. ``make dev`` puts 0.33's Python code in a folder of its own
(``support/vllm033.py``), and one child interpreter (``support/vllm033_walk.py``, 30 to
60 s on the 2-core machine) runs 0.33's real ``Scheduler`` and ``AsyncScheduler`` with
our connector's scheduler side, built by vLLM's connector factory, and its worker side
in the same process over a CPU KV cache. This process keeps 0.32. No 0.33 engine runs: its model
runner and GPU worker need its CUDA kernels.

Each check below holds for both scheduler classes (``Scheduler``; ``AsyncScheduler``,
0.33's default), and for ``Scheduler`` with every hit loaded as vLLM's asynchronous
load (``background``), with the same counts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import vllm033

pytestmark = pytest.mark.slow

MODES = ("sync", "async", "background")
BLOCK_TOKENS = 16
STORED = {  # the counters each phase ends with (the walk's prompts, in blocks)
    "store": {"blocks_submitted_for_store": 3, "tokens_stored": 48, "blocks_loaded": 0},
    "hit": {"blocks_submitted_for_store": 3, "blocks_loaded": 3, "tokens_loaded": 48},
    "abort_running": {"blocks_submitted_for_store": 7, "tokens_stored": 112, "blocks_loaded": 3},
    "abort_waiting": {"blocks_submitted_for_store": 7, "blocks_loaded": 3},
    "slept": {"blocks_submitted_for_store": 11, "tokens_stored": 176, "blocks_loaded": 3},
    "wake_miss": {"blocks_submitted_for_store": 14, "tokens_stored": 224, "blocks_loaded": 3},
    "wake_hit": {"blocks_submitted_for_store": 14, "blocks_loaded": 6, "tokens_loaded": 96},
}
TIMED = {"lookups"}
"""Counters that depend on the machine's speed: a lookup not answered within 5 ms is
asked again at the next step, and each question counts."""
LATENCY = "_latency_seconds_"
"""The tiers' latency histograms (a bucket's count and seconds): what a load or store
took, so which bucket it lands in is the machine's speed too."""
HELD = ".blocks_held"
"""The blocks a tier holds when the stats were read: a state, and in the async mode
the last stores may still be in flight when the walk reads them."""
IDLE_HEALTH = {"pinned": [0], "holds": 0, "plans": 0, "prefetches": 0, "claims": 0, "problems": []}
NEW_IN_033 = {"supports_sleep_mode", "unregister_kv_caches", "restore_kv_caches"}


def counts(phase: dict[str, Any], name: str) -> dict[str, Any]:
    """The counters of :data:`STORED` ``[name]`` as ``phase`` ends."""
    return {k: phase["counters"][k] for k in STORED[name]}


@pytest.fixture(scope="module")
def walk(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not vllm033.installed():
        # A failure under CI=true (support/ci_rules.py): `make dev` installs it.
        pytest.skip(f"vLLM {vllm033.VERSION} is not installed in {vllm033.TARGET}: make dev")
    return vllm033.run_walk(Path(tmp_path_factory.mktemp("vllm033")))


def test_the_child_ran_vllm_033_and_this_process_keeps_032(walk: dict[str, Any]) -> None:
    import vllm

    assert walk["version"] == vllm033.VERSION
    assert Path(walk["file"]).is_relative_to(vllm033.TARGET)
    assert walk["checked"] == vllm033.VERSION  # check_vllm_version accepts it
    assert vllm.__version__.startswith("0.32.")


def test_the_base_class_grew_only_the_sleep_hooks(walk: dict[str, Any]) -> None:
    """Every method and property of 0.32's ``KVConnectorBase_V1`` is in 0.33 with the
    same signature; 0.33 adds the three sleep-mode hooks, and nothing is left
    abstract in our class."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    old, new = vllm033.base_api(KVConnectorBase_V1), walk["base"]
    assert set(new) - set(old) == NEW_IN_033
    assert set(old) <= set(new)
    assert {k: v for k, v in old.items() if new[k] != v} == {}
    assert walk["ours_abstract"] == []
    assert {"unregister_kv_caches", "restore_kv_caches"} <= set(walk["ours_overrides"])
    assert "supports_sleep_mode" not in walk["ours_overrides"]  # the base's True


@pytest.mark.parametrize("mode", MODES)
def test_vllm_builds_our_scheduler_side(walk: dict[str, Any], mode: str) -> None:
    facts = walk["modes"][mode]["facts"]
    assert facts["scheduler"] == ("AsyncScheduler" if mode == "async" else "Scheduler")
    assert (facts["connector"], facts["role"]) == ("TieredOffloadConnector", "SCHEDULER")
    # A kv_both engine's stores are a best-effort cache; vLLM accepts sleep mode.
    assert facts["requires_kv_delivery"] is False
    assert facts["supports_sleep_mode"] is True


@pytest.mark.parametrize("mode", MODES)
def test_a_prompt_is_stored_then_hit_and_loaded_byte_for_byte(
    walk: dict[str, Any], mode: str
) -> None:
    phases = walk["modes"][mode]
    store, hit = phases["store"], phases["hit"]
    for name in ("store", "hit"):
        assert counts(phases[name], name) == STORED[name], name
    assert store["counters"]["tier.cpu.blocks_stored"] == 3
    assert store["sent"] == ["A"]  # its blocks held until its stores read them
    assert phases["local_reset"] is True
    assert hit["counters"]["tier.cpu.hits"] == 3
    assert hit["counters"]["load_errors"] == 0
    assert (hit["verified"], hit["mismatched"]) == (3, 0)
    # vLLM counted the connector's 48 tokens for B, from the cpu tier ("host").
    assert hit["external"] == {"A": 0, "B": 48}
    assert hit["hits"]["hits"] == 48
    assert hit["hits_by_source"] == {"host": 48}
    for name in ("store", "hit"):
        assert phases[name]["health"] == IDLE_HEALTH
        assert (phases[name]["requests"], phases[name]["free_blocks"]) == (0, 63)


@pytest.mark.parametrize("mode", MODES)
def test_aborted_requests_free_their_blocks_and_claims(walk: dict[str, Any], mode: str) -> None:
    phases = walk["modes"][mode]
    # C: aborted after its first chunk (4 blocks, stores submitted): vLLM keeps it
    # until the worker reports the stores done, then frees its blocks.
    assert phases["abort_running_scheduled"] == 4 * BLOCK_TOKENS
    assert phases["abort_running_held"] == 1
    running = phases["abort_running"]
    assert counts(running, "abort_running") == STORED["abort_running"]
    assert running["sent"] == ["A", "C"]
    # D: aborted before it was scheduled: no load, nothing left pinned.
    waiting = phases["abort_waiting"]
    assert counts(waiting, "abort_waiting") == STORED["abort_waiting"]
    assert "D" not in waiting["external"]
    for name in ("abort_running", "abort_waiting"):
        assert phases[name]["health"] == IDLE_HEALTH
        assert (phases[name]["requests"], phases[name]["free_blocks"]) == (0, 63)
        assert phases[name]["counters"]["load_errors"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_sleep_unregisters_once_nothing_reads_and_serves_after_the_wake(
    walk: dict[str, Any], mode: str
) -> None:
    phases = walk["modes"][mode]
    # Called in the step that submitted E's stores, unregister returns with none left.
    mid = phases["unregister_mid_step"]
    assert mid["before"]["store_gates"] == 1
    assert mid["after"] == {"store_gates": 0, "fences": 0, "layer_loads": 0, "background": 0}
    # vLLM's in-process engine resets right after the abort, while E's blocks are
    # held for its stores: vLLM 0.33 raises there (docs/vllm.md, "vLLM 0.33").
    assert "Failed to reset KV cache" in (phases["inproc_reset_error"] or "")
    # The multi-process engine waits until the scheduler is idle: then it resets.
    assert phases["sleep_idle_steps"] >= 1
    assert phases["sleep_reset"] is True
    assert phases["asleep_pending"] == mid["after"]
    slept = phases["slept"]
    assert counts(slept, "slept") == STORED["slept"]
    assert slept["counters"]["store_timeouts"] == 0
    assert slept["sent"] == ["A", "C", "E"]
    # After the wake, over a KV cache overwritten meanwhile: the first prompt misses
    # (stored before the reset) and is stored again; repeated, it hits and loads.
    miss, hit = phases["wake_miss"], phases["wake_hit"]
    assert counts(miss, "wake_miss") == STORED["wake_miss"]
    assert miss["external"]["F"] == 0
    assert counts(hit, "wake_hit") == STORED["wake_hit"]
    assert hit["external"]["G"] == 48
    assert (hit["verified"], hit["mismatched"]) == (6, 0)
    assert hit["counters"]["load_errors"] == 0
    assert hit["health"] == IDLE_HEALTH
    assert (hit["requests"], hit["free_blocks"]) == (0, 63)


def test_background_loads_are_received_and_waited_for_at_unregister(
    walk: dict[str, Any],
) -> None:
    phases = walk["modes"]["background"]
    # Unregistered in the step that started B's load in the background: it returns
    # with the load done (vLLM's multi-process engine never unregisters so early).
    mid = phases["unregister_mid_load"]
    assert mid["before"]["background"] == 1
    assert mid["after"] == {"store_gates": 0, "fences": 0, "layer_loads": 0, "background": 0}
    assert phases["hit"]["counters"]["loads_in_background"] == 1
    assert phases["wake_hit"]["counters"]["loads_in_background"] == 2


def test_every_mode_counts_the_same(walk: dict[str, Any]) -> None:
    modes = walk["modes"]

    def untimed(mode: str, name: str) -> dict[str, Any]:
        counters = modes[mode][name]["counters"]
        return {
            k: v
            for k, v in counters.items()
            if k not in TIMED and LATENCY not in k and not k.endswith(HELD)
        }

    for name in STORED:
        sync = untimed("sync", name)
        assert untimed("async", name) == sync, name
        background = untimed("background", name)
        # The same blocks loaded, none of them in the step.
        assert background["blocks_loaded_in_step"] == 0, name
        same = dict(background, loads_in_background=0)
        same["blocks_loaded_in_step"] = sync["blocks_loaded_in_step"]
        assert same == sync, name

"""The connector under vLLM's own scheduler: a Hypothesis state machine (issue 29).

vLLM 0.32's ``Scheduler`` drives the connector's scheduler side; its worker side runs
in the same process over a CPU KV cache and real tiers, and a model runner of ours
writes each computed token's KV as a function of the weights version and the tokens
(``support/contract_harness.py``). The machine adds requests over a tiny pool of
prefixes (so hits happen), steps, aborts, resets vLLM's prefix cache and updates the
weights (``reset_prefix_cache(reset_connector=True)``, then a new weights version);
under synchronous scheduling and under vLLM's ``AsyncScheduler`` (one step in flight,
driven as the engine core's batch queue drives it: the ``-asyncsched`` variants);
after every step the harness checks its invariants (``Engine.check_*``), and once idle
that nothing is left pinned, held, claimed or planned.

Rules that reach a known bug can be switched off in :data:`KNOWN_BUGS` while it is
open; the two it had (the disk tiers' blocks after a weights update, ``resident``
without stats) were fixed by 13198cb and are on. Each bug the machine found on the
connector before that commit also has a named regression test below (they pass on
13198cb and later, and fail on 4abe03f's connector).

``CONTRACT_EXAMPLES`` (examples per variant) and ``CONTRACT_STEPS`` (rules per
example) scale the run for a deep local search; the CI default is 2,100 sequences in
all. Examples are derandomized (the same sequences every run), and a failure prints
its sequence and a ``@reproduce_failure`` blob.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support.contract_harness import BLOCK, Engine, InvariantError, Variant, engine, prompt

KNOWN_BUGS: dict[str, bool] = {
    # A connector reset (weights update) left the lower tiers' blocks, which were then
    # served under the new weights (fixed by 13198cb's reset generation).
    "weights_update_with_disk_tier": True,
    # ``Shared.resident`` kept an entry per hit when vLLM logs no stats (fixed by
    # 13198cb).
    "stats_off": True,
}
"""Rules that reach a known bug: ``False`` keeps the machine away from it (while it is
open), ``True`` lets the machine explore them."""

EXAMPLES = int(os.environ.get("CONTRACT_EXAMPLES", "0")) or None
STEPS = int(os.environ.get("CONTRACT_STEPS", "20"))
"""Rules per sequence (Hypothesis' ``stateful_step_count``)."""

VARIANTS: dict[str, tuple[Variant, int]] = {
    # name: (variant, CI examples). vLLM's KV cache is 8 blocks unless said otherwise:
    # its own prefix cache evicts soon, so repeats hit the tiers, and requests are
    # preempted.
    "cpu-roomy": (Variant(tiers="cpu", gpu_blocks=32), 150),
    "cpu": (Variant(tiers="cpu"), 250),
    "cpu+mmap": (Variant(tiers="cpu+mmap"), 400),
    "cpu+mmap-async": (Variant(tiers="cpu+mmap", async_loads=True), 300),
    "cpu+lmdb-nostats": (Variant(tiers="cpu+lmdb", log_stats=False), 300),
    "flakycpu+mmap": (Variant(tiers="flakycpu+mmap"), 300),
    # vLLM's AsyncScheduler, one step in flight (the engine core's batch queue):
    # step N+1 is scheduled and its worker calls run before step N's output is applied.
    "cpu+mmap-asyncsched": (Variant(tiers="cpu+mmap", async_scheduling=True), 200),
    "cpu+mmap-async-asyncsched": (
        Variant(tiers="cpu+mmap", async_loads=True, async_scheduling=True),
        200,
    ),
}
"""The CI examples add up to 2,100 sequences."""


def _enabled(variant: Variant) -> bool:
    return variant.log_stats or KNOWN_BUGS["stats_off"]


REQUEST = st.tuples(
    st.integers(0, 2),  # which prefix
    st.integers(1, 4),  # how many of its blocks
    st.lists(st.integers(1, 8), min_size=1, max_size=BLOCK + 4),  # then these tokens
    st.integers(1, 6),  # max_tokens
)
"""One request: prompts share prefixes from a pool of three (hits), suffixes from a
tiny alphabet."""


class EngineMachine(RuleBasedStateMachine):
    """One engine per example (see the module docstring)."""

    variant: Variant = Variant()

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.prompts: list[list[int]] = []

    @initialize(first=st.lists(REQUEST, min_size=1, max_size=3))
    def start(self, first: list[tuple[int, int, list[int], int]]) -> None:
        self.engine = Engine(self.variant)
        for request in first:
            self._add(*request)

    @property
    def e(self) -> Engine:
        assert self.engine is not None
        return self.engine

    def _add(self, prefix: int, prefix_blocks: int, suffix: list[int], max_tokens: int) -> None:
        # Rules and preconditions depend on the drawn data only: the engine's state
        # depends on its threads' timing too, which a replay must not see.
        self.prompts.append(prompt(prefix, prefix_blocks, suffix))
        if len(self.e.unfinished()) < 6:
            self.e.add(self.prompts[-1], max_tokens)

    @rule(requests=st.lists(REQUEST, min_size=1, max_size=3), steps=st.integers(0, 3))
    def arrive(self, requests: list[tuple[int, int, list[int], int]], steps: int) -> None:
        """Requests arrive (a burst of one to three), then some steps run."""
        for request in requests:
            self._add(*request)
        for _ in range(steps):
            self.e.step()

    @precondition(lambda self: bool(self.prompts))
    @rule(which=st.integers(0, 15), max_tokens=st.integers(1, 6))
    def repeat(self, which: int, max_tokens: int) -> None:
        """A request arrives with the prompt of an earlier one (a hit, if its blocks
        are still anywhere)."""
        if len(self.e.unfinished()) < 6:
            self.e.add(self.prompts[which % len(self.prompts)], max_tokens)

    @rule(n=st.integers(1, 4))
    def step(self, n: int) -> None:
        for _ in range(n):
            self.e.step()

    @rule(which=st.integers(0, 5))
    def abort(self, which: int) -> None:
        """A client gives up on a request still unfinished (the which-th, if any)."""
        ids = sorted(self.e.unfinished(), key=lambda r: int(r[1:]))
        if ids:
            self.e.abort(ids[which % len(ids)])

    @rule()
    def reset_prefix_cache(self) -> None:
        self.e.reset_prefix_cache()

    @precondition(
        lambda self: (
            self.engine is not None
            and (self.engine.variant.tiers == "cpu" or KNOWN_BUGS["weights_update_with_disk_tier"])
        )
    )
    @rule()
    def update_weights(self) -> None:
        self.e.update_weights()

    @rule()
    def drain(self) -> None:
        self.e.check_idle()

    def teardown(self) -> None:
        if self.engine is not None:
            try:
                self.e.check_idle()
            finally:
                self.e.close()


def _run(variant: Variant, examples: int) -> None:
    machine = type("Machine", (EngineMachine,), {"variant": variant})
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=EXAMPLES or examples,
            stateful_step_count=STEPS,
            deadline=None,
            derandomize=True,
            print_blob=True,
            suppress_health_check=list(HealthCheck),
        ),
    )


@pytest.mark.parametrize("name", [n for n, (v, _) in VARIANTS.items() if _enabled(v)])
def test_engine_contract(name: str) -> None:
    """The machine over one variant: every invariant holds after every step, and
    nothing is left once idle."""
    variant, examples = VARIANTS[name]
    _run(variant, examples)


# ------------------------------------------------------------------ regressions
# Short explicit sequences through the harness, one per bug of issue 29 the machine
# found on the connector before 13198cb (run against 4abe03f's connector, each failed
# with the message quoted in its docstring), and requires_kv_delivery as vLLM's real
# scheduler reads it.

PROMPT = prompt(0, 3, [7, 8, 9])
"""Three full blocks of prefix 0 and three tokens: a hit of three blocks when repeated."""


def test_harness_catches_a_block_that_lost_its_kv() -> None:
    """The first invariant is not vacuous: a computed block overwritten behind vLLM's
    back fails it, named."""
    with engine(Variant(tiers="cpu")) as e:
        e.add(PROMPT, 4)
        e.step()
        e.step()
        running = e.scheduler.running[0]
        block = e.scheduler.kv_cache_manager.get_block_ids(running.request_id)[0][0]
        for t in e.kv.values():
            t[block].view(torch.int16).fill_(7)
        with pytest.raises(InvariantError, match=r"^computed_blocks_current: .*wrong or unwritten"):
            e.check_computed_blocks_current()


def test_harness_counts_a_connector_hit() -> None:
    """The sequence the regressions below build on loads its repeat from the tiers
    (vLLM's own prefix cache reset in between), and every invariant holds."""
    with engine(Variant(tiers="cpu+mmap")) as e:
        e.add(PROMPT, 3)
        e.drain()
        assert e.reset_prefix_cache()
        e.add(PROMPT, 3)
        e.drain()
        assert e.counters()["tokens_loaded"] == 3 * BLOCK
        e.check_idle()


@pytest.mark.parametrize("async_loads", [False, True])
def test_async_scheduling_loads_a_connector_hit(async_loads: bool) -> None:
    """The same sequence under vLLM's ``AsyncScheduler`` (one step in flight): the
    repeat loads its three blocks from the tiers, its KV is the forward pass's, and
    the hits vLLM counted (over two schedules per ``update_from_output``) are the
    tokens loaded."""
    variant = Variant(tiers="cpu+mmap", async_loads=async_loads, async_scheduling=True)
    with engine(variant) as e:
        e.add(PROMPT, 3)
        e.drain()
        assert e.reset_prefix_cache()
        e.add(PROMPT, 3)
        e.drain()
        assert e.counters()["tokens_loaded"] == 3 * BLOCK
        e.check_idle()


@pytest.mark.parametrize("tiers", ["cpu+mmap", "cpu+lmdb"])
def test_weights_update_never_serves_old_kv_from_a_disk_tier(tiers: str) -> None:
    """After ``reset_prefix_cache(reset_connector=True)`` and a new weights version, a
    repeat of an earlier prompt computes (or loads) its blocks under the new weights.
    Before 13198cb the disk tier kept the old blocks and served them:
    ``computed_blocks_current: request r1: 48 of its 51 computed tokens in layer 0 do
    not hold weights version 1's KV; ... stale (weights version 0)``."""
    with engine(Variant(tiers=tiers)) as e:
        e.add(PROMPT, 3)
        e.drain()
        assert e.update_weights()
        e.add(PROMPT, 3)
        e.drain()
        e.check_idle()


def test_no_resident_entry_left_without_stats() -> None:
    """With vLLM's stats off (``log_stats=False``: nobody asks for hit sources) a hit
    leaves nothing in ``Shared.resident``. Before 13198cb each hit left its entry:
    ``idle_resident: {'r1': 3} once idle``."""
    with engine(Variant(tiers="cpu", log_stats=False)) as e:
        e.add(PROMPT, 3)
        e.drain()
        assert e.reset_prefix_cache()
        e.add(PROMPT, 3)
        e.drain()
        assert e.counters()["tokens_loaded"] == 3 * BLOCK
        e.check_idle()


def test_a_best_effort_cache_does_not_ask_for_kv_delivery() -> None:
    """vLLM's scheduler reads ``requires_kv_delivery`` from the connector: under
    ``kv_both`` the connector is a best-effort cache (a dropped store is a later miss),
    so a preempted request's in-flight output is not dropped for it. Before 13198cb the
    base class's default (any producer, ``kv_both`` included) held."""
    with engine(Variant(tiers="cpu")) as e:
        assert e.scheduler.requires_kv_delivery is False

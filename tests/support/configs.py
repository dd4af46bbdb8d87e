"""Config files for the tests that validate a config without the engine: a cpu tier
over an mmap one, written as YAML the way a user writes it, with any further tiers
after them."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_tiers_yaml(tmp: Path, name: str, more: str = "") -> Path:
    """Write ``tmp / name``: a 64 MiB cpu tier over a 1 GiB mmap tier at ``tmp / "ssd"``,
    then ``more`` (further entries of the ``tiers`` list, in YAML, indented as written);
    the file's path."""
    text = textwrap.dedent(
        f"""
        tiers:
          - {{name: cpu, backend: cpu, capacity: 64MiB}}
          - {{name: ssd, backend: mmap, capacity: 1GiB, path: {tmp / "ssd"}}}
        """
    )
    if more:
        text += textwrap.indent(textwrap.dedent(more).strip("\n") + "\n", "  ")
    cfg = tmp / name
    cfg.write_text(text)
    return cfg

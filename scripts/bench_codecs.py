"""Which lossless blosc2 settings pay for KV-cache blocks (issue 24), on captured real KV.

Loads the captures of ``scripts/capture_kv.py`` (``out/kv_capture/*.npz``: each block
the bytes the tier stores for one 32-token block, all layers) and, per capture and
codec setting, compresses every block on its own, in one ``blosc2.compress2`` call
per unit, as the tier will: the whole block record payload (``--unit block``, the
default: 720 KiB for SmolLM2 in bf16), or each layer's piece of it (``--unit layer``,
for contrast). Reports:

- ``ratio``: stored bytes / logical bytes, summed over all blocks (lower is better;
  the stored bytes include blosc2's chunk header);
- ``comp GB/s`` and ``decomp GB/s``: logical bytes / seconds on one thread
  (``nthreads=1`` for both), best of ``--repeats`` passes over ``--time-mb`` MB of
  units spread evenly over the capture (the ratio is over all of them);
  decompression goes into a preallocated array with a slot per unit
  (``decompress2(src, dst=slot)``), and every unit is checked against its original
  once;
- ``memcpy``: numpy ``copyto`` of the same blocks into the same kind of preallocated
  array, in the same run: the ceiling.

typesize is the cache's element size (2 for bf16, 1 for fp8). Settings: LZ4 (clevel 1,
5, 9), LZ4HC (1, 5, 9), ZSTD (1, 3, 5), BLOSCLZ (5, 9), each with NOFILTER, SHUFFLE,
BITSHUFFLE and SHUFFLE+BYTEDELTA (``--quick`` for a smaller set)::

    .venv/bin/python scripts/bench_codecs.py --json out/bench_codecs.json
    .venv/bin/python scripts/bench_codecs.py --capture smollm2-bf16 --unit layer --quick
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blosc2
import numpy as np

from kvoffload.tools.bench import harness

REPO = Path(__file__).resolve().parent.parent
CAPTURES = REPO / "out" / "kv_capture"

C = blosc2.Codec
F = blosc2.Filter
LEVELS: dict[blosc2.Codec, tuple[int, ...]] = {
    C.LZ4: (1, 5, 9),
    C.LZ4HC: (1, 5, 9),
    C.ZSTD: (1, 3, 5),
    C.BLOSCLZ: (5, 9),
}
QUICK_LEVELS: dict[blosc2.Codec, tuple[int, ...]] = {
    C.LZ4: (1, 5, 9),
    C.ZSTD: (1, 3),
}
FILTERS: dict[str, tuple[blosc2.Filter, ...]] = {
    "nofilter": (F.NOFILTER,),
    "shuffle": (F.SHUFFLE,),
    "bitshuffle": (F.BITSHUFFLE,),
    "shuffle+bytedelta": (F.SHUFFLE, F.BYTEDELTA),
}
QUICK_FILTERS = ("shuffle", "bitshuffle")


@dataclass
class Capture:
    name: str
    blocks: np.ndarray  # uint8 [n, bytes_per_block]
    meta: dict[str, Any]


def load(path: Path) -> Capture:
    z = np.load(path)
    meta = json.loads(str(z["meta"]))
    return Capture(meta["name"], np.ascontiguousarray(z["blocks"]), meta)


def units(cap: Capture, unit: str) -> np.ndarray:
    """The blocks as the units compressed one call each: ``[n_units, unit_bytes]``."""
    if unit == "block":
        return cap.blocks
    layers = cap.meta["layers"]
    return cap.blocks.reshape(cap.blocks.shape[0] * layers, -1)


def spread(n: int, k: int) -> np.ndarray:
    """``k`` unit indices spread evenly over ``n`` (every section of the text timed)."""
    return np.unique(np.linspace(0, n - 1, k).round().astype(int))


def memcpy_gbs(src: np.ndarray, repeats: int) -> float:
    """numpy ``copyto`` of each unit into its own slot of a preallocated array."""
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch

    def copy() -> None:
        for i in range(src.shape[0]):
            np.copyto(dst[i], src[i])

    best = harness.timings({"copy": copy}, repeats, warmup=False)["copy"].best
    return harness.gbps(src.nbytes, best)


def bench_setting(
    src: np.ndarray,
    timed: int,
    codec: blosc2.Codec,
    clevel: int,
    filters: tuple[blosc2.Filter, ...],
    typesize: int,
    repeats: int,
) -> dict[str, Any]:
    """The ratio over every unit of ``src`` (each checked once after a round trip);
    the speeds over its first ``timed`` units, best of ``repeats``."""
    cparams = blosc2.CParams(
        codec=codec,
        clevel=clevel,
        typesize=typesize,
        nthreads=1,
        filters=list(filters),
        filters_meta=[0] * len(filters),
    )
    dparams = blosc2.DParams(nthreads=1)
    packed = [blosc2.compress2(unit, cparams=cparams) for unit in src]
    stored = sum(len(p) for p in packed)
    dst = np.empty_like(src)
    for i, p in enumerate(packed):
        blosc2.decompress2(p, dst=dst[i], dparams=dparams)
    if not np.array_equal(dst, src):
        raise AssertionError(f"{codec.name} clevel {clevel} {filters}: round trip differs")
    picks = spread(src.shape[0], timed)
    part = src[picks]
    part_packed = [packed[i] for i in picks]

    def comp() -> None:
        for i in range(timed):
            blosc2.compress2(part[i], cparams=cparams)

    def decomp() -> None:
        for i in range(timed):
            blosc2.decompress2(part_packed[i], dst=dst[i], dparams=dparams)

    # Interleaved rounds, compress then decompress, best of each kept.
    best = harness.timings({"comp": comp, "decomp": decomp}, repeats, warmup=False)
    return {
        "ratio": stored / src.nbytes,
        "stored_bytes": stored,
        "comp_gbs": harness.gbps(part.nbytes, best["comp"].best),
        "decomp_gbs": harness.gbps(part.nbytes, best["decomp"].best),
    }


def settings(quick: bool, only: list[str] | None) -> list[tuple[blosc2.Codec, int, str]]:
    """``(codec, clevel, filters name)`` to measure: ``only`` (``CODEC:CLEVEL:FILTERS``,
    e.g. ``LZ4:1:shuffle``), else the full or the ``quick`` grid."""
    if only:
        out = []
        for spec in only:
            codec, clevel, fname = spec.split(":")
            if fname not in FILTERS:
                raise SystemExit(f"unknown filters {fname!r}: one of {list(FILTERS)}")
            out.append((C[codec.upper()], int(clevel), fname))
        return out
    levels = QUICK_LEVELS if quick else LEVELS
    fnames = QUICK_FILTERS if quick else tuple(FILTERS)
    return [(c, lv, f) for c, lvs in levels.items() for lv in lvs for f in fnames]


def run(
    cap: Capture,
    unit: str,
    repeats: int,
    time_bytes: int,
    grid: list[tuple[blosc2.Codec, int, str]],
) -> dict[str, Any]:
    src = units(cap, unit)
    typesize = int(cap.meta["element_size"])
    timed = max(1, min(src.shape[0], time_bytes // src.shape[1]))
    result: dict[str, Any] = {
        "capture": cap.name,
        "meta": {k: v for k, v in cap.meta.items() if k != "prompts"},
        "unit": unit,
        "units": int(src.shape[0]),
        "unit_bytes": int(src.shape[1]),
        "logical_bytes": int(src.nbytes),
        "typesize": typesize,
        "repeats": repeats,
        "timed_units": timed,
        "memcpy_gbs": memcpy_gbs(src[spread(src.shape[0], timed)], repeats),
        "settings": [],
    }
    for codec, clevel, fname in grid:
        row: dict[str, Any] = {"codec": codec.name, "clevel": clevel, "filters": fname}
        row |= bench_setting(src, timed, codec, clevel, FILTERS[fname], typesize, repeats)
        result["settings"].append(row)
        print(
            f"  {cap.name:<22} {codec.name:<7} {clevel} {fname:<18} "
            f"ratio {row['ratio']:.3f}  comp {row['comp_gbs']:6.2f}  "
            f"decomp {row['decomp_gbs']:6.2f} GB/s",
            file=sys.stderr,
            flush=True,
        )
    # Once more after the settings: the ceiling of the same run, as load changes.
    last = memcpy_gbs(src[spread(src.shape[0], timed)], repeats)
    result["memcpy_gbs"] = max(result["memcpy_gbs"], last)
    return result


TABLE: list[tuple[str, harness.Cell]] = [
    ("codec", "codec"),
    ("clevel", "clevel"),
    ("filters", "filters"),
    ("ratio", harness.fixed("ratio", 3)),
    ("saved", lambda r: f"{1 - r['ratio']:.1%}"),
    ("comp GB/s", harness.fixed("comp_gbs")),
    ("decomp GB/s", harness.fixed("decomp_gbs")),
]
"""The docs' table of one capture: every column left-aligned, as recorded before."""


def table(result: dict[str, Any]) -> str:
    m = result["meta"]
    head = (
        f"## {result['capture']}: {m['cache_dtype']} cache {m['cache_shape']}, "
        f"{m['layers']} layers, {result['units']} units of {result['unit_bytes']} B "
        f"({result['unit']}), {result['logical_bytes'] / 1e6:.1f} MB, "
        f"typesize {result['typesize']}; timed: {result['timed_units']} units, "
        f"best of {result['repeats']}; memcpy {result['memcpy_gbs']:.2f} GB/s\n"
    )
    return head + "\n" + harness.markdown_table(TABLE, result["settings"], left=len(TABLE)) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=CAPTURES, help="where the captures are")
    ap.add_argument("--capture", action="append", help="capture name(s); default: all")
    ap.add_argument("--unit", choices=("block", "layer"), default="block")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument(
        "--time-mb", type=float, default=32.0, help="MB of units timed (spread over the capture)"
    )
    ap.add_argument("--quick", action="store_true", help="fewer settings")
    ap.add_argument("--setting", action="append", help="CODEC:CLEVEL:FILTERS, e.g. LZ4:1:shuffle")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    blosc2.set_nthreads(1)
    paths = sorted(args.dir.glob("*.npz"))
    if args.capture:
        paths = [args.dir / f"{name}.npz" for name in args.capture]
    if not paths:
        print(f"no captures in {args.dir}: run scripts/capture_kv.py first", file=sys.stderr)
        return 1
    results = []
    for path in paths:
        grid = settings(args.quick, args.setting)
        result = run(load(path), args.unit, args.repeats, int(args.time_mb * 1e6), grid)
        results.append(result)
        print(table(result), flush=True)
    if args.json:
        payload = {"blosc2": blosc2.__version__, "results": results}
        harness.write_json(args.json, payload, facts=harness.run_facts())
    return 0


if __name__ == "__main__":
    sys.exit(main())

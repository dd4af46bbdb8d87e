"""``kvoffload stress --plot``: throughput and hit rate over time, per tier, as a PNG.

Matplotlib is an optional extra (``pip install 'kvoffload[plot]'``); nothing else in
the package imports it, and a missing install is a one-line usage error, checked
before the run starts rather than after it.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from kvoffload.exceptions import KVOffloadError


def require_matplotlib() -> None:
    """Raise a one-line error naming the fix when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KVOffloadError(
            "--plot needs matplotlib, which is not installed; "
            "install the extra: pip install 'kvoffload[plot]'"
        ) from None


def plot_report(report: dict[str, Any], path: Path) -> None:
    """Draw ``report``'s timeline (a ``StressReport.to_json()`` document) into ``path``:
    write and read GB/s per tier, and the cumulative hit rate."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    timeline = report["timeline"]
    names = [t["name"] for t in report["tiers"]]
    times = [s["t"] for s in timeline]
    fig, (ax_w, ax_r, ax_h) = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    for i, name in enumerate(names):
        for ax, field in ((ax_w, "bytes_written"), (ax_r, "bytes_read")):
            rates = [
                (b["tiers"][i][field] - a["tiers"][i][field]) / (b["t"] - a["t"]) / 1e9
                if b["t"] > a["t"]
                else 0.0
                for a, b in itertools.pairwise(timeline)
            ]
            ax.plot(times[1:], rates, label=name)
    hit_rate = [s["loaded"] / s["requested"] if s["requested"] else 0.0 for s in timeline]
    ax_h.plot(times, hit_rate, color="black", label="all tiers")
    for i, name in enumerate(names):
        share = [
            s["tiers"][i]["hits"] / s["requested"] if s["requested"] else 0.0 for s in timeline
        ]
        ax_h.plot(times, share, linestyle="--", label=f"{name} hits")
    ax_w.set_ylabel("write GB/s")
    ax_r.set_ylabel("read GB/s")
    ax_h.set_ylabel("hit rate (cumulative)")
    ax_h.set_xlabel("seconds")
    for ax in (ax_w, ax_r, ax_h):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    fig.suptitle(
        f"kvoffload stress: {report['workload']}, {report['ops']} requests, "
        f"hit rate {report['hit_rate']:.3f}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

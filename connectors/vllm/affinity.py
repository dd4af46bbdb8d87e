"""CPU affinity for the worker side's threads.

vLLM's CPU build binds each worker's main thread to one CPU, and a thread inherits its
creator's affinity. The Offloader's lanes and I/O threads are made from that thread, so
without this module they would all share one core with OpenMP's first thread. It is a
role of its own because it depends only on the process's environment (what vLLM set for
OpenMP) and not on the connector's state: :func:`rank_affinity` wraps the Offloader's
construction in :mod:`.worker`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator

logger = logging.getLogger(__name__)


def rank_cpus(environ: dict[str, str] | os._Environ[str] = os.environ) -> set[int] | None:
    """The CPUs vLLM's CPU build gave this worker's OpenMP threads (it sets
    ``GOMP_CPU_AFFINITY``, ``KMP_AFFINITY`` or ``OMP_PLACES`` per rank); ``None`` when
    none is set (a GPU worker, or binding off)."""
    spec = environ.get("GOMP_CPU_AFFINITY")
    if spec is None:
        kmp = re.search(r"proclist=\[([0-9,\s-]+)\]", environ.get("KMP_AFFINITY", ""))
        spec = kmp.group(1) if kmp else environ.get("OMP_PLACES", "").strip("{}") or None
    if not spec:
        return None
    cpus: set[int] = set()
    for part in re.split(r"[\s,]+", spec.strip()):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus or None


@contextlib.contextmanager
def rank_affinity(ranks: int = 1) -> Iterator[None]:
    """Start the Offloader's threads on more than the one CPU vLLM bound us to.

    vLLM's CPU build binds the worker's main thread to a single CPU (OpenMP's first),
    and a thread inherits its creator's affinity: built from that thread, every lane
    and I/O thread would share one core with OpenMP thread 0, and a 510 MiB disk load
    ran at 0.33 GB/s where the same code alone reads 0.85. So the calling thread is
    widened while the threads are made, then restored: with one rank, to every CPU
    this process may use (the I/O threads mostly wait on the disk; vLLM keeps a core
    for its scheduler, which idles during the forward pass); with several, to the
    rank's own OpenMP CPUs, which vLLM chose per NUMA node."""
    if not hasattr(os, "sched_setaffinity"):
        yield
        return
    cpus = set(range(os.cpu_count() or 1)) if ranks == 1 else rank_cpus()
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:  # CPUs outside this process's cpuset
        logger.warning("kvoffload: could not widen thread affinity to %s: %s", sorted(cpus), exc)
        yield
        return
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)

"""The raw-disk baseline of the benchmarks, and the helpers they share.

``O_DIRECT`` ``pwrite`` / ``pread`` at the best of several thread counts is what the
disk does; :mod:`~kvoffload.tools.bench.tiers` sets every disk tier against it, and
:mod:`~kvoffload.tools.bench.chain` the whole store chain. Both need it, so it lives
here, below both, rather than in one of them importing the other.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Final

from kvoffload.layout import KVLayout
from kvoffload.tools.bench.harness import gbps as gbps  # its old home: re-exported
from kvoffload.tools.bench.harness import strongest, timed

logger = logging.getLogger(__name__)

RAW_THREADS: Final = (1, 4, 8, 16)


def layout_of_size(block_bytes: int) -> KVLayout:
    """A one-layer bf16 layout whose blocks are exactly ``block_bytes``."""
    head_dim = block_bytes // (2 * 16 * 2)
    return KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=head_dim, block_size=16, namespace="kvoffload-bench"
    )


def drop_page_cache() -> bool:
    """Flush dirty pages and drop the page cache; ``False`` if not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------ raw
def raw_io(
    directory: Path, block_bytes: int, total_bytes: int, threads: int
) -> tuple[float, float, float]:
    """O_DIRECT pwrite then pread of ``total_bytes`` in ``block_bytes`` I/Os split over
    ``threads``; returns (write GB/s, durable write GB/s, read GB/s).

    The durable figure also counts the ``fdatasync`` after the writes. ``O_DIRECT``
    only hands the data to the device: on this VM the host caches it, and writes
    absorbed there ran at 2-3x what the flush then costs (2026-11-23: 2.1 GB/s
    written, 0.6-0.7 GB/s once synced). A tier with ``fsync: true`` pays that flush
    on every batch, so it is compared with the durable figure, and a tier without
    it (or vLLM's fs tier, which never syncs) with the plain one."""
    path = directory / f"raw-{block_bytes}-{threads}.bin"
    n = total_bytes // block_bytes
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        # No O_DIRECT here (tmpfs, some network filesystems): buffered, as the tier does.
        logger.warning("%s refuses O_DIRECT; raw baseline uses buffered I/O", directory)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, n * block_bytes)
        bufs = [mmap.mmap(-1, block_bytes) for _ in range(threads)]
        for b in bufs:
            b.write(
                os.urandom(min(block_bytes, 1 << 16)) * (block_bytes // min(block_bytes, 1 << 16))
            )

        def worker(t: int, write: bool) -> None:
            buf = bufs[t]
            for i in range(t, n, threads):
                if write:
                    os.pwrite(fd, buf, i * block_bytes)
                else:
                    os.preadv(fd, [buf], i * block_bytes)

        def run(write: bool) -> float:
            def once() -> None:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda t: worker(t, write), range(threads)))

            return timed(once)

        start = time.perf_counter()
        w = run(True)
        os.fdatasync(fd)
        synced = time.perf_counter() - start
        drop_page_cache()
        r = run(False)
        for b in bufs:
            b.close()
        return gbps(n * block_bytes, w), gbps(n * block_bytes, synced), gbps(n * block_bytes, r)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def raw_best(directory: Path, block_bytes: int, total_bytes: int) -> dict[str, float]:
    """The best write, durable write and read figures over :data:`RAW_THREADS`, with
    the thread counts that reached them."""
    results = {t: raw_io(directory, block_bytes, total_bytes, t) for t in RAW_THREADS}
    (w_threads, w), (s_threads, s), (r_threads, r) = (
        strongest({t: figures[i] for t, figures in results.items()}) for i in range(3)
    )
    return {
        "raw_write_gbps": w,
        "raw_write_synced_gbps": s,
        "raw_read_gbps": r,
        "raw_write_threads": w_threads,
        "raw_write_synced_threads": s_threads,
        "raw_read_threads": r_threads,
    }

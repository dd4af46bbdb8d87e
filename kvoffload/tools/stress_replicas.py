"""``kvoffload stress --replicas N``: N stress runners in processes of their own.

Each replica runs its share of one seeded stream
(:class:`~kvoffload.tools.workloads.ReplicaShare`) with its own tiers above the
config's server-booked ones, which they share: what one replica stored is a verified
hit in another, and :class:`~kvoffload.tools.stress_report.ReplicaSetReport` puts
their reports side by side.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Final

from kvoffload.config import KVOffloadConfig
from kvoffload.exceptions import ConfigError, KVOffloadError
from kvoffload.tools.stress_report import ReplicaSetReport
from kvoffload.tools.stress_runner import ProgressFn, StressRunner

logger = logging.getLogger(__name__)


MAX_REPLICAS: Final = 64
"""Most replica processes ``kvoffload stress --replicas`` starts."""

REPLICA_START_TIMEOUT_S: Final = 300.0
"""How long a replica waits for the others to open their tiers before giving up."""

REPLICA_MAX_LEAD: Final = 4
"""Most requests a replica finishes ahead of the slowest replica still running. A
fleet's replicas serve at once; one that ran ahead (started first, a core of its own)
would look up the shared prefixes before the others stored them and measure no
sharing, so each waits for the slowest (never past the run's duration)."""


def shared_tiers(config: KVOffloadConfig) -> list[str]:
    """Names of ``config``'s tiers whose books live on their server
    (:attr:`~kvoffload.backend.Backend.server_booked`): the tiers replicas share."""
    from kvoffload.registry import get_backend_class

    return [t.name for t in config.tiers if get_backend_class(t.backend).server_booked]


def replica_config(config: KVOffloadConfig, replica: int) -> dict[str, Any]:
    """``config`` as replica ``replica`` runs it, as a mapping for ``load_config``.

    A local disk tier's directory takes one writer process, so each replica's goes to
    a directory of its own, the tier's ``path`` suffixed ``.replica<R>``; the shared
    (server-booked) tiers and the cpu tier are as configured."""
    from kvoffload.registry import get_backend_class

    raw = config.model_dump()
    # Only what was set: a preset and the default layout both dumped would conflict.
    raw["stress"] = config.stress.model_dump(exclude_unset=True)
    for tier_raw, tier in zip(raw["tiers"], config.tiers, strict=True):
        path = tier_raw.get("path")
        if isinstance(path, str) and not get_backend_class(tier.backend).server_booked:
            tier_raw["path"] = f"{os.path.normpath(path)}.replica{replica}"
    return raw


def run_replicas(
    config: KVOffloadConfig,
    *,
    replicas: int,
    ops: int,
    duration_s: float,
    seed: int | None = None,
    progress: ProgressFn | None = None,
) -> ReplicaSetReport:
    """Run ``replicas`` stress processes that share ``config``'s server-booked tiers.

    Each is a fresh process (``spawn``) with its own tiers above the shared ones (its
    own cpu tier; its own directory for a local disk tier, see :func:`replica_config`)
    running its :class:`~kvoffload.tools.workloads.ReplicaShare` of the one seeded
    stream, ``ops`` requests or ``duration_s`` seconds. They open their tiers, wait
    for each other, start together, and keep within :data:`REPLICA_MAX_LEAD` requests
    of each other (as a fleet's replicas serve at once). ``progress`` gets the
    requests done by all of them. A replica that fails (its config, its tiers'
    consistency check, a crash) raises :class:`~kvoffload.exceptions.KVOffloadError`
    naming it, once all have ended.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    from kvoffload.config import load_config

    if not 1 <= replicas <= MAX_REPLICAS:
        raise ConfigError(f"replicas = {replicas}: it must be between 1 and {MAX_REPLICAS}")
    shared = shared_tiers(config)
    if replicas > 1 and not shared:
        raise ConfigError(
            f"{replicas} replicas need a tier they share: add one whose books live on its "
            "server (backend: redis) below the cpu tier"
        )
    seed = config.stress.seed if seed is None else seed
    raws = [replica_config(config, r) for r in range(replicas)]
    for raw in raws:
        load_config(raw, env={})  # a bad per-replica path fails here, once
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(replicas)
    done = ctx.Array("q", replicas, lock=False)
    over = ctx.Array("b", replicas, lock=False)  # a replica's run has ended
    level = logging.getLogger().getEffectiveLevel()
    procs, pipes = [], []
    for r, raw in enumerate(raws):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_replica_main,
            args=(raw, r, replicas, seed, ops, duration_s, barrier, (done, over), writer, level),
            name=f"kvoffload-stress-replica-{r}",
            daemon=True,
        )
        proc.start()
        writer.close()  # the child's end: EOF here once it exits
        procs.append(proc)
        pipes.append(reader)
    results: dict[int, tuple[str, Any]] = {}
    start = time.perf_counter()
    try:
        waiting = dict(enumerate(pipes))
        while waiting:
            for ready in wait(list(waiting.values()), timeout=0.25):
                r = next(i for i, p in waiting.items() if p is ready)
                pipe = waiting.pop(r)
                try:
                    results[r] = pipe.recv()
                except EOFError:
                    procs[r].join(timeout=10)
                    results[r] = ("error", f"exited with code {procs[r].exitcode} and no report")
            if progress is not None:
                progress(sum(done), time.perf_counter() - start)
        for proc in procs:
            proc.join(timeout=30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for pipe in pipes:
            pipe.close()
    failed = [
        f"replica {r}: {msg}" for r, (kind, msg) in sorted(results.items()) if kind == "error"
    ]
    if not failed:  # only the replicas that gave up waiting for a crashed one
        failed = [
            f"replica {r}: {msg}" for r, (kind, msg) in sorted(results.items()) if kind != "ok"
        ]
    if failed:
        raise KVOffloadError("; ".join(failed))
    return ReplicaSetReport([results[r][1] for r in range(replicas)], shared)


def _replica_main(
    raw: dict[str, Any],
    replica: int,
    replicas: int,
    seed: int,
    ops: int,
    duration_s: float,
    barrier: Any,
    progress: tuple[Any, Any],
    out: Any,
    log_level: int,
) -> None:
    """One replica process of :func:`run_replicas`: sends ``("ok", StressReport)`` or
    ``("error", one-line message)`` through ``out``."""
    import threading

    from kvoffload.config import load_config

    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s %(name)s: replica {replica}: %(message)s",
    )
    runner: StressRunner | None = None
    try:
        try:
            config = load_config(raw, env={})
            runner = StressRunner(config, seed=seed, replica=replica, replicas=replicas)
        except Exception:
            barrier.abort()  # the others stop waiting for us
            raise
        barrier.wait(timeout=REPLICA_START_TIMEOUT_S)
        done, over = progress
        others = [i for i in range(replicas) if i != replica]
        give_up = time.monotonic() + duration_s

        def tick(n: int, _t: float) -> None:
            done[replica] = n
            while time.monotonic() < give_up:  # stay within REPLICA_MAX_LEAD of the slowest
                running = [done[i] for i in others if not over[i]]
                if not running or n - min(running) <= REPLICA_MAX_LEAD:
                    return
                time.sleep(0.002)

        try:
            report = runner.run(ops=ops, duration_s=duration_s, progress=tick)
        finally:
            over[replica] = 1
        out.send(("ok", report))
    except threading.BrokenBarrierError:
        out.send(("broken", "another replica failed to start"))
    except Exception as exc:  # sent to the parent as one line
        logger.debug("replica %d failed", replica, exc_info=True)
        text = str(exc) if isinstance(exc, KVOffloadError) else f"{type(exc).__name__}: {exc}"
        out.send(("error", " ".join(text.split())))
    finally:
        if runner is not None:
            runner.close()
        out.close()

"""``kvoffload stress``: a seeded offload workload whose every loaded block is checked.

The names a user or a script imports, in one place; each part is a module of its own:

- :mod:`~kvoffload.tools.stress_runner`: :class:`StressRunner`, the simulated engine
  over the real :class:`~kvoffload.offloader.Offloader` (its docstring says what one
  request does);
- :mod:`~kvoffload.tools.stress_data`: the request stream a config selects and the
  blocks' deterministic contents that every load is verified against;
- :mod:`~kvoffload.tools.stress_report`: what a run measured (:class:`StressReport`,
  :class:`TierReport`, :class:`ReplicaSetReport`) and their ``--json`` documents;
- :mod:`~kvoffload.tools.stress_replicas`: :func:`run_replicas` (``--replicas N``), N
  runners in processes of their own sharing the config's server-booked tiers.
"""

from __future__ import annotations

from kvoffload.tools.stress_data import (
    DATA_SEED,
    BlockDataGenerator,
    kv_like,
    workload_from_config,
)
from kvoffload.tools.stress_replicas import (
    MAX_REPLICAS,
    REPLICA_MAX_LEAD,
    REPLICA_START_TIMEOUT_S,
    replica_config,
    run_replicas,
    shared_tiers,
)
from kvoffload.tools.stress_report import (
    REPLICAS_SCHEMA,
    REPORT_SCHEMA,
    RESOURCE_EVERY_S,
    ReplicaSetReport,
    Reservoir,
    StressReport,
    TierReport,
    percentile_ms,
    process_resources,
)
from kvoffload.tools.stress_runner import SAMPLE_EVERY_S, ProgressFn, StressRunner

__all__ = [
    "DATA_SEED",
    "MAX_REPLICAS",
    "REPLICAS_SCHEMA",
    "REPLICA_MAX_LEAD",
    "REPLICA_START_TIMEOUT_S",
    "REPORT_SCHEMA",
    "RESOURCE_EVERY_S",
    "SAMPLE_EVERY_S",
    "BlockDataGenerator",
    "ProgressFn",
    "ReplicaSetReport",
    "Reservoir",
    "StressReport",
    "StressRunner",
    "TierReport",
    "kv_like",
    "percentile_ms",
    "process_resources",
    "replica_config",
    "run_replicas",
    "shared_tiers",
    "workload_from_config",
]

"""The tools on top of the runtime: the ``kvoffload`` command and what it runs.

The CLI (:mod:`~kvoffload.tools.cli`), the stress run and its workloads, the maintenance
tools over persistent tiers, the benchmarks and the stress plot. A connector never
imports anything here; these modules sit above the whole runtime (the offloader
included) and nothing below imports them, so the top of :mod:`kvoffload` is exactly
what an engine integration uses. One exception, data only: :mod:`.stressconfig`, the
config's ``stress`` section, which :mod:`kvoffload.config` reads (layer 1 of the
import map).
"""

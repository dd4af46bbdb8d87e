"""The tests' helpers, in one place: test modules import from here, never from each
other. ``tests/`` is on ``sys.path`` (pytest puts a rootdir conftest's folder there),
so this is ``support``.

- ``checkout``: where the ``kvoffload`` command and the checkout's files are;
- ``ci_rules``: what ``CI=true`` forbids (a pytest plugin);
- ``blocks``: a small layout, keyed block contents and three real tiers;
- ``stress``: the small ``stress`` setting;
- ``redisserver``: real ``redis-server`` processes on loopback ports;
- ``tierproc``: child-process programs of the crash and shared-tier tests;
- ``engine_run``: real vLLM engines in a child process (a script);
- ``e2e``: the end-to-end tests' engine server and their connector configs;
- ``waiting``: hang guards (``wait_until``, ``returns``) and a tier held until released,
  so that no test asserts on elapsed time;
- ``smollm2``: the real model (SmolLM2-135M, bf16), built once from a dev dependency
  (also run by ``scripts/`` benchmarks: ``python tests/support/smollm2.py``).
"""

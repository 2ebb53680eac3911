# repro: every target prints what it runs. `make help` lists them.
PYTHON ?= .venv/bin/python
VENV_PYTHON ?= python3
SCALE ?= smoke
PYTEST_ARGS ?=
# Lanes of tests (pytest-xdist workers, tests/lanes.py): one pytest process leaves one of two cores idle on
# average (ranks and launchers wait on each other); tests sharing a daemon or a module's runs share a lane.
TEST_LANES ?= 2
LANES = -n $(TEST_LANES) --dist loadgroup
# `--editable` for a checkout you work in; the image installs a regular copy (EDITABLE=).
EDITABLE ?= --editable
# The image installs the runtime pins only; a checkout also gets the test and lint tools.
REQUIREMENTS ?= requirements.txt
# pip itself, pinned: the image and CI install with the same pip.
PIP_VERSION ?= 26.3
# Containers (docs/containers.md): image name and tag, the base pinned by digest, an optional CA bundle
# for pip behind TLS inspection (a build secret, never stored in the image), DeepSpeed's ops and the
# accelerator they are built for, GPU architectures, LBANN on or off, wikitext-2 from the Hub.
DOCKER ?= docker
IMAGE ?= repro
TAG ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo dev)
GIT_SHA ?= $(shell git rev-parse HEAD 2>/dev/null || echo unknown)
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
BASE_IMAGE ?= pytorch/pytorch:2.14.1-cuda13.0-cudnn9-devel
BASE_DIGEST ?=
CA_BUNDLE ?=
DEEPSPEED_OPS ?= cpu_adam fused_adam fused_lamb utils
DS_ACCELERATOR ?= cuda
TORCH_CUDA_ARCH_LIST ?= 8.0;9.0
WITH_LBANN ?= 1
STAGE_WIKITEXT ?= 0
IMAGE_BUILD = DOCKER_BUILDKIT=1 $(DOCKER) build \
	--build-arg BASE_IMAGE=$(BASE_IMAGE) --build-arg BASE_DIGEST=$(BASE_DIGEST) \
	$(if $(CA_BUNDLE),--secret id=ca$(,)src=$(CA_BUNDLE)) \
	--build-arg DEEPSPEED_OPS="$(DEEPSPEED_OPS)" --build-arg DS_ACCELERATOR=$(DS_ACCELERATOR) \
	--build-arg TORCH_CUDA_ARCH_LIST="$(TORCH_CUDA_ARCH_LIST)" \
	--build-arg WITH_LBANN=$(WITH_LBANN) --build-arg STAGE_WIKITEXT=$(STAGE_WIKITEXT) \
	--build-arg SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) \
	--build-arg REPRO_IMAGE=$(IMAGE):$(TAG) --build-arg REPRO_GIT_SHA=$(GIT_SHA) \
	--tag $(IMAGE):$(TAG) --tag $(IMAGE):latest
, := ,
# Compose: the v2 plugin (`docker compose`) where it exists, else docker-compose; GPUS=1 reserves the
# GPUs for the repro service (docker/compose.gpu.yml), COMPOSE_FILES adds others.
COMPOSE ?= $(shell $(DOCKER) compose version >/dev/null 2>&1 && echo "$(DOCKER) compose" || echo docker-compose)
GPUS ?= 0
COMPOSE_FILES ?= -f docker-compose.yml $(if $(filter 1,$(GPUS)),-f docker/compose.gpu.yml)
SIF ?= repro.sif
MLFLOW_PORT ?= 5000
MLFLOW_STORE ?= sqlite:///mlflow.db
EXPERIMENT ?= repro

.PHONY: test-deps test-image help setup ops lbann-python install install-requirements install-kit test test-fast test-ranks test-end-to-end test-services reproduce-table2 mlflow-ui data clean \
	image sif compose-up bench gpu-check

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup:  ## create .venv and install the kit with its pinned dependencies, and build DeepSpeed's CPU op
	$(VENV_PYTHON) -m venv .venv
	$(MAKE) install PYTHON=.venv/bin/python REQUIREMENTS=requirements-dev.txt
	$(MAKE) lbann-python
	$(MAKE) ops PYTHON=.venv/bin/python

ops:  ## build what a framework's first CPU run would build as it starts (DeepSpeed's shm op), once per environment
	$(PYTHON) -m repro.cli doctor --build-ops

lbann-python:  ## create .venv-lbann: LBANN 0.104's own Python (protobuf 4.21, numpy, protoc 3.21) for the LBANN front-end tests
	$(VENV_PYTHON) -m venv .venv-lbann
	.venv-lbann/bin/python -m pip install -r requirements-lbann.txt

install: install-requirements install-kit  ## install pinned requirements and the kit into $(PYTHON) (the image runs these same two steps)

# torch first: DeepSpeed's setup compiles the ops it is asked for (the image's DS_BUILD_*) against it.
install-requirements:  ## the pinned $(REQUIREMENTS) only (the image's dependency layer)
	$(PYTHON) -m pip install pip==$(PIP_VERSION)
	$(PYTHON) -m pip install $$(grep '^torch==' requirements.txt)
	$(PYTHON) -m pip install -r $(REQUIREMENTS)

install-kit:  ## the kit itself, without dependencies (the image's source layer)
	$(PYTHON) -m pip install --no-deps $(EDITABLE) .

data:  ## prepare the smoke datasets (digits is generated; wikitext-2 is read from a staged copy or fetched)
	$(PYTHON) -m repro.cli data prepare digits
	$(PYTHON) -m repro.cli data prepare wikitext-2

# The image test spends most of its time on downloads and disk (building the image), so it runs
# alongside the others, its output in IMAGE_TEST_LOG, shown when both are done.
IMAGE_TEST_LOG ?= .test-image.log
test: data test-deps  ## run every tier (the image test alongside the others; the slowest tests are listed)
	$(PYTHON) -m pytest -q -p no:cacheprovider --durations=10 tests/test_image.py $(PYTEST_ARGS) > $(IMAGE_TEST_LOG) 2>&1 & image=$$!; \
	trap 'kill $$image 2>/dev/null' INT TERM; \
	$(PYTHON) -m pytest -q $(LANES) --durations=25 --ignore=tests/test_image.py $(PYTEST_ARGS); others=$$?; \
	wait $$image; image=$$?; echo "--- tests/test_image.py (run alongside) ---"; cat $(IMAGE_TEST_LOG); \
	exit $$((others || image))

test-deps:  ## install the Debian packages the tests need (tests/debian-packages.txt) where missing, as root
	bash tests/test-deps.sh

test-image: data test-deps  ## only the image test (part of `make test`): build from a local Debian base, run it as users do (minutes)
	$(PYTHON) -m pytest -q tests/test_image.py $(PYTEST_ARGS)

# The tiers (tests/tiers.py), named by what their tests need; `make test` runs all four.
test-fast: data  ## the units tier: no process group, no training process (at most 2 minutes)
	$(PYTHON) -m pytest -q $(LANES) -m units $(PYTEST_ARGS)

test-ranks: data  ## the ranks tier: the real Trainer and adapters in gloo ranks forked by the tests
	$(PYTHON) -m pytest -q $(LANES) -m ranks $(PYTEST_ARGS)

test-end-to-end: data  ## the end-to-end tier: real `repro` runs per launcher path, faults and signals
	$(PYTHON) -m pytest -q $(LANES) -m end_to_end $(PYTEST_ARGS)

test-services: data test-deps  ## the services tier: Slurm, PostgreSQL + MLflow server, Chromium, Docker (the image test too)
	$(PYTHON) -m pytest -q $(LANES) -m services $(PYTEST_ARGS)

reproduce-table2: data  ## run the Table 2 matrix at SCALE (smoke by default) and write reports/
	$(PYTHON) -m repro.cli table2 --scale $(SCALE)

mlflow-ui:  ## browse the runs of MLFLOW_STORE (default: the embedded sqlite file); prints the runs view's address
	@$(PYTHON) -c 'from repro import tracking; print("runs view:", tracking.runs_view("$(MLFLOW_STORE)", "$(EXPERIMENT)", "http://127.0.0.1:$(MLFLOW_PORT)"))'
	$(PYTHON) -m mlflow ui --backend-store-uri $(MLFLOW_STORE) --host 127.0.0.1 --port $(MLFLOW_PORT)

image:  ## build $(IMAGE):$(TAG) from BASE_IMAGE@BASE_DIGEST, labelled with what it contains (docs/containers.md)
	@test -n "$(BASE_DIGEST)" || { echo "BASE_DIGEST is not set: pin the base image, e.g." \
		"make image BASE_DIGEST=\$$(docker buildx imagetools inspect --format '{{json .Manifest.Digest}}'" \
		"$(BASE_IMAGE) | tr -d '\"')"; exit 2; }
	$(IMAGE_BUILD) .
	$(IMAGE_BUILD) $$($(DOCKER) run --rm -i --entrypoint python $(IMAGE):$(TAG) - < docker/labels.py) .

sif:  ## build the Apptainer image $(SIF) from $(IMAGE):$(TAG) in the local Docker daemon
	apptainer build --build-arg FROM=$(IMAGE):$(TAG) $(SIF) apptainer.def

compose-up:  ## start PostgreSQL, the MLflow server (http://127.0.0.1:$(MLFLOW_PORT)) and a smoke run of the image
	COMPOSE_DOCKER_CLI_BUILD=1 DOCKER_BUILDKIT=1 REPRO_TAG=$(TAG) MLFLOW_PORT=$(MLFLOW_PORT) \
		$(COMPOSE) $(COMPOSE_FILES) up --build

clean:  ## remove runs, reports and the local MLflow store
	rm -rf runs reports mlflow.db mlruns

gpu-check:  ## on a GPU machine: every framework at the paper's sizes, a few dozen steps -> reports/gpu_check.json
	$(PYTHON) bench/gpu_check.py

bench: data  ## measure the kit's own costs (harness overhead, verify speed, smoke matrix time) -> reports/bench.json
	$(PYTHON) bench/run.py

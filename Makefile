# repro: every target prints what it runs. `make help` lists them.
PYTHON ?= .venv/bin/python
VENV_PYTHON ?= python3
SCALE ?= smoke
PYTEST_ARGS ?=

.PHONY: help setup install test test-fast reproduce-table2 mlflow-ui data clean

help:  ## list targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/'

setup:  ## create .venv and install the kit with its pinned dependencies
	$(VENV_PYTHON) -m venv .venv
	$(MAKE) install PYTHON=.venv/bin/python

install:  ## install pinned requirements and the kit into $(PYTHON) (the image runs this same target)
	$(PYTHON) -m pip install --upgrade pip
	$(PYTHON) -m pip install -r requirements.txt
	$(PYTHON) -m pip install --no-deps -e .

data:  ## prepare the smoke datasets (digits is generated; wikitext-2 is read from a staged copy or fetched)
	$(PYTHON) -m repro.cli data prepare digits
	$(PYTHON) -m repro.cli data prepare wikitext-2

test: data  ## run the test suite
	$(PYTHON) -m pytest -q $(PYTEST_ARGS)

test-fast:  ## unit tests only (no multi-process training)
	$(PYTHON) -m pytest -q -m "not slow" $(PYTEST_ARGS)

reproduce-table2: data  ## run the Table 2 matrix at SCALE (smoke by default) and write reports/
	$(PYTHON) -m repro.cli table2 --scale $(SCALE)

mlflow-ui:  ## browse every run (embedded sqlite store) on http://127.0.0.1:5000
	$(PYTHON) -m mlflow ui --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port 5000

clean:  ## remove runs, reports and the local MLflow store
	rm -rf runs reports mlflow.db mlruns

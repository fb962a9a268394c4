# pgherd: every set-up step lives here, so that a fresh clone needs nothing else.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup setup-kube test lint typecheck unit demo crds bench-backup bench-failover clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)
	bash scripts/ensure-postgres.sh
	bash scripts/ensure-helm.sh

## make setup-kube: what the localkube e2e driver needs (as root): the node's Debian packages and the
## Kubernetes commands built from their Go modules (about 15 minutes the first time, then nothing), and
## promtool and prometheus built from Prometheus' Go module (about 3 minutes the first time).
setup-kube: setup
	bash scripts/ensure-localkube.sh
	bash scripts/ensure-prometheus.sh >/dev/null

lint: $(STAMP)
	$(BIN)/ruff check operator backup tests e2e bench scripts
	$(BIN)/ruff format --check operator backup tests e2e bench scripts

typecheck: $(STAMP)
	$(BIN)/mypy

## make test: set up everything, then ruff, mypy and the whole pytest suite (the e2e scenarios on the
## sandbox, the `local` driver), then the e2e scenarios again on a real single-node Kubernetes on this
## machine, the chart's operator included (the `localkube` driver: python -m e2e.localkube, docs/e2e.md).
test: setup setup-kube lint typecheck
	# The engine's property search in an interpreter of its own: its derandomized search reaches the
	# same sequences only from a fresh process (after the rest of the suite it explored others).
	$(BIN)/pytest tests/engine/test_properties.py
	PATH="$(CURDIR)/.tools/bin:$(CURDIR)/$(BIN):$$PATH" $(BIN)/pytest --ignore=tests/engine/test_properties.py
	PATH="$(CURDIR)/.tools/bin:$(CURDIR)/$(BIN):$$PATH" PGHERD_E2E_DRIVER=localkube $(BIN)/pytest e2e

## make demo: the sandbox tour on real PostgreSQL processes (no Kubernetes needed).
demo: setup
	$(BIN)/pgherd sandbox demo --dir .sandbox-demo

## make crds: regenerate crds/ and the chart's copy from the API models.
crds: $(STAMP)
	$(BIN)/pgherd crds --out crds --chart charts/pgherd/crds

## Benchmarks (run by hand; they print ratios against references measured in the same run).
bench-backup: setup
	$(BIN)/python bench/backup_bench.py

bench-failover: setup
	$(BIN)/python bench/failover_bench.py

clean:
	rm -rf $(VENV) .tools .sandbox .sandbox-demo .mypy_cache .ruff_cache .pytest_cache .hypothesis

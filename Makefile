# raykv: the two README commands. Each bootstraps what it needs on a fresh machine.
#   make demo   - a local multi-node Ray, the service, a real tiny Llama workload, a table + PNG
#   make test   - lint + the unit, actor and cluster test tiers (with a private redis-server)

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raykv-installed
# The CPU build of torch lies on this kind of machine; a bare `torch` would pull GBs of CUDA.
# On a GPU machine: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test lint unit actors cluster bench system-deps clean help

help:
	@echo "make demo   - run the demo (bootstraps .venv)"
	@echo "make test   - ruff + all test tiers (bootstraps .venv and redis-server)"
	@echo "make bench  - run every benchmark, JSON under out/bench/"

system-deps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v fio >/dev/null || missing="$$missing fio"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

demo: system-deps $(STAMP)
	$(VENV)/bin/raykv demo

test: system-deps $(STAMP) lint
	$(PY) -m cluster.tools.redis_server -- $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

bench: system-deps $(STAMP)
	mkdir -p out/bench
	for name in hashing tiers directory remote tax; do \
	  $(VENV)/bin/raykv bench $$name --json out/bench/$$name.json || exit 1; done

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache *.egg-info

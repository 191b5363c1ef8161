# Set-up lives here so that the two README commands work on a fresh machine.
# TORCH pins the CPU wheel; on a CUDA host run e.g. `make TORCH=torch==2.13.0+cu130 test`
# or install torch yourself first (any torch>=2.4 that is already present is kept).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed
# The SGLang peer of `bench tree` and `bench storage` (--peer-python $(PEER_VENV)/bin/python).
PEER_VENV ?= .peer-venv
PEER_STAMP := $(PEER_VENV)/.kvtier-peer-installed

.PHONY: setup demo test test-fast lint format bench clean peer-venv peer-file

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[server,dev,mooncake,encryption,events,route]"
	sh scripts/install_system_deps.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo

# Every test, spread over the machine's cores (pytest-xdist; tests share no port, dir or global).
test: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal tests

# The inner loop: everything not marked slow.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n auto --dist worksteal -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/kvtier bench tree && $(BIN)/kvtier bench transfer && $(BIN)/kvtier bench storage

$(PEER_STAMP): scripts/peer_venv.sh scripts/peer_venv/requirements.txt scripts/peer_venv/torchvision_stub.py
	PYTHON=$(PYTHON) TORCH="$(TORCH)" sh scripts/peer_venv.sh $(PEER_VENV)
	touch $(PEER_STAMP)

peer-venv: $(PEER_STAMP)

# HiCacheFile's modules alone, for a host without network (--peer-python .peer-file/python).
peer-file: $(PEER_STAMP) $(STAMP)
	sh scripts/peer_file_only.sh .peer-file $(PEER_VENV)/bin/python

clean:
	rm -rf $(VENV) $(PEER_VENV) .peer-file kvtier-data build *.egg-info

# Set-up lives here so that the two README commands work on a fresh machine.
# TORCH pins the CPU wheel; on a CUDA host run e.g. `make TORCH=torch==2.13.0+cu130 test`
# or install torch yourself first (any torch>=2.4 that is already present is kept).
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvtier-installed

.PHONY: setup demo test lint format bench clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[server,dev,mooncake]"
	sh scripts/install_system_deps.sh
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/kvtier demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/kvtier bench tree && $(BIN)/kvtier bench transfer && $(BIN)/kvtier bench storage

clean:
	rm -rf $(VENV) kvtier-data build *.egg-info

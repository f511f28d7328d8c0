# Two commands on a fresh machine: `make train` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
MODEL ?= gpt
CONFIG ?= configs/$(MODEL)_tiny.yaml
# Restarts after a dead rank resume from the latest checkpoint (training/launcher.py).
MAX_RESTARTS ?= 0

.PHONY: venv train test lint bench clean

venv: $(STAMP)

# torch goes first and alone, pinned exactly: any range would fetch a CUDA build.
$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# The config and its layout on NPROC ranks are checked before torchrun starts, so a mistake
# costs one line, not a traceback per rank. training.launcher is torchrun ending with one line:
# Ctrl-C or SIGTERM saves a checkpoint first (training/signals.py).
train: venv
	$(BIN)/python -m training.config --family $(MODEL) --world-size $(NPROC) $(CONFIG) $(ARGS) > /dev/null
	OMP_NUM_THREADS=1 $(BIN)/python -m training.launcher --standalone --nproc_per_node $(NPROC) --max-restarts $(MAX_RESTARTS) pretrain_$(MODEL).py --config $(CONFIG) $(ARGS)

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf runs .cache

# Two commands on a fresh machine: `make train` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NPROC ?= 2
MODEL ?= gpt
CONFIG ?= configs/$(MODEL)_tiny.yaml

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
# costs one line, not a traceback per rank.
train: venv
	$(BIN)/python -m training.config --family $(MODEL) --world-size $(NPROC) $(CONFIG) $(ARGS) > /dev/null
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc_per_node $(NPROC) pretrain_$(MODEL).py --config $(CONFIG) $(ARGS)

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf runs .cache

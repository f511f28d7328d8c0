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
# pytest-xdist workers for make test. Whole files go to one worker (--dist loadfile): a
# module's shared runs (module-scoped fixtures) are built once, not once per worker.
TEST_WORKERS ?= 2

.PHONY: venv train test lint clean

venv: $(STAMP)

# torch goes first and alone, pinned exactly: any range would fetch a CUDA build. pyproject.toml
# lists the packages the editable install maps: a new one needs the install again.
$(STAMP): requirements.txt pyproject.toml
	@echo "fp8train: creating $(VENV) (once; about a minute or two)"
	$(PYTHON) -m venv $(VENV)
	@echo "fp8train: [1/3] torch==2.13.0"
	$(BIN)/pip install -q torch==2.13.0
	@echo "fp8train: [2/3] requirements.txt (megatron-core, sentencepiece, tensorboard, transformers, ...)"
	$(BIN)/pip install -q -r requirements.txt
	@# triton only where torch brought none (a CUDA torch pins its own; requirements.txt).
	$(BIN)/python -c "import triton" 2>/dev/null || $(BIN)/pip install -q triton==3.9.0
	@echo "fp8train: [3/3] this project (editable)"
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)
	@echo "fp8train: $(VENV) ready"

# training.launcher is torchrun ending with one line. Before it starts a worker it checks the
# config for NPROC ranks (layout, batch split, directories, data, tokenizer, the checkpoint to
# resume: training/preflight.py), so a mistake costs one line, not a traceback per rank;
# Ctrl-C or SIGTERM saves a checkpoint first (training/signals.py).
train: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m training.launcher --standalone --nproc_per_node $(NPROC) --max-restarts $(MAX_RESTARTS) pretrain_$(MODEL).py --config $(CONFIG) $(ARGS)

# --durations=25: the slowest tests close the log, so growth is visible in CI. One process left
# half of two cores idle (ranks start, import, wait on each other): two workers overlap that.
test: venv
	@echo "fp8train: running the test suite ($(TEST_WORKERS) workers; about 8-9 minutes on 2 CPU cores; a dot per test)"
	$(BIN)/python -m pytest -q tests -n $(TEST_WORKERS) --dist loadfile --durations=25

lint: venv
	$(BIN)/ruff check .

clean:
	rm -rf runs .cache

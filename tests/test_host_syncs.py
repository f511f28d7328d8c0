"""Host synchronisations per training step, counted at every level (a guard for CUDA speed).

A value read from a device tensor (``.item()``, ``float(t)``, ``.tolist()``) makes the host
wait for the device: every such read in the step drains the queue of launched kernels. The
step makes three, each one scalar: the clip decision (is the global norm finite?), the norm
that decides whether the step is skipped, and the step's losses for the log. This test counts
them (``aten._local_scalar_dense``, what every such read dispatches to) in one step of the tiny
GPT on CPU, where the same code runs, so that a read added inside a layer, a scaling update or
the optimizer shows up here rather than as a slow step on a GPU. Reads of torch.optim's own
step counters are not counted: torch keeps them on the host unless ``capturable``/``fused``.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from conftest import REPO, tiny_overrides
from torch.utils._python_dispatch import TorchDispatchMode

from data.sampler import micro_batches
from training.config import load_config
from training.setup import build_run
from training.step import train_step

ALLOWED = 3


def _ours(filename: str) -> bool:
    """A frame of the project's own code (not its venv, not this test)."""
    inside = filename.startswith(str(REPO))
    return inside and "/.venv/" not in filename and "/tests/" not in filename


class _CountReads(TorchDispatchMode):
    """Counts device-to-host scalar reads by the innermost project frame that made them."""

    def __init__(self):
        super().__init__()
        self.where = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = traceback.extract_stack()
            if not any("torch/optim/" in f.filename for f in stack):
                ours = [f for f in stack if _ours(f.filename)]
                frame = ours[-1] if ours else stack[-2]
                self.where[f"{frame.filename.removeprefix(str(REPO))}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("level", ["fp32", "bf16", "fp16", "te", "O1", "O2", "O3"])
def test_one_step_reads_at_most_three_values(tiny_data, tmp_path, level):
    overrides = tiny_overrides(tiny_data, tmp_path, level)
    cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
    state = build_run(cfg)
    n_micro = state.plan.micro_batches
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
    train_step(state, data, n_micro)  # the first step sets up state (moments, amax histories)
    with _CountReads() as reads:
        train_step(state, data, n_micro)
    assert sum(reads.where.values()) <= ALLOWED, dict(reads.where)

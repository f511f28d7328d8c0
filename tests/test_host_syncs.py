"""Host synchronisations per training step, counted at every level (a guard for CUDA speed).

A value read from a device tensor (``.item()``, ``float(t)``, ``.tolist()``) makes the host
wait for the device: every such read in the step drains the queue of launched kernels, and a
step with one cannot be captured as a CUDA graph. A step reads nothing at any level on the
optimizers a CUDA run builds: LowBitAdamW (O1-O3) and torch's fused AdamW (fp32, bf16, fp16,
te) skip a step with non-finite gradients under a device ``found_inf``. One path still reads
one value, listed in ``CPU_ADAMW`` by the function that makes it:

- ``training/optimizer.py`` ``TrainOptimizer.step`` with torch's foreach AdamW, what the CPU
  builds at fp32/bf16/fp16/te (the fused CPU kernel rounds a few elements differently from
  the results the CPU figures were made with): whether to skip, a value in host memory there,
  so the read waits for nothing. The ``fused`` cases run those levels with the fused AdamW
  a CUDA run gets, on the CPU, and read nothing.

Everything else stays on the device: the loss scale (fp8train/loss_scaler.py, updated from a
device ``found_inf``), the unscaling, the clipping (training/optimizer.py ``clip_grad_norm``
multiplies by a coefficient chosen on the device, 1 for a non-finite norm), the norm, the skip
and the first non-finite gradient (``StepStats``), the count of skipped steps
(training/step.py ``SkipCounter``), and the step's losses, which the loop reads only when it
logs or saves (training/loop.py). This test counts the reads (``aten._local_scalar_dense``,
what every one of them dispatches to) in one step of the tiny GPT on CPU, where the same code
runs, so that a read added inside a layer, a scaling update or the optimizer shows up here
rather than as a slow step on a GPU. Reads of torch.optim's own step counters are not counted:
torch keeps them on the host unless ``capturable``/``fused``.
"""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
from conftest import REPO, tiny_overrides
from torch.utils._python_dispatch import TorchDispatchMode

import training.optimizer
from data.sampler import micro_batches
from training.config import load_config
from training.loop import _Run
from training.setup import build_run
from training.step import train_step

# (file, function) -> reads per step it may make (why: the module docstring).
ALLOWED: dict = {}
CPU_ADAMW = {("training/optimizer.py", "step"): 1}  # torch's foreach AdamW: the CPU's
TORCH_ADAMW = ["fp32", "bf16", "fp16", "te"]
LEVELS = [*TORCH_ADAMW, "O1", "O2", "O3"]
CASES = [(level, False) for level in LEVELS] + [(level, True) for level in TORCH_ADAMW]


def _allowed(level: str, fused: bool) -> dict:
    return CPU_ADAMW if level in TORCH_ADAMW and not fused else ALLOWED


def _build(cfg, monkeypatch, fused: bool):
    """The run of ``cfg``; ``fused``: with the fused AdamW a CUDA run builds, on the CPU."""
    if fused:
        monkeypatch.setattr(training.optimizer, "_fused_adamw", lambda params: True)
    state = build_run(cfg)
    assert state.optimizer.skips_on_device == (fused or state.optimizer.low_bit)
    return state


def _ours(filename: str) -> bool:
    """A frame of the project's own code (not its venv, not this test)."""
    inside = filename.startswith(str(REPO))
    return inside and "/.venv/" not in filename and "/tests/" not in filename


class _CountReads(TorchDispatchMode):
    """Counts device-to-host reads by the innermost project frame that made them: scalar
    reads, and ``Tensor.tolist`` (which reads a CPU tensor's memory without dispatching any
    op, so it is counted by a wrapper while the mode is on)."""

    def __init__(self):
        super().__init__()
        self.where = Counter()

    def _count(self) -> None:
        stack = traceback.extract_stack()[:-2]  # not this method, nor its caller here
        if not any("torch/optim/" in f.filename for f in stack):
            ours = [f for f in stack if _ours(f.filename)]
            frame = ours[-1] if ours else stack[-1]
            path = frame.filename.removeprefix(str(REPO)).lstrip("/")
            self.where[path, frame.name] += 1

    def __enter__(self):
        tolist, count = torch.Tensor.tolist, self._count

        def counted_tolist(tensor):
            count()
            return tolist(tensor)

        self._tolist, torch.Tensor.tolist = tolist, counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self._count()
        return func(*args, **(kwargs or {}))


def _beyond_allowed(where: Counter, allowed: dict) -> dict:
    return {k: n for k, n in where.items() if n > allowed.get(k, 0)}


@pytest.mark.parametrize(("level", "fused"), CASES, ids=[f"{lv}{'-fused' * f}" for lv, f in CASES])
def test_one_step_reads_only_the_allowed_values(tiny_data, tmp_path, monkeypatch, level, fused):
    overrides = tiny_overrides(tiny_data, tmp_path, level)
    cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
    state = _build(cfg, monkeypatch, fused)
    n_micro = state.plan.micro_batches
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
    train_step(state, data, n_micro)  # the first step sets up state (moments, amax histories)
    with _CountReads() as reads:
        train_step(state, data, n_micro)
    assert not _beyond_allowed(reads.where, _allowed(level, fused)), dict(reads.where)


@pytest.mark.parametrize(("level", "fused"), [("fp16", True), ("fp16", False), ("O2", False)])
def test_the_loop_reads_losses_only_when_it_logs(tiny_data, tmp_path, monkeypatch, level, fused):
    """A loop iteration that neither logs nor saves reads no more than the step's allowed
    values; the logging one reads the interval's losses and the skip counts, all in one read,
    and logs the same means as reading each step would (and the last step's norm)."""
    overrides = tiny_overrides(
        tiny_data, tmp_path, level, **{"logging.interval": 3, "training.eval_iters": 0,
                                       "checkpoint.save_interval": 0, "logging.tensorboard": False}
    )  # fmt: skip
    cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
    run = _Run(_build(cfg, monkeypatch, fused))
    try:
        steps = [run.step()]  # the first step sets up state
        run.log_if_due(steps[-1])
        with _CountReads() as reads:
            steps.append(run.step())
            run.log_if_due(steps[-1])
        assert not _beyond_allowed(reads.where, _allowed(level, fused)), dict(reads.where)
        assert run.unread, "the step's losses were read before the log needed them"
        steps.append(run.step())
        with _CountReads() as reads:
            run.log_if_due(steps[-1])  # iteration 3: the interval's line
        assert reads.where[("training/loop.py", "_read_losses")] == 1, dict(reads.where)
        assert not run.unread
        mean = sum(s.loss for s in steps) / 3
        assert run.last["lm loss"] == mean
        assert run.last["grad-norm"] == steps[-1].grad_norm > 0
        assert run.last["skipped-iterations"] == sum(s.skipped for s in steps) == 0
    finally:
        run.close()

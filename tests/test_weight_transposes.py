"""``precision.keep_weight_transposes``: the FP8 weights' transposes kept for a step of several
micro-batches (``Linear.keep_weight_cast``, set by training/forward_backward.py) or copied per
backward, through the real training step."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, tiny_overrides

from data.sampler import micro_batches
from fp8train.linear import Linear
from training.config import load_config
from training.setup import build_run
from training.step import train_step


def steps_with_and_without_kept_casts(tiny_data, tmp_path, level: str, extra, kept_part):
    """Three steps of two micro-batches of the real training step with
    ``precision.keep_weight_transposes`` on and off (``extra``: more overrides), asserting
    that every loss and weight is bitwise the same, that off keeps nothing, and that on, the
    second micro-batch of each step reads what the first kept: ``kept_part(cast)`` of each
    FP8 linear's ``_weight_cast`` after its forward (None where nothing is kept)."""
    results = {}
    for keep in (True, False):
        overrides = tiny_overrides(tiny_data, tmp_path / str(keep), level) + list(extra)
        overrides += [f"precision.keep_weight_transposes={str(keep).lower()}"]
        cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
        state = build_run(cfg)
        assert state.plan.micro_batches == 2
        linears = [m for m in state.model.modules() if isinstance(m, Linear) and m.fp8]
        kept = []  # per forward of an FP8 linear: what it kept after it, or None

        def record(module, args, out, kept=kept):
            cast = module._weight_cast
            kept.append(None if cast is None else kept_part(cast))

        hooks = [m.register_forward_hook(record) for m in linears]
        data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
        losses = [train_step(state, data, 2).loss for _ in range(3)]
        for h in hooks:
            h.remove()
        assert len(kept) == 3 * 2 * len(linears) and all(m._weight_cast is None for m in linears)
        results[keep] = losses, kept, state.model.state_dict()
    (losses_on, kept_on, weights_on), (losses_off, kept_off, weights_off) = results.values()
    assert losses_on == losses_off
    for name, value in weights_on.items():
        assert torch.equal(value, weights_off[name]), name
    assert all(t is None for t in kept_off)
    n = len(kept_on) // 6
    for step in range(3):  # the second micro-batch reads what the first kept
        first = kept_on[2 * step * n : (2 * step + 1) * n]
        second = kept_on[(2 * step + 1) * n : (2 * step + 2) * n]
        assert all(a is not None and a is b for a, b in zip(first, second)), step


@pytest.mark.parametrize("level", ["te", "O3"])
def test_keep_weight_transposes_off_keeps_none_and_changes_no_bit(tiny_data, tmp_path, level):
    """``precision.keep_weight_transposes``: on, a step of two micro-batches keeps each FP8
    weight's transpose from the first micro-batch (the second reads the same tensor); off,
    no transpose outlives a forward and every loss and weight is bitwise the same (the same
    GEMMs on the same bytes). Three steps, so the FP8 scales move between them."""
    steps_with_and_without_kept_casts(
        tiny_data, tmp_path, level, ["precision.fp8_gemm_backend=scaled_mm"], lambda c: c[2]
    )

"""tools/grad_fidelity.py: a level's gradients against FP32's at a checkpoint. A tiny GPT is
trained 3 steps at O3 with block scales (one process) and saved; the tool then loads it at
FP32 and at other levels and compares their gradients on the same micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, tiny_overrides

from tools.grad_fidelity import compare, level_gradients, main

CONFIG = str(REPO / "configs/gpt_tiny.yaml")


@pytest.fixture(scope="module")
def checkpoint(tiny_data, tmp_path_factory):
    from training.config import load_config
    from training.loop import pretrain

    run = tmp_path_factory.mktemp("o3_block")
    overrides = tiny_overrides(
        tiny_data, run, "O3", **{"training.train_iters": 3, "checkpoint.save_interval": 3}
    )
    overrides += [
        f"checkpoint.dir={run / 'ckpt'}",
        "precision.fp8_granularity=block",
        "precision.fp8_recipe=current",
    ]
    pretrain(load_config(CONFIG, overrides))
    # The tool's own overrides: the run's data and model, not its level or directories.
    return run / "ckpt", [o for o in overrides if o.startswith(("data.", "model.", "training."))]


def test_compare_matches_the_definitions():
    ref = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0, 1.0])}
    other = {"a": torch.tensor([3.0, 5.0]), "b": torch.tensor([0.0, 2.0])}
    out = compare(ref, other)
    assert out["a"] == pytest.approx((1 / 5, (9 + 20) / (5 * 34**0.5), 34**0.5 / 5))
    assert out["b"] == pytest.approx((1.0, 1.0, 2.0))
    # (all): the vectors concatenated, [3, 4, 0, 1] against [3, 5, 0, 2]
    assert out["(all)"] == pytest.approx(
        (2**0.5 / 26**0.5, 31 / (26**0.5 * 38**0.5), (38 / 26) ** 0.5)
    )


def test_fp32_against_itself_is_exact_and_fp8_levels_are_close(checkpoint):
    ckpt, overrides = checkpoint
    ref_losses, ref = level_gradients("fp32", CONFIG, str(ckpt), overrides, 2, "gpt")
    # The same level twice: the same operations in the same order on the same shapes and the
    # same batches, so bit for bit (also shows the batches are the run's next, not random).
    again_losses, again = level_gradients("fp32", CONFIG, str(ckpt), overrides, 2, "gpt")
    assert again_losses == ref_losses
    for r, a in zip(ref, again):
        assert r.keys() == a.keys() and all(torch.equal(r[k], a[k]) for k in r)
    # O3 at block: the checkpoint's FP8 weights are FP32-exact, so only the step's arithmetic
    # differs. Every cast rounds to within 2^-4 (E4M3) or 2^-3 (E5M2) of its value; a gradient
    # passes a few of them, so a relative error far below 1 and a cosine near 1.
    losses, grads = level_gradients("O3@block", CONFIG, str(ckpt), overrides, 2, "gpt")
    assert losses == pytest.approx(ref_losses, rel=1e-2)
    for r, g in zip(ref, grads):
        rel, cos, ratio = compare(r, g)["(all)"]
        assert 0 < rel < 0.25 and cos > 0.97 and 0.8 < ratio < 1.25


def test_command_line_prints_one_row_per_linear(checkpoint, capsys):
    ckpt, overrides = checkpoint
    assert (
        main([str(ckpt), "--config", CONFIG, "--levels", "te", "--batches", "1", *overrides]) == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| layers.")]
    assert len(rows) == 2 * 4  # 2 layers x (qkv, proj, fc1, fc2)
    assert "| (all) |" in out


def test_bad_checkpoint_is_one_error_line(tmp_path, capsys):
    assert main([str(tmp_path / "none"), "--config", CONFIG, "--levels", "te"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")

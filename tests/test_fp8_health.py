"""Overflow handling at the FP8 levels: an inf gradient skips the step, never reaches the
weights, and the FP8 scales recover on the next step. Also the audit command end to end."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from fp8train.convert import lower_linear_weights
from fp8train.linear import Linear
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe
from models.context import BuildContext
from models.gpt import GPTConfig, GPTModel
from training.optimizer import build_optimizer, clip_grad_norm

OPT = SimpleNamespace(
    type="adamw", lr=1e-3, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8
)


def _model(level):
    torch.manual_seed(0)
    config = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=2,
        seq_length=16,
        vocab_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config, BuildContext(get_recipe(level)))
    lower_linear_weights(model)
    return model, build_optimizer(model, get_recipe(level), OPT)


def _step(model, opt, tokens, blow_up=False):
    loss = model(tokens, labels=tokens).mean()
    if blow_up:
        loss = loss * torch.tensor(float("inf"))  # an overflow, as a too-large loss scale makes
    loss.backward()
    norm = clip_grad_norm(opt.grads(), 1.0, opt.grad_slots())
    finite = math.isfinite(float(norm))
    if finite:
        opt.step()
    opt.zero_grad()
    return finite


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_overflow_skips_step_and_scales_recover(level):
    model, opt = _model(level)
    tokens = torch.randint(0, 64, (2, 16))
    assert _step(model, opt, tokens)
    before = {k: v.clone() for k, v in model.state_dict().items() if "fp8_" not in k}
    assert not _step(model, opt, tokens, blow_up=True)  # skipped
    after = {k: v for k, v in model.state_dict().items() if "fp8_" not in k}
    for key, value in before.items():
        assert torch.equal(value, after[key]), key  # nothing reached the weights
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    assert any(int(m.fp8_grad_output.nonfinite) > 0 for m in layers)  # the inf was seen
    for _ in range(2):
        assert _step(model, opt, tokens)  # and training goes on
    for m in layers:
        for state in m.fp8_states().values():
            assert torch.isfinite(state.scale) and state.scale > 0
        assert torch.isfinite(m.weight.float()).all()
        assert torch.isfinite(m.weight_scale_inv)


def test_audit_command_passes_every_level(capsys):
    from tools.audit_precision import main

    overrides = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2"]
    assert main(["--config", "configs/gpt_tiny.yaml", "--levels", "all", *overrides]) == 0
    out = capsys.readouterr().out
    assert "MISMATCH" not in out
    # The acceptance bars for linear weights at one rank: O1 <= 11.1, O2 <= 6.1, O3 <= 7.1.
    for level, bar in (("O1", 11.1), ("O2", 6.1), ("O3", 7.1)):
        measured = float(re.search(rf"\| {level} \| ([0-9.]+) \|", out).group(1))
        assert bar - 0.1 <= measured <= bar, (level, measured)


def test_audit_command_rejects_bad_input(capsys):
    from tools.audit_precision import main

    assert main(["--levels", "O9"]) == 2
    assert "O9" in capsys.readouterr().err


def _tracked_pass(layer: Linear, x: torch.Tensor) -> dict[str, float]:
    layer.track_health = True
    layer(x).sum().backward()
    layer.track_health = False
    return layer.fp8_stats()


def test_saturation_counts_only_values_beyond_the_maximum():
    """Current scaling maps the amax onto the format's maximum, so nothing is clipped, though
    a few percent of a fresh weight round to the maximum (what the old count reported)."""
    torch.manual_seed(0)
    # The default (uniform) init: 3.6% of its values lie within 448/464 of the amax.
    layer = Linear(256, 256, recipe=get_recipe("te", scaling=ScalingRecipe(mode="current")))
    stats = _tracked_pass(layer, torch.randn(64, 256))
    assert stats["weight_saturated"] == 0.0 and stats["input_saturated"] == 0.0
    w = layer.weight.detach().float()
    at_max = (w * (448.0 / w.abs().max())).to(torch.float8_e4m3fn).float().abs() == 448.0
    assert at_max.float().mean() > 0.02  # what the old count reported as saturated


def test_saturation_counts_the_values_a_stale_scale_clips():
    """Delayed scaling after a 4x jump of the input: the values whose scaled magnitude lies
    beyond 464 (448 plus half of E4M3's spacing of 32 there; below that a value rounds to 448
    anyway), computed from the scale the layer used."""
    torch.manual_seed(0)
    layer = Linear(64, 32, recipe=get_recipe("te", scaling=ScalingRecipe(mode="delayed")))
    torch.nn.init.normal_(layer.weight, std=0.05)
    for _ in range(3):
        _tracked_pass(layer, torch.randn(128, 64))
    x = torch.randn(128, 64) * 4
    scale = layer.fp8_states()["input"].scale.clone()  # what this pass casts with
    stats = _tracked_pass(layer, x)
    expected = float(((x * scale).abs() > 464.0).float().mean())
    assert expected > 0.001
    assert stats["input_saturated"] == pytest.approx(expected, abs=1e-7)


def test_clip_threshold_is_where_rounding_stops():
    """Against ml_dtypes' own rounding (no saturation there): just below the threshold a value
    still rounds to the maximum, just above it rounds past it (NaN or inf in ml_dtypes)."""
    import ml_dtypes
    import numpy as np

    from fp8train.formats import E4M3, E5M2

    for fmt, ref in ((E4M3, ml_dtypes.float8_e4m3fn), (E5M2, ml_dtypes.float8_e5m2)):
        below = np.float32(fmt.clip_threshold * (1 - 2**-20)).astype(ref).astype(np.float32)
        above = np.float32(fmt.clip_threshold * (1 + 2**-20)).astype(ref).astype(np.float32)
        assert below == fmt.max, fmt
        assert not np.isfinite(above) or above > fmt.max, fmt

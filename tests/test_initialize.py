"""fp8train.initialize on a plain PyTorch model: conversion, training, audit and refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8train
from fp8train.low_precision import Fp8GradSlot
from fp8train.param_state import fp8_grad_slot


def _setup(seed=0, opt_cls=torch.optim.AdamW, **opt_kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = opt_cls(model.parameters(), lr=1e-2, **opt_kw)
    return model, optimizer


def _train(model, optimizer, steps=60):
    torch.manual_seed(1)
    x = torch.randn(256, 32)
    y = x[:, :1] * 2 + x[:, 1:2] ** 2
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("level", ["te", "O1", "O2", "O3"])
def test_converted_model_trains_like_the_fp32_one_and_audits_clean(level):
    reference = _train(*_setup())
    model, optimizer = fp8train.initialize(*_setup(), opt_level=level)
    assert not any(type(m) is nn.Linear for m in model.modules())
    losses = _train(model, optimizer)
    # FP8 GEMMs and low-bit states perturb the path, not the destination: the converted model
    # must fit the same data about as well (the FP32 run ends near 1e-2 from 7).
    assert losses[-1] < 0.1 * losses[0]
    assert losses[-1] < reference[-1] * 3 + 0.05
    rows = fp8train.audit_precision(model, optimizer, fp8train.get_recipe(level))
    assert all(r.ok for r in rows), fp8train.format_audit(rows, fp8train.get_recipe(level))


def test_o2_storage_and_grad_slots():
    model, optimizer = fp8train.initialize(*_setup(), opt_level="O2")
    first = model[0]
    assert first.weight.dtype == torch.float16
    slot = fp8_grad_slot(first.weight)
    assert isinstance(slot, Fp8GradSlot)
    assert first.weight.main_grad is slot  # Megatron's attribute, for outside code that reads it
    assert isinstance(optimizer, fp8train.LowBitAdamW)
    model(torch.randn(4, 32)).sum().backward()
    assert first.weight.grad is None and slot.has_data
    optimizer.zero_grad()
    assert not slot.has_data


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1), "SGD is not supported"),
        (lambda m: torch.optim.Adam(m.parameters(), weight_decay=0.1), "weight_decay"),
        (lambda m: torch.optim.AdamW(m.parameters(), amsgrad=True), "amsgrad"),
    ],
)
def test_unsupported_optimizers_are_refused(build, match):
    model, _ = _setup()
    with pytest.raises(TypeError, match=match):
        fp8train.initialize(model, build(model), opt_level="O2")


def test_unsupported_layers_and_levels_are_refused():
    attention = nn.Sequential(nn.MultiheadAttention(16, 2), nn.Linear(16, 4))
    with pytest.raises(TypeError, match="MultiheadAttention"):
        fp8train.initialize(attention, torch.optim.AdamW(attention.parameters()), "O2")
    no_linear = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(TypeError, match="no nn.Linear"):
        fp8train.initialize(no_linear, torch.optim.AdamW(no_linear.parameters()), "O1")
    model, optimizer = _setup()
    with pytest.raises(ValueError, match="opt_level='O4'"):
        fp8train.initialize(model, optimizer, "O4")

"""O3's FP16 master starts from the weight's initial value, not from its FP8 rounding.

An O3 weight is FP8 E4M3 (3 mantissa bits) with an FP16 master (10) that the optimizer steps.
A master made from the FP8 weight sits on E4M3's grid: an update smaller than half an E4M3
step (~6% of the element) moves the master but not the weight it rounds to, so early training
(warm-up, lr ~1e-4 against weights ~0.02) ran on a frozen model. A master made from the
initial FP32 value sits anywhere between grid points: each step flips the elements its update
carries across a rounding boundary, so the FP8 weight moves by the update on average.

References: torch.optim.AdamW in FP32 for the trajectory, ml_dtypes for the FP8 rounding and
numpy's float16 for the master's rounding.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from torch import nn

import fp8train
from fp8train.linear import Linear
from fp8train.optim import LowBitAdamW
from fp8train.param_state import scale_block_of, scale_inv_of, take_initial_master
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

GRANULARITIES = ("tensor", "block")


def _scaling(granularity: str) -> ScalingRecipe:
    grad = "e4m3" if granularity == "block" else "e5m2"  # the block recipe's gradients
    return ScalingRecipe(mode="current", granularity=granularity, grad_format=grad)


def _recipe(granularity: str):
    return get_recipe("O3", scaling=_scaling(granularity))


def _lowered(granularity: str, init: torch.Tensor) -> Linear:
    out_f, in_f = init.shape
    lin = Linear(in_f, out_f, bias=False, recipe=_recipe(granularity))
    with torch.no_grad():
        lin.weight.copy_(init)
    lin.lower_weight_precision()
    return lin


def _init(rows: int = 384, cols: int = 256, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * 0.02
    w[:128, :128] *= 8  # blocks of different magnitudes: block scales differ from the tensor's
    return w


def _scale_inv(p: torch.Tensor) -> torch.Tensor:
    """The FP8 weight's scale per element (its block's, or the tensor's)."""
    scale = scale_inv_of(p)
    block = scale_block_of(p)
    if block is None:
        return scale.expand(p.shape)
    scale = scale.repeat_interleave(block[0], 0)[: p.shape[0]]
    return scale.repeat_interleave(block[1], 1)[:, : p.shape[1]]


def _value(p: torch.Tensor) -> torch.Tensor:
    return p.float() * _scale_inv(p)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_lowering_leaves_the_fp16_rounding_of_the_initial_value(granularity):
    init = _init()
    lin = _lowered(granularity, init)
    data, scale_inv = take_initial_master(lin.weight)
    # numpy float16 of the value times the power-of-two scale: an independent rounding.
    scale = 1.0 / scale_inv.item()
    assert scale == 2.0 ** round(np.log2(scale))
    want = (init.numpy() * np.float32(scale)).astype(np.float16)
    assert np.array_equal(data.numpy().view(np.uint16), want.view(np.uint16))
    # The FP8 weight is the E4M3 rounding of that master (ml_dtypes, per element's scale).
    master = torch.from_numpy(want.astype(np.float32)) / scale
    q = (master / _scale_inv(lin.weight)).numpy().astype(ml_dtypes.float8_e4m3fn)
    assert torch.equal(lin.weight.float(), torch.from_numpy(q.astype(np.float32)))
    assert take_initial_master(lin.weight) is None  # taken once


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_the_master_starts_at_the_initial_value_and_the_weight_keeps_its_bits(granularity):
    """Fails with a master made from the FP8 weight: its error is E4M3's (up to 2**-4 of an
    element), not FP16's (2**-11)."""
    init = _init()
    lin = _lowered(granularity, init)
    before = lin.weight.detach().clone()
    low = dict(exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float16)
    opt = LowBitAdamW(lin.parameters(), lr=0.0, weight_decay=0.0, **low)
    lin(torch.randn(8, 256)).sum().backward()
    opt.step()
    state = opt.state[lin.weight]
    master = state["master"].float() * state["master_scale_inv"]
    rel = ((master - init).abs() / init.abs().clamp(min=1e-30)).max().item()
    assert rel <= 2.0**-11, rel
    # lr 0: the optimizer re-casts the FP8 weight from the master with its own cast; the
    # lowering wrote the same bytes (``weight == E4M3(master)`` from the start).
    assert torch.equal(lin.weight.view(torch.uint8), before.view(torch.uint8))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    for p in model.parameters():
        nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_small_updates_reach_the_fp8_weight(granularity):
    """Six AdamW steps at lr 1e-4 (an update of ~1e-4 per element per step, against an E4M3
    step of ~1e-3 at 0.02): the FP8 weight's mean movement follows FP32 AdamW's. With the
    master on E4M3's grid it reached 0.30 of it after two steps and 0.70 after six. Rounding a
    master that lies anywhere between grid points moves an element by a whole grid step with
    probability |update| / step, so the mean movement is unbiased; over 131k elements its
    sampling noise is far below the 5% allowed."""
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    moved = {}
    for level in ("fp32", "O3"):
        model = _mlp()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
        if level == "O3":
            model, opt = fp8train.initialize(
                model, opt, opt_level="O3",
                scaling=_scaling(granularity),
            )  # fmt: skip
        w0 = _value(model[0].weight) if level == "O3" else model[0].weight.detach().clone()
        for _ in range(6):
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        w = _value(model[0].weight) if level == "O3" else model[0].weight.detach()
        moved[level] = (w - w0).abs().mean().item()
    assert moved["O3"] == pytest.approx(moved["fp32"], rel=0.05), moved


def test_a_loaded_weight_drops_the_initial_master():
    """A load replaces the weight the initial master was the finer value of: the master is
    then made from the loaded FP8 weight (value for value)."""
    lin = _lowered("tensor", _init())
    other = _lowered("tensor", _init(seed=1))
    lin.load_state_dict(other.state_dict())
    assert take_initial_master(lin.weight) is None
    opt = LowBitAdamW(lin.parameters(), lr=0.0, weight_decay=0.0)
    lin(torch.randn(8, 256)).sum().backward()
    opt.step()
    state = opt.state[lin.weight]
    master = state["master"].float() * state["master_scale_inv"]
    assert torch.equal(master, _value(other.weight))


def test_the_initial_master_moves_with_the_weight():
    lin = _lowered("block", _init())
    lin.to("meta")
    data, scale_inv = take_initial_master(lin.weight)
    assert data.device.type == scale_inv.device.type == "meta"
    assert data.dtype == torch.float16

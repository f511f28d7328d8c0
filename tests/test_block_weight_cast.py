"""Row/block FP8 linears cast the weight once per step of several micro-batches
(``Linear.keep_weight_cast`` / ``reuse_weight_cast``, set by training/forward_backward.py):
the first micro-batch casts W and Wᵀ, the others read them, as the per-tensor path reads its
kept cast (``Linear.weight_fp8``). Every row/block scale is the weight's current one, so
sharing the cast changes no bit: the same operations run on the same bytes in the same order,
which is why the comparisons here are bitwise."""

from __future__ import annotations

import pytest
import torch
from test_hot_path_ops import _CountOps
from test_weight_transposes import steps_with_and_without_kept_casts

from fp8train.block_linear import weight_operands
from fp8train.linear import Linear
from fp8train.param_state import grad_value
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

BLOCK = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
ROW = ScalingRecipe(mode="current", granularity="row")
CASES = {"te@block": ("te", BLOCK), "O2@block": ("O2", BLOCK), "O3@block": ("O3", BLOCK),
         "te@row": ("te", ROW)}  # fmt: skip


def _linear(level: str, scaling: ScalingRecipe) -> Linear:
    torch.manual_seed(0)
    linear = Linear(256, 384, recipe=get_recipe(level, scaling=scaling))
    linear.lower_weight_precision()
    return linear


def _micro_batches(linear: Linear, xs, keep: bool, count_from: int | None = None):
    """Forward and backward of each x, the step's flags set as forward_backward sets them;
    returns the outputs, input gradients, the weight's gradient and (``count_from``) the
    ATen operations of the micro-batches from that one on."""
    counts, ys, dxs = _CountOps(), [], []
    for micro, x in enumerate(xs):
        linear.keep_weight_cast, linear.reuse_weight_cast = keep, micro > 0
        x = x.clone().requires_grad_(True)
        if micro == count_from:
            counts.__enter__()
        y = linear(x)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        ys.append(y.detach())
        dxs.append(x.grad)
    if count_from is not None:
        counts.__exit__(None, None, None)
    linear.release_weight_cast()
    return ys, dxs, grad_value(linear.weight), counts


@pytest.mark.parametrize("case", list(CASES))
def test_one_cast_per_step_changes_no_bit_and_drops_the_casts_operations(case):
    """Three micro-batches with the kept cast against each casting its own: every output,
    input gradient and the accumulated weight gradient bitwise equal; the later
    micro-batches run exactly the weight cast's operations fewer (counted alone)."""
    xs = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    level, scaling = CASES[case]
    kept = _micro_batches(_linear(level, scaling), xs, keep=True, count_from=1)
    fresh = _micro_batches(_linear(level, scaling), xs, keep=False, count_from=1)
    for a, b in zip(kept[0] + kept[1], fresh[0] + fresh[1]):
        assert torch.equal(a, b)
    assert torch.equal(kept[2], fresh[2])
    linear = _linear(level, scaling)
    with _CountOps() as cast:
        weight_operands(linear.weight, getattr(linear, "weight_scale_inv", None),
                        linear.scaling, False, False)  # fmt: skip
    assert cast.total > 0
    assert fresh[3].total - kept[3].total == 2 * cast.total, (fresh[3].ops, kept[3].ops)


def test_a_kept_cast_is_read_by_the_later_micro_batches_and_released():
    linear = _linear("te", BLOCK)
    x = torch.randn(8, 256)
    linear.keep_weight_cast = True
    linear(x)
    first = linear._weight_cast
    assert first is not None
    linear.reuse_weight_cast = True
    linear(x)
    assert linear._weight_cast is first
    linear.track_health = True  # a logging step's micro-batch measures a fresh cast
    linear(x)
    assert linear._weight_cast is first
    linear.release_weight_cast()
    assert linear._weight_cast is None
    linear.track_health = False
    linear.eval()  # evaluation keeps nothing
    linear.keep_weight_cast = True
    linear(x)
    assert linear._weight_cast is None


@pytest.mark.parametrize("level", ["te@block", "O3@block"])
def test_training_steps_equal_with_and_without_the_kept_cast(tiny_data, tmp_path, level):
    """The real step, two micro-batches, three steps (the weights and their scales move):
    ``precision.keep_weight_transposes`` on (one cast per step) and off (one per
    micro-batch) give bitwise the same losses and weights; on, the second micro-batch
    reads the first's operands."""
    base, _ = level.split("@")
    block = ["precision.fp8_granularity=block", "precision.fp8_recipe=current"]
    steps_with_and_without_kept_casts(tiny_data, tmp_path, base, block, lambda cast: cast)

"""The precision table as README.md writes it, and the recipes' runtime flags."""

import pytest
import torch

from fp8train.precision import LEVELS, get_recipe

# level: (GEMM, grad comm, weight, master, weight grad, Adam m, Adam v) from README.md.
TABLE = {
    "fp32": ("fp32", "fp32", "fp32", None, "fp32", "fp32", "fp32"),
    "bf16": ("bf16", "fp32", "bf16", "fp32", "fp32", "fp32", "fp32"),
    "fp16": ("fp16", "fp32", "fp32", None, "fp32", "fp32", "fp32"),
    "te": ("fp8", "fp32", "fp32", None, "fp32", "fp32", "fp32"),
    "O1": ("fp8", "fp8", "fp16", None, "fp8", "fp32", "fp32"),
    "O2": ("fp8", "fp8", "fp16", None, "fp8", "fp8", "fp16"),
    "O3": ("fp8", "fp8", "fp8", "fp16", "fp8", "fp8", "fp16"),
}


@pytest.mark.parametrize("level", list(TABLE))
def test_rows_match_the_design_table(level):
    r = get_recipe(level)
    got = (r.gemm, r.grad_comm, r.weight, r.master_weight, r.weight_grad, r.adam_m, r.adam_v)
    assert got == TABLE[level]


def test_runtime_flags():
    assert set(LEVELS) == set(TABLE)
    assert get_recipe("bf16").param_dtype == torch.bfloat16 and get_recipe("bf16").has_fp32_master
    assert get_recipe("fp16").autocast_dtype == torch.float16
    assert get_recipe("fp16").uses_loss_scaling and not get_recipe("te").uses_loss_scaling
    assert get_recipe("te").fp8_gemm and not get_recipe("bf16").fp8_gemm


def test_unknown_level_lists_the_known_ones():
    with pytest.raises(ValueError, match="fp32, bf16, fp16, te, O1, O2, O3"):
        get_recipe("fp9")

"""The precision table as README.md writes it, and the recipes' runtime flags."""

from dataclasses import replace

import pytest
import torch
from conftest import REPO

from fp8train.precision import LEVELS, get_recipe, resolve_param_dtype
from fp8train.scaling import ScalingRecipe
from training.config import load_config

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


def test_the_recipe_carries_its_scaling():
    """One object per layer: the level's row with the FP8 scaling it was asked for, the same
    row otherwise; a run's config fills it from its ``precision.fp8_*`` keys."""
    block = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
    row = get_recipe("O2", "bf16")
    assert row.scaling == ScalingRecipe()
    assert get_recipe("O2", "bf16", scaling=block) == replace(row, scaling=block)
    assert len({row, get_recipe("O2", "bf16", block)}) == 2  # frozen: hashable, grouped by
    cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), ["precision.fp8_recipe=current"])
    current = ScalingRecipe(mode="current")
    assert cfg.precision.recipe("bf16") == get_recipe(cfg.precision.level, "bf16", current)


def test_unknown_level_lists_the_known_ones():
    with pytest.raises(ValueError, match="fp32, bf16, fp16, te, O1, O2, O3"):
        get_recipe("fp9")


# precision.param_dtype=auto per level: (on the CPU, on CUDA). CUDA runs the FP8 levels on
# BF16 parameters and activations, as Transformer Engine does; the CPU keeps the table's FP32.
AUTO = {
    "fp32": ("fp32", "fp32"),
    "bf16": ("bf16", "bf16"),
    "fp16": ("fp32", "fp32"),
    "te": ("fp32", "bf16"),
    "O1": ("fp32", "bf16"),
    "O2": ("fp32", "bf16"),
    "O3": ("fp32", "bf16"),
}


@pytest.mark.parametrize("level", list(AUTO))
def test_auto_param_dtype_resolves_by_device(level):
    """The resolver's answers (a CUDA run is only named here: nothing runs on it). Every
    answer is a value that combines with the level, and the CPU's is the table's own row."""
    cpu, cuda = AUTO[level]
    assert resolve_param_dtype(level, "auto", "cpu") == cpu
    assert resolve_param_dtype(level, "auto", "cuda") == cuda
    assert resolve_param_dtype(level, "auto", "meta") == cpu  # only CUDA changes the answer
    assert get_recipe(level, cpu) == get_recipe(level)
    assert get_recipe(level, cuda).other_params == cuda


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_explicit_param_dtype_stays_on_every_device(device_type):
    assert resolve_param_dtype("te", "fp32", device_type) == "fp32"
    assert resolve_param_dtype("O2", "bf16", device_type) == "bf16"
    assert resolve_param_dtype("bf16", "bf16", device_type) == "bf16"
    for level, dtype in (("bf16", "fp32"), ("fp16", "bf16")):  # combinations that do not exist
        with pytest.raises(ValueError, match=f"precision.param_dtype={dtype} does not combine"):
            resolve_param_dtype(level, dtype, device_type)
    with pytest.raises(ValueError, match="precision.param_dtype='fp16': choose one of"):
        resolve_param_dtype("te", "fp16", device_type)
    with pytest.raises(ValueError, match="precision.level='fp9'"):
        resolve_param_dtype("fp9", "auto", device_type)

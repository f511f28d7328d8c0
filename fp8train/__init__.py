"""fp8train: FP8 beyond the GEMMs. Usable alone in any PyTorch script.

The ladder, bottom up: formats (FP8 dtypes, saturating casts) -> scaling (per-tensor scales,
delayed and current) -> tensor (Float8Tensor) -> gemm (scaled_mm or exact emulation) -> linear
(the FP8 linear with its three GEMMs) -> precision (the level table every layer reads).
"""

from __future__ import annotations

from fp8train.formats import E4M3, E5M2, FP8Format, cast_to_fp8
from fp8train.linear import Linear
from fp8train.loss_scaler import DynamicLossScaler
from fp8train.precision import LEVELS, NotImplementedLevelError, PrecisionRecipe, get_recipe
from fp8train.scaling import ScalingRecipe
from fp8train.tensor import Float8Tensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Format",
    "Float8Tensor",
    "LEVELS",
    "Linear",
    "DynamicLossScaler",
    "NotImplementedLevelError",
    "PrecisionRecipe",
    "ScalingRecipe",
    "cast_to_fp8",
    "get_recipe",
    "initialize",
]


def initialize(model, optimizer, opt_level: str = "O2"):
    """Convert a plain PyTorch model and optimizer to a precision level (MS-AMP style).

    Not built yet: it arrives with the O1-O3 levels. Until then, build models on
    ``fp8train.Linear`` with ``recipe=get_recipe("te")`` for FP8 GEMMs.
    """
    del model, optimizer
    raise NotImplementedLevelError(
        f"fp8train.initialize(opt_level={opt_level!r}) is not implemented yet; it comes with "
        "the O1-O3 levels. For FP8 GEMMs now, use fp8train.Linear(..., recipe=get_recipe('te'))"
    )

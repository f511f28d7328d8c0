"""fp8train: FP8 beyond the GEMMs. Usable alone in any PyTorch script:

    model, optimizer = fp8train.initialize(model, optimizer, opt_level="O2")

The ladder, bottom up: formats (FP8 dtypes, saturating casts) -> scaling (per-tensor scales,
delayed and current) -> precision (the level table every layer reads, each row with its
scaling recipe) -> tensor (Float8Tensor) -> gemm (scaled_mm or exact emulation) ->
gemm_backend (which GEMM runs: a pinned choice or the per-machine race) -> linear (the FP8
linear with its three GEMMs) -> low_precision (scaled FP16/FP8 storage, FP8 gradient slots) ->
optim (low-bit AdamW) -> initialize and audit.
"""

from __future__ import annotations

from fp8train.audit import audit_precision, format_audit
from fp8train.convert import lower_linear_weights
from fp8train.formats import E4M3, E5M2, FP8Format, cast_to_fp8
from fp8train.initialize import initialize
from fp8train.linear import Linear
from fp8train.loss_scaler import DynamicLossScaler
from fp8train.low_precision import Fp8GradSlot, ScaledTensor
from fp8train.optim import LowBitAdamW
from fp8train.precision import LEVELS, PrecisionRecipe, get_recipe
from fp8train.scaling import ScalingRecipe
from fp8train.tensor import Float8Tensor

__all__ = [
    "E4M3",
    "E5M2",
    "FP8Format",
    "Float8Tensor",
    "Fp8GradSlot",
    "LEVELS",
    "Linear",
    "LowBitAdamW",
    "DynamicLossScaler",
    "PrecisionRecipe",
    "ScaledTensor",
    "ScalingRecipe",
    "audit_precision",
    "cast_to_fp8",
    "format_audit",
    "get_recipe",
    "initialize",
    "lower_linear_weights",
]

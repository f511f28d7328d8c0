"""Model conversion: lower the linear weights of a model to its level's storage."""

from __future__ import annotations

import torch
from torch import nn

from .linear import Linear

__all__ = ["apply_level_storage", "lower_linear_weights"]


def lower_linear_weights(model: nn.Module) -> int:
    """Apply each fp8train ``Linear``'s recipe to its weight storage; returns how many changed.

    Call after initialisation and after moving to the device: O1/O2 weights become scaled FP16
    masters, O3 weights FP8, each with an FP8 gradient slot. Other levels are left alone.
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, Linear) and not module.lowered:
            module.lower_weight_precision()
            changed += int(module.lowered)
    return changed


def apply_level_storage(model: nn.Module, recipe) -> nn.Module:
    """Put an initialised, placed model into its level's storage: BF16 parameters at bf16
    (FP8 scaling buffers stay FP32, so parameters only), then the linear weights lowered."""
    if recipe.param_dtype != torch.float32:
        for p in model.parameters():
            p.data = p.data.to(recipe.param_dtype)
    lower_linear_weights(model)
    return model

"""Model conversion: lower the linear weights of a model to its level's storage."""

from __future__ import annotations

from torch import nn

from .linear import Linear

__all__ = ["lower_linear_weights"]


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

"""Model-state bytes per parameter, measured from the live tensors, by role and category.

Counted per rank: weights, gradients (``.grad``, the FP32 ``main_grad`` at bf16 or the FP8
gradient slot at O1-O3), master weights and optimizer states. A scaled weight's scales (one
per tensor, or one per 128x128 block for O3 at block granularity) count with the weight, an
FP8 gradient slot's scales and amaxes (per tensor, row or block) with the gradient. The
linear (GEMM) weights are reported apart from the rest (embeddings, norms, biases) because the
precision table governs only them; ``all`` is the whole model.
"""

from __future__ import annotations

import torch

from fp8train.linear import Linear
from fp8train.low_precision import Fp8GradSlot
from fp8train.param_state import grad_slot, scale_inv_of

__all__ = ["ROLES", "model_state_bytes"]

ROLES = ("weights", "grads", "master", "optimizer")


def _scale_bytes(grad) -> int:
    """An FP8 gradient slot's scales and amaxes (one each per tensor, row or block)."""
    if not isinstance(grad, Fp8GradSlot):
        return 0
    return grad.scale_inv.nbytes + grad.amax.nbytes


def model_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, dict[str, float]]:
    """``{category: {role: bytes per parameter, ..., "total": ..., "num-parameters": n}}``.

    Categories: "linear" (weights of fp8train Linear layers), "other", "all". Call it while
    gradients are alive (after backward, before they are zeroed) and after the first optimizer
    step (lazily created states exist), so every slot is measured rather than assumed.
    """
    linear_ids = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    sums = {c: dict.fromkeys((*ROLES, "n"), 0) for c in ("linear", "other", "all")}
    for index, p in enumerate(optimizer.model_params):
        grad = grad_slot(p)
        if grad is None:
            grad = p.grad
        master, states = optimizer.param_state_bytes(index)
        row = {
            "weights": p.nbytes + (0 if scale_inv_of(p) is None else scale_inv_of(p).nbytes),
            "grads": 0 if grad is None else grad.nbytes + _scale_bytes(grad),
            "master": master,
            "optimizer": states,
            "n": p.numel(),
        }
        for category in ("linear" if id(p) in linear_ids else "other", "all"):
            for key, value in row.items():
                sums[category][key] += value
    out = {}
    for category, s in sums.items():
        n = max(s["n"], 1)
        per = {role: s[role] / n for role in ROLES}
        per["total"] = sum(per.values())
        per["num-parameters"] = float(s["n"])
        out[category] = per
    return out

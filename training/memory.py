"""Model-state bytes per parameter, measured from the live tensors, by role.

Counted per rank: weights, gradients (``.grad`` or the FP32 ``main_grad``), master weights and
optimizer states. Embedding/norm/bias parameters are reported apart from linear weights because
the precision table only governs the GEMM weights.
"""

from __future__ import annotations

import torch

__all__ = ["model_state_bytes"]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def model_state_bytes(model: torch.nn.Module, optimizer) -> dict[str, float]:
    """Bytes per parameter by role plus the total, for this rank's share of the model.

    Call it while gradients are alive (after backward, before they are zeroed) so the gradient
    slot is measured rather than assumed.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    weights = sum(_nbytes(p) for p in params)
    grads = 0
    for p in params:
        grad = getattr(p, "main_grad", None)
        grads += _nbytes(grad if grad is not None else p.grad)
    extra = optimizer.bytes_by_role()
    total = weights + grads + extra["master"] + extra["optimizer"]
    return {
        "weights": weights / n,
        "grads": grads / n,
        "master": extra["master"] / n,
        "optimizer": extra["optimizer"] / n,
        "total": total / n,
        "num-parameters": float(n),
    }

"""The precision table: one frozen recipe per level, read by every layer, buffer and optimizer.

Rows are levels, fields are the tensor roles of the linear (GEMM) layers (the table in
README.md, "Precision levels"). Embeddings, norms and biases stay in higher precision at every
level (``other_params``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LEVELS", "PrecisionRecipe", "get_recipe"]


@dataclass(frozen=True)
class PrecisionRecipe:
    """Dtype of each tensor role of the linear layers at one precision level.

    Strings rather than dtypes so the table prints and compares as the design writes it.
    """

    level: str
    gemm: str  # "fp32" | "bf16" | "fp16" | "fp8"
    grad_comm: str  # dtype on the wire for data-parallel gradient reduction
    weight: str  # the weight the forward pass reads
    master_weight: str | None  # separate master copy owned by the optimizer, if any
    weight_grad: str
    adam_m: str
    adam_v: str
    other_params: str  # embeddings, norms, biases

    @property
    def fp8_gemm(self) -> bool:
        return self.gemm == "fp8"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype for torch.autocast around the forward (only the fp16 AMP level uses it)."""
        return torch.float16 if self.level == "fp16" else None

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype the model's parameters live in during forward/backward."""
        return torch.bfloat16 if self.level == "bf16" else torch.float32

    @property
    def adam_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(first moment, second moment) storage dtypes of the linear weights' Adam states."""
        return _STORAGE[self.adam_m], _STORAGE[self.adam_v]

    @property
    def uses_loss_scaling(self) -> bool:
        return self.level == "fp16" or self.weight == "fp16"

    @property
    def has_fp32_master(self) -> bool:
        return self.master_weight == "fp32"


_STORAGE = {"fp32": torch.float32, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def _row(level, gemm, comm, weight, master, wgrad, m, v, other):
    return PrecisionRecipe(level, gemm, comm, weight, master, wgrad, m, v, other)


LEVELS: dict[str, PrecisionRecipe] = {
    r.level: r
    for r in (
        _row("fp32", "fp32", "fp32", "fp32", None, "fp32", "fp32", "fp32", "fp32"),
        _row("bf16", "bf16", "fp32", "bf16", "fp32", "fp32", "fp32", "fp32", "bf16"),
        _row("fp16", "fp16", "fp32", "fp32", None, "fp32", "fp32", "fp32", "fp32"),
        _row("te", "fp8", "fp32", "fp32", None, "fp32", "fp32", "fp32", "fp32"),
        _row("O1", "fp8", "fp8", "fp16", None, "fp8", "fp32", "fp32", "fp32"),
        _row("O2", "fp8", "fp8", "fp16", None, "fp8", "fp8", "fp16", "fp32"),
        _row("O3", "fp8", "fp8", "fp8", "fp16", "fp8", "fp8", "fp16", "fp32"),
    )
}


def get_recipe(level: str) -> PrecisionRecipe:
    """The recipe of ``level``; unknown names fail with the list of known ones."""
    try:
        return LEVELS[level]
    except KeyError:
        raise ValueError(
            f"precision.level={level!r} is not a level; choose one of {', '.join(LEVELS)}"
        ) from None

"""The precision table: one frozen recipe per level, read by every layer, buffer and optimizer.

Rows are levels, fields are the tensor roles of the linear (GEMM) layers (the table in
README.md, "Precision levels"). Embeddings, norms and biases stay in higher precision at every
level (``other_params``). A recipe also carries how its FP8 scales are chosen (``scaling``), so
a layer takes one object, not two that must travel side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .scaling import ScalingRecipe

__all__ = [
    "LEVELS", "PARAM_DTYPES", "PrecisionRecipe", "get_recipe", "resolve_param_dtype", "split_level",
]  # fmt: skip


@dataclass(frozen=True)
class PrecisionRecipe:
    """Dtype of each tensor role of the linear layers at one precision level.

    Strings rather than dtypes so the table prints and compares as the design writes it.
    scaling: how the FP8 scales are chosen (read where ``fp8_gemm``); not a column of the
    table, so every row carries the default and ``get_recipe`` replaces it.
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
    scaling: ScalingRecipe = ScalingRecipe()  # frozen, so one shared default is safe

    @property
    def fp8_gemm(self) -> bool:
        return self.gemm == "fp8"

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Dtype for torch.autocast around the forward (only the fp16 AMP level uses it)."""
        return torch.float16 if self.level == "fp16" else None

    @property
    def param_dtype(self) -> torch.dtype:
        """Dtype of the parameters that are not in low-bit storage (embeddings, norms, biases;
        te's linear weights), and so of the activations between the GEMMs."""
        return torch.bfloat16 if self.other_params == "bf16" else torch.float32

    @property
    def adam_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """(first moment, second moment) storage dtypes of the linear weights' Adam states."""
        return _STORAGE[self.adam_m], _STORAGE[self.adam_v]

    @property
    def uses_loss_scaling(self) -> bool:
        return self.level == "fp16" or self.weight == "fp16"

    @property
    def has_fp32_master(self) -> bool:
        """BF16 parameters are stepped through FP32 master copies (the optimizer's)."""
        return self.other_params == "bf16"


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


# ``precision.param_dtype``: the level's own, or BF16 with FP32 masters for what the FP8 levels
# keep in higher precision (Transformer Engine's usual setup: a BF16 model whose GEMMs run in
# FP8), so the activations between the GEMMs are BF16 too. "auto" depends on the device a run
# takes (``resolve_param_dtype``); the table itself knows no device: here "auto" is the
# level's own.
PARAM_DTYPES = ("auto", "fp32", "bf16")
_FP8_LEVELS = ("te", "O1", "O2", "O3")


def split_level(spec: str) -> tuple[str, str]:
    """``"te:bf16"`` -> ``("te", "bf16")``, ``"te"`` -> ``("te", "auto")``: the short form the
    benchmark tools and tests take for ``precision.level`` plus ``precision.param_dtype``."""
    level, _, param_dtype = spec.partition(":")
    return level, param_dtype or "auto"


def get_recipe(
    level: str, param_dtype: str = "auto", scaling: ScalingRecipe | None = None
) -> PrecisionRecipe:
    """The recipe of ``level`` with its higher-precision parameters in ``param_dtype`` and its
    FP8 scales chosen by ``scaling`` (None: ``ScalingRecipe()``); unknown names and
    combinations fail naming the keys."""
    recipe = _level_row(level, param_dtype)
    return recipe if scaling is None else replace(recipe, scaling=scaling)


def _level_row(level: str, param_dtype: str) -> PrecisionRecipe:
    try:
        recipe = LEVELS[level]
    except KeyError:
        raise ValueError(
            f"precision.level={level!r} is not a level; choose one of {', '.join(LEVELS)}"
        ) from None
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(
            f"precision.param_dtype={param_dtype!r}: choose one of {', '.join(PARAM_DTYPES)}"
        )
    if param_dtype == "auto" or param_dtype == recipe.other_params:
        return recipe
    if param_dtype == "bf16" and level in _FP8_LEVELS:
        if recipe.weight == "fp32":  # te: the linear weights are BF16 with FP32 masters too
            return replace(recipe, weight="bf16", master_weight="fp32", other_params="bf16")
        return replace(recipe, other_params="bf16")  # O1-O3: low-bit weights stay as they are
    raise ValueError(
        f"precision.param_dtype={param_dtype} does not combine with precision.level={level} "
        f"(bf16 applies to {', '.join(_FP8_LEVELS)}; level bf16 is BF16 already)"
    )


def resolve_param_dtype(level: str, param_dtype: str, device_type: str) -> str:
    """What ``precision.param_dtype`` is for a run of ``level`` on a ``device_type`` device
    ("cuda", "cpu", ...): "fp32" or "bf16", never "auto". An explicit choice stays. "auto" is
    BF16 on CUDA at te and O1-O3: BF16 activations between the FP8 GEMMs, as Transformer
    Engine and FP8-LM run (in FP32 the attention and the head took about 160 ms of a 607 ms
    te step of GPT-1.3B on an H200). Everywhere else it is the level's own: the CPU keeps
    FP32 as its exact reference."""
    recipe = get_recipe(level, param_dtype)  # unknown names fail here, naming the key
    if param_dtype != "auto":
        return param_dtype
    if device_type == "cuda" and level in _FP8_LEVELS:
        return "bf16"
    return recipe.other_params

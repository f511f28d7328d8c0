"""``fp8train.initialize``: put any PyTorch model and Adam/AdamW optimizer on a precision level.

    model, optimizer = fp8train.initialize(model, optimizer, opt_level="O2")

Every ``nn.Linear`` becomes an ``fp8train.Linear`` (same weights, FP8 GEMMs); at O1-O3 the
weights are then stored as the level says (scaled FP16 / FP8 with FP8 gradient slots) and the
optimizer is rebuilt as ``LowBitAdamW`` with the same parameter groups and hyper-parameters.
What cannot be converted faithfully is refused with an error naming it.
"""

from __future__ import annotations

import torch
from torch import nn

from .convert import lower_linear_weights
from .linear import Linear
from .optim import LowBitAdamW
from .precision import PrecisionRecipe, get_recipe
from .scaling import ScalingRecipe
from .scaling_table import attach

__all__ = ["initialize"]

_LEVELS = ("te", "O1", "O2", "O3")


def _convert_linears(model: nn.Module, recipe: PrecisionRecipe, mapping: dict) -> int:
    count = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            # It calls its projections through F.multi_head_attention_forward, bypassing any
            # module we could put in their place.
            raise TypeError(
                f"fp8train.initialize: {name or 'model'} is nn.MultiheadAttention, whose "
                "projections are called functionally and cannot be converted; build attention "
                "from nn.Linear layers instead"
            )
        for child_name, child in list(module.named_children()):
            if isinstance(child, Linear) or not isinstance(child, nn.Linear):
                continue
            where = f"{name}.{child_name}" if name else child_name
            if type(child) is not nn.Linear:
                raise TypeError(
                    f"fp8train.initialize: {where} is {type(child).__name__}, a subclass of "
                    "nn.Linear whose behaviour cannot be assumed; only plain nn.Linear converts"
                )
            if child.weight.dtype != torch.float32:
                raise TypeError(
                    f"fp8train.initialize: {where}.weight is {child.weight.dtype}; convert an "
                    "FP32 model (the level decides every lower precision)"
                )
            new = Linear(
                child.in_features,
                child.out_features,
                bias=child.bias is not None,
                recipe=recipe,
                device=child.weight.device,
            )
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            new.train(child.training)
            mapping[id(child.weight)] = new
            if child.bias is not None:
                mapping[id(child.bias)] = new.bias
            setattr(module, child_name, new)
            count += 1
    return count


def _check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW):
        raise TypeError(
            f"fp8train.initialize: optimizer {kind.__name__} is not supported; use "
            "torch.optim.Adam or torch.optim.AdamW"
        )
    for i, group in enumerate(optimizer.param_groups):
        for option in ("amsgrad", "maximize", "capturable", "differentiable"):
            if group.get(option):
                raise TypeError(f"fp8train.initialize: param group {i} sets {option}=True")
        if kind is torch.optim.Adam and group.get("weight_decay", 0):
            raise TypeError(
                f"fp8train.initialize: torch.optim.Adam param group {i} has weight_decay "
                f"{group['weight_decay']} (L2, coupled); LowBitAdamW decays decoupled: use AdamW"
            )
    if any(optimizer.state.values()):
        raise TypeError("fp8train.initialize: the optimizer has already stepped; initialize first")


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    opt_level: str = "O2",
    scaling: ScalingRecipe | None = None,
):
    """Convert ``model`` in place and return ``(model, optimizer)`` for ``opt_level``.

    opt_level: "te" (FP8 GEMMs only), "O1", "O2" or "O3" (the precision table). scaling: how
    the FP8 scales are chosen (None: ``ScalingRecipe()``); it becomes the level's recipe's
    ``scaling``, which every converted linear reads. The returned optimizer reads FP8 weight
    gradients from each weight's gradient slot (``fp8train.param_state.grad_slot``, the
    ``main_grad`` attribute) and zeroes them in ``zero_grad()``; use it exactly like the one
    passed in.
    """
    if opt_level not in _LEVELS:
        raise ValueError(
            f"fp8train.initialize: opt_level={opt_level!r}; choose one of {', '.join(_LEVELS)} "
            "(for bf16/fp16 mixed precision use torch.autocast)"
        )
    recipe = get_recipe(opt_level, scaling=scaling)
    _check_optimizer(optimizer)
    mapping: dict[int, object] = {}
    if _convert_linears(model, recipe, mapping) == 0:
        raise TypeError("fp8train.initialize: the model has no nn.Linear layer to convert")
    lower_linear_weights(model)  # new Parameter objects at O1-O3: map through the modules
    attach(model)  # one bulk scaling update per forward for every linear
    groups = []
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            target = mapping.get(id(p), p)
            params.append(target.weight if isinstance(target, Linear) else target)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    hyper = {k: optimizer.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")}
    if recipe.weight_grad == "fp8":
        new_optimizer = LowBitAdamW(
            groups,
            exp_avg_dtype=recipe.adam_dtypes[0],
            exp_avg_sq_dtype=recipe.adam_dtypes[1],
            **hyper,
        )
    else:
        new_optimizer = torch.optim.AdamW(groups, **hyper)
    return model, new_optimizer

"""Precision audit: what each tensor role of a live model and optimizer really is, next to the
level's row of the precision table, with mismatches flagged.

Reads only what exists: parameter dtypes, gradient slots, optimizer states (run one step first
so lazily created states exist). Linear (GEMM) weights are audited role by role; embeddings,
norms and biases are summarised as "other params".
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from .linear import Linear
from .low_precision import Fp8GradSlot
from .param_state import grad_slot
from .precision import PrecisionRecipe

__all__ = ["RoleAudit", "audit_precision", "format_audit", "dtype_name"]

_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float8_e4m3fn: "fp8",
    torch.float8_e5m2: "fp8",
}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype).replace("torch.", ""))


@dataclass
class RoleAudit:
    role: str
    expected: str
    actual: str
    bytes_per_param: float | None  # storage bytes per parameter of this role, None if none

    @property
    def ok(self) -> bool:
        return self.actual == self.expected


def _summary(names: list[str]) -> str:
    counts = Counter(names)
    if len(counts) == 1:
        return next(iter(counts))
    return "mixed: " + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _state_tensor(state: dict, want: str) -> torch.Tensor | None:
    """The optimizer state tensor for role ``want`` ("m", "v" or "master"), by key name."""
    for key, value in state.items():
        if not torch.is_tensor(value) or "scale" in key:
            continue
        if want == "v" and "exp_avg_sq" in key:
            return value
        if want == "m" and "exp_avg" in key and "exp_avg_sq" not in key:
            return value
        if want == "master" and "master" in key:
            return value
    return None


def audit_precision(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    recipe: PrecisionRecipe,
    master_of: dict[int, torch.Tensor] | None = None,
) -> list[RoleAudit]:
    """One row per role of the table for the model's fp8train Linear weights, plus "other".

    ``master_of`` maps ``id(param)`` to a master copy kept outside ``optimizer.state`` (the
    bf16 level's FP32 masters); the optimizer's own state is keyed by that master then.
    """
    master_of = master_of or {}
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if not linears:
        raise ValueError("audit: the model has no fp8train.Linear layers (convert it first)")
    rows: dict[str, list[str]] = {k: [] for k in ("gemm", "comm", "w", "master", "g", "m", "v")}
    nbytes = Counter()
    numel = 0
    for layer in linears:
        w = layer.weight
        numel += w.numel()
        master = master_of.get(id(w))
        state = optimizer.state.get(master if master is not None else w, {})
        if layer.fp8:
            rows["gemm"].append("fp8")
        else:
            rows["gemm"].append(dtype_name(recipe.autocast_dtype or w.dtype))
        slot = grad_slot(w)
        grad = slot if slot is not None else w.grad
        rows["comm"].append("fp8" if isinstance(slot, Fp8GradSlot) else "fp32")
        rows["w"].append(dtype_name(w.dtype))
        nbytes["w"] += w.nbytes
        if master is None:
            master = _state_tensor(state, "master")
        rows["master"].append("—" if master is None else dtype_name(master.dtype))
        nbytes["master"] += 0 if master is None else master.nbytes
        if isinstance(grad, Fp8GradSlot):
            rows["g"].append("fp8")
            nbytes["g"] += grad.nbytes
        elif grad is not None:
            rows["g"].append(dtype_name(grad.dtype))
            nbytes["g"] += grad.nbytes
        else:
            # Zeroed with set_to_none: autograd will allocate it in the parameter's dtype.
            rows["g"].append(dtype_name(w.dtype))
            nbytes["g"] += w.nbytes
        for role in ("m", "v"):
            t = _state_tensor(state, role)
            rows[role].append("(none yet)" if t is None else dtype_name(t.dtype))
            nbytes[role] += 0 if t is None else t.nbytes
    linear_ids = {id(m.weight) for m in linears}
    others = [p for p in model.parameters() if id(p) not in linear_ids]
    expected = {
        "gemm": recipe.gemm,
        "comm": recipe.grad_comm,
        "w": recipe.weight,
        "master": recipe.master_weight or "—",
        "g": recipe.weight_grad,
        "m": recipe.adam_m,
        "v": recipe.adam_v,
    }
    titles = {
        "gemm": "GEMM",
        "comm": "grad comm",
        "w": "weight",
        "master": "master weight",
        "g": "weight grad",
        "m": "Adam m",
        "v": "Adam v",
    }
    out = [
        RoleAudit(
            titles[k],
            expected[k],
            _summary(rows[k]),
            nbytes[k] / numel if k in ("w", "master", "g", "m", "v") else None,
        )
        for k in titles
    ]
    other_names = [dtype_name(p.dtype) for p in others] or ["—"]
    other_bytes = sum(p.nbytes for p in others) / max(1, sum(p.numel() for p in others))
    out.append(RoleAudit("other params", recipe.other_params, _summary(other_names), other_bytes))
    return out


def format_audit(rows: list[RoleAudit], recipe: PrecisionRecipe) -> str:
    """A plain-text table: role, what the table says, what is there, bytes per parameter."""
    lines = [
        f"precision audit, level {recipe.level} (linear-layer weights; 'other params' are "
        "embeddings, norms and biases)",
        f"{'role':<14} {'table':<7} {'actual':<24} {'bytes/param':>11}  check",
    ]
    for r in rows:
        b = (
            ""
            if r.bytes_per_param is None or r.role in ("GEMM", "grad comm")
            else (f"{r.bytes_per_param:.3f}")
        )
        lines.append(
            f"{r.role:<14} {r.expected:<7} {r.actual:<24} {b:>11}  {'ok' if r.ok else 'MISMATCH'}"
        )
    return "\n".join(lines)

"""Per-parameter storage for ``LowBitAdamW``: parameter kinds, state layout, vectorised casts.

State keys of one parameter (all plain tensors, so ``state_dict`` flattens straight into
safetensors as ``state.<index>.<key>``):

  step               []   fp32  number of updates applied to this parameter (as in torch AdamW)
  exp_avg            like p   fp32, or fp8 E4M3 (then with exp_avg_scale_inv)
  exp_avg_scale_inv  []   fp32  value = exp_avg.float() * exp_avg_scale_inv
  exp_avg_sq         like p   fp32, or fp16 (then with exp_avg_sq_scale_inv)
  exp_avg_sq_scale_inv []  fp32
  master             like p   fp16, only for FP8 weights (O3): the tensor-scaled master weight
  master_scale_inv   []   fp32

A state is low-precision exactly when its ``*_scale_inv`` key exists: the stored tensors, not
the constructor, say how a loaded checkpoint is read.

Scales. FP16 states (v, masters) and the weights written back use a power-of-two scale that
puts the amax just below the format's max (``pow2_scale``): the multiply is exact, so the only
rounding is the format's own. The FP8 first moment uses the full-range scale
``E4M3.max / amax`` instead: m is signed and spans many decades (it follows the gradient), and
E4M3 normals cover only 2**-6..448, about 2**15; entries below ``amax * 2**-18`` flush to zero
and those below ``amax * 2**-15`` are subnormal with fewer mantissa bits. Putting the amax at
448 rather than anywhere in [224, 448] buys up to one more binade at the bottom, where
underflow happens; the non-power-of-two multiply costs one fp32 rounding, far below E4M3's.
A flushed entry only means that element does not move this step (its v is small as well).
"""

from __future__ import annotations

import torch

from .blockwise import scaled_value
from .formats import E4M3
from .low_precision import FP16_MAX, pow2_scale
from .param_state import fp8_grad_slot, scale_block_of, scale_inv_of, take_initial_master
from .scaling import compute_scale

__all__ = [
    "EXP_AVG_DTYPES",
    "EXP_AVG_SQ_DTYPES",
    "FP8_DTYPES",
    "param_kind",
    "grad_of",
    "has_grad",
    "weight_value",
    "init_state",
    "dequantize",
    "quantize_into_",
]

EXP_AVG_DTYPES = (torch.float32, E4M3.dtype)
EXP_AVG_SQ_DTYPES = (torch.float32, torch.float16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def param_kind(p: torch.Tensor) -> str:
    """ "fp8" (O3 FP8 weight), "fp16" (O1/O2 scaled FP16 weight) or "plain"."""
    if scale_inv_of(p) is not None:
        if p.dtype in FP8_DTYPES:
            return "fp8"
        if p.dtype == torch.float16:
            return "fp16"
    if p.dtype in FP8_DTYPES:
        raise TypeError("an FP8 parameter needs a `scale_inv` attribute (its per-tensor scale)")
    return "plain"


def grad_of(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient as FP32, or None when there is none this step (the parameter is skipped).

    An ``Fp8GradSlot`` gradient slot (``param_state.fp8_grad_slot``) wins (its ``has_data``
    is a host flag: no sync); otherwise ``p.grad``.
    """
    slot = fp8_grad_slot(p)
    if slot is not None:
        return slot.dequantize() if slot.has_data else None
    if p.grad is None:
        return None
    return p.grad if p.grad.dtype == torch.float32 else p.grad.float()


def has_grad(p: torch.Tensor) -> bool:
    """Whether ``grad_of(p)`` has a gradient this step, without forming it (host flags only)."""
    slot = fp8_grad_slot(p)
    return slot.has_data if slot is not None else p.grad is not None


def weight_value(p: torch.Tensor) -> torch.Tensor:
    """The value a scaled parameter represents, in FP32 (a new tensor)."""
    scale_inv = scale_inv_of(p)
    if scale_inv is None:
        raise TypeError("weight_value: the parameter has no scale (not a scaled weight)")
    return scaled_value(p.detach(), scale_inv, scale_block_of(p))


def init_state(
    p: torch.Tensor, kind: str, m_dtype: torch.dtype, v_dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Zero moments (each with scale 1 when low-precision) and, for FP8 weights, the master."""
    dev = p.device
    state = {"step": torch.zeros((), dtype=torch.float32, device=dev)}
    state["exp_avg"] = torch.zeros(p.shape, dtype=m_dtype, device=dev)
    if m_dtype != torch.float32:
        state["exp_avg_scale_inv"] = torch.ones((), device=dev)
    state["exp_avg_sq"] = torch.zeros(p.shape, dtype=v_dtype, device=dev)
    if v_dtype != torch.float32:
        state["exp_avg_sq_scale_inv"] = torch.ones((), device=dev)
    if kind == "fp8":
        initial = take_initial_master(p)
        if initial is not None:  # the FP16 rounding of the initial value (param_state)
            data, scale_inv = initial
            state["master"] = data.to(dev)
            state["master_scale_inv"] = scale_inv.to(device=dev, dtype=torch.float32)
            return state
        # Else the FP8 weight is the only record of the value (a weight loaded in FP8). With a
        # power-of-two weight scale FP16 holds it exactly: 3 mantissa bits fit in 10, and
        # E4M3's 2**18 span of magnitudes fits FP16's 2**40 (with block scales, as long as the
        # blocks' scales span less than the remaining 2**22, i.e. no block sits 22 binades
        # below the largest).
        state["master"] = torch.empty(p.shape, dtype=torch.float16, device=dev)
        state["master_scale_inv"] = torch.ones((), device=dev)
        quantize_into_(
            [weight_value(p)], [state["master"]], [state["master_scale_inv"]], FP16_MAX, pow2=True
        )
    return state


def dequantize(datas: list[torch.Tensor], scale_invs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``data.float() * scale_inv`` for each pair: fresh FP32 tensors."""
    out = [d.float() for d in datas]
    if out:
        torch._foreach_mul_(out, scale_invs)
    return out


def quantize_into_(
    values: list[torch.Tensor],
    datas: list[torch.Tensor],
    scale_invs: list[torch.Tensor],
    max_value: float,
    pow2: bool,
) -> None:
    """Store each FP32 ``value`` in place as ``data`` (its dtype) with a fresh per-tensor scale.

    ``pow2``: the largest power of two that keeps the amax <= ``max_value`` (exact multiply);
    otherwise ``E4M3.max / amax`` (the first moment). A zero or non-finite amax gives scale 1.
    All on the device: per-tensor amaxes, then the scales of all tensors at once.
    ``values`` are consumed (scaled in place).
    """
    if not values:
        return
    # aminmax needs no |x| temporary (_foreach_norm(inf) is 10x slower on CPU); NaN propagates.
    lo, hi = zip(*(torch.aminmax(v) for v in values))
    amax = torch.maximum(-torch.stack(lo), torch.stack(hi))
    if pow2:
        scales = pow2_scale(amax, max_value)
    else:
        if max_value != E4M3.max:
            raise ValueError("full-range scales are only used for E4M3 moments")
        scales = compute_scale(amax, E4M3)
    torch._foreach_mul_(values, list(scales.unbind()))
    torch._foreach_clamp_min_(values, -max_value)  # saturate, like every cast in fp8train
    torch._foreach_clamp_max_(values, max_value)
    torch._foreach_copy_(datas, values)
    torch._foreach_copy_(scale_invs, list(scales.reciprocal().unbind()))

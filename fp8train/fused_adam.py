"""LowBitAdamW's step of one tensor as one compiled function: the fused path (issue 34, item 5).

Why: the reference step (optim.py) runs some thirty ``torch._foreach_*`` passes over FP32
working copies of every gradient, weight and moment; on an H200 that was 130 ms a step at
GPT-1.3B against 29 ms for torch's fused AdamW. Here one function, compiled with
``fullgraph=True``, reads a tensor's gradient (an FP8 slot's bytes and scale, or an FP32
``grad``), its weight (the tensor-scaled FP16 weight at O1/O2, the FP16 master at O3, or a
plain weight), its moments (FP8 m, FP16 v, each with its scale, or FP32) and writes them all
back; at O3 it also writes the FP8 weight. Inductor makes that a few kernels: the per-tensor
scales of the re-quantised values depend on their amaxes, so one reduction precedes the casts
(and, at O3, one more over the stored master before the FP8 weight). Between the two it may
keep the new FP32 values of the one tensor (on the CPU it does: 12 bytes per element of w, m
and v, freed when the call returns), which bounds the transient memory by the largest tensor,
as the reference's ``chunk_elements`` bounds its chunks.

The arithmetic is the reference's, op for op (optim.py's docstring): the same dequantisation,
the same AdamW update on FP32 values, the same saturating casts with the same scales
(``pow2_scale``, ``compute_scale``). Where eager kernels round a multiply-add once (``lerp``,
``addcmul``: a fused multiply-add in their vectorised CPU code, and in nvcc's CUDA code), the
traced graph must do so too, or ~10% of the moments differ by an fp32 ulp:

- on CUDA, inductor lowers ``addcmul`` with a unit value to one ``fma`` (as eager CUDA rounds);
- inductor's C++ code emits no ``fma`` (its lowerings use one on CUDA and XPU only), so on the
  CPU the product and sum are formed in float64 and rounded once to fp32. The product of two
  fp32 values is exact in float64; the sum rounds twice (to float64, then fp32), which
  differs from one rounding only when the float64 sum lands exactly halfway between two fp32
  values, of the order of 2**-29 of the time.

Everything else is correctly rounded IEEE arithmetic on both sides but one op: eager's CPU
``sqrt`` (the reference's ``_foreach_sqrt``) is not; it is within an ulp, off by one in about
0.6% of fp32 inputs (measured, torch 2.13), where the compiled ``sqrt`` rounds exactly. So on
a CPU with vector units (AVX2, AVX-512) the fused step gives the bits of the reference with a
correctly rounded square root, and otherwise differs from it only where an ulp of the
denominator moves a rounding: the moments never (they do not read it), an FP32 weight by an
ulp now and then (4 elements of 4002 after 20 steps, measured), a stored FP16 or FP8 value
more rarely still (none in 1.8 million element-steps). ATen's scalar kernels
(``ATEN_CPU_CAPABILITY=default``) round ``lerp`` and ``addcmul`` twice where the compiled
step rounds once, so there a fifth of the FP32 moments differ by an ulp or so of their amax.
tests/test_fused_adam.py holds the traced step to the eager one bit for bit (``aot_eager``)
and the compiled one to the reference within a bar derived from its roundings. The CUDA code
(Triton) has not been compared with the eager CUDA reference yet: no GPU was lent to the
session that wrote this. Do that before trusting its bits (the test file runs on a CUDA
machine as it is, on the CPU).

Bias corrections stay with the caller: LowBitAdamW increments the step counters and forms
``-lr / (1 - b1**t)`` and ``sqrt(1 - b2**t)`` for a whole param group in float64 as the
reference does (a few small ops per group, not per tensor), and every hyperparameter reaches
the compiled function in one small fp32 tensor (``coefficients``): a new learning rate or step
never recompiles. Tensors are passed flat (1-D views) and marked dynamic, so one compiled graph
serves every shape of a kind of parameter; the kinds (dtypes of gradient, weight, moments, and
whether an FP8 weight is written) each compile once, to their own code object, so that no kind
competes for another's dynamo cache entries.

A skipped step (``found_inf`` set: the gradients were not finite) is decided on the device:
every store selects, at the stored tensor's own precision, between its old and its new value
(``_store_``), so a skipped step writes back exactly what was there and a taken one exactly
what it would have written anyway; the caller takes the step counter back.

Not fused (the caller's reference path): block-scaled FP8 weights (``scale_block_of(p)`` not
None: their cast is per 128x128 block, ``blockwise.quantize_blocks``) and tensors the step
writes that are not contiguous (a flat view would be a copy, and the writes would be lost). A
block- or row-scaled FP8 gradient is dequantised eagerly (``Fp8GradSlot.dequantize``) and enters
as an FP32 gradient.
"""

from __future__ import annotations

import functools
import types

import torch

from .formats import E4M3
from .low_precision import FP16_MAX, max_of, pow2_scale
from .param_state import fp8_grad_slot, scale_block_of, scale_inv_of
from .scaling import compute_scale

__all__ = ["coefficients", "fusable", "fused_update_", "compiled_steps"]


def coefficients(
    group: dict, neg_step_size: torch.Tensor, bc2_sqrt: torch.Tensor
) -> list[torch.Tensor]:
    """One fp32 row of hyperparameters per tensor of a param group: ``1 - lr*wd``, ``1 - b1``,
    ``b2``, ``1 - b2``, ``eps``, ``-lr / (1 - b1**t)``, ``sqrt(1 - b2**t)`` (the order in which
    ``_adamw_step_`` unbinds them).

    ``neg_step_size`` (float64) and ``bc2_sqrt`` (fp32) are the group's bias-corrected vectors,
    one entry per tensor. Every value is the fp32 rounding of the double the reference passes
    as a Python scalar (which its kernels round to fp32 the same way), so no bit changes.
    """
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    # Copied up without blocking: a blocking copy to a CUDA device waits for its stream.
    hyper = torch.tensor([1 - lr * wd, 1 - beta1, beta2, 1 - beta2, eps], dtype=torch.float32)
    hyper = hyper.to(bc2_sqrt.device, non_blocking=True)
    n = bc2_sqrt.numel()
    rows = torch.cat([hyper.expand(n, 5), neg_step_size.float()[:, None], bc2_sqrt[:, None]], 1)
    return list(rows.unbind(0))


def fusable(p: torch.Tensor, state: dict) -> bool:
    """Whether ``p`` can take the fused step: one weight scale (not per block), and every
    tensor the step writes contiguous (so its flat view is the tensor itself)."""
    if scale_block_of(p) is not None:
        return False  # per-block casts: blockwise.quantize_blocks, the reference path
    written = [p, state["exp_avg"], state["exp_avg_sq"], state.get("master", p)]
    return all(t.is_contiguous() for t in written)


def _flat(t: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-D view (a copy for a non-contiguous gradient, which is only read), dynamic in size."""
    if t is None:
        return None
    flat = t.detach().reshape(-1)
    torch._dynamo.maybe_mark_dynamic(flat, 0)
    return flat


def _grad(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gradient's storage and scale: an FP8 slot's bytes and per-tensor scale; a block- or
    row-scaled slot dequantised here (its scale grid does not fit the flat kernel); ``grad``."""
    slot = fp8_grad_slot(p)
    if slot is None:
        return p.grad, None
    if slot.block is None:
        return slot.data, slot.scale_inv
    return slot.dequantize(), None


def fused_update_(
    p: torch.Tensor, kind: str, state: dict, coeffs: torch.Tensor, found_inf=None
) -> None:
    """One AdamW step of ``p`` (its step counter already incremented, ``coeffs`` its row of
    ``coefficients``): weight, moments, scales and, at O3, master and FP8 weight, in place.
    ``found_inf``: a 0-d bool tensor on ``p``'s device; where it is true every tensor keeps
    its bits (module docstring). None: a step."""
    if found_inf is None:  # one compiled graph either way: always a tensor
        found_inf = torch.zeros((), dtype=torch.bool, device=p.device)
    grad, grad_scale_inv = _grad(p)
    w8 = w8_scale_inv = None
    if kind == "fp8":  # O3: the step updates the master and writes the FP8 weight from it
        w, w_scale_inv = state["master"], state["master_scale_inv"]
        w8, w8_scale_inv = p, scale_inv_of(p)
    else:
        w, w_scale_inv = p, scale_inv_of(p)  # None for a plain weight
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m_scale_inv = state.get("exp_avg_scale_inv")
    v_scale_inv = state.get("exp_avg_sq_scale_inv")
    key = tuple(None if t is None else t.dtype for t in (grad, grad_scale_inv, w, w_scale_inv))
    key += tuple(None if t is None else t.dtype for t in (m, m_scale_inv, v, v_scale_inv, w8))
    step = compiled_steps(key, p.device.type)
    step(
        _flat(grad), grad_scale_inv, _flat(w), w_scale_inv, _flat(m), m_scale_inv,
        _flat(v), v_scale_inv, coeffs, _flat(w8), w8_scale_inv, found_inf,
    )  # fmt: skip


@functools.cache
def compiled_steps(key: tuple, device_type: str):
    """The compiled step for one kind of parameter (``key``: the dtypes of its tensors) on one
    device type. A code object of its own per kind: dynamo keeps at most 8 compilations per
    code object and, past that, runs the function eagerly without a word."""
    del key, device_type  # only the cache's key: the graph follows the arguments' dtypes
    own = types.FunctionType(
        _adamw_step_.__code__.replace(), _adamw_step_.__globals__, "adamw_step_", None, None
    )
    # Inductor elides a downcast followed by an upcast (fp32 -> fp16 -> fp32) when it fuses
    # them; the O3 FP8 weight must be cast from the master as stored, not from its fp32
    # value (a tie of E4M3 then rounds the other way: 1 in 128 elements), so keep the casts.
    return torch.compile(own, fullgraph=True, options={"emulate_precision_casts": True})


def _value(data: torch.Tensor, scale_inv: torch.Tensor | None) -> torch.Tensor:
    x = data.float()
    return x if scale_inv is None else x * scale_inv


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` rounded once, as eager's multiply-add kernels do (module docstring)."""
    if c.device.type == "cpu":  # C++ inductor has no fma: an exact product, one late rounding
        return (a.double() * b.double() + c.double()).float()
    return torch.addcmul(c, a, b)  # inductor lowers a unit-value addcmul to one fma


def _lerp(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.lerp`` as eager rounds it: ``start + w*(end-start)`` for a small weight,
    ``end - (1-w)*(end-start)`` from 0.5 on, each one multiply-add."""
    big = weight.abs() >= 0.5
    coeff = torch.where(big, weight - 1, weight)
    return _fma(coeff, end - start, torch.where(big, end, start))


def _store_(value, data, scale_inv, max_value: float, pow2: bool, skip) -> None:
    """``optim_states.quantize_into_`` for one tensor; a tensor without a scale is written at
    its own precision (an FP32 moment or a plain weight). ``skip`` (0-d bool): write back the
    old bits instead: the stored value widened to fp32 narrows back to itself exactly, and the
    old scale is kept with it."""
    if scale_inv is None:
        data.copy_(torch.where(skip, data.float(), value))
        return
    lo, hi = torch.aminmax(value)
    amax = torch.maximum(-lo, hi)
    scale = pow2_scale(amax, max_value) if pow2 else compute_scale(amax, E4M3)
    data.copy_(torch.where(skip, data.float(), (value * scale).clamp(-max_value, max_value)))
    scale_inv.copy_(torch.where(skip, scale_inv, scale.reciprocal()))


def _adamw_step_(
    grad, grad_scale_inv, w, w_scale_inv, m, m_scale_inv, v, v_scale_inv, coeffs, w8,
    w8_scale_inv, skip,
) -> None:  # fmt: skip
    """The reference's ``LowBitAdamW._update`` for one flat tensor (``None`` scales: FP32 or
    plain storage; ``w8`` None: no FP8 weight to write), every store kept as it was where
    ``skip`` (a 0-d bool) is true."""
    decay, lerp_weight, beta2, one_minus_beta2, eps, neg_step_size, bc2 = coeffs.unbind()
    g = _value(grad, grad_scale_inv)
    weight = _value(w, w_scale_inv) * decay  # a weight decay of 0 multiplies by 1: exact
    exp_avg = _lerp(_value(m, m_scale_inv), g, lerp_weight)
    # addcmul(v, g, g, value=1-b2): the reference's kernels round (value*g)*g + v once on the
    # CPU; on CUDA value*(g*g) + v, as inductor's own addcmul lowering does.
    v_decayed = _value(v, v_scale_inv) * beta2
    if v_decayed.device.type == "cpu":
        exp_avg_sq = _fma(one_minus_beta2 * g, g, v_decayed)
    else:
        exp_avg_sq = _fma(one_minus_beta2, g * g, v_decayed)
    denom = exp_avg_sq.sqrt() / bc2 + eps
    weight = weight + (neg_step_size * exp_avg) / denom
    _store_(exp_avg, m, m_scale_inv, E4M3.max, False, skip)
    _store_(exp_avg_sq, v, v_scale_inv, FP16_MAX, True, skip)
    _store_(weight, w, w_scale_inv, FP16_MAX, True, skip)
    if w8 is not None:
        # O3: the FP8 weight is the rounding of the master as stored (optim.py's rule).
        _store_(_value(w, w_scale_inv), w8, w8_scale_inv, max_of(w8.dtype), True, skip)

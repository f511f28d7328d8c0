"""Tensor-scaled low-precision storage: FP16/FP8 weights, masters, moments and FP8 gradients.

A ``ScaledTensor`` stores ``x`` as ``data = cast(x * scale)`` with one FP32 scale per tensor and
reads it back as ``data * scale_inv``. For FP16 the scale is a power of two chosen so the
tensor's amax sits just below 65504 (MS-AMP's tensor scaling): multiplying by a power of two is
exact, so the only rounding is FP16's own 11-bit mantissa, and small values keep FP16's range.

``Fp8GradSlot`` is a weight gradient kept in FP8 E4M3 between backward and the optimizer step
(a main-grad slot), with one scale per tensor, or per row or 128x128 block at row/block FP8
granularity. Accumulation rule across micro-batches: the stored gradient is read back to
FP32, the new micro-batch's FP32 gradient is added, and the sum is cast again with a scale from
the sum's own amax. Each accumulation therefore rounds once to E4M3 (relative error at most
2**-4 of an element's magnitude, half an E4M3 ulp, for normal values); after k micro-batches the
error is a sum of k such roundings of partial sums, so it grows at most linearly and in practice
like sqrt(k). No FP32 copy survives the call: the FP32 sum is a temporary.

Scaling a slot (unscaling by the loss scale, clipping, averaging) touches only ``scale_inv``:
the FP8 bytes are unchanged, so it is exact and free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .blockwise import block_grid, cast_blocks, scaled_value
from .formats import E4M3, FP8Format, cast_to_fp8
from .scaling import compute_scale

__all__ = ["FP16_MAX", "ScaledTensor", "Fp8GradSlot", "pow2_scale", "max_of"]

FP16_MAX = 65504.0


def max_of(dtype: torch.dtype) -> float:
    """Largest finite value of a storage dtype (fp16 or one of the FP8 formats)."""
    return float(torch.finfo(dtype).max)


def pow2_scale(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """Largest power of two ``s`` with ``amax * s <= max_value``; 1.0 where amax is 0 or not finite.

    A tensor result, computed on the device: no host synchronisation.
    """
    amax = amax.float()
    raw = (max_value / amax).clamp(2.0**-126, 2.0**126)
    mantissa, _ = torch.frexp(raw)  # raw = m * 2**e, m in [0.5, 1): raw / (2m) = 2**(e-1) <= raw
    scale = raw / (2.0 * mantissa)
    usable = (amax > 0) & torch.isfinite(amax)
    return torch.where(usable, scale, torch.ones_like(scale))


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = max_of(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


@dataclass
class ScaledTensor:
    """``data`` (fp16 or fp8) with one FP32 ``scale_inv``: the value is ``data * scale_inv``."""

    data: torch.Tensor
    scale_inv: torch.Tensor

    @classmethod
    def quantize(cls, x: torch.Tensor, dtype: torch.dtype) -> ScaledTensor:
        out = cls(torch.empty_like(x, dtype=dtype), torch.ones((), device=x.device))
        out.assign_(x)
        return out

    @classmethod
    def zeros(cls, shape, dtype: torch.dtype, device=None) -> ScaledTensor:
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.ones((), device=device))

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * self.scale_inv

    def assign_(self, x: torch.Tensor) -> None:
        """Store ``x`` in place with a fresh power-of-two scale from its own amax."""
        scale = pow2_scale(x.detach().abs().amax(), max_of(self.data.dtype))
        self.data.copy_(_cast(x, scale, self.data.dtype))
        self.scale_inv.copy_(1.0 / scale)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class Fp8GradSlot:
    """An FP8 E4M3 weight gradient with a per-tensor (or per-block) scale, accumulated across
    micro-batches.

    ``block`` (rows, columns): one scale per block of the 2-D gradient instead (row/block FP8
    granularity: ``(1, K)`` per row, ``(128, 128)`` per block); ``scale_inv`` and ``amax`` are
    then the block grid ``[ceil(R/br), ceil(C/bc)]`` (``units`` values), each block cast with
    its own scale from its own amax by the accumulation rule above.

    ``amax`` is the largest magnitude the slot represents (per block); it is inf/NaN when an
    accumulated gradient overflowed, which is how the step's inf check sees an FP8 gradient
    (the cast itself saturates, so the bytes alone would hide the overflow).

    Every update writes in place, so ``data``, ``scale_inv`` and ``amax`` may be views into
    contiguous buffers owned by someone else (``bind``: the data-parallel gradient buckets of
    ``parallel/grad_buffer.py``). ``on_accumulate``, when set, is called after each
    accumulation: that is how a bucket learns its FP8 gradients are ready, since they never
    pass through autograd's ``.grad``.
    """

    fmt: FP8Format = E4M3

    def __init__(self, shape, device=None, block: tuple[int, int] | None = None):
        self.data = torch.zeros(shape, dtype=self.fmt.dtype, device=device)
        self.block = None if block is None else tuple(block)
        grid = () if block is None else block_grid(tuple(shape), self.block)
        self.scale_inv = torch.ones(grid, device=device)
        self.amax = torch.zeros(grid, device=device)
        self.has_data = False  # host flag, set by code paths alone: never read from the device
        self.on_accumulate = None
        # Made here, outside any compiled region (a leaf cannot be created inside one).
        self._sink = torch.empty_strided(tuple(shape), (0,) * len(shape), device=device)
        self._sink.requires_grad_()
        self._sink.register_post_accumulate_grad_hook(self._take_grad)

    @property
    def sink(self) -> torch.Tensor:
        """Where an FP8 linear's backward hands its FP32 weight gradient: a leaf of the
        weight's shape that owns no memory (every stride 0), whose hook accumulates the
        gradient into this slot as autograd delivers it, and drops it.

        Why not accumulate inside the linear's backward: that is a side effect on Python
        state (``has_data``, ``on_accumulate``) in the middle of the graph, which
        ``torch.compile`` cannot trace. Handed to autograd like any gradient, the compiled
        backward only returns it; the hook runs after, in the autograd engine, eagerly."""
        return self._sink

    def _take_grad(self, sink: torch.Tensor) -> None:
        grad, sink.grad = sink.grad, None
        self.accumulate(grad)

    def bind(self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> None:
        """Move the storage into the given views (same shape/dtype; scale and amax of the
        slot's own shape: 0-d, or its block grid), keeping the current contents."""
        if data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(
                f"bind: data view {tuple(data.shape)} {data.dtype} does not match the slot's "
                f"{tuple(self.data.shape)} {self.data.dtype}"
            )
        data.copy_(self.data)
        scale_inv.copy_(self.scale_inv)
        amax.copy_(self.amax)
        self.data, self.scale_inv, self.amax = data, scale_inv, amax

    def accumulate(self, grad: torch.Tensor) -> None:
        total = grad.float() if not self.has_data else self.dequantize() + grad.float()
        # Non-finite amax: keep it (the inf check reads it) but cast with a finite scale.
        if self.block is None:
            amax = total.abs().amax()
            scale = compute_scale(amax, self.fmt, fallback=1.0 / self.scale_inv)
            self.data.copy_(cast_to_fp8(total, self.fmt, scale))
        else:
            data, scale, amax = cast_blocks(
                total, self.fmt, self.block, fallback=1.0 / self.scale_inv
            )
            self.data.copy_(data)
        self.scale_inv.copy_(1.0 / scale)
        self.amax.copy_(amax)
        self.has_data = True
        if self.on_accumulate is not None:
            self.on_accumulate()

    def assign(self, data: torch.Tensor, scale_inv: torch.Tensor, amax: torch.Tensor) -> None:
        """Replace the contents (e.g. with the data-parallel average)."""
        self.data.copy_(data.view(self.data.shape))
        self.scale_inv.copy_(scale_inv)
        self.amax.copy_(amax)
        self.has_data = True

    def dequantize(self) -> torch.Tensor:
        return scaled_value(self.data, self.scale_inv, self.block)

    def mul_(self, factor: torch.Tensor | float) -> None:
        """Multiply the represented gradient by ``factor``: only the scale changes (exact)."""
        self.scale_inv.mul_(factor)
        self.amax.mul_(abs(factor))

    def zero_(self) -> None:
        self.data.zero_()
        self.scale_inv.fill_(1.0)
        self.amax.zero_()
        self.has_data = False

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def units(self) -> int:
        """How many scales the slot keeps: 1, or its blocks."""
        return self.scale_inv.numel()

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

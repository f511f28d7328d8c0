"""FP8 formats (E4M3, E5M2) and the one cast every FP8 tensor in the project goes through.

Overflow convention: **saturate**. A value whose magnitude exceeds the format's largest finite
number becomes ±max, ±inf becomes ±max, NaN stays NaN; everything in range is rounded to the
nearest representable value, ties to even (subnormals included). This is what Transformer
Engine and MS-AMP do, and it is what delayed scaling needs: a scale chosen from past amaxes may
be slightly too large for today's tensor, and clipping a few outliers costs far less than
turning them into NaN (E4M3FN has no inf, so ml_dtypes/numpy-style casts give NaN) or inf
(E5M2 overflow in ml_dtypes and in torch's own cast), which would poison the whole GEMM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FP8Format", "E4M3", "E5M2", "FORMATS", "cast_health", "cast_to_fp8", "widen"]


@dataclass(frozen=True)
class FP8Format:
    """One FP8 encoding: its torch dtype and the numbers that drive scaling."""

    name: str  # "E4M3" | "E5M2"
    dtype: torch.dtype
    max: float  # largest finite magnitude
    min_normal: float
    min_subnormal: float

    def __post_init__(self):
        fi = torch.finfo(self.dtype)
        # The literals are the spec; finfo is the implementation. They must agree.
        if fi.max != self.max or fi.smallest_normal != self.min_normal:
            raise ValueError(f"{self.name}: literals disagree with torch.finfo({self.dtype})")

    @property
    def clip_threshold(self) -> float:
        """The magnitude above which a cast clips rather than rounds: the maximum plus half
        its unit in the last place (448 + 16 for E4M3, 57344 + 4096 for E5M2). Values between
        the maximum and this round to the maximum as they would without saturation."""
        mantissa_ulp = self.min_subnormal / self.min_normal  # 2^-(mantissa bits)
        return self.max + 2.0 ** math.floor(math.log2(self.max)) * mantissa_ulp / 2

    def __repr__(self) -> str:
        return self.name


E4M3 = FP8Format("E4M3", torch.float8_e4m3fn, 448.0, 2.0**-6, 2.0**-9)
E5M2 = FP8Format("E5M2", torch.float8_e5m2, 57344.0, 2.0**-14, 2.0**-16)
FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3, E5M2)}


def cast_to_fp8(
    x: torch.Tensor, fmt: FP8Format, scale: torch.Tensor | float | None = None
) -> torch.Tensor:
    """``saturate(x * scale)`` rounded to nearest-even in ``fmt``; returns a ``fmt.dtype`` tensor.

    The multiply happens in fp32 (bf16/fp16 inputs widen exactly, so an unscaled cast rounds
    once). ``clamp`` keeps NaN as NaN and maps ±inf to ±max, which is the saturating convention.
    Eagerly these are three kernels; inside a compiled region (``training.compile``) the
    compiler fuses them, with the amax and any transposed copy of the same tensor, into one
    kernel per pass (``Float8Tensor.quantize``).
    """
    if scale is None:
        y = x.float().clamp(-fmt.max, fmt.max)  # out of place: x.float() may be x itself
    else:
        y = (x.float() * scale).clamp_(-fmt.max, fmt.max)
    return y.to(fmt.dtype)


def widen(data: torch.Tensor) -> torch.Tensor:
    """The FP32 values of FP8 ``data``, exactly (``data.float()``'s bits, NaN included).

    Eagerly on the CPU an E4M3 tensor goes through a 256-entry table (one gather): ATen's
    element-wise E4M3 -> FP32 conversion there is scalar code, about 4x slower than the gather
    (7.8 against 1.8 ms per million elements on one Xeon core), and the emulated GEMMs widen
    both operands of every call. E5M2 (the upper byte of an FP16) converts fast as it is, and
    so does any device with FP8 hardware; compiled code keeps ``.float()`` for the compiler to
    fuse. Only the emulated GEMMs, themselves the CPU's stand-ins, use it: elsewhere the
    table's index and gather would be CPU-only work in the step the planner accounts (it
    counts the bytes each dispatched operation moves, for a GPU's step)."""
    if (
        data.dtype != torch.float8_e4m3fn
        or data.device.type != "cpu"
        or torch.compiler.is_compiling()
    ):
        return data.float()
    if not data.is_contiguous():
        # ``.float()`` keeps a transposed operand's layout, which decides the GEMM kernel
        # that reads it (and so the order of its sums): keep it too.
        if data.dim() == 2 and data.t().is_contiguous():
            return widen(data.t()).t()
        return data.float()
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    index = data.view(torch.uint8).reshape(-1).int()
    return table.index_select(0, index).view(data.shape)


def cast_health(
    x: torch.Tensor, stored: torch.Tensor, fmt: FP8Format, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fractions of ``x`` lost to its cast into ``stored`` (``fmt`` values, ``scale`` one
    value or one per element): nonzero values flushed to zero (underflow), and values the cast
    clipped (saturation). Tensors, so recording never syncs.

    Saturated means the scaled magnitude lay beyond the maximum by more than half a unit in
    the last place there, i.e. rounding alone would have given a larger value. Stored values
    equal to the maximum are not the measure: values just below it round to it too (about
    3.5% of a fresh weight under current scaling, where nothing is clipped), and the amax that
    current scaling maps onto the maximum may land a rounding error above it."""
    nonzero = x != 0
    flushed = (nonzero & (stored.float() == 0)).sum()
    underflow = flushed / nonzero.sum().clamp(min=1)
    clipped = (x.float() * scale).abs() > fmt.clip_threshold  # the product the cast computed
    return underflow, clipped.float().mean()

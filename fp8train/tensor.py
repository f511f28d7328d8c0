"""``Float8Tensor``: FP8 payload plus the per-tensor scale needed to read it back.

A plain container, not a ``torch.Tensor`` subclass: FP8 tensors only ever flow between the cast
and the GEMM inside ``linear``/``gemm``, where an explicit object is easier to reason about than
a subclass that every torch op would have to be taught about.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import FP8Format, cast_to_fp8

__all__ = ["Float8Tensor"]


@dataclass(frozen=True)
class Float8Tensor:
    """``value ≈ data.float() * scale_inv``.

    data: FP8 tensor of ``fmt.dtype``; scale_inv: fp32 scalar tensor (the dequantisation
    factor, i.e. 1 / the scale the data was cast with); fmt: E4M3 or E5M2.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: FP8Format
    # The same values transposed and contiguous ([cols, rows]), where a GEMM reads that
    # layout (cuBLASLt's operands: the first row-major, the second column-major); None: a
    # consumer that needs it copies ``data.t()`` itself.
    data_t: torch.Tensor | None = None

    def __post_init__(self):
        if self.data.dtype != self.fmt.dtype:
            raise TypeError(f"Float8Tensor {self.fmt}: data is {self.data.dtype}")
        if self.scale_inv.dtype != torch.float32 or self.scale_inv.numel() != 1:
            raise TypeError("Float8Tensor: scale_inv must be a single fp32 value")
        if self.data_t is not None and (
            self.data_t.dtype != self.data.dtype or self.data_t.shape != self.data.shape[::-1]
        ):
            raise TypeError("Float8Tensor: data_t must be data's transpose, in its dtype")

    @classmethod
    def quantize(
        cls,
        x: torch.Tensor,
        fmt: FP8Format,
        scale: torch.Tensor | float = 1.0,
        transpose: bool = False,
    ) -> Float8Tensor:
        """Cast ``x * scale`` (saturating, round-to-nearest-even) and keep ``1 / scale``; with
        ``transpose`` (2-D ``x``) also the transposed layout, ``data_t``.

        One unit: compiled (``training.compile``), the cast and its transposed copy are one
        kernel that reads ``x`` once and writes both layouts, as Transformer Engine's
        cast-transpose does; eagerly the copy reads the 1-byte result, not ``x``."""
        scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if scale.dim():
            scale = scale.reshape(())
        data = cast_to_fp8(x, fmt, scale)
        data_t = data.t().contiguous() if transpose else None
        return cls(data, scale.reciprocal(), fmt, data_t)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # fp8 -> fp32 is exact; the one rounding is the product with scale_inv.
        return (self.data.float() * self.scale_inv).to(dtype)

    def t(self) -> Float8Tensor:
        """The transpose (no copy): ``data_t`` where there is one, so that the GEMM reads a
        contiguous operand, else a view; the scale is per tensor, so it carries over."""
        if self.data_t is not None:
            return Float8Tensor(self.data_t, self.scale_inv, self.fmt, self.data)
        return Float8Tensor(self.data.t(), self.scale_inv, self.fmt)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def __repr__(self) -> str:
        return (
            f"Float8Tensor({self.fmt.name}, shape={tuple(self.shape)}, "
            f"device={self.device}, scale_inv={self.scale_inv.detach().cpu().item():.6g})"
        )

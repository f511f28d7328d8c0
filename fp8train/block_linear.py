"""The FP8 linear with row-wise or block-wise scales (``ScalingRecipe.granularity``).

Each GEMM reads its operands along its own reduction dimension, so each operand is quantized
in the layout that GEMM reduces over, from the high-precision tensor, with current scales:

    forward      y  = x · Wᵀ     x [M,K] along K;  W [N,K] along K
    input grad   dx = g · W      g [M,N] along N;  Wᵀ [K,N] along N
    weight grad  dW = gᵀ · x     gᵀ [N,M] along M; xᵀ [K,M] along M

``block``: x, g, gᵀ and xᵀ in 1x128 tiles, W in 128x128 blocks whose transpose is Wᵀ's
quantization (one cast of the weight serves both GEMMs, the reason for square blocks).
``row``: one scale per row of each operand, so Wᵀ is a second cast of the weight.
A tensor and its transpose are one cast unit (``_cast_unit``): both computed from the tensor
as it lies, the transposed bytes written contiguous, every scale grid in the layout cuBLASLt
reads, so no GEMM copies an operand or a scale. Where the linear bound the Triton kernels
(``triton_cast.bind``: CUDA sm_90+ with triton, decided at build time and passed in as
``kernels``), one read of the tensor writes both (two at ``row``: amaxes, then both casts), and
a weight's 128x128 cast writes Wᵀ's contiguous copy in the same read. Elsewhere, the
reference: ``blockwise.quantize_operand`` of the tensor and, ``transposed``, of its transpose,
each reading the tensor (compiled, inductor generates their kernels as it sees fit).
What backward needs is cast in forward and kept in FP8: xᵀ (1 byte per activation, as the
per-tensor path keeps x) and Wᵀ (at ``block`` a view of W's bytes for the emulation, their
transposed copy where cuBLASLt reads it, whose second operand is column-major). The weight's
two operands (``weight_operands``) are made once per step where a step has several
micro-batches: the first casts them, the others read them (``Linear.keep_weight_cast``).

The GEMMs (``gemm.fp8_gemm``): row-wise on ``torch._scaled_mm``, block-wise on cuBLASLt's
block-scaled kernel where it was bound (``block_scaled_mm``), else the emulation. The forward
GEMM writes the activation's dtype with the bias added before its one rounding (in cuBLASLt's
epilogue where it adds it), with the recipe's fast accumulation on ``torch._scaled_mm``.

No scaling state: every scale is this step's, so activation recompute casts the same bytes
again. Under sequence parallelism (``input_comm``) each rank casts its own rows (their scales
depend on those rows alone), the FP8 bytes and scales are all-gathered, and xᵀ, whose tiles
run along the gathered rows, is cast from the gathered values (DeepSeek-V3's dequantize,
transpose, re-quantize): a second rounding that the single-process run, which casts xᵀ from
x itself, does not have.

The weight is read in high precision: FP32 or BF16 (te), or the tensor-scaled FP16 master
dequantized (O1, O2). At O1-O3 the weight gradient, an FP32 GEMM output, is added to
the weight's FP8 gradient slot, scaled like the operands: one scale per row (``row``) or per
128x128 block (``block``), each from its own amax at every accumulation. O3 at ``block``
stores the FP8 weight in its 128x128 blocks (``Linear.lower_weight_precision``): both GEMMs
read those bytes as they are, with no cast in the step (cuBLASLt's input-gradient GEMM reads
their transposed copy); O3 at ``row`` is refused there.
"""

from __future__ import annotations

import torch

from . import block_scaled_mm, triton_cast
from .blockwise import (
    WEIGHT_BLOCK,
    BlockFloat8Tensor,
    block_amax,
    fit_block,
    operand_block,
    per_element,
    quantize_operand,
)
from .formats import E4M3, FORMATS, cast_health
from .gemm import fp8_gemm
from .scaling import ScalingRecipe

__all__ = ["BlockFp8LinearFunction", "block_health", "uses_layouts", "weight_operands"]


def _cast(x: torch.Tensor, scaling: ScalingRecipe, fmt, weight: bool) -> BlockFloat8Tensor:
    """``x [R, C]`` cast along C (its columns)."""
    block = operand_block(scaling.granularity, weight, x.shape[1])
    return quantize_operand(x, fmt, block, False, scaling.margin, scaling.power_of_two)


def _cast_t(x: torch.Tensor, scaling: ScalingRecipe, fmt, weight: bool) -> BlockFloat8Tensor:
    """``xᵀ [C, R]`` cast along R (x's rows), from ``x`` as it lies."""
    block = operand_block(scaling.granularity, weight, x.shape[0])
    return quantize_operand(x, fmt, block, True, scaling.margin, scaling.power_of_two)


def _transposed(w8: BlockFloat8Tensor, layouts: bool) -> BlockFloat8Tensor:
    """A weight's 128x128 blocks read as its transpose's: a view, or with ``layouts`` (the
    block-scaled kernel bound, whose second operand is a contiguous ``[N, K]`` read
    column-major) the bytes transposed into a contiguous copy, no cast."""
    wt8 = w8.t()
    if not layouts:
        return wt8
    return BlockFloat8Tensor(wt8.data.contiguous(), wt8.scale_inv, wt8.fmt, wt8.block)


def _cast_unit(
    x: torch.Tensor, scaling: ScalingRecipe, fmt, kernels: bool, want=(True, True)
) -> tuple[BlockFloat8Tensor | None, BlockFloat8Tensor | None]:
    """``(x8, xt8)`` of an activation, a gradient or (``row``) a weight ``x [R, C]``: x along
    C and xᵀ along R, each where ``want`` says (None elsewhere). With the kernels bound
    (``triton_cast.bind``), one read of ``x`` writes both (two at ``row``); else one
    ``quantize_operand`` per orientation."""
    if kernels:
        return triton_cast.quantize_pair(
            x, fmt, scaling.granularity, scaling.margin, scaling.power_of_two, want
        )
    x8 = _cast(x, scaling, fmt, weight=False) if want[0] else None
    return x8, _cast_t(x, scaling, fmt, weight=False) if want[1] else None


def _cast_weight(
    w: torch.Tensor, scaling: ScalingRecipe, layouts: bool, kernels: bool
) -> tuple[BlockFloat8Tensor, BlockFloat8Tensor]:
    """``(w8, wt8)`` of a weight in 128x128 blocks: one cast serves both GEMMs, Wᵀ's bytes a
    view or (``layouts``) a contiguous copy, which the kernels write in the same read."""
    if kernels:
        w8, wt8 = triton_cast.quantize_weight(
            w, E4M3, scaling.margin, scaling.power_of_two, transposed=layouts
        )
        return w8, w8.t() if wt8 is None else wt8
    w8 = _cast(w, scaling, E4M3, weight=True)
    return w8, _transposed(w8, layouts)


def uses_layouts(device: torch.device, backend: str) -> bool:
    """Whether the GEMMs on ``device`` read cuBLASLt's layouts (Wᵀ's bytes a contiguous copy):
    the block-scaled kernel bound there for the ``scaled_mm`` backend. Decided by what was
    bound at build time, never by values."""
    return backend == "scaled_mm" and block_scaled_mm.bound(device) is not None


def weight_operands(
    weight: torch.Tensor,
    w_scale_inv: torch.Tensor | None,
    scaling: ScalingRecipe,
    layouts: bool,
    kernels: bool,
) -> tuple[torch.Tensor | None, BlockFloat8Tensor, BlockFloat8Tensor]:
    """``(w, w8, wt8)``: the weight in high precision (None for a stored FP8 weight), W for the
    forward GEMM along K and Wᵀ for the input gradient's along N. At ``block`` the 128x128
    weight blocks transpose as they are; rows do not, so at ``row`` Wᵀ is a second cast. Every
    scale is the weight's own current one: casting an unchanged weight again gives the same
    bytes, so a step's micro-batches may share one cast (``Linear.keep_weight_cast``)."""
    if weight.dtype == E4M3.dtype:  # O3: the stored FP8 weight in its 128x128 blocks
        block = fit_block(WEIGHT_BLOCK, tuple(weight.shape))
        w8 = BlockFloat8Tensor(weight.detach(), w_scale_inv, E4M3, block)
        return None, w8, _transposed(w8, layouts)
    w = weight.detach() if w_scale_inv is None else weight.detach().float() * w_scale_inv
    if scaling.granularity == "block":
        return w, *_cast_weight(w, scaling, layouts, kernels)
    return w, *_cast_unit(w, scaling, E4M3, kernels)


def block_health(health: dict, role: str, x: torch.Tensor, q: BlockFloat8Tensor) -> None:
    """The health of one row- or block-scaled cast: ``formats.cast_health`` (underflow,
    saturation) with each value against its own block's scale, and in place of a per-tensor
    state's amax and scale: ``<role>_amax`` (of the tensor), ``<role>_scale`` (the smallest
    block scale, that of the block holding the amax: what one per-tensor scale would be) and
    ``<role>_scale_spread`` (binades between the smallest and largest scale of the non-zero
    blocks: how far the finest blocks sit above what one scale would give them)."""
    scales = q.scale_inv.reciprocal()
    spread = per_element(scales, q.block, tuple(x.shape))
    health[f"{role}_underflow"], health[f"{role}_saturated"] = cast_health(x, q.data, q.fmt, spread)
    amax = block_amax(x, q.block)
    live = amax > 0  # an all-zero block takes scale 1, which says nothing
    smallest = torch.where(live, scales, torch.inf).amin()
    largest = torch.where(live, scales, 0.0).amax()
    any_live = live.any()
    health[f"{role}_amax"] = amax.amax()
    health[f"{role}_scale"] = torch.where(any_live, smallest, 1.0)
    health[f"{role}_scale_spread"] = torch.where(any_live, (largest / smallest).log2(), 0.0)


class BlockFp8LinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` with the three GEMMs on row- or block-scaled FP8 operands. x is 2-D
    [M, K]; W [N, K] in FP32 or BF16, FP16 with ``w_scale_inv`` (one value), or FP8 E4M3
    with ``w_scale_inv`` the grid of its 128x128 blocks; b [N] or None;
    ``wgrad_sink``: the sink of the weight's FP8 gradient slot (O1-O3) or None."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        wgrad_sink,
        scaling: ScalingRecipe,
        health,
        w_scale_inv,
        input_comm,
        backend="emulated",
        kernels=False,
        weight_cast=None,
    ):
        # ``weight_cast``: ``weight_operands``' answer made by the caller (a step's kept cast,
        # ``w`` None where no health is measured), else cast here. Wᵀ's bytes contiguous where
        # cuBLASLt's block-scaled kernel reads them; the emulation reads a view.
        if weight_cast is None:
            layouts = uses_layouts(x.device, backend)
            weight_cast = weight_operands(weight, w_scale_inv, scaling, layouts, kernels)
        w, w8, wt8 = weight_cast
        # xᵀ for dW, along M: with x in the same read unless x's rows are gathered below.
        x8, xt8 = _cast_unit(x.detach(), scaling, E4M3, kernels, (True, input_comm is None))
        if health is not None:  # this rank's rows, before any gather
            block_health(health, "input", x.detach(), x8)
        if input_comm is not None:  # this rank's rows -> all rows, FP8 bytes and their scales
            x8 = BlockFloat8Tensor(
                input_comm.gather(x8.data), input_comm.gather_rows(x8.scale_inv), E4M3, x8.block
            )
        y = fp8_gemm(x8, w8, x.dtype, backend, bias=bias, fast_accum=scaling.fast_accum)
        if health is not None and w is not None:  # a stored FP8 weight is not cast here
            block_health(health, "weight", w, w8)
        if input_comm is not None:  # xᵀ's tiles run along the gathered rows
            _, xt8 = _cast_unit(x8.dequantize(), scaling, E4M3, kernels, (False, True))
        ctx.save_for_backward(xt8.data, xt8.scale_inv, wt8.data, wt8.scale_inv)
        ctx.blocks = xt8.block, wt8.block
        ctx.scaling, ctx.health, ctx.backend, ctx.kernels = scaling, health, backend, kernels
        ctx.sink = wgrad_sink is not None
        ctx.input_comm = input_comm
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y

    @staticmethod
    def backward(ctx, g):
        xt_data, xt_sinv, wt_data, wt_sinv = ctx.saved_tensors
        xt8 = BlockFloat8Tensor(xt_data, xt_sinv, E4M3, ctx.blocks[0])
        wt8 = BlockFloat8Tensor(wt_data, wt_sinv, E4M3, ctx.blocks[1])
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b, need_sink = ctx.needs_input_grad[:4]
        need_w = need_sink if ctx.sink else need_w
        fmt = FORMATS[ctx.scaling.grad_format.upper()]
        g = g.detach()
        dx = dw = db = None
        # g along N for dx, gᵀ along M for dW: one cast unit, both from one read where both
        # are needed (the first layer needs no dx).
        g8, gt8 = _cast_unit(g, ctx.scaling, fmt, ctx.kernels, (need_x, need_w))
        if need_x:
            if ctx.health is not None:
                block_health(ctx.health, "grad_output", g, g8)
            dx = fp8_gemm(g8, wt8, out_dtype=x_dtype, backend=ctx.backend)  # [M,N]·[K,N]ᵀ
            if ctx.input_comm is not None:
                dx = ctx.input_comm.scatter_grad(dx)  # back to this rank's rows
        if need_w:
            if ctx.health is not None and not need_x:  # the first layer: no dx, no g8
                block_health(ctx.health, "grad_output", g.t(), gt8)
            out = torch.float32 if ctx.sink else w_dtype
            dw = fp8_gemm(gt8, xt8, out_dtype=out, backend=ctx.backend)  # [N,M]·[K,M]ᵀ
        if need_b:
            db = g.float().sum(0).to(b_dtype)
        # O1-O3: the FP32 weight gradient goes to the FP8 slot's sink, the weight gets none.
        dw, dsink = (None, dw) if ctx.sink else (dw, None)
        return dx, dw, db, dsink, None, None, None, None, None, None, None

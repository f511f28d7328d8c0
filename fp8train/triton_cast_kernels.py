"""The Triton kernels behind ``fp8train.triton_cast`` and the ``torch.library`` ops that run
them. Imported only where triton is (``triton_cast.kernels``): this module imports it at the
top, as ``@triton.jit`` needs.

Every program reads one tile of ``x [M, K]`` once (128 x 128; 64 x 128 for the row-scaled
cast, whose scales come from a first pass) and computes what ``blockwise.quantize_operand``
computes, bit for bit:

- the amax of a tile row or column, a NaN counted as inf (both take scale 1, and
  ``tl.max`` may drop a NaN where ``torch.amax`` keeps it);
- the scale of ``scaling.compute_scale``: ``max_value / amax`` correctly rounded
  (``tl.div_rn``: Triton's ``/`` on fp32 is approximate on CUDA), rounded down to a power
  of two by clearing the mantissa (a usable scale is a normal number, where ``frexp``'s
  ``scale / (2 m)`` is exactly that), 1 where the amax lies outside ``[lowest, highest]``;
- ``cast_to_fp8``: ``x * scale`` in fp32, clamped to the format's range by comparisons (a
  NaN passes through, as ``clamp`` lets it), rounded to nearest even by the conversion;
- ``scale_inv = 1 / scale`` correctly rounded, as ``Tensor.reciprocal``.

Tile bases are int64 (a [16384, 131072] tensor has 2**31 elements), offsets within a tile
int32. Only long-standing ``triton.language`` calls: the GPU machine's torch brings an older
triton than this one. ``tests/test_triton_cast.py`` compiles them for sm_90 here and checks
the instructions these bits rest on (``cvt.rn.satfinite``, ``div.rn.f32``, no fma or ftz).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from .formats import E4M3, E5M2
from .scaling import amax_bounds

__all__ = ["TILE", "cast_blocks", "cast_pair"]

TILE = 128  # a program's tile: DeepSeek-V3's 1 x 128 tiles along either dimension
# 16 warps: a 128 x 128 tile then fits in registers without spilling (ptxas for sm_90, bf16
# and fp32 input: at most 128 registers a thread, no stack; 8 warps spill). With one scale
# per row the cast's tile size is free: 64 rows keep it below that too.
_WARPS = 16
_ROWS_BM = 64


@triton.jit
def _scale(amax, max_value, lowest, highest, POW2: tl.constexpr):
    """``compute_scale`` of an amax tensor (1 outside [lowest, highest], NaN included)."""
    scale = tl.div_rn(tl.zeros_like(amax) + max_value, amax)
    if POW2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where((amax >= lowest) & (amax <= highest), scale, 1.0)


@triton.jit
def _saturated(y, fmt_max):
    """``clamp(y, -fmt_max, fmt_max)`` that keeps NaN (a comparison with NaN is false)."""
    return tl.where(y > fmt_max, fmt_max, tl.where(y < -fmt_max, -fmt_max, y))


@triton.jit
def _tile(x_ptr, sxm, sxk, M, K, BM: tl.constexpr, BK: tl.constexpr):
    """This program's tile of ``x`` as stored (zeros outside ``x``: they raise no amax), its
    |x| with NaN as inf, where it starts (``m0``, ``k0``: int64 scalars), the int32 row and
    column indices within it and the mask. Registers bound a 128 x 128 tile: the values stay
    in their 16-bit dtype until a cast widens them (|x| and its maxima are exact in any
    float dtype), and offsets within a tile stay int32; only the scalar bases are int64, for
    tensors beyond 2**31 elements."""
    m0 = tl.program_id(0).to(tl.int64) * BM
    k0 = tl.program_id(1).to(tl.int64) * BK
    rm, rk = tl.arange(0, BM), tl.arange(0, BK)
    mask = (rm[:, None] < (M - m0).to(tl.int32)) & (rk[None, :] < (K - k0).to(tl.int32))
    tile = x_ptr + m0 * sxm + k0 * sxk
    x = tl.load(tile + rm[:, None] * sxm + rk[None, :] * sxk, mask=mask, other=0.0)
    a = tl.abs(x)
    a = tl.where(a == a, a, float("inf"))
    return x, a, m0, k0, rm, rk, mask


@triton.jit
def _store_cast(out_ptr, offsets, mask, x, scale, fmt_max):
    """``cast_to_fp8(x, fmt, scale)`` stored at ``out_ptr + offsets``: the product in fp32."""
    y = _saturated(x.to(tl.float32) * scale, fmt_max)
    tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_inv(out_ptr, offsets, mask, scale):
    """``scale.reciprocal()``, correctly rounded, stored at ``out_ptr + offsets``."""
    tl.store(out_ptr + offsets, tl.div_rn(tl.zeros_like(scale) + 1.0, scale), mask=mask)


@triton.jit
def _amax_kernel(
    x_ptr,
    sxm,
    sxk,
    M,
    K,
    row_amax_ptr,
    col_amax_ptr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    # A max is exact in any order, so atomics give the bits of one reduction.
    _, a, m0, k0, rm, rk, _ = _tile(x_ptr, sxm, sxk, M, K, BM, BK)
    if ROWS:
        amax = tl.max(a, axis=1).to(tl.float32)
        tl.atomic_max(row_amax_ptr + m0 + rm, amax, mask=rm < M - m0)
    if COLS:
        amax = tl.max(a, axis=0).to(tl.float32)
        tl.atomic_max(col_amax_ptr + k0 + rk, amax, mask=rk < K - k0)


@triton.jit
def _cast_kernel(
    x_ptr,
    sxm,
    sxk,
    M,
    K,
    row_amax_ptr,
    col_amax_ptr,
    x8_ptr,
    xt8_ptr,
    sinv_ptr,
    sinvt_ptr,
    max_value,
    lowest,
    highest,
    fmt_max,
    ROWS: tl.constexpr,
    POW2: tl.constexpr,
    WRITE_X: tl.constexpr,
    WRITE_T: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    # Both orientations of one tile. 1 x 128 tiles (not ROWS): a tile row's amax scales x8's
    # tile (scale_inv in row program_id(1) of sinv [Kb, M]), a tile column's xt8's (row
    # program_id(0) of sinvt [Mb, K]). ROWS: one scale per row and per column, from pass
    # 1's amaxes (_amax_kernel), each scale_inv stored by the first tile column or row.
    x, a, m0, k0, rm, rk, mask = _tile(x_ptr, sxm, sxk, M, K, BM, BK)
    # Both amaxes before either cast, so that |x| is dead while the casts run.
    if ROWS:
        amax_x = tl.load(row_amax_ptr + m0 + rm, mask=(rm < M - m0) & WRITE_X, other=0.0)
        amax_t = tl.load(col_amax_ptr + k0 + rk, mask=(rk < K - k0) & WRITE_T, other=0.0)
    else:
        amax_x = tl.max(a, axis=1).to(tl.float32)
        amax_t = tl.max(a, axis=0).to(tl.float32)
    if WRITE_X:
        scale = _scale(amax_x, max_value, lowest, highest, POW2)
        out = x8_ptr + m0 * K + k0
        _store_cast(out, rm[:, None] * K + rk[None, :], mask, x, scale[:, None], fmt_max)
        if ROWS:
            if tl.program_id(1) == 0:
                _store_inv(sinv_ptr + m0, rm, rm < M - m0, scale)
        else:
            inv = sinv_ptr + tl.program_id(1).to(tl.int64) * M + m0
            _store_inv(inv, rm, rm < M - m0, scale)
    if WRITE_T:
        scale = _scale(amax_t, max_value, lowest, highest, POW2)
        # xt8[k, m]: the compiler lays the stores out along m, where they are contiguous.
        out = xt8_ptr + k0 * M + m0
        _store_cast(out, rk[None, :] * M + rm[:, None], mask, x, scale[None, :], fmt_max)
        if ROWS:
            if tl.program_id(0) == 0:
                _store_inv(sinvt_ptr + k0, rk, rk < K - k0, scale)
        else:
            inv = sinvt_ptr + tl.program_id(0).to(tl.int64) * K + k0
            _store_inv(inv, rk, rk < K - k0, scale)


@triton.jit
def _blocks_kernel(
    x_ptr,
    sxm,
    sxk,
    M,
    K,
    x8_ptr,
    xt8_ptr,
    sinv_ptr,
    max_value,
    lowest,
    highest,
    fmt_max,
    POW2: tl.constexpr,
    WRITE_T: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    # One scale per 128 x 128 block (a weight's): the block's bytes are cast once and stored
    # as they are and, transposed, in xt8 [K, M] (the copy cuBLASLt's second operand reads).
    x, a, m0, k0, rm, rk, mask = _tile(x_ptr, sxm, sxk, M, K, BM, BK)
    amax = tl.max(tl.max(a, axis=1), axis=0).to(tl.float32)
    scale = _scale(amax, max_value, lowest, highest, POW2)
    y = _saturated(x.to(tl.float32) * scale, fmt_max).to(x8_ptr.dtype.element_ty)
    tl.store(x8_ptr + m0 * K + k0 + rm[:, None] * K + rk[None, :], y, mask=mask)
    if WRITE_T:
        tl.store(xt8_ptr + k0 * M + m0 + rk[None, :] * M + rm[:, None], y, mask=mask)
    block = tl.program_id(0).to(tl.int64) * tl.num_programs(1) + tl.program_id(1)
    tl.store(sinv_ptr + block, tl.div_rn(tl.zeros_like(scale) + 1.0, scale))


def _fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32, as ``torch.full_like`` rounds it: the kernels
    take fp32 arguments, and the bounds must be the emulation's bits."""
    return struct.unpack("f", struct.pack("f", value))[0]


def _constants(e5m2: bool, margin: int) -> tuple[float, float, float, float]:
    """``(max_value, lowest, highest, fmt_max)`` of ``compute_scale`` for a format and margin."""
    fmt = E5M2 if e5m2 else E4M3
    max_value = fmt.max / 2.0**margin
    lowest, highest = amax_bounds(max_value)
    return _fp32(max_value), _fp32(lowest), _fp32(highest), float(fmt.max)


def _tiles_along(n):
    """``ceil(n / TILE)`` in integers: ``n`` may be a symbolic size under ``torch.compile``."""
    return (n + TILE - 1) // TILE


def _fp8(e5m2: bool) -> torch.dtype:
    return (E5M2 if e5m2 else E4M3).dtype


def _outputs(x, e5m2, write_x, write_t, kb, mb):
    """``x8 [M, K]``, ``xt8 [K, M]`` and their scale_inv grids ``[Kb, M]``, ``[Mb, K]``, each
    empty where it is not written."""
    m, k = x.shape
    dtype = _fp8(e5m2)
    return (
        torch.empty((m, k) if write_x else (0, 0), dtype=dtype, device=x.device),
        torch.empty((k, m) if write_t else (0, 0), dtype=dtype, device=x.device),
        torch.empty((kb, m) if write_x else (0, 0), dtype=torch.float32, device=x.device),
        torch.empty((mb, k) if write_t else (0, 0), dtype=torch.float32, device=x.device),
    )


@triton_op("fp8train::cast_pair", mutates_args=())
def cast_pair(
    x: torch.Tensor,
    rows: bool,
    e5m2: bool,
    margin: int,
    power_of_two: bool,
    write_x: bool,
    write_t: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` cast along K (``x8``) and along M (``xt8 = x8ᵀ``, contiguous ``[K, M]``),
    in 1 x 128 tiles (scale_inv ``[Kb, M]`` and ``[Mb, K]``) from one read of ``x``, or with
    ``rows`` one scale per row and per column (scale_inv ``[1, M]`` and ``[1, K]``) from two:
    one for both amaxes, one for both casts (a scale needs its whole row's amax first)."""
    m, k = x.shape
    mb, kb = (1, 1) if rows else (_tiles_along(m), _tiles_along(k))
    x8, xt8, sinv, sinvt = _outputs(x, e5m2, write_x, write_t, kb, mb)
    if not (m and k):
        return x8, xt8, sinv, sinvt
    grid = (_tiles_along(m), _tiles_along(k))
    row_amax = col_amax = x  # not read by the 1 x 128 cast
    if rows:
        row_amax = torch.zeros(m if write_x else 0, dtype=torch.float32, device=x.device)
        col_amax = torch.zeros(k if write_t else 0, dtype=torch.float32, device=x.device)
        wrap_triton(_amax_kernel)[grid](
            x, x.stride(0), x.stride(1), m, k, row_amax, col_amax,
            ROWS=write_x, COLS=write_t, BM=TILE, BK=TILE, num_warps=_WARPS,
        )  # fmt: skip
    bm = _ROWS_BM if rows else TILE
    wrap_triton(_cast_kernel)[((m + bm - 1) // bm, grid[1])](
        x, x.stride(0), x.stride(1), m, k, row_amax, col_amax, x8, xt8, sinv, sinvt,
        *_constants(e5m2, margin),
        ROWS=rows, POW2=power_of_two, WRITE_X=write_x, WRITE_T=write_t, BM=bm, BK=TILE,
        num_warps=_WARPS,
    )  # fmt: skip
    return x8, xt8, sinv, sinvt


@triton_op("fp8train::cast_blocks", mutates_args=())
def cast_blocks(
    x: torch.Tensor, e5m2: bool, margin: int, power_of_two: bool, write_t: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [M, K]`` in 128 x 128 blocks: ``x8``, with ``write_t`` its bytes transposed
    contiguous ``[K, M]`` (else empty), and the scale_inv grid ``[Mb, Kb]``."""
    m, k = x.shape
    mb, kb = _tiles_along(m), _tiles_along(k)
    x8, xt8, _, _ = _outputs(x, e5m2, True, write_t, 0, 0)
    sinv = torch.empty((mb, kb), dtype=torch.float32, device=x.device)
    if m and k:
        wrap_triton(_blocks_kernel)[(mb, kb)](
            x, x.stride(0), x.stride(1), m, k, x8, xt8, sinv,
            *_constants(e5m2, margin),
            POW2=power_of_two, WRITE_T=write_t, BM=TILE, BK=TILE, num_warps=_WARPS,
        )  # fmt: skip
    return x8, xt8, sinv

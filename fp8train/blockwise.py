"""Row-wise and block-wise FP8 scaling: one scale per row, or per tile, of a GEMM operand.

A per-tensor scale lets one outlier channel push every other value of the tensor toward
E4M3's subnormals. Finer scales confine it:

- ``row``: one scale per row of each GEMM operand along the reduction dimension (torchao's
  row-wise recipe). Operand ``[R, K]`` of ``a @ b.T`` -> scales ``[R, 1]``.
- ``block``: DeepSeek-V3's tiles, as Transformer Engine's ``Float8BlockScaling``: 1x128 along
  the reduction dimension for activations and output gradients (scales ``[R, ceil(K/128)]``),
  128x128 for weights (``[ceil(R/128), ceil(K/128)]``), so a weight's blocks serve its
  transpose too.

A dimension that is not a multiple of the block gets a partial last block. Scales are current
(this tensor's amax per block, now): delayed scaling keeps one amax history per tensor and
stays with ``tensor`` granularity.

``BlockFloat8Tensor`` holds the FP8 bytes, the per-block ``scale_inv`` and the block shape;
``block_gemm`` computes ``a @ b.T`` the way DeepSeek-V3 promotes its accumulation: each
K block's partial product in FP32, scaled by both operands' block scales, added to an FP32
accumulator (``tests/test_blockwise.py`` checks it against float64 with the same blocking).

A GEMM operand is cast in the layout its GEMM reduces over. ``quantize_operand`` casts
``x [R, C]`` along C, or (``transposed``) along R, writing ``xᵀ [C, R]`` contiguous (what the
other GEMM of a linear reads), both computed from ``x`` in its own layout: no high-precision
transposed copy. The two together are the cast unit of a row- or block-scaled tensor: here
two calls, each reading ``x`` (eagerly the transposed one also makes a 1-byte transposed copy;
compiled, inductor generates their kernels, and how often they read ``x`` is its choice).
This is the reference, and the path everywhere but CUDA: there, where triton imports, a linear
binds ``triton_cast``, whose kernels write both orientations from one read of ``x`` (two for
one scale per row), bit for bit these. The scale grids come out in the layout cuBLASLt
reads (``fp8train/block_scaled_mm.py``): 1 x 128 tiles' scales K-block-major (``[R, Kb]``
with strides ``(1, R)``), one scale per row ``[R, 1]``; the values are those of
``quantize_blocks`` bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .formats import FP8Format, cast_to_fp8, widen
from .scaling import compute_scale

__all__ = [
    "BLOCK",
    "WEIGHT_BLOCK",
    "BlockFloat8Tensor",
    "block_gemm",
    "block_amax",
    "block_grid",
    "cast_blocks",
    "fit_block",
    "operand_block",
    "per_element",
    "quantize_blocks",
    "quantize_operand",
    "scaled_value",
]

BLOCK = 128  # DeepSeek-V3's tile and Transformer Engine's block: 128 along each blocked dim
WEIGHT_BLOCK = (BLOCK, BLOCK)  # a weight's blocks, and those of O3's stored FP8 weights


def operand_block(granularity: str, weight: bool, k: int) -> tuple[int, int]:
    """The (rows, columns) block of a GEMM operand laid out ``[R, K]`` (K reduced): ``row``
    -> ``(1, K)``; ``block`` -> ``(128, 128)`` for a weight, ``(1, 128)`` otherwise."""
    if granularity == "row":
        return 1, k
    if granularity == "block":
        return (BLOCK, BLOCK) if weight else (1, BLOCK)
    raise ValueError(f"fp8 granularity {granularity!r}: row or block here ('tensor' is per tensor)")


def fit_block(block: tuple[int, int], shape: tuple[int, ...]) -> tuple[int, int]:
    """``block`` no larger than the 2-D ``shape``: a dimension shorter than its block is one
    partial block, the same grid, and two operands' blocks along K then compare equal."""
    return min(block[0], max(shape[0], 1)), min(block[1], max(shape[1], 1))


def block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """Blocks along each dimension of a 2-D ``shape``: ``[ceil(R/br), ceil(C/bc)]``."""
    return math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1])


@dataclass(frozen=True)
class BlockFloat8Tensor:
    """FP8 ``data [R, C]`` whose block ``(i, j)`` (rows ``i*br ...``, columns ``j*bc ...``)
    dequantizes as ``data * scale_inv[i, j]``."""

    data: torch.Tensor
    scale_inv: torch.Tensor  # [ceil(R/br), ceil(C/bc)] fp32
    fmt: FP8Format
    block: tuple[int, int]

    def __post_init__(self):
        if self.data.dtype != self.fmt.dtype or self.data.dim() != 2:
            raise TypeError(f"BlockFloat8Tensor {self.fmt}: data is {self.data.dtype}")
        grid = block_grid(tuple(self.data.shape), self.block)
        if self.scale_inv.dtype != torch.float32 or tuple(self.scale_inv.shape) != grid:
            raise TypeError(
                f"BlockFloat8Tensor: scale_inv {tuple(self.scale_inv.shape)} "
                f"{self.scale_inv.dtype} for data {tuple(self.data.shape)} in blocks "
                f"{self.block}: want {grid} fp32"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def t(self) -> BlockFloat8Tensor:
        """The transpose (a view of the bytes): blocks and scales transpose with it."""
        return BlockFloat8Tensor(
            self.data.t(), self.scale_inv.t(), self.fmt, (self.block[1], self.block[0])
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        # fp8 -> fp32 is exact; the one rounding is the product with the block's scale_inv.
        return scaled_value(self.data, self.scale_inv, self.block).to(dtype)


def per_element(t: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A per-block tensor ``[Rb, Cb]`` spread to one value per element of ``shape``."""
    (r, c), (br, bc) = shape, block
    return t.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :c]


def scaled_value(
    data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """The FP32 value of ``data`` stored with one scale (``block`` None: ``scale_inv`` is a
    single value) or one per ``block`` of a 2-D ``data`` (``scale_inv`` its grid)."""
    if block is None:
        return data.float() * scale_inv
    # Tiles broadcast against their scales: no per-element scale tensor is built.
    tiles = _tiled(data.float(), block) * scale_inv.float()[:, None, :, None]
    return _untiled(tiles, tuple(data.shape))


def _tiled(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """2-D ``x`` as ``[Rb, br, Cb, bc]`` (a view when the blocks divide it; partial last blocks
    padded with zeros otherwise), so per-block values broadcast as ``[Rb, 1, Cb, 1]``."""
    (r, c), (br, bc) = x.shape, block
    rb, cb = block_grid((r, c), block)
    if rb * br != r or cb * bc != c:
        x = F.pad(x, (0, cb * bc - c, 0, rb * br - r))
    return x.reshape(rb, br, cb, bc)


def _padded(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """2-D ``x`` with dimension ``dim`` zero-padded to ``size`` (the partial last block)."""
    short = size - x.shape[dim]
    if not short:
        return x
    return F.pad(x, (0, short) if dim == 1 else (0, 0, 0, short))


def _untiled(tiles: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``_tiled``'s inverse: ``[Rb, br, Cb, bc]`` back to a contiguous 2-D ``shape``, the
    padding of partial last blocks cut off."""
    r, c = shape
    return tiles.reshape(tiles.shape[0] * tiles.shape[1], -1)[:r, :c].contiguous()


def block_amax(x: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``max |x|`` over each block of a 2-D ``x``: ``[ceil(R/br), ceil(C/bc)]`` fp32. Partial
    last blocks are padded with zeros, which never raise an amax (NaN still propagates)."""
    return _tiled(x.detach(), block).abs().amax(dim=(1, 3)).float()


def quantize_blocks(
    x: torch.Tensor,
    fmt: FP8Format,
    block: tuple[int, int],
    margin: int = 0,
    power_of_two: bool = False,
) -> BlockFloat8Tensor:
    """Cast 2-D ``x`` to ``fmt`` with one current scale per block: ``fmt.max / amax /
    2**margin`` (a power of two at most that with ``power_of_two``), saturating, round to
    nearest even. A block of zeros (or one with a non-finite amax) gets scale 1."""
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks: a 2-D tensor, not {tuple(x.shape)}")
    block = fit_block(block, tuple(x.shape))
    data, scale, _ = cast_blocks(x, fmt, block, margin, power_of_two)
    return BlockFloat8Tensor(data, scale.reciprocal(), fmt, block)


def cast_blocks(
    x: torch.Tensor,
    fmt: FP8Format,
    block: tuple[int, int],
    margin: int = 0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``quantize_blocks``' cast as ``(bytes, scale grid, amax grid)``; ``fallback``: the scale
    of a block whose amax is zero or not finite (a tensor of the grid's shape, or a number;
    None: 1, made like the grid, so a compiled cast on a fake device makes no real tensor)."""
    tiles = _tiled(x.detach(), block)
    amax = tiles.abs().amax(dim=(1, 3)).float()
    scale = compute_scale(amax, fmt, margin, power_of_two, fallback)
    # Each tile times its own scale, broadcast: the per-element products of a spread scale
    # tensor without building it.
    data = cast_to_fp8(tiles, fmt, scale[:, None, :, None])
    return _untiled(data, tuple(x.shape)), scale, amax


def _k_blocks(a: BlockFloat8Tensor, b: BlockFloat8Tensor) -> int:
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"block_gemm: a {tuple(a.shape)} @ b {tuple(b.shape)}.T does not fit")
    if a.block[1] != b.block[1]:
        raise ValueError(
            f"block_gemm: the operands' blocks along K differ ({a.block[1]} and {b.block[1]})"
        )
    return a.block[1]


def block_gemm(
    a: BlockFloat8Tensor, b: BlockFloat8Tensor, out_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``a @ b.T`` -> ``[M, N]``: per K block, the FP32 product of the FP8 bytes times both
    operands' scales of that block, summed in FP32 (DeepSeek-V3's promoted accumulation)."""
    bk = _k_blocks(a, b)
    m, k = a.data.shape
    n = b.data.shape[0]
    a32, b32 = widen(a.data), widen(b.data)  # exact; once, not per K block
    acc = None
    for j in range(math.ceil(k / bk)):
        cols = slice(j * bk, (j + 1) * bk)
        part = a32[:, cols] @ b32[:, cols].t()
        sa = a.scale_inv[:, j].repeat_interleave(a.block[0])[:m]
        sb = b.scale_inv[:, j].repeat_interleave(b.block[0])[:n]
        part.mul_(sa[:, None]).mul_(sb[None, :])  # (product * sa) * sb, in place
        acc = part if acc is None else acc.add_(part)
    if acc is None:  # K = 0
        acc = torch.zeros(m, n, dtype=torch.float32, device=a.data.device)
    return acc.to(out_dtype)


def quantize_operand(
    x: torch.Tensor,
    fmt: FP8Format,
    block: tuple[int, int],
    transposed: bool = False,
    margin: int = 0,
    power_of_two: bool = False,
) -> BlockFloat8Tensor:
    """The operand ``[rows, K]`` of a GEMM that reduces over one dimension of 2-D ``x``: ``x``
    itself (K its columns), or with ``transposed`` ``xᵀ`` (K its rows), written transposed and
    contiguous. ``block``: the operand's, 1 x ``bk`` tiles along K, ``(1, K)`` one scale per
    row, or a weight's blocks (``x`` itself only: its blocks serve its transpose as they are,
    ``BlockFloat8Tensor.t()``). Bit for bit ``quantize_blocks(x or x.t(), fmt, block)``,
    computed on ``x`` as it lies (no high-precision transposed copy), with the scale grid of
    tiles K-block-major: ``[rows, Kb]`` with strides ``(1, rows)``, the layout cuBLASLt reads
    1 x 128 scales in, so no GEMM copies them (one per row: ``[rows, 1]`` contiguous, as
    ATen's row-wise scales must be)."""
    rows, k = x.shape[::-1] if transposed else x.shape
    block = fit_block(block, (rows, k))
    if block[0] != 1 or (block[1] == k and not transposed):
        if transposed:
            raise ValueError(f"quantize_operand: xᵀ in tiles along x's rows, not {block}")
        return quantize_blocks(x, fmt, block, margin, power_of_two)  # [Rb, Kb] as it is
    bk = block[1]
    kb = math.ceil(k / bk)
    if transposed:  # each scale from a bk x 1 column tile of x [K, rows]
        tiles = _padded(x.detach(), 0, kb * bk).reshape(kb, bk, rows)
        amax = tiles.abs().amax(1)
    else:  # from a 1 x bk row tile of x [rows, K], reduced from a [Kb, rows, bk] view
        tiles = _padded(x.detach(), 1, kb * bk).reshape(rows, kb, bk)
        amax = tiles.transpose(0, 1).abs().amax(-1)
    # Either way [Kb, rows] in memory: the same maxima and scale formula as quantize_blocks.
    scale = compute_scale(amax.float(), fmt, margin, power_of_two)
    if transposed:  # eagerly a 1-byte transposed copy; compiled, inductor may fold it into the cast
        data = cast_to_fp8(tiles, fmt, scale[:, None, :]).reshape(kb * bk, rows)[:k].t()
    else:
        data = cast_to_fp8(tiles, fmt, scale.t()[:, :, None]).reshape(rows, kb * bk)[:, :k]
    scale_inv = scale.reciprocal()
    scale_inv = scale_inv.reshape(rows, 1) if kb == 1 else scale_inv.t()
    return BlockFloat8Tensor(data.contiguous(), scale_inv, fmt, block)

"""The row- and block-scaled cast unit as Triton kernels on CUDA: one read of a tensor writes
both orientations (issue 35).

A GEMM operand ``x [M, K]`` of a row- or block-scaled linear is needed twice: along K
(``x8``) and, for the other GEMM that reads it, along M (``xt8 = x8ᵀ``, contiguous
``[K, M]``). ``blockwise.quantize_operand`` computes each of them from ``x`` as it lies, one
call (one read of ``x``, and eagerly a 1-byte transposed copy) per orientation. Here:

- ``quantize_pair`` at ``block``: one kernel, each program one 128 x 128 tile of ``x`` read
  once, the amaxes of its 128 row tiles (1 x 128 along K) and its 128 column tiles (xᵀ's
  1 x 128 along M), both casts and both scale grids written;
- ``quantize_pair`` at ``row``: two kernels, since a row's scale needs the amax of the whole
  row first: one read for the row and column amaxes (per-tile maxima, atomic max), one read
  for both casts and both scale vectors;
- ``quantize_weight``: a weight's 128 x 128 blocks and, where cuBLASLt reads it, the
  transposed contiguous copy of their bytes, from one read.

Bytes, scale grids and their layouts are ``quantize_operand``'s bit for bit (the CPU
emulation stays the reference: ``tests/test_triton_cast.py`` compares them under Triton's
interpreter on the CPU and on CUDA). The kernels are ``torch.library`` ops (``triton_op``,
``fp8train::cast_pair`` and ``fp8train::cast_blocks``), so ``torch.compile`` traces
them, ``fullgraph=True``, with no break; on fake tensors they only allocate.

Where they run is decided when a linear binds its backends (``bind``, from
``Linear._bind_gemm_backend``), never per call: a CUDA sm_90+ device and an importable
triton. The
answer reaches the cast as a constant argument of the autograd function. triton is imported
only then, so a CPU install without it imports fp8train as before.
"""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from . import device as _device
from .blockwise import WEIGHT_BLOCK, BlockFloat8Tensor, fit_block, operand_block
from .formats import E5M2, FP8Format

__all__ = ["available", "bind", "kernels", "quantize_pair", "quantize_weight"]

_kernels: list[ModuleType] = []  # fp8train.triton_cast_kernels, once imported


def available() -> bool:
    """Whether triton can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a None in sys.modules
        return False


def kernels() -> ModuleType:
    """``fp8train.triton_cast_kernels``: imports triton and registers the ops, once."""
    if not _kernels:
        from . import triton_cast_kernels

        _kernels.append(triton_cast_kernels)
    return _kernels[0]


def bind(device: torch.device | str) -> bool:
    """Whether casts on ``device`` run the kernels: on CUDA sm_90 or newer where triton
    imports, registering the ops now, at build time, not in a traced step. Elsewhere (the
    CPU, meta, older GPUs) False: ``blockwise.quantize_operand``. Not sm_89: some Triton
    releases lower fp32 -> FP8 there through fp16 (two roundings: not the emulation's bits);
    Hopper is what the kernels are for, and its lowering is what the tests check."""
    device = torch.device(device)
    capability = _device.cuda_capability(device) or (0, 0)  # None: no CUDA in this torch
    if device.type != "cuda" or not available() or capability < (9, 0):
        return False
    kernels()
    return True


def _scale_inv(grid: torch.Tensor, rows: int) -> torch.Tensor:
    """A ``[Kb, rows]`` scale_inv grid in ``quantize_operand``'s layout: ``[rows, Kb]`` with
    strides ``(1, rows)``, or ``[rows, 1]`` when ``Kb`` is 1 (a view either way)."""
    return grid.reshape(rows, 1) if grid.shape[0] == 1 else grid.t()


def quantize_pair(
    x: torch.Tensor,
    fmt: FP8Format,
    granularity: str,
    margin: int = 0,
    power_of_two: bool = False,
    write: tuple[bool, bool] = (True, True),
) -> tuple[BlockFloat8Tensor | None, BlockFloat8Tensor | None]:
    """``(x8, xt8)``: ``quantize_operand(x, fmt, block)`` and ``quantize_operand(x, fmt, block,
    transposed=True)`` of an activation or gradient ``x [M, K]`` (``granularity`` ``block``:
    1 x 128 tiles; ``row``: one scale per row, which for ``xt8`` is one per column of ``x``),
    from one read of ``x`` (two at ``row``). ``write``: which of the two to compute (None
    for the other)."""
    if not any(write):
        return None, None
    m, k = x.shape
    e5m2, per_row = fmt.dtype == E5M2.dtype, granularity == "row"
    x8, xt8, sinv, sinvt = kernels().cast_pair(x, per_row, e5m2, margin, power_of_two, *write)
    out = []
    for data, grid, (rows, cols), wanted in (
        (x8, sinv, (m, k), write[0]),
        (xt8, sinvt, (k, m), write[1]),
    ):
        block = fit_block(operand_block(granularity, False, cols), (rows, cols))
        out.append(BlockFloat8Tensor(data, _scale_inv(grid, rows), fmt, block) if wanted else None)
    return out[0], out[1]


def quantize_weight(
    w: torch.Tensor,
    fmt: FP8Format,
    margin: int = 0,
    power_of_two: bool = False,
    transposed: bool = False,
) -> tuple[BlockFloat8Tensor, BlockFloat8Tensor | None]:
    """``(w8, wt8)``: ``quantize_operand(w, fmt, (128, 128))`` and, with ``transposed``, its
    transpose with the bytes contiguous (``block_linear._transposed(w8, layouts=True)``),
    from one read of ``w``; else ``wt8`` is None."""
    block = fit_block(WEIGHT_BLOCK, tuple(w.shape))
    e5m2 = fmt.dtype == E5M2.dtype
    w8, wt8, sinv = kernels().cast_blocks(w, e5m2, margin, power_of_two, transposed)
    q = BlockFloat8Tensor(w8, sinv, fmt, block)
    if not transposed:
        return q, None
    return q, BlockFloat8Tensor(wt8, sinv.t(), fmt, (block[1], block[0]))

"""cuBLASLt's block-scaled FP8 GEMM (DeepSeek-V3's 1x128 and 128x128 scales) through
``torch.nn.functional.scaled_mm``: where it runs, the layout of its scales, and an emulation
of it that reads them as it does.

Where it runs is decided once per process and device type (``bind``), when a linear binds its
GEMM backend, never per call: sm_90 (cuBLASLt's 1x128/128x128 scaling is Hopper's), a torch
whose ``F.scaled_mm`` knows ``ScalingType.BlockWise1x128`` and ``BlockWise128x128``, and a
probe that runs the kernel on scales that differ from block to block (a misread scale shows)
at a K whose 128x128 scale grid needs padding, compared with ``blockwise.block_gemm`` by
DeepGEMM's criterion. One line says which path was bound and why. Everywhere else, and for
operands the kernel does not take (E5M2, K not a multiple of 128), the emulation runs.

The layouts, for an operand described as ``[R, K]`` (K reduced; the second operand too,
before its transposition into ``mat_b``), as ``aten/src/ATen/native/cuda/ScaledBlas.cpp``
checks them since pytorch#166752:

- 1 x 128 tiles: ``[R, Kb]`` with strides ``(1, R)``, K-block-major ("outer-dim-major").
  ``blockwise.quantize_operand`` writes them so.
- 128 x 128 blocks: ``[L4, Rb]`` with strides ``(1, L4)``: the ``[Rb, Kb]`` grid padded along
  K to ``L4 = roundup(Kb, 4)`` columns, transposed. Without the padding cuBLASLt reads its
  scales with the wrong stride and the results are silently wrong. The grid is padded here,
  at the GEMM (``kernel_scale``): a weight's grid is tiny, and O3's stored grid keeps its
  shape for the optimizer and the checkpoint.

``mat_a`` is row-major ``[M, K]``; ``mat_b`` column-major ``[K, N]``, the transposed view of a
contiguous ``[N, K]`` operand. Both E4M3: the block recipe's gradients are E4M3 too.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import device as _device
from .blockwise import (
    BLOCK,
    WEIGHT_BLOCK,
    BlockFloat8Tensor,
    block_gemm,
    quantize_blocks,
    quantize_operand,
)
from .formats import E4M3

__all__ = [
    "BlockKernel",
    "bind",
    "block_scaled_mm",
    "bound",
    "deepgemm_difference",
    "emulated_scaled_mm",
    "fits",
    "kernel_scale",
    "probe_reason",
]

TILE = (1, BLOCK)
RECIPES = {TILE: "BlockWise1x128", WEIGHT_BLOCK: "BlockWise128x128"}  # F.ScalingType names
_HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockKernel:
    """What this device's block-scaled GEMM takes (``bind``'s probe): the output dtypes it
    writes correctly and whether it adds a 16-bit bias in its epilogue; ``line``: what was
    bound, in words."""

    out_dtypes: tuple[torch.dtype, ...]
    fuses_bias: bool
    line: str


# A plan on meta stands for a Hopper run: it takes the kernel (its shapes, its FLOPs).
PLANNED = BlockKernel((torch.bfloat16, torch.float32), False, "planned: cuBLASLt's kernel")
_bound: dict[str, BlockKernel | None] = {}  # device type -> the kernel, None: the emulation


def _strides_ok(t: torch.Tensor, strides: tuple[int, int]) -> bool:
    # ATen's rule: a dimension of size 1 has no meaningful stride.
    return all(size <= 1 or have == want for size, have, want in zip(t.shape, t.stride(), strides))


def _l4(kb: int) -> int:
    return 4 * math.ceil(kb / 4)


def kernel_scale(q: BlockFloat8Tensor) -> torch.Tensor:
    """``q``'s scales (``scale_inv``) in the layout cuBLASLt reads, ``q`` an operand
    ``[R, K]``: 1 x 128 tiles' ``[R, Kb]`` K-block-major (as the cast unit wrote them; a grid
    cast elsewhere, e.g. all-gathered rows, is laid out here), 128 x 128 blocks' ``[Rb, Kb]``
    grid padded with zeros to ``[Rb, L4]`` and transposed: ``[L4, Rb]``, strides ``(1, L4)``."""
    grid = q.scale_inv
    if q.block[0] == 1:
        if not _strides_ok(grid, (1, grid.shape[0])):
            grid = grid.t().contiguous().t()
        return grid
    rb, kb = grid.shape
    padded = grid.new_zeros(rb, _l4(kb))
    padded[:, :kb] = grid
    return padded.t()


def _scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out_dtype):
    """The kernel: ``F.scaled_mm`` (recipes by ``F.ScalingType`` name). A module-level name
    so that a test can put ``emulated_scaled_mm`` in its place on the CPU."""
    kinds = F.ScalingType
    return F.scaled_mm(
        mat_a,
        mat_b,
        scale_a,
        getattr(kinds, recipe_a),
        scale_b,
        getattr(kinds, recipe_b),
        bias=bias,
        output_dtype=out_dtype,
    )


def _kernel_out(
    kernel: BlockKernel, out_dtype: torch.dtype, bias: torch.Tensor | None
) -> tuple[torch.dtype | None, bool]:
    """``(the dtype the kernel writes, whether it adds the bias)`` for ``out_dtype`` (+
    ``bias``): a 16-bit bias of the output's dtype in its epilogue where it fuses one, else
    FP32 with the bias added after it; a dtype of None: it cannot."""
    fused = bias is not None and kernel.fuses_bias and out_dtype in _HALF
    fused = fused and bias.dtype == out_dtype
    if bias is not None and not fused:
        out_dtype = torch.float32
    return (out_dtype if out_dtype in kernel.out_dtypes else None), fused


def fits(
    kernel: BlockKernel | None,
    a: BlockFloat8Tensor,
    b: BlockFloat8Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> bool:
    """Whether ``kernel`` takes ``a @ b.T``: E4M3 both, ``a`` in 1 x 128 tiles, ``b`` in 1 x 128
    tiles or 128 x 128 blocks, K a multiple of 128 (no partial K block), the outer dimensions
    multiples of 16 (of 128 for a 128 x 128 operand), and an output it writes."""
    if kernel is None or a.fmt is not E4M3 or b.fmt is not E4M3:
        return False
    if a.block != TILE or b.block not in RECIPES:
        return False
    (m, k), n = a.shape, b.shape[0]
    if k % BLOCK or m % 16 or n % (BLOCK if b.block == WEIGHT_BLOCK else 16):
        return False
    return _kernel_out(kernel, out_dtype, bias)[0] is not None


def block_scaled_mm(
    a: BlockFloat8Tensor,
    b: BlockFloat8Tensor,
    out_dtype: torch.dtype,
    kernel: BlockKernel,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` -> ``[M, N]`` on the kernel (``fits`` said it takes them). The
    operands' bytes are read as the cast unit wrote them: ``a.data`` row-major, ``b.data``
    ``[N, K]`` contiguous, whose transpose is the column-major ``mat_b``."""
    out, fused = _kernel_out(kernel, out_dtype, bias)
    y = _scaled_mm(
        a.data.contiguous(),  # no-ops for the cast unit's operands
        b.data.contiguous().t(),
        kernel_scale(a),
        RECIPES[a.block],
        kernel_scale(b),
        RECIPES[b.block],
        bias if fused else None,
        out,
    )
    if bias is None or fused:
        return y
    return (y + bias.float()).to(out_dtype)


def _read_scales(scale: torch.Tensor, recipe: str, rows: int, k: int, name: str) -> torch.Tensor:
    """The ``[rows / block, Kb]`` grid the kernel reads from ``scale``, refused as ATen
    refuses a layout cuBLASLt would misread."""
    kb = math.ceil(k / BLOCK)
    if recipe == RECIPES[TILE]:
        shape, strides = (rows, kb), (1, rows)
    elif recipe == RECIPES[WEIGHT_BLOCK]:
        shape, strides = (_l4(kb), math.ceil(rows / BLOCK)), (1, _l4(kb))
    else:
        raise ValueError(f"{name}: recipe {recipe!r} is not a block recipe")
    if (
        tuple(scale.shape) != shape
        or not _strides_ok(scale, strides)
        or scale.dtype != torch.float32
    ):
        raise ValueError(
            f"{name}: {recipe} scales are read as {shape} fp32 with strides {strides}; got "
            f"{tuple(scale.shape)} {scale.dtype} with strides {scale.stride()}"
        )
    # From memory (from the tensor's own offset), with the kernel's strides.
    raw = scale.as_strided(shape, strides)
    return raw if recipe == RECIPES[TILE] else raw[:kb].t()


def emulated_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out_dtype):
    """What the kernel computes, with ``_scaled_mm``'s arguments: the operands and scales read
    from memory the way cuBLASLt reads them (a layout it would misread is refused, as ATen
    does), then ``blockwise.block_gemm``. On the CPU it stands in for the kernel, so the
    layouts the GEMM path hands it are tested against the emulation on the original scales."""
    (m, k), n = mat_a.shape, mat_b.shape[1]
    if mat_a.dtype != E4M3.dtype or mat_b.dtype != E4M3.dtype:
        raise ValueError(f"block-scaled GEMM: E4M3 operands, got {mat_a.dtype}, {mat_b.dtype}")
    if not _strides_ok(mat_a, (k, 1)) or not _strides_ok(mat_b, (1, k)):
        raise ValueError("block-scaled GEMM: mat_a row-major, mat_b column-major")
    blocks = {name: block for block, name in RECIPES.items()}
    a = BlockFloat8Tensor(
        mat_a, _read_scales(scale_a, recipe_a, m, k, "scale_a"), E4M3, blocks[recipe_a]
    )
    b_rows = mat_b.t()  # [N, K] row-major: the same bytes
    b = BlockFloat8Tensor(
        b_rows, _read_scales(scale_b, recipe_b, n, k, "scale_b"), E4M3, blocks[recipe_b]
    )
    y = block_gemm(a, b, torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def deepgemm_difference(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's test criterion, ``1 - 2 sum(x y) / sum(x^2 + y^2)`` in float64: 0 for equal
    tensors, about half the mean squared relative error for close ones; < 1e-3 passes."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    return (1 - 2 * (x * y).sum() / denominator).item() if denominator > 0 else 0.0


def probe_reason(has_api: bool, capability: tuple[int, int] | None) -> str | None:
    """Why the kernel cannot run here before trying it (None: try it)."""
    if not has_api:
        return (
            f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with "
            "ScalingType.BlockWise1x128/BlockWise128x128"
        )
    if capability != (9, 0):
        have = "no CUDA device" if capability is None else f"sm_{capability[0]}{capability[1]}"
        return f"cuBLASLt's 1x128/128x128 scaling runs on sm_90 only ({have})"
    return None


def _has_api() -> bool:
    kinds = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and all(hasattr(kinds, n) for n in RECIPES.values())


def _probe_operands(device: torch.device):
    """Operands at K = 384 (3 K blocks: the 128x128 grid is padded to 4) whose scales differ
    from block to block and from row to row by powers of two, so a misread scale shows."""
    gen = torch.Generator().manual_seed(0)
    k_binades = 2.0 ** (3 * torch.arange(3)).repeat_interleave(BLOCK)  # 1, 8, 64 per K block

    def operand(rows: torch.Tensor) -> torch.Tensor:
        values = torch.randn(len(rows), 3 * BLOCK, generator=gen) * k_binades
        return (values * 2.0 ** rows[:, None]).to(device)

    x = quantize_operand(operand(torch.arange(128) % 5 - 2), E4M3, TILE)
    w = quantize_blocks(operand(4 * (torch.arange(256) // BLOCK)), E4M3, WEIGHT_BLOCK)
    g = quantize_operand(operand(torch.arange(128) % 3 - 1), E4M3, TILE)
    return x, w, g, torch.randn(256, generator=gen).to(device)


def _try(device: torch.device, out_dtype: torch.dtype, with_bias: bool) -> str | None:
    """None when the kernel agrees with the emulation at both recipe pairs, else why not."""
    x, w, g, bias = _probe_operands(device)
    bias = bias.to(out_dtype) if with_bias else None
    kernel = BlockKernel((out_dtype,), with_bias, "")
    for a, b in ((x, w), (x, g)):
        shape = f"{a.shape[0]}x{a.shape[1]}x{b.shape[0]} {RECIPES[a.block]} x {RECIPES[b.block]}"
        bias_b = None if bias is None or b is not w else bias
        try:
            got = block_scaled_mm(a, b, out_dtype, kernel, bias_b)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as err:
            first = str(err).strip().splitlines()[0][:160] if str(err).strip() else ""
            return f"F.scaled_mm refused {shape} ({type(err).__name__}: {first})"
        want = block_gemm(a, b, torch.float32)
        if bias_b is not None:
            want = want + bias_b.float()
        diff = deepgemm_difference(got, want)
        if not diff < 1e-3:
            return f"F.scaled_mm disagreed with the emulation at {shape} (difference {diff:.3g})"
    return None


def _probe(device: torch.device) -> tuple[BlockKernel | None, str]:
    reason = probe_reason(_has_api(), _device.cuda_capability(device))
    if reason is None:
        reason = _try(device, torch.bfloat16, with_bias=False)
    if reason is not None:
        return None, f"the emulation (blockwise.block_gemm): {reason}"
    outs = (torch.bfloat16,) + (
        (torch.float32,) if _try(device, torch.float32, False) is None else ()
    )
    fuses = _try(device, torch.bfloat16, with_bias=True) is None
    line = (
        "cuBLASLt via torch.nn.functional.scaled_mm (BlockWise1x128 x BlockWise128x128 and "
        f"x BlockWise1x128; out {', '.join(str(d).removeprefix('torch.') for d in outs)}; "
        f"bias {'in the epilogue' if fuses else 'added after'})"
    )
    return BlockKernel(outs, fuses, line), line


def _say(line: str) -> None:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    print(line, file=sys.stderr, flush=True)


def bind(device: torch.device | str) -> BlockKernel | None:
    """The block-scaled GEMM for ``device``'s type, decided once per process: on CUDA the
    checks and the probe (one line on stderr, from rank 0, says which path was bound), on meta
    the kernel a plan assumes, elsewhere None (the emulation)."""
    device = torch.device(device)
    if device.type == "meta":
        return PLANNED
    if device.type not in _bound:
        kernel, line = _probe(device) if device.type == "cuda" else (None, "")
        _bound[device.type] = kernel
        if device.type == "cuda":
            name = _device.device_name(device)
            _say(f"fp8train: block-scaled FP8 GEMMs on {name} (torch {torch.__version__}): {line}")
    return _bound[device.type]


def bound(device: torch.device) -> BlockKernel | None:
    """What ``bind`` decided for ``device``'s type. A linear binds it at build time
    (``gemm.prepare_scaled_gemm``); an eager GEMM on CUDA that finds it undecided binds it
    then, a compiled one (which cannot run the probe) takes the emulation."""
    if device.type == "meta":
        return PLANNED
    if device.type in _bound:
        return _bound[device.type]
    if device.type != "cuda" or torch.compiler.is_compiling():
        return None
    return bind(device)

"""The FP8 GEMM: ``a @ b.T`` of two ``Float8Tensor`` with their scales applied.

Two backends compute the same thing:

- "scaled_mm": ``torch._scaled_mm`` (FP8 tensor cores on CUDA sm89+; ATen's reference kernel
  on CPU, ``call_scaled_mm``). cuBLASLt wants the first operand row-major, the second
  column-major, K and N multiples of 16, and never E5M2 x E5M2; shapes that do not fit go to
  "emulated".
- "emulated": upcast both FP8 operands to fp32 (exact), fp32 matmul, multiply by both
  ``scale_inv``. FP8 x FP8 products are exact in fp32 (and in TF32, should a CUDA fp32 matmul
  use it), so this matches the hardware's fp32 accumulation up to summation order and the
  rounding of the final scale multiply.

Which one runs is the caller's to say (``fp8_gemm``'s ``backend``, the emulation when none is
given): choosing, and the race behind "auto", live in ``fp8train.gemm_backend``, which imports
this module and never the other way round.

Row- and block-scaled operands (``BlockFloat8Tensor``) on "scaled_mm": row-wise scales go to
``torch._scaled_mm`` (scale_a ``[M, 1]``, scale_b ``[1, N]``) where the device takes them,
1 x 128 / 128 x 128 ones to cuBLASLt's block-scaled GEMM where ``block_scaled_mm.bind`` found
it working; the rest, and every block-scaled GEMM on the CPU, to ``blockwise.block_gemm``.
What a device takes is probed once, when a linear binds its backend (``prepare_scaled_gemm``),
so a compiled GEMM reads a decided answer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

from . import block_scaled_mm
from . import device as _device
from .blockwise import BlockFloat8Tensor, block_gemm
from .formats import E4M3, E5M2, widen
from .tensor import Float8Tensor

__all__ = [
    "BACKENDS",
    "Gemm",
    "backend_gemms",
    "call_scaled_mm",
    "check_backend",
    "cpu_takes_rowwise",
    "fits_scaled_mm",
    "fp8_gemm",
    "prepare_scaled_gemm",
    "scaled_mm_available",
]

BACKENDS = ("scaled_mm", "emulated")
_available: dict[str, bool] = {}  # device type -> torch._scaled_mm works there


def check_backend(name: str) -> str:
    """``name`` if it is a backend, else a ValueError listing them."""
    if name not in BACKENDS:
        raise ValueError(f"FP8 GEMM backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def call_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm``; on the CPU with oneDNN switched off for the call, so that ATen's
    reference kernel runs: upcast and an FP32 GEMM, the same bits on every x86 CPU. oneDNN's
    FP8 kernels depend on the instruction set, and on an Intel Xeon with AVX-512 one took
    11.2 s at 2048x256x768 where the reference took 11 ms, with equal results (2026-11-27)."""
    if mat1.device.type != "cpu":
        return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    if torch.compiler.is_compiling():
        return _reference_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype)
    # Eagerly, the same kernel without the operator: a custom operator's first call costs
    # about 2 s per process on 2 cores (every rank of every multi-rank test paid it).
    return _without_onednn(mat1, mat2, scale_a, scale_b, out_dtype)


def _without_onednn(mat1, mat2, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


# An operator of its own for compiled graphs, opaque to torch.compile: switching oneDNN off
# and on again is host state that dynamo cannot trace (each call would break the graph), and
# inside the operator the compiled step runs the very kernel the eager one does.
@torch.library.custom_op("fp8train::reference_scaled_mm", mutates_args=())
def _reference_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return _without_onednn(mat1, mat2, scale_a, scale_b, out_dtype)


@_reference_scaled_mm.register_fake
def _(mat1, mat2, scale_a, scale_b, out_dtype):
    return mat1.new_empty((mat1.shape[0], mat2.shape[1]), dtype=out_dtype)


@register_flop_formula(torch.ops.fp8train.reference_scaled_mm)
def _(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # torch.utils.flop_counter's count for aten._scaled_mm: FLOP counts see the same GEMM.
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def scaled_mm_available(device: torch.device | str) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on this device type (tried once, then cached)."""
    device = torch.device(device)
    if device.type not in _available:
        ok = hasattr(torch, "_scaled_mm")
        cap = _device.cuda_capability(device)
        if ok and device.type == "cuda":
            ok = cap is not None and cap >= (8, 9)  # FP8 tensor cores start with Ada
        if ok:
            try:
                one = torch.ones((), device=device)
                a = torch.zeros(16, 16, device=device).to(E4M3.dtype)
                call_scaled_mm(a, a.t(), one, one, torch.float32)
            except (RuntimeError, NotImplementedError):
                ok = False
        _available[device.type] = ok
    return _available[device.type]


def fits_scaled_mm(a: Float8Tensor, b: Float8Tensor) -> bool:
    """Whether ``torch._scaled_mm`` takes this per-tensor pair (else "emulated" runs it)."""
    if a.fmt is E5M2 and b.fmt is E5M2:
        return False
    # CUDA's layout rule; also on meta, where a plan (training/planning/rank_plan.py) stands
    # for a GPU.
    if a.data.device.type in ("cuda", "meta"):
        k, n = a.shape[1], b.shape[0]
        return k % 16 == 0 and n % 16 == 0
    return True


def _gemm_scaled_mm(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    # contiguous() is a no-op for the forward GEMM and an FP8 (1 byte/elem) transpose copy for
    # the two backward GEMMs, whose operands arrive as transposed views.
    mat1 = a.data.contiguous()
    mat2 = b.data.contiguous().t()  # column-major [K, N]
    return call_scaled_mm(mat1, mat2, a.scale_inv, b.scale_inv, out_dtype)


def _fuses_bias(a: Float8Tensor, out_dtype: torch.dtype, bias: torch.Tensor) -> bool:
    """Whether cuBLASLt adds ``bias`` itself (its epilogue): on CUDA, for a 16-bit output and
    a bias of that dtype. Elsewhere the GEMM writes FP32 and the bias is added in FP32 before
    the one rounding to ``out_dtype``, the CPU reference's order."""
    on_cuda = a.data.device.type == "cuda"
    return on_cuda and out_dtype in (torch.bfloat16, torch.float16) and bias.dtype == out_dtype


def _gemm_cublas(
    a: Float8Tensor,
    b: Float8Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """CUDA's ``torch._scaled_mm``, writing ``out_dtype`` directly, with the bias and the
    accumulation mode the caller asks for."""
    mat2 = b.data.contiguous().t()  # column-major [K, N]
    return torch._scaled_mm(
        a.data.contiguous(),
        mat2,
        scale_a=a.scale_inv,
        scale_b=b.scale_inv,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _gemm_scaled_mm_rowwise(
    a: BlockFloat8Tensor,
    b: BlockFloat8Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    # Row-wise scales as cuBLASLt and ATen take them: scale_a [M, 1], scale_b [1, N]. The
    # cast unit (blockwise.quantize_operand) wrote the operands and each scale column
    # contiguous, so these contiguous() calls are no-ops.
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()
    scale_a, scale_b = a.scale_inv.contiguous(), b.scale_inv.t().contiguous()
    if a.data.device.type == "cpu":
        return call_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype)
    return torch._scaled_mm(
        mat1,
        mat2,
        scale_a=scale_a,
        scale_b=scale_b,
        bias=bias,
        out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def _gemm_emulated(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    acc = widen(a.data) @ widen(b.data).t()
    return acc.mul_(a.scale_inv * b.scale_inv).to(out_dtype)


def _rowwise_fits_scaled_mm(
    a: BlockFloat8Tensor, b: BlockFloat8Tensor, out_dtype: torch.dtype
) -> bool:
    k = a.shape[1]
    if a.block != (1, k) or b.block != (1, k) or (a.fmt is E5M2 and b.fmt is E5M2):
        return False  # block scales: no kernel here takes them (the emulation does)
    if a.data.device.type in ("cuda", "meta"):
        # cuBLASLt's row-wise scaling writes BF16 only, and wants K and N multiples of 16.
        return out_dtype == torch.bfloat16 and k % 16 == 0 and b.shape[0] % 16 == 0
    return cpu_takes_rowwise()


_cpu_rowwise: list[bool] = []  # the answer of cpu_takes_rowwise, once known


def cpu_takes_rowwise() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.13 does; 2.11 takes
    per-tensor scales only there). Tried once per process (the first call costs about 2 s
    on a 2-core CPU: only row-wise linears ask), when such a linear binds its backend
    (``Linear._bind_gemm_backend``, at build time): a compiled GEMM then reads a constant."""
    if not _cpu_rowwise:
        a = torch.zeros(16, 16).to(E4M3.dtype)
        try:
            call_scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), torch.float32)
            _cpu_rowwise.append(True)
        except (RuntimeError, NotImplementedError):
            _cpu_rowwise.append(False)
    return _cpu_rowwise[0]


def prepare_scaled_gemm(device: torch.device | str, granularity: str) -> None:
    """What a linear that binds the "scaled_mm" backend at ``granularity`` on ``device``
    asks once, at build time, so that no GEMM, compiled or not, probes the device: whether
    the CPU's ``_scaled_mm`` takes row-wise scales, whether CUDA's block-scaled kernel runs
    (``block_scaled_mm.bind``, which says in one line which path it bound)."""
    device = torch.device(device)
    if granularity == "row" and device.type == "cpu":
        cpu_takes_rowwise()
    elif granularity == "block":
        block_scaled_mm.bind(device)


def fp8_gemm(
    a: Float8Tensor | BlockFloat8Tensor,
    b: Float8Tensor | BlockFloat8Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "emulated",
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` with scales applied: a [M, K], b [N, K] -> [M, N] in ``out_dtype``.

    Per-tensor operands (``Float8Tensor``) or per-row/per-block ones (``BlockFloat8Tensor``,
    both sides alike). ``backend``: "emulated" (exact) unless given; a caller that wants the
    machine's pick passes ``gemm_backend.select_gemm_backend(device)``, bound once, as
    ``fp8train.Linear`` does at build time (this function reads no global and no
    environment). Row-wise operands take ``torch._scaled_mm`` where it accepts them,
    1 x 128 / 128 x 128 ones cuBLASLt's block-scaled GEMM where it was bound
    (``prepare_scaled_gemm``), the rest the exact emulation (``blockwise.block_gemm``).

    ``bias`` [N]: added before the one rounding to ``out_dtype``; on CUDA, per tensor with a
    16-bit output, inside the GEMM (``_fuses_bias``). ``fast_accum``: cuBLASLt's faster,
    less often promoted FP8 accumulation (Transformer Engine and torchao take it for the
    forward GEMM only); ignored by the CPU and the emulation.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} @ b {tuple(b.shape)}.T does not fit")
    check_backend(backend)
    blocked = isinstance(a, BlockFloat8Tensor), isinstance(b, BlockFloat8Tensor)
    if any(blocked):
        if not all(blocked):
            raise TypeError("fp8_gemm: both operands per tensor, or both per row/block")
        return _blocked_gemm(a, b, out_dtype, backend, bias, fast_accum)
    if backend == "scaled_mm" and fits_scaled_mm(a, b):
        if a.data.device.type == "cuda":
            fused = bias is not None and _fuses_bias(a, out_dtype, bias)
            if bias is None or fused:
                return _gemm_cublas(a, b, out_dtype, bias, fast_accum)
            return (_gemm_cublas(a, b, torch.float32, None, fast_accum) + bias.float()).to(
                out_dtype
            )
        gemm = _gemm_scaled_mm
    else:
        gemm = _gemm_emulated
    if bias is None:
        return gemm(a, b, out_dtype)
    return (gemm(a, b, torch.float32) + bias.float()).to(out_dtype)


def _blocked_gemm(
    a: BlockFloat8Tensor,
    b: BlockFloat8Tensor,
    out_dtype: torch.dtype,
    backend: str,
    bias: torch.Tensor | None,
    fast_accum: bool,
) -> torch.Tensor:
    """``fp8_gemm`` of row- or block-scaled operands: row-wise on ``torch._scaled_mm`` (on
    CUDA with the bias in its epilogue), 1 x 128 / 128 x 128 on the block-scaled kernel where
    it was bound, else the emulation; the bias added in FP32 before the one rounding where no
    kernel adds it."""
    if backend == "scaled_mm":
        device = a.data.device
        # cuBLASLt adds a bias of the output's dtype in its epilogue; the CPU's adds none.
        takes_bias = bias is None or (device.type != "cpu" and bias.dtype == out_dtype)
        if takes_bias and _rowwise_fits_scaled_mm(a, b, out_dtype):
            return _gemm_scaled_mm_rowwise(a, b, out_dtype, bias, fast_accum)
        kernel = block_scaled_mm.bound(device)
        if block_scaled_mm.fits(kernel, a, b, out_dtype, bias):
            return block_scaled_mm.block_scaled_mm(a, b, out_dtype, kernel, bias)
    if bias is not None:
        y = _blocked_gemm(a, b, torch.float32, backend, None, fast_accum)
        return (y + bias.float()).to(out_dtype)
    return block_gemm(a, b, out_dtype)


Gemm = Callable[[Float8Tensor, Float8Tensor, torch.dtype], torch.Tensor]


def backend_gemms(device: torch.device | str) -> dict[str, Gemm]:
    """Name -> per-tensor GEMM of the backends that run on ``device``, emulation first (what
    ``gemm_backend`` races and measures)."""
    fns: dict[str, Gemm] = {"emulated": _gemm_emulated}
    if scaled_mm_available(device):
        fns["scaled_mm"] = _gemm_scaled_mm
    return fns

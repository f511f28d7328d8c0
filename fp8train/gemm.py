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

"auto" races the backends once per machine (``race_gemm_backends``): a small probe first, then
the representative shape, a backend dropped as soon as it is clearly slower, so a pathological
kernel (seen: a CPU whose oneDNN FP8 GEMM took 11.6 s where emulation took 10 ms) costs a
second, not minutes. scaled_mm must beat emulation by 10% (near-ties would flip between
machines and runs). The pick is stored per machine (``fp8train.machine_cache``): the processes
of a run, and of a test suite, measure once between them. A run that must reproduce another
bit for bit should pin the backend (``set_gemm_backend`` or the ``FP8TRAIN_GEMM_BACKEND``
environment variable), because the two differ in the last fp32 bits.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
from torch.utils.flop_counter import register_flop_formula

from . import device as _device
from .blockwise import BlockFloat8Tensor, block_gemm
from .formats import E4M3, E5M2
from .machine_cache import remember
from .tensor import Float8Tensor

__all__ = [
    "BACKENDS",
    "call_scaled_mm",
    "fp8_gemm",
    "measure_gemm_backends",
    "race_gemm_backends",
    "scaled_mm_available",
    "select_gemm_backend",
    "set_gemm_backend",
]

BACKENDS = ("scaled_mm", "emulated")
ENV_VAR = "FP8TRAIN_GEMM_BACKEND"

_forced: str | None = None
_auto_choice: dict[str, str] = {}  # device type -> backend chosen by the race (this process)
_available: dict[str, bool] = {}  # device type -> torch._scaled_mm works there

# "auto" takes scaled_mm only when it is clearly faster: where the two are close (CPU) a
# coin-flip choice would change the last bits of results from one process to the next.
_AUTO_MARGIN = 0.9
# Shapes timed by "auto": big enough that kernel launch costs do not decide. (M, K, N)
_AUTO_SHAPE = {"cpu": (2048, 256, 768), "cuda": (8192, 4096, 4096)}
# The probe before them: 1/24 (CPU) and 1/16 (CUDA) of the work, enough to expose a kernel
# that is orders of magnitude off without paying for it at full size.
_PROBE_SHAPE = {"cpu": (256, 256, 256), "cuda": (2048, 2048, 2048)}
# A backend this many times slower than the best so far leaves the race. Far above timing
# noise and warm-up effects (a few tens of percent), far below a broken kernel (100x+).
_DROP_RATIO = 3.0


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"FP8 GEMM backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def set_gemm_backend(name: str | None) -> None:
    """Force a backend for every device ("scaled_mm" | "emulated"); None or "auto" undoes it."""
    global _forced
    _forced = None if name in (None, "auto") else _check_name(name)


def call_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """``torch._scaled_mm``; on the CPU with oneDNN switched off for the call, so that ATen's
    reference kernel runs: upcast and an FP32 GEMM, the same bits on every x86 CPU. oneDNN's
    FP8 kernels depend on the instruction set, and on an Intel Xeon with AVX-512 one took
    11.2 s at 2048x256x768 where the reference took 11 ms, with equal results (2026-11-27)."""
    if mat1.device.type != "cpu":
        return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    return _reference_scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype)


# An operator of its own, opaque to torch.compile: switching oneDNN off and on again is host
# state that dynamo cannot trace (each call would break the graph), and inside the operator
# the compiled step runs the very kernel the eager one does.
@torch.library.custom_op("fp8train::reference_scaled_mm", mutates_args=())
def _reference_scaled_mm(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)
    finally:
        torch._C._set_mkldnn_enabled(enabled)


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


def _fits_scaled_mm(a: Float8Tensor, b: Float8Tensor) -> bool:
    if a.fmt is E5M2 and b.fmt is E5M2:
        return False
    # CUDA's layout rule; also on meta, where a plan (training/planner.py) stands for a GPU.
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
    a: BlockFloat8Tensor, b: BlockFloat8Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    # Row-wise scales as cuBLASLt and ATen take them: scale_a [M, 1], scale_b [1, N].
    mat1, mat2 = a.data.contiguous(), b.data.contiguous().t()
    scale_b = b.scale_inv.t().contiguous()
    return call_scaled_mm(mat1, mat2, a.scale_inv.contiguous(), scale_b, out_dtype)


def _gemm_emulated(a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    acc = a.data.float() @ b.data.float().t()
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
    return _cpu_takes_rowwise()


_cpu_rowwise: list[bool] = []  # the answer of _cpu_takes_rowwise, once known


def _cpu_takes_rowwise() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.13 does; 2.11 takes
    per-tensor scales only there). Tried once per process, when a backend is selected for
    the CPU (build time): a compiled GEMM then reads a constant."""
    if not _cpu_rowwise:
        a = torch.zeros(16, 16).to(E4M3.dtype)
        try:
            call_scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), torch.float32)
            _cpu_rowwise.append(True)
        except (RuntimeError, NotImplementedError):
            _cpu_rowwise.append(False)
    return _cpu_rowwise[0]


def fp8_gemm(
    a: Float8Tensor | BlockFloat8Tensor,
    b: Float8Tensor | BlockFloat8Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str | None = None,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``a @ b.T (+ bias)`` with scales applied: a [M, K], b [N, K] -> [M, N] in ``out_dtype``.

    Per-tensor operands (``Float8Tensor``) or per-row/per-block ones (``BlockFloat8Tensor``,
    both sides alike). ``backend`` None means the selected one for a's device (see
    ``select_gemm_backend``); row-wise operands take ``torch._scaled_mm`` where it accepts
    them, block-wise ones always the exact emulation (``blockwise.block_gemm``).

    ``bias`` [N]: added before the one rounding to ``out_dtype``; on CUDA, per tensor with a
    16-bit output, inside the GEMM (``_fuses_bias``). ``fast_accum``: cuBLASLt's faster,
    less often promoted FP8 accumulation (Transformer Engine and torchao take it for the
    forward GEMM only); ignored by the CPU and the emulation.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"fp8_gemm: a {tuple(a.shape)} @ b {tuple(b.shape)}.T does not fit")
    backend = _check_name(backend) if backend else select_gemm_backend(a.data.device)
    blocked = isinstance(a, BlockFloat8Tensor), isinstance(b, BlockFloat8Tensor)
    if any(blocked):
        if not all(blocked):
            raise TypeError("fp8_gemm: both operands per tensor, or both per row/block")
        if bias is not None:
            return (fp8_gemm(a, b, torch.float32, backend) + bias.float()).to(out_dtype)
        if backend == "scaled_mm" and _rowwise_fits_scaled_mm(a, b, out_dtype):
            return _gemm_scaled_mm_rowwise(a, b, out_dtype)
        return block_gemm(a, b, out_dtype)
    if backend == "scaled_mm" and _fits_scaled_mm(a, b):
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


def _time_ms(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: kernel selection, allocator
    _device.synchronize(device)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _device.synchronize(device)
        best = min(best, time.perf_counter() - t0)  # min: least disturbed by other load
    return best * 1e3


Gemm = Callable[[Float8Tensor, Float8Tensor, torch.dtype], torch.Tensor]


def _backends(device: torch.device) -> dict[str, Gemm]:
    """The backends that run on ``device``, emulation first."""
    fns: dict[str, Gemm] = {"emulated": _gemm_emulated}
    if scaled_mm_available(device):
        fns["scaled_mm"] = _gemm_scaled_mm
    return fns


def _operands(device: torch.device, shape: tuple[int, int, int]):
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    one = torch.ones((), device=device)
    a = Float8Tensor.quantize(torch.randn(m, k, generator=gen).to(device), E4M3, one)
    b = Float8Tensor.quantize(torch.randn(n, k, generator=gen).to(device), E4M3, one)
    return a, b


def measure_gemm_backends(
    device: torch.device | str, shape: tuple[int, int, int] | None = None, reps: int = 5
) -> dict[str, float]:
    """Milliseconds per FP8 GEMM of each available backend for ``shape`` = (M, K, N), best of
    ``reps`` after a warm-up, every backend timed in full (a benchmark's view; ``auto`` uses
    ``race_gemm_backends``)."""
    device = torch.device(device)
    a, b = _operands(device, shape or _AUTO_SHAPE.get(device.type, _AUTO_SHAPE["cpu"]))
    fns = {
        name: fn
        for name, fn in _backends(device).items()
        if name == "emulated" or _fits_scaled_mm(a, b)
    }
    # Interleaved rounds, best of each: a process's first timings (thread pool start, page
    # faults) and bursts of other load then hit both backends alike instead of one.
    out = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            out[name] = min(out[name], _time_ms(lambda fn=fn: fn(a, b, torch.float32), device, 1))
    return out


def _race_round(fns, a, b, device, best, drop) -> None:
    """One timed call of each backend in ``fns`` on ``a @ b.T``, kept in ``best``; then the
    clearly slower ones leave ``fns`` (when ``drop``)."""
    for name, fn in fns.items():
        _device.synchronize(device)
        t0 = time.perf_counter()
        fn(a, b, torch.float32)
        _device.synchronize(device)
        best[name] = min(best.get(name, float("inf")), (time.perf_counter() - t0) * 1e3)
    if drop:
        fastest = min(best[name] for name in fns)
        for name in [n for n in fns if best[n] > _DROP_RATIO * fastest]:
            del fns[name]


def race_gemm_backends(
    device: torch.device | str,
    shape: tuple[int, int, int] | None = None,
    probe: tuple[int, int, int] | None = None,
    reps: int = 5,
    backends: dict[str, Gemm] | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """Time the backends against each other at a bounded cost: ``(milliseconds at shape of
    those that finished, why each other one left)``.

    Two rounds at the small ``probe`` shape (the first one warms up); a backend more than
    ``_DROP_RATIO`` times slower than the fastest leaves. Then up to ``reps`` rounds at
    ``shape``, with the same rule after every round: a backend 100x slower than another runs
    once at full size. ``backends`` (name -> gemm): defaults to those available on ``device``.
    """
    device = torch.device(device)
    shape = shape or _AUTO_SHAPE.get(device.type, _AUTO_SHAPE["cpu"])
    probe = probe or _PROBE_SHAPE.get(device.type, _PROBE_SHAPE["cpu"])
    fns = dict(backends or _backends(device))
    left: dict[str, str] = {}
    stages = (
        [(probe, 2, 1)] if probe[0] * probe[1] * probe[2] < shape[0] * shape[1] * shape[2] else []
    )
    for stage_shape, rounds, first_drop in [*stages, (shape, reps, 0)]:
        a, b = _operands(device, stage_shape)
        best: dict[str, float] = {}
        for r in range(rounds):
            alive = set(fns)
            _race_round(fns, a, b, device, best, drop=r >= first_drop)
            fastest = min(best[n] for n in fns)
            for name in alive - set(fns):
                left[name] = (
                    f"{best[name]:.3g} ms at {'x'.join(map(str, stage_shape))}, "
                    f"{best[name] / fastest:.0f}x the fastest"
                )
    return {name: best[name] for name in fns}, left


def _auto_pick(device: torch.device) -> str:
    times, _ = race_gemm_backends(device)
    if "emulated" not in times:  # emulation itself left the race: the fastest wins
        return min(times, key=times.__getitem__)
    fast = times.get("scaled_mm", float("inf")) < _AUTO_MARGIN * times["emulated"]
    return "scaled_mm" if fast else "emulated"


def select_gemm_backend(device: torch.device | str, choice: str | None = "auto") -> str:
    """The backend ``fp8_gemm`` uses on ``device``.

    An explicit ``choice`` wins; then ``set_gemm_backend``; then the environment variable
    FP8TRAIN_GEMM_BACKEND; "auto" races the backends (``race_gemm_backends``; scaled_mm must
    win by 10%) once per machine: the pick is stored by ``fp8train.machine_cache`` and the
    processes that start together measure once between them. Asking for "scaled_mm" where it
    cannot run is an error, not a silent fallback. On meta (a plan of a GPU run) "auto" is
    scaled_mm.
    """
    device = torch.device(device)
    if choice in (None, "auto"):
        choice = _forced or os.environ.get(ENV_VAR) or "auto"
    if device.type == "meta":  # a plan (training/planner.py) stands for a GPU run
        return "scaled_mm" if choice == "auto" else _check_name(choice)
    if device.type == "cpu":
        _cpu_takes_rowwise()  # known before any compiled GEMM asks
    if choice != "auto":
        if _check_name(choice) == "scaled_mm" and not scaled_mm_available(device):
            raise RuntimeError(f"FP8 GEMM backend scaled_mm does not run on {device}")
        return choice
    if device.type not in _auto_choice:
        picked, _ = remember("fp8-gemm-backend", device, lambda: _auto_pick(device))
        if picked not in _backends(device):  # a damaged or foreign cache entry: race here
            picked = _auto_pick(device)
        _auto_choice[device.type] = picked
    return _auto_choice[device.type]

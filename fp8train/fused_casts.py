"""One-pass FP8 casts on CUDA: the amax and the saturating cast, each a single fused kernel.

Eager PyTorch spends five full passes over a tensor on one FP8 cast (``abs``, ``amax``,
``float``, ``* scale``, ``clamp``, ``to``), each writing a temporary of up to 4 bytes per
element. On an H200 this was most of the FP8 levels' overhead: in a GPT-1.3B step at te with
BF16 activations, copies, products, clamps and abs took about 180 ms against 43 ms of FP8
GEMMs (docs/BENCHMARKS.md, the GPU profile). ``torch.compile`` turns each into one kernel
that reads the input once (2 bytes per element from BF16) and writes 1 byte of FP8.

The arithmetic is the eager one, op for op (an fp32 product, a clamp to ±max, a
round-to-nearest-even cast), so the bytes are the same; ``tests/test_fused_casts.py`` checks
this bitwise on the CPU compiler against the eager cast and against ml_dtypes.

Used only for CUDA tensors (on the CPU the passes are cheap next to the GEMM emulation, and a
compiler there costs every process seconds), and only with one scale for the whole tensor.
``FP8TRAIN_FUSED_CASTS=0`` turns it off; if compiling fails once, the process warns and keeps
the eager path.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

__all__ = ["ENV", "abs_max", "fusable", "saturating_cast"]

ENV = "FP8TRAIN_FUSED_CASTS"
_failed = False  # a compile error turns fusion off for the rest of the process


def fusable(x: torch.Tensor, force: bool = False) -> bool:
    """Whether ``x`` takes the compiled path: a CUDA tensor (or ``force``, for tests), with
    fusion neither switched off nor broken."""
    if _failed or os.environ.get(ENV, "1") == "0":
        return False
    return force or x.device.type == "cuda"


def _abs_max(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax()


def _cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    # The eager cast of formats.cast_to_fp8: widen, scale in fp32, saturate, round.
    return (x.float() * scale).clamp_(-fmax, fmax).to(dtype)


@functools.cache
def _compiled_abs_max():
    return torch.compile(_abs_max, dynamic=True)


@functools.cache
def _compiled_cast(fmax: float, dtype: torch.dtype):
    # One compiled function per format: the maximum and the dtype are constants of the kernel.
    return torch.compile(functools.partial(_cast, fmax=fmax, dtype=dtype), dynamic=True)


def _run(compiled, eager, *args):
    global _failed
    try:
        return compiled(*args)
    except Exception as err:  # noqa: BLE001  (any compiler failure: fall back, once, loudly)
        _failed = True
        warnings.warn(
            f"fp8train: fused FP8 casts disabled ({type(err).__name__}: {str(err)[:200]}); "
            f"using the eager casts (set {ENV}=0 to skip the attempt)",
            RuntimeWarning,
            stacklevel=3,
        )
        return eager(*args)


def abs_max(x: torch.Tensor, force: bool = False) -> torch.Tensor:
    """``x.abs().amax()`` as a 0-dim tensor of ``x``'s dtype (NaN propagates), fused where
    ``fusable``."""
    if not fusable(x, force):
        return _abs_max(x)
    return _run(_compiled_abs_max(), _abs_max, x)


def saturating_cast(
    x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype, force: bool = False
) -> torch.Tensor:
    """``clamp(x * scale, ±fmax)`` rounded to ``dtype``, in one kernel where ``fusable`` and
    ``scale`` is one value; otherwise the same operations eagerly."""
    if scale.numel() != 1 or not fusable(x, force):
        return _cast(x, scale, fmax, dtype)
    eager = functools.partial(_cast, fmax=fmax, dtype=dtype)
    return _run(_compiled_cast(fmax, dtype), eager, x, scale)

"""The FP8 cast as one ``torch.compile``'d kernel on CUDA: opt-in (``FP8TRAIN_FUSED_CASTS=1``).

Eager PyTorch spends four passes on one saturating cast (``float``, ``* scale``, ``clamp``,
``to``), with fp32 temporaries; compiled, it is one kernel that reads the input once and
writes FP8. Measured on an H200 (docs/BENCHMARKS.md, "GPU"), GPT-1.3B at te with BF16
activations: the casts' device time fell from tens of ms to 8.4 ms a step, but the step time
did not (435 ms against 415 ms eager, on two machines of the same kind), because that step
waits on the host: each compiled call costs more host time than the eager launches it
replaces (about 70 against 30 us here on the CPU). So it stays off until a step is no longer
host-bound. An amax compiled the same way was slower than eager ``abs`` + ``amax`` (19
against 16 ms a step) and was dropped.

The traced arithmetic is the eager one, op for op; ``tests/test_fused_casts.py`` checks the
bytes on the CPU compiler (scalar code: its AVX2 vectorized FP8 conversion flushed the
smallest subnormals). Triton's conversion on the GPU has not been compared with the eager
cast yet: do that before turning this on by default.

Only CUDA tensors take it; if compiling fails once, the process warns and stays eager.
"""

from __future__ import annotations

import functools
import os
import types
import warnings

import torch

__all__ = ["ENV", "fusable", "saturating_cast"]

ENV = "FP8TRAIN_FUSED_CASTS"
_failed = False  # a compile error turns fusion off for the rest of the process


def fusable(x: torch.Tensor, force: bool = False) -> bool:
    """Whether ``x`` takes the compiled path: ``force`` (tests), or a CUDA tensor with
    ``FP8TRAIN_FUSED_CASTS=1``; never after a compile failure."""
    if _failed:
        return False
    return force or (x.device.type == "cuda" and os.environ.get(ENV, "0") == "1")


def _cast(x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype) -> torch.Tensor:
    # The eager cast of formats.cast_to_fp8: widen, scale in fp32, saturate, round.
    return (x.float() * scale).clamp_(-fmax, fmax).to(dtype)


@functools.cache
def _compiled_cast(fmax: float, dtype: torch.dtype):
    # One compiled function per format, the maximum and the dtype baked into the kernel. Each
    # gets a code object of its own: dynamo keeps at most 8 compilations per code object and
    # runs it eagerly, without a word, past that (formats x input dtypes could reach it, and
    # ``torch.compile`` of a ``functools.partial`` shares one wrapper's code among them all).
    def cast(x, scale):
        return _cast(x, scale, fmax, dtype)

    own = types.FunctionType(
        cast.__code__.replace(), cast.__globals__, "cast", None, cast.__closure__
    )
    return torch.compile(own, dynamic=True)


def saturating_cast(
    x: torch.Tensor, scale: torch.Tensor, fmax: float, dtype: torch.dtype, force: bool = False
) -> torch.Tensor:
    """``clamp(x * scale, ±fmax)`` rounded to ``dtype``, in one kernel where ``fusable`` and
    ``scale`` is one value; otherwise the same operations eagerly."""
    if scale.numel() != 1 or not fusable(x, force):
        return _cast(x, scale, fmax, dtype)
    global _failed
    try:
        return _compiled_cast(fmax, dtype)(x, scale)
    except Exception as err:  # noqa: BLE001  (any compiler failure: fall back, once, loudly)
        _failed = True
        warnings.warn(
            f"fp8train: compiled FP8 casts disabled ({type(err).__name__}: "
            f"{str(err)[:200]}); using eager PyTorch",
            RuntimeWarning,
            stacklevel=2,
        )
        return _cast(x, scale, fmax, dtype)

"""Which FP8 GEMM backend runs: a pinned choice, the environment, or "auto", and the race
behind "auto". ``fp8_gemm`` itself never chooses (it takes ``backend``, the exact emulation
when none is given); a caller binds the pick once, as ``fp8train.Linear`` does at build time,
so no GEMM reads a global or the environment.

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

import torch

from . import device as _device
from .formats import E4M3
from .gemm import (
    Gemm,
    backend_gemms,
    check_backend,
    fits_scaled_mm,
    scaled_mm_available,
)
from .machine_cache import remember
from .tensor import Float8Tensor

__all__ = [
    "ENV_VAR",
    "measure_gemm_backends",
    "race_gemm_backends",
    "select_gemm_backend",
    "set_gemm_backend",
]

ENV_VAR = "FP8TRAIN_GEMM_BACKEND"

_forced: str | None = None
_auto_choice: dict[str, str] = {}  # device type -> backend chosen by the race (this process)

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


def set_gemm_backend(name: str | None) -> None:
    """Force a backend for every device ("scaled_mm" | "emulated"); None or "auto" undoes it.
    Linears built afterwards take it (a built one keeps the backend it bound)."""
    global _forced
    _forced = None if name in (None, "auto") else check_backend(name)


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
        for name, fn in backend_gemms(device).items()
        if name == "emulated" or fits_scaled_mm(a, b)
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
    fns = dict(backends or backend_gemms(device))
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
    """The backend for FP8 GEMMs on ``device``: what a caller passes to ``fp8_gemm``.

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
    if device.type == "meta":  # a plan (training/planning/rank_plan.py) stands for a GPU run
        return "scaled_mm" if choice == "auto" else check_backend(choice)
    if choice != "auto":
        if check_backend(choice) == "scaled_mm" and not scaled_mm_available(device):
            raise RuntimeError(f"FP8 GEMM backend scaled_mm does not run on {device}")
        return choice
    if device.type not in _auto_choice:
        picked, _ = remember("fp8-gemm-backend", device, lambda: _auto_pick(device))
        if picked not in backend_gemms(device):  # a damaged or foreign cache entry: race here
            picked = _auto_pick(device)
        _auto_choice[device.type] = picked
    return _auto_choice[device.type]

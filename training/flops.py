"""Peaks for MFU: known dense vendor peaks by device name, or a measured CPU matmul rate.

FLOPs per step are each model family's own (``ModelFamily.flops_per_step``)."""

from __future__ import annotations

import time

import torch

__all__ = ["PEAK_TFLOPS", "peak_tflops_for", "measure_cpu_peak_tflops"]

# Dense (no sparsity) vendor peaks in TFLOP/s, keyed by a substring of the device name.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "H800": {"bf16": 989.0, "fp16": 989.0, "fp8": 1979.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0, "fp32": 80.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp8": 733.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp8": 242.0, "fp32": 30.3},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
}


def peak_tflops_for(device_name: str, gemm: str) -> float | None:
    """Dense peak of a known GPU for the GEMM dtype, or None when the device is unknown."""
    for key, peaks in PEAK_TFLOPS.items():
        if key in device_name:
            return peaks.get(gemm, peaks.get("bf16"))
    return None


def measure_cpu_peak_tflops(size: int = 1024, repeats: int = 10) -> float:
    """A measured fp32 matmul rate on this process's CPU threads: the denominator of CPU 'MFU'.

    There is no vendor peak for an arbitrary CPU, so we report utilisation against what a large
    plain GEMM achieves here, and label it as measured. The best of several runs, because a
    busy machine only ever makes a run slower and an underestimated peak inflates MFU.
    """
    # A private generator: drawing from the default one would shift the training run's
    # dropout stream, and a resumed run would then differ from an uninterrupted one.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    a @ b  # warm-up: thread pool and caches
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best / 1e12

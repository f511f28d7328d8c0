"""Time FP8 GEMM backends next to fp32/bf16 matmuls and show what "auto" picks.

    python -m benchmarks.bench_fp8_gemm [--device cpu|cuda] [--reps 5] [--shapes 2048x256x768 ...]

Shapes are MxKxN for ``a[M,K] @ b[N,K].T``. A benchmark prints; it never asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from fp8train import device as fdevice  # noqa: E402
from fp8train.gemm_backend import measure_gemm_backends, select_gemm_backend  # noqa: E402

DEFAULT_SHAPES = {
    "cpu": ["512x256x768", "2048x256x768", "2048x768x256", "1024x1024x1024", "1000x250x750"],
    "cuda": ["4096x4096x4096", "8192x4096x4096", "8192x8192x8192", "16384x4096x14336"],
}


def parse_shape(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n


def dense_ms(shape, dtype, device, reps) -> float:
    """Best-of-``reps`` milliseconds of a plain ``a @ b.T`` in ``dtype`` (same rule as gemm)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype)
    a @ b.t()  # warm-up
    best = float("inf")
    for _ in range(reps):
        fdevice.synchronize(device)
        t0 = time.perf_counter()
        a @ b.t()
        fdevice.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=str(fdevice.get_device()))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", nargs="*", default=None)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    shapes = [parse_shape(s) for s in (args.shapes or DEFAULT_SHAPES.get(device.type, []))]

    chosen = select_gemm_backend(device)  # the "auto" decision fp8_gemm will use
    print(
        f"device: {fdevice.device_name(device)} ({device}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, best of {args.reps} reps, milliseconds"
    )
    header = f"{'shape MxKxN':>18} {'fp32':>9} {'bf16':>9} {'scaled_mm':>10} {'emulated':>9}  best"
    print(header)
    print("-" * len(header))
    for shape in shapes:
        fp8 = measure_gemm_backends(device, shape, args.reps)
        row = [
            dense_ms(shape, torch.float32, device, args.reps),
            dense_ms(shape, torch.bfloat16, device, args.reps),
        ]
        sm = f"{fp8['scaled_mm']:10.2f}" if "scaled_mm" in fp8 else f"{'n/a':>10}"
        best = min(fp8, key=fp8.__getitem__)
        print(
            f"{'x'.join(map(str, shape)):>18} {row[0]:9.2f} {row[1]:9.2f} {sm} "
            f"{fp8['emulated']:9.2f}  {best}"
        )
    print(f"auto backend for {device.type}: {chosen}")


if __name__ == "__main__":
    main()

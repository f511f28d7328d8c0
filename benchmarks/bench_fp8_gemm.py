"""Time FP8 GEMMs next to fp32/bf16 matmuls: the per-tensor backends "auto" races, and the
forward GEMM of a linear at each scaling granularity (tensor, row, block) as the linear calls it.

    python -m benchmarks.bench_fp8_gemm [--device cpu|cuda] [--reps 5] [--shapes 2048x256x768 ...]

Shapes are MxKxN for ``a[M,K] @ b[N,K].T``. Columns, best of ``--reps`` milliseconds:

- ``fp32``, ``bf16``: the plain matmul;
- ``scaled_mm``, ``emulated``: the per-tensor backends as "auto" races them (FP32 output), and
  ``best`` of the two;
- ``tensor``, ``row``, ``block``, ``blk 1x128``: ``fp8train.gemm.fp8_gemm`` as a linear's
  forward GEMM calls it (BF16 output, fast accumulation, the "scaled_mm" backend where it runs):
  per-tensor ``Float8Tensor`` operands; one scale per row of each (``(1, K)``); x in 1 x 128
  tiles and W in 128 x 128 blocks (the forward and input-gradient GEMMs at ``block``); both in
  1 x 128 tiles (the weight-gradient GEMM's pattern). Operands from
  ``blockwise.quantize_operand``, the layouts the cast unit writes.

What each of the last four actually ran is observed, not assumed: the ATen operators of one
untimed call. A cell ending in ``*`` ran the emulation (``blockwise.block_gemm``, one FP32 GEMM
per K block, or the per-tensor one), not a scaled-GEMM kernel; the lines under the table name
the operator per column, and ``block kernel:`` says whether cuBLASLt's block-scaled GEMM was
bound (``block_scaled_mm.bind``, whose own line on stderr says why not). ``check``: the largest
DeepGEMM difference (``1 - 2 sum(xy) / sum(x^2 + y^2)``, float64) of the row and block results
against the emulation on the same operands; below 1e-3 agrees. A benchmark prints; it never
asserts.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from fp8train import block_scaled_mm  # noqa: E402
from fp8train import device as fdevice  # noqa: E402
from fp8train.blockwise import BLOCK, WEIGHT_BLOCK, block_gemm, quantize_operand  # noqa: E402
from fp8train.formats import E4M3  # noqa: E402
from fp8train.gemm import fp8_gemm, prepare_scaled_gemm, scaled_mm_available  # noqa: E402
from fp8train.gemm_backend import measure_gemm_backends, select_gemm_backend  # noqa: E402
from fp8train.scaling import compute_scale  # noqa: E402
from fp8train.tensor import Float8Tensor  # noqa: E402

__all__ = ["DEFAULT_SHAPES", "GRANULARITIES", "main", "operands", "parse_shape", "ran"]

DEFAULT_SHAPES = {
    "cpu": ["512x256x768", "2048x256x768", "2048x768x256", "1024x1024x1024", "1000x250x750"],
    "cuda": ["4096x4096x4096", "8192x4096x4096", "8192x8192x8192", "16384x4096x14336"],
}
# column -> (x's block, W's block); None: per tensor. K stands for the whole reduced dim.
GRANULARITIES = {
    "tensor": None,
    "row": ((1, "K"), (1, "K")),
    "block": ((1, BLOCK), WEIGHT_BLOCK),
    "blk 1x128": ((1, BLOCK), (1, BLOCK)),
}
EMULATION = "emulation"


def parse_shape(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.lower().split("x"))
    return m, k, n


def _best_ms(fn, device, reps: int) -> float:
    """Best-of-``reps`` milliseconds of ``fn()`` after a warm-up, synchronised each call."""
    fn()
    best = float("inf")
    for _ in range(reps):
        fdevice.synchronize(device)
        t0 = time.perf_counter()
        fn()
        fdevice.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def dense_ms(shape, dtype, device, reps) -> float:
    """Best-of-``reps`` milliseconds of a plain ``a @ b.T`` in ``dtype`` (same rule as gemm)."""
    m, k, n = shape
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype)
    return _best_ms(lambda: a @ b.t(), device, reps)


def operands(column: str, x: torch.Tensor, w: torch.Tensor):
    """``(x8, w8)`` of ``x [M, K] @ w [N, K].T`` at ``column``'s granularity, E4M3, current
    scales: per tensor, or ``quantize_operand`` in the blocks ``GRANULARITIES`` names."""
    blocks = GRANULARITIES[column]
    if blocks is None:

        def one(t):
            return Float8Tensor.quantize(t, E4M3, compute_scale(t.abs().amax().float(), E4M3))

        return one(x), one(w)
    k = x.shape[1]
    x_block, w_block = (tuple(k if d == "K" else d for d in b) for b in blocks)
    return quantize_operand(x, E4M3, x_block), quantize_operand(w, E4M3, w_block)


class _Ops(TorchDispatchMode):
    """The ATen operators a call dispatches (below autograd, as they run)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def ran(fn) -> str:
    """What ``fn()`` ran: the scaled-GEMM operator it dispatched (``_scaled_mm``,
    ``_scaled_mm_v2``: cuBLASLt's block-scaled kernel behind ``F.scaled_mm``, ...), else
    ``EMULATION`` with its count of matmuls."""
    with _Ops() as ops:
        fn()
    scaled = sorted(name for name in ops.seen if "scaled_mm" in name or "scaled_grouped" in name)
    if scaled:
        return "+".join(scaled)
    mms = sum(n for name, n in ops.seen.items() if name in ("mm", "matmul", "bmm", "addmm"))
    return f"{EMULATION} ({mms} mm)"


def _fp8_columns(shape, device, backend: str, reps: int) -> dict[str, tuple[float, str]]:
    """column -> (milliseconds, what ran) for the linear's forward GEMM; plus ``check``."""
    m, k, n = shape
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    out, diffs = {}, []
    for column in GRANULARITIES:
        a, b = operands(column, x, w)

        def call(a=a, b=b):
            return fp8_gemm(a, b, torch.bfloat16, backend, fast_accum=True)

        what = ran(call)
        out[column] = (_best_ms(call, device, reps), what)
        if GRANULARITIES[column] is not None and not what.startswith(EMULATION):
            want = block_gemm(a, b, torch.float32)
            diffs.append(block_scaled_mm.deepgemm_difference(call().float(), want))
        del a, b
    out["check"] = (max(diffs) if diffs else float("nan"), "")
    return out


def _device(text: str) -> torch.device:
    device = torch.device(text)
    if device.type == "cuda" and not fdevice.is_cuda():
        raise SystemExit(
            f"bench_fp8_gemm: --device {text}: no CUDA device here (torch {torch.__version__}); "
            "--device cpu runs the CPU columns"
        )
    return device


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=str(fdevice.get_device()))
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--shapes", nargs="*", default=None)
    args = p.parse_args(argv)
    device = _device(args.device)
    shapes = [parse_shape(s) for s in (args.shapes or DEFAULT_SHAPES.get(device.type, []))]

    chosen = select_gemm_backend(device)  # the "auto" decision fp8_gemm will use
    backend = "scaled_mm" if scaled_mm_available(device) else "emulated"
    for granularity in ("row", "block"):  # what a linear asks once, at build time
        prepare_scaled_gemm(device, granularity)
    kernel = block_scaled_mm.bound(device)
    print(
        f"device: {fdevice.device_name(device)} ({device}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, best of {args.reps} reps, milliseconds; "
        f"tensor/row/block columns: fp8_gemm backend {backend}, BF16 out, fast accumulation"
    )
    names = ["fp32", "bf16", "scaled_mm", "emulated", "best", *GRANULARITIES, "check"]
    widths = [9, 9, 10, 9, 10, 9, 9, 9, 10, 8]
    header = f"{'shape MxKxN':>18} " + " ".join(f"{c:>{w}}" for c, w in zip(names, widths))
    print(header)
    print("-" * len(header))
    what_ran: dict[str, dict[str, list[str]]] = {c: {} for c in GRANULARITIES}
    for shape in shapes:
        label = "x".join(map(str, shape))
        fp8 = measure_gemm_backends(device, shape, args.reps)
        cells = [
            f"{dense_ms(shape, torch.float32, device, args.reps):.2f}",
            f"{dense_ms(shape, torch.bfloat16, device, args.reps):.2f}",
            f"{fp8['scaled_mm']:.2f}" if "scaled_mm" in fp8 else "n/a",
            f"{fp8['emulated']:.2f}",
            min(fp8, key=fp8.__getitem__),
        ]
        for column, (ms, what) in _fp8_columns(shape, device, backend, args.reps).items():
            if column == "check":
                cells.append(f"{ms:.1e}")
                continue
            cells.append(f"{ms:.2f}" + ("*" if what.startswith(EMULATION) else ""))
            what_ran[column].setdefault(what, []).append(label)
        print(f"{label:>18} " + " ".join(f"{c:>{w}}" for c, w in zip(cells, widths)), flush=True)
    print("* ran the emulation, not a scaled-GEMM kernel. What each column ran (ATen operator):")
    for column, seen in what_ran.items():
        for what, where in seen.items():
            print(f"  {column}: {what} at {', '.join(where)}")
    bound = f"bound: {kernel.line}" if kernel else f"not bound on {device.type} (the emulation)"
    print(f"block kernel: {bound}")
    print(f"auto backend for {device.type}: {chosen}")


if __name__ == "__main__":
    main()

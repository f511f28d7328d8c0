"""The row/block cast unit on CUDA: the Triton kernels (``fp8train.triton_cast``) against the
torch ops they replace (``blockwise.quantize_operand`` of x and of xᵀ), eager and compiled,
at GPT-1.3B's tensor shapes (8192 tokens: micro-batch 4 x 2048; hidden 2048, FFN 8192).

    python -m benchmarks.bench_cast [--reps 50]

One row per tensor and unit, each timed over ``--reps`` back-to-back calls (best of 5):

- ``block``: an activation or gradient in 1 x 128 tiles, x8 and xt8 (one read of x);
- ``row``: one scale per row of x and per row of xᵀ (two reads: amaxes, casts);
- ``weight``: 128 x 128 blocks and the transposed contiguous copy cuBLASLt reads.

GB/s counts the least traffic the unit needs (x read once, both FP8 orientations and their
scales written), whatever a kernel actually moves; ``x eager`` and ``x compiled`` are how many
times faster the kernels are than the torch unit eager and under ``torch.compile``
(inductor). ``bits`` says whether the kernels wrote the eager unit's bytes and scales. A
table, never a pass/fail: tests/test_triton_cast.py checks the bits.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from fp8train import device as devices
from fp8train import triton_cast
from fp8train.blockwise import WEIGHT_BLOCK, quantize_operand
from fp8train.formats import E4M3

__all__ = ["SHAPES", "main", "time_ms"]

TOKENS, HIDDEN, FFN = 8192, 2048, 8192
# (unit, what, [rows, cols]) of a GPT-1.3B layer's GEMM operands.
SHAPES = [
    ("block", "x into QKV / fc1; dy of proj / fc2", (TOKENS, HIDDEN)),
    ("block", "x into fc2; dy of fc1", (TOKENS, FFN)),
    ("block", "dy of QKV", (TOKENS, 3 * HIDDEN)),
    ("row", "x into QKV / fc1", (TOKENS, HIDDEN)),
    ("row", "x into fc2", (TOKENS, FFN)),
    ("weight", "fc1 W", (FFN, HIDDEN)),
    ("weight", "fc2 W", (HIDDEN, FFN)),
    ("weight", "QKV W", (3 * HIDDEN, HIDDEN)),
]


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Milliseconds per ``fn()``: the best of 5 runs of ``reps`` back-to-back calls (launches
    overlap as in a step), after a warm-up."""
    fn()
    devices.synchronize(device)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        devices.synchronize(device)
        best = min(best, (time.perf_counter() - start) / reps)
    return best * 1e3


def _torch_unit(unit: str):
    """The torch ops the kernels replace, returning every tensor they write."""

    def pair(x):
        k, m = x.shape[1], x.shape[0]
        tiles = unit == "block"
        a = quantize_operand(x, E4M3, (1, 128) if tiles else (1, k))
        b = quantize_operand(x, E4M3, (1, 128) if tiles else (1, m), True)
        return a.data, a.scale_inv, b.data, b.scale_inv

    def weight(w):
        q = quantize_operand(w, E4M3, WEIGHT_BLOCK)
        return q.data, q.scale_inv, q.data.t().contiguous()

    return weight if unit == "weight" else pair


def _kernel_unit(unit: str):
    def pair(x):
        a, b = triton_cast.quantize_pair(x, E4M3, unit)
        return a.data, a.scale_inv, b.data, b.scale_inv

    def weight(w):
        q, t = triton_cast.quantize_weight(w, E4M3, transposed=True)
        return q.data, q.scale_inv, t.data

    return weight if unit == "weight" else pair


def _same_bits(got, want) -> bool:
    def bits(t):
        return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)

    return all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


def _min_bytes(x: torch.Tensor, out) -> int:
    return x.numel() * x.element_size() + sum(t.numel() * t.element_size() for t in out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args(argv)
    if not devices.is_cuda() or not triton_cast.bind("cuda"):
        sys.exit("bench_cast: needs a CUDA sm_90+ device with triton (the kernels run there only)")
    device = torch.device("cuda")
    print(f"{devices.device_name(device)}, torch {torch.__version__}, bf16 input, E4M3")
    head = ["unit", "tensor", "shape", "torch eager ms", "compiled ms", "kernels ms"]
    head += ["kernels GB/s", "x eager", "x compiled", "bits"]
    rows = []
    gen = torch.Generator().manual_seed(0)
    for unit, what, shape in SHAPES:
        x = torch.randn(*shape, generator=gen).to(device, torch.bfloat16)
        eager, kernels = _torch_unit(unit), _kernel_unit(unit)
        torch._dynamo.reset()  # one compile per row: shapes differ, no recompile limit
        compiled = torch.compile(eager, fullgraph=True, dynamic=False)
        want = eager(x)
        same = _same_bits(kernels(x), want)
        ms = [time_ms(lambda f=f, x=x: f(x), device, args.reps) for f in (eager, kernels)]
        try:  # a compile that fails costs its column, not the table
            ms.insert(1, time_ms(lambda f=compiled, x=x: f(x), device, args.reps))
        except Exception as err:  # noqa: BLE001  (reported in the row)
            print(f"  compile failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
            ms.insert(1, float("nan"))
        gbps = _min_bytes(x, want) / ms[2] / 1e6
        rows.append([unit, what, "x".join(map(str, shape)), *(f"{t:.3f}" for t in ms)])
        rows[-1] += [f"{gbps:.0f}", f"{ms[0] / ms[2]:.2f}", f"{ms[1] / ms[2]:.2f}", str(same)]
        print("  " + " | ".join(rows[-1]), flush=True)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, ["-" * w for w in widths], *rows]:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")


if __name__ == "__main__":
    main()

"""SQNR of one FP8 linear layer's forward and backward at each scaling granularity.

    .venv/bin/python -m benchmarks.bench_fp8_granularity [--tokens 1024] [--size 1024]
        [--write docs/BENCHMARKS.md]

One ``fp8train.Linear`` (te: FP32 weights, FP8 GEMMs) against the same layer in float64, on
the same weights, input and output gradient: SQNR (signal over error power, dB) of the output
y and of both gradients dx and dW. Three inputs: Gaussian; Gaussian with 4 input channels
100x larger (outlier activations, as LLMs have); Gaussian with 4 output-gradient channels 100x
larger.

Rows: per-tensor (current scaling, E5M2 gradients: torchao's tensorwise recipe); row-wise
with E5M2 and with E4M3 gradients; row-wise with torchao's row-wise settings, power-of-two
scales and E4M3 everywhere (torchao 0.17's ``Float8LinearConfig.from_recipe_name("rowwise")``,
read from its source: this project emulates its rule, torchao is not a dependency);
block-wise (1x128 / 128x128) with E5M2 and with E4M3 gradients (DeepSeek-V3); block-wise
with power-of-two scales and E4M3 (Transformer Engine's ``Float8BlockScaling``). Numerics,
not speed: nothing here is timed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import bench_docs  # noqa: E402
from fp8train.linear import Linear  # noqa: E402
from fp8train.precision import get_recipe  # noqa: E402
from fp8train.scaling import ScalingRecipe  # noqa: E402

__all__ = ["CASES", "ROWS", "main", "sqnr_db", "sqnr_row"]

TAG = "bench_fp8_granularity"
HEADING = "## FP8 scaling granularity: SQNR of one linear layer (CPU)"

# (row name, granularity, power-of-two scales, gradient format)
ROWS = [
    ("tensor (torchao tensorwise)", "tensor", False, "e5m2"),
    ("row", "row", False, "e5m2"),
    ("row, E4M3 gradients", "row", False, "e4m3"),
    ("row, torchao's row-wise settings", "row", True, "e4m3"),
    ("block", "block", False, "e5m2"),
    ("block, E4M3 gradients (DeepSeek-V3)", "block", False, "e4m3"),
    ("block, power-of-two, E4M3 (TE Float8BlockScaling)", "block", True, "e4m3"),
]
CASES = ("gaussian", "outlier input channels", "outlier gradient channels")
OUTLIERS = 4  # channels 100x larger


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def inputs(case: str, tokens: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The input x [tokens, size] and the output gradient g [tokens, size] of one case."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, size, generator=gen)
    g = torch.randn(tokens, size, generator=gen)
    picks = torch.randperm(size, generator=gen)[:OUTLIERS]
    if case == "outlier input channels":
        x[:, picks] *= 100.0
    elif case == "outlier gradient channels":
        g[:, picks] *= 100.0
    return x, g


def sqnr_row(granularity: str, pow2: bool, grad_format: str, x, g) -> tuple[float, ...]:
    """(y, dx, dW) SQNR of the FP8 layer against float64 on the same weights."""
    mode = "delayed" if granularity == "tensor" else "current"
    scaling = ScalingRecipe(
        mode=mode, granularity=granularity, power_of_two=pow2, grad_format=grad_format
    )
    torch.manual_seed(0)
    layer = Linear(x.shape[1], g.shape[1], recipe=get_recipe("te", scaling=scaling))
    # Delayed scaling's first update is current scaling (warm-up), so this row is per-tensor
    # current scaling: the fair comparison with the other rows' current scales.
    w64 = layer.weight.detach().double().requires_grad_()
    x_in, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y = layer(x_in)
    y.backward(g)
    y64 = x64 @ w64.t() + layer.bias.detach().double()
    y64.backward(g.double())
    return (
        sqnr_db(y64, y.detach()),
        sqnr_db(x64.grad, x_in.grad),
        sqnr_db(w64.grad, layer.weight.grad),
    )


def table(tokens: int, size: int) -> str:
    lines = [
        "| input | granularity | y dB | dx dB | dW dB |",
        "|---|---|---|---|---|",
    ]
    for case in CASES:
        x, g = inputs(case, tokens, size)
        for name, granularity, pow2, fmt in ROWS:
            y, dx, dw = sqnr_row(granularity, pow2, fmt, x, g)
            lines.append(f"| {case} | {name} | {y:.1f} | {dx:.1f} | {dw:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="rows of x (M)")
    parser.add_argument("--size", type=int, default=1024, help="in and out features (K = N)")
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args(argv)
    started, load = time.monotonic(), os.getloadavg()[0]
    text = (
        f"One linear layer, {args.tokens} tokens x {args.size} features in and out, te recipe "
        "(FP32 weights), against float64 on the same tensors; outlier cases scale "
        f"{OUTLIERS} channels by 100.\n\n" + table(args.tokens, args.size)
    )
    bench_docs.report(
        text, args.write, TAG, "-m benchmarks.bench_fp8_granularity", argv, started, load
    )


if __name__ == "__main__":
    main()

"""Time LowBitAdamW (reference and fused) against torch's AdamW on GPT-1.3B's parameters.

    python -m benchmarks.bench_optimizer                      # CUDA: full size; CPU: --scale 8
    python -m benchmarks.bench_optimizer --scale 16 --layers 4 --levels O2 O3 --steps 3
    python -m benchmarks.bench_optimizer --threads 1   # a shared CPU: one thread is steadier

The parameters are GPT-1.3B's (24 layers, hidden 2048, FFN 8192, vocabulary 50257, 2048
positions), each dimension divided by ``--scale``: the linear weights of each level as the
model layer stores them (O1/O2 tensor-scaled FP16, O3 FP8, each with an FP8 gradient slot),
everything else (embeddings, biases, norms) FP32 with FP32 gradients, as in the precision table.
torch's AdamW steps all of them as FP32 (``fused=True`` where this torch has it for the
device, else ``foreach``), the baseline issue 34 measures against.

Each row: the median and the best of ``--steps`` timed steps after ``--warmup`` untimed ones
(which also compile the fused path), the same gradients every step (an optimizer step's time
does not depend on their values), each as a multiple of torch's AdamW's. A benchmark prints; it
never asserts.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fp8train import device as fdevice  # noqa: E402
from fp8train.formats import E4M3  # noqa: E402
from fp8train.low_precision import Fp8GradSlot, ScaledTensor  # noqa: E402
from fp8train.optim import LowBitAdamW  # noqa: E402
from fp8train.param_state import set_grad_slot, set_scale_inv  # noqa: E402

# GPT-1.3B as benchmarks/bench_gpu.py runs it.
GPT_1_3B = dict(layers=24, hidden=2048, ffn=8192, vocab=50257, positions=2048)
# Storage of the linear weights and the moments' dtypes per level (the precision table).
LEVELS = {
    "O1": (torch.float16, torch.float32, torch.float32),
    "O2": (torch.float16, E4M3.dtype, torch.float16),
    "O3": (E4M3.dtype, E4M3.dtype, torch.float16),
}


def gpt_shapes(scale: int, layers: int | None = None) -> tuple[list, list]:
    """(linear weight shapes, other parameter shapes) of GPT-1.3B divided by ``scale``."""
    g = GPT_1_3B
    h, f = g["hidden"] // scale, g["ffn"] // scale
    linear, other = [], [(g["vocab"] // scale, h), (g["positions"] // scale, h), (h,), (h,)]
    for _ in range(g["layers"] if layers is None else layers):
        linear += [(3 * h, h), (h, h), (f, h), (h, f)]
        other += [(3 * h,), (h,), (f,), (h,), (h,), (h,), (h,), (h,)]  # biases, two norms
    return linear, other


def _linear_param(shape, dtype: torch.dtype, device) -> nn.Parameter:
    """A linear weight stored as the model layer stores it, with a filled FP8 gradient slot."""
    w = torch.randn(shape, device=device) * 0.02
    stored = ScaledTensor.quantize(w, dtype)
    p = nn.Parameter(stored.data, requires_grad=False)  # FP8 has no autograd; none is needed
    set_scale_inv(p, stored.scale_inv)
    slot = Fp8GradSlot(shape, device=device)
    slot.accumulate(torch.randn(shape, device=device) * 1e-3)
    set_grad_slot(p, slot)
    return p


def _plain_param(shape, device) -> nn.Parameter:
    p = nn.Parameter(torch.randn(shape, device=device) * 0.02)
    p.grad = torch.randn(shape, device=device) * 1e-3
    return p


def build_lowbit(level: str, shapes: tuple[list, list], device, fused: bool) -> LowBitAdamW:
    weight_dtype, m_dtype, v_dtype = LEVELS[level]
    linear, other = shapes
    params = [_linear_param(s, weight_dtype, device) for s in linear]
    params += [_plain_param(s, device) for s in other]
    return LowBitAdamW(
        params, lr=1e-4, weight_decay=0.1, exp_avg_dtype=m_dtype, exp_avg_sq_dtype=v_dtype,
        fused=fused,
    )  # fmt: skip


def build_torch(shapes: tuple[list, list], device) -> tuple[torch.optim.AdamW, str]:
    """torch's AdamW on FP32 copies of every parameter: fused where it steps, else foreach."""
    params = [_plain_param(s, device) for s in shapes[0] + shapes[1]]
    try:
        opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
        opt.step()  # a device without a fused kernel refuses here, at the first step
        return opt, "fused"
    except (RuntimeError, NotImplementedError):
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, foreach=True), "foreach"


def time_steps(opt: torch.optim.Optimizer, device, warmup: int, steps: int) -> tuple:
    """(median, best) milliseconds of one ``opt.step()``: on a shared CPU the best is the
    steadier figure, the median the more honest one."""
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        fdevice.synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        fdevice.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def _release(device) -> None:
    gc.collect()
    fdevice.empty_cache(device)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default=str(fdevice.get_device()))
    p.add_argument("--scale", type=int, default=None, help="divide every dimension (CPU: 8)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default 24)")
    p.add_argument("--levels", nargs="*", default=list(LEVELS), choices=list(LEVELS))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    scale = args.scale or (1 if device.type == "cuda" else 8)
    shapes = gpt_shapes(scale, args.layers)
    n_linear = sum(torch.Size(s).numel() for s in shapes[0])
    n_other = sum(torch.Size(s).numel() for s in shapes[1])
    print(
        f"device: {fdevice.device_name(device)} ({device}), torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}; GPT-1.3B / {scale}, "
        f"{args.layers or GPT_1_3B['layers']} layers: {len(shapes[0])} linear weights "
        f"({n_linear / 1e6:.1f} M), {len(shapes[1])} other tensors ({n_other / 1e6:.1f} M); "
        f"median of {args.steps} steps after {args.warmup}"
    )

    opt, kind = build_torch(shapes, device)
    base, base_best = time_steps(opt, device, args.warmup, args.steps)
    del opt
    _release(device)
    rows = [(f"torch AdamW ({kind}, FP32)", "-", base, base_best)]
    for level in args.levels:
        for fused in (False, True):
            opt = build_lowbit(level, shapes, device, fused)
            ms, best = time_steps(opt, device, args.warmup, args.steps)
            name = "LowBitAdamW " + ("fused" if opt.fused else "reference")
            if fused and not opt.fused:
                name += " (fused fell back)"
            rows.append((name, level, ms, best))
            del opt
            _release(device)

    header = f"| {'optimizer':<34} | level | ms/step | vs torch AdamW | best ms | vs torch best |"
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for name, level, ms, best in rows:
        print(
            f"| {name:<34} | {level:<5} | {ms:7.1f} | {ms / base:13.2f}x | {best:7.1f} "
            f"| {best / base_best:12.2f}x |"
        )


if __name__ == "__main__":
    main()

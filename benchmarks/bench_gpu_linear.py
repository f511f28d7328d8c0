"""The rows of ``benchmarks/bench_gpu.py linear``: forward + backward of one [M, K] x [K, N] linear
(M = N = K = ``--size``), bf16 ``torch.nn.Linear`` against ``fp8train.Linear`` under the te
recipe and torchao's Float8Linear, all timed in this process (a layer is small next to a GPT).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.bench_gpu_rows import (
    NOT_INSTALLED,
    device_info,
    fp8_backend,
    time_steps,
    torchao_float8,
)
from fp8train import gemm_backend
from fp8train.linear import Linear
from fp8train.precision import get_recipe

__all__ = ["linear_rows"]


def linear_rows(args, device: torch.device, record: Callable[[dict], dict]) -> list[dict]:
    """One row per layer (``record`` gives each its progress line and ``--json`` so far as it
    finishes); a torchao layer where torchao is missing, or one that fails, keeps its row."""
    m = n = k = args.size
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=gen).to(device)
    grad = torch.randn(m, n, generator=gen).to(device)
    backend = fp8_backend(device, args.fp8_backend)
    gemm_backend.set_gemm_backend(backend)
    te = f"fp8train.Linear te ({backend} GEMMs)"
    # (name, layer factory, activation dtype, torchao recipe or None)
    cases = [
        ("torch.nn.Linear bf16", lambda: _bf16_linear(k, n), torch.bfloat16, None),
        (f"{te}, fp32 activations as te trains", lambda: _te_linear(k, n), torch.float32, None),
        (f"{te}, bf16 activations", lambda: _te_linear(k, n), torch.bfloat16, None),
    ]  # fmt: skip
    for recipe in ("tensorwise", "rowwise"):
        for compiled in (False, True) if args.compile else (False,):
            name = f"torchao Float8Linear {recipe}" + (" + torch.compile" if compiled else "")
            make = lambda r=recipe, c=compiled: _torchao_linear(k, n, r, c)
            cases.append((name, make, torch.bfloat16, recipe))
    rows = []
    for name, make, dtype, recipe in cases:
        spec = {"name": name, "kind": "linear", "recipe": recipe}
        if recipe is not None and torchao_float8() is None:
            rows.append(record({**spec, "status": NOT_INSTALLED}))
            continue
        try:
            timing = _time_linear(make().to(device), x.to(dtype), grad.to(dtype), device, args)
            row = {**spec, "status": "ok", **timing, **device_info(device)}
            row.update(tokens=m, flops=6.0 * m * n * k)
        except Exception as err:  # noqa: BLE001  (reported in the row)
            traceback.print_exc()
            row = {**spec, "status": f"failed: {type(err).__name__}: {str(err)[:160]}"}
        rows.append(record(row))
    return rows


def _bf16_linear(k: int, n: int) -> nn.Linear:
    return nn.Linear(k, n, bias=False).to(torch.bfloat16)


def _te_linear(k: int, n: int) -> Linear:
    return Linear(k, n, bias=False, recipe=get_recipe("te"))  # fp32 weight, as te stores it


def _torchao_linear(k: int, n: int, recipe: str, compiled: bool) -> nn.Module:
    config_cls, convert = torchao_float8()
    layer = nn.Sequential(nn.Linear(k, n, bias=False)).to(torch.bfloat16)
    convert(layer, config=config_cls.from_recipe_name(recipe))
    return torch.compile(layer) if compiled else layer


def _time_linear(layer: nn.Module, x, grad, device, args) -> dict:
    x = x.detach().requires_grad_()
    params = list(layer.parameters())

    def step():
        x.grad = None
        for p in params:
            p.grad = None  # no accumulation: every iteration is the same three GEMMs
        layer(x).backward(grad)

    return time_steps(step, device, args.warmup, args.iters)

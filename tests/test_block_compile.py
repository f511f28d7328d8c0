"""Row- and block-scaled FP8 linears under ``torch.compile`` (issue 35 item 4): one graph, no
break, on both GEMM backends, and on the kernel path itself.

- ``torch._dynamo.explain`` of a ``Linear`` at te@row, te@block and O3@block on the CPU:
  1 graph, 0 breaks, with the emulation and with ``torch._scaled_mm`` bound.
- On meta a plan stands for a Hopper run, so the GEMMs take the kernels (``torch._scaled_mm``
  row-wise, ``F.scaled_mm`` with BlockWise1x128/BlockWise128x128): forward and backward
  compile with ``fullgraph=True``, which fails on any break.
- On the CPU with the emulated block-scaled kernel standing in for cuBLASLt's: the compiled
  layer (``aot_eager``: the traced ATen operations, run as eager runs them) equals eager bit
  for bit, forward and backward.

Small layers, one compile each: compile work is slow on 2 cores.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo as dynamo

from fp8train import block_scaled_mm as bsm
from fp8train.gemm_backend import set_gemm_backend
from fp8train.linear import Linear
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

IN, OUT, TOKENS = 256, 384, 256


def _linear(spec: str, backend: str, device="cpu", dtype=torch.float32) -> Linear:
    """``level@granularity``: a linear at that level with current row or block scales (E4M3
    gradients at block), its weight in the level's storage, ``backend`` bound."""
    level, _, granularity = spec.partition("@")
    grad = "e4m3" if granularity == "block" else "e5m2"
    scaling = ScalingRecipe(mode="current", granularity=granularity, grad_format=grad)
    torch.manual_seed(0)
    set_gemm_backend(backend)
    try:
        layer = Linear(
            IN, OUT, recipe=get_recipe(level, scaling=scaling), device=device, dtype=dtype
        )
    finally:
        set_gemm_backend(None)
    layer.lower_weight_precision()
    return layer


def _input(seed: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    x = torch.randn(2, TOKENS // 2, IN, generator=torch.Generator().manual_seed(seed))
    return x.to(device, dtype).requires_grad_()


@pytest.mark.parametrize("backend", ["emulated", "scaled_mm"])
@pytest.mark.parametrize("spec", ["te@row", "te@block", "O3@block"])
def test_a_row_or_block_linear_traces_as_one_graph(spec, backend):
    layer = _linear(spec, backend)
    dynamo.reset()
    explained = dynamo.explain(layer)(_input(0))
    reasons = [str(b.reason)[:200] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons


@pytest.mark.parametrize("spec", ["te@row", "te@block", "O3@block"])
def test_the_kernel_path_compiles_whole_on_meta(spec):
    layer = _linear(spec, "scaled_mm", device="meta", dtype=torch.bfloat16)
    assert layer.gemm_backend == "scaled_mm"
    dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = _input(0, "meta", torch.bfloat16)
    y = compiled(x)
    y.float().sum().backward()
    assert y.shape == (2, TOKENS // 2, OUT) and x.grad.shape == x.shape


@pytest.mark.parametrize("spec", ["te@block", "O3@block"])
def test_the_compiled_kernel_path_equals_eager(spec, monkeypatch):
    kernel = bsm.BlockKernel((torch.bfloat16, torch.float32), True, "test: emulated kernel")
    monkeypatch.setitem(bsm._bound, "cpu", kernel)
    monkeypatch.setattr(bsm, "_scaled_mm", bsm.emulated_scaled_mm)
    eager, twin = _linear(spec, "scaled_mm"), _linear(spec, "scaled_mm")
    dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    xa, xb = _input(1), _input(1)
    ya, yb = eager(xa), compiled(xb)
    ya.square().sum().backward()
    yb.square().sum().backward()
    assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(eager.bias.grad, twin.bias.grad)
    if eager.weight.grad is not None:
        assert torch.equal(eager.weight.grad, twin.weight.grad)

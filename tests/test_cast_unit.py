"""The FP8 cast as one unit (``Float8Tensor.quantize`` with ``transpose``): compiled on the CPU's
inductor, bit for bit against ml_dtypes and the eager cast, both layouts, and fused into as few
kernels as its data dependencies allow.

A compiled layer (``training.compile``) is where a cast becomes one kernel on CUDA (Triton);
that code generator is not here, so this checks what can be checked here: the traced
arithmetic (an fp32 product, a saturating clamp, a round-to-nearest-even cast) is the eager
one, the transposed layout holds the same bytes, and the compiler fuses the unit. The kernel
counts come from the CPU code generator, whose fusion decisions (a pointwise node reading the
same input as a reduction) follow the same graph as Triton's.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch._inductor.utils import run_and_get_code

from fp8train.formats import E4M3, E5M2, cast_to_fp8
from fp8train.linear import _forward_quantize
from fp8train.scaling import ScalingState
from fp8train.tensor import Float8Tensor
from tests.test_fp8_formats import all_finite_16bit, ref_bits


@pytest.fixture(autouse=True)
def compiled_or_fail(inductor_cache_per_isa):
    # Past its recompile limit dynamo runs a function eagerly without a word, and these
    # tests would then compare eager with eager. Scalar C++ (simdlen 1): inductor's AVX2
    # vectorized float -> FP8 conversion flushed the smallest subnormals to zero (38% of the
    # bytes differed under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 Xeon, torch 2.13), a CPU
    # code-generator matter; what is checked here is the traced arithmetic.
    import torch._inductor.config as inductor_config

    with (
        torch._dynamo.config.patch(fail_on_recompile_limit_hit=True),
        inductor_config.patch({"cpp.simdlen": 1}),
    ):
        yield


def _unit(x, scale, fmt):
    q = Float8Tensor.quantize(x, fmt, scale, transpose=True)
    return q.data, q.data_t


_compiled_unit = torch.compile(_unit, fullgraph=True, dynamic=False)


_SPECIALS = [float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e30, -1e30, 1.0]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_bf16_value_and_the_specials_match_ml_dtypes_and_eager_in_both_layouts(fmt):
    # Every finite bf16 value times a scale that is not a power of two (the product rounds in
    # fp32 first), as a 2-D tensor: ml_dtypes of the same fp32 product and the eager cast,
    # byte for byte, and the transposed layout the same bytes transposed. The last row holds
    # the specials: ±inf and overflow saturate to ±max, NaN stays NaN, -0 keeps its sign.
    t, _ = all_finite_16bit("bf16")
    t = t[: t.numel() // 256 * 256].reshape(-1, 256)
    specials = torch.tensor(_SPECIALS * 32, dtype=torch.bfloat16).reshape(1, 256)
    t = torch.cat([t, specials])
    scale = torch.tensor(0.37)
    data, data_t = _compiled_unit(t, scale, fmt)
    prod = t.float().numpy() * np.float32(0.37)  # IEEE fp32 multiply, as the kernel's
    bits = data.view(torch.uint8).numpy()
    np.testing.assert_array_equal(bits[:-1], ref_bits(prod[:-1].astype(np.float64), fmt))
    np.testing.assert_array_equal(bits, cast_to_fp8(t, fmt, scale).view(torch.uint8).numpy())
    assert data_t.is_contiguous() and data_t.shape == (256, t.shape[0])
    np.testing.assert_array_equal(data_t.view(torch.uint8).numpy(), bits.T)
    y = data[-1, :8].float()
    assert y[0] == fmt.max and y[1] == -fmt.max and y[5] == fmt.max and y[6] == -fmt.max
    assert torch.isnan(y[2])
    assert y[3] == 0 and not torch.signbit(y[3]) and torch.signbit(y[4])


def _kernels(fn, *args) -> list[str]:
    """The generated kernels ``fn`` calls, compiled on its own."""
    torch._dynamo.reset()
    _, code = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    return re.findall(r"^\s+(cpp_fused\w+)\(", code[0], re.M)


def test_a_compiled_cast_with_its_amax_and_transpose_is_one_or_two_kernels():
    x = torch.randn(256, 512, dtype=torch.bfloat16)

    def fixed_scale(x, scale):  # a scale known before the tensor: TE's delayed cast
        amax = x.abs().amax()
        q = Float8Tensor.quantize(x, E4M3, scale, transpose=True)
        return q.data, q.data_t, amax

    # One kernel reads x once and writes the amax and both FP8 layouts.
    assert len(_kernels(fixed_scale, x, torch.tensor(2.0))) == 1

    state = ScalingState(E4M3)
    state.managed = True  # a model's table folds it: the cast only records its amax

    def linear_cast(x):  # what a compiled Linear runs for its input
        q = _forward_quantize(x, state, True, None, "input", transpose=True)
        return q.data, q.data_t, q.scale_inv

    # The state's scale may come from this tensor's own amax (the warm-up and the recovery
    # after a non-finite amax are decided on the device), so the amax is a pass before the
    # cast: the reduction with the scale formula, then the cast with its transpose.
    first, second = _kernels(linear_cast, x)
    assert "amax" in first and "where" in first
    assert "amax" not in second and "_t_" in second

"""The compiled FP8 cast (fp8train/fused_casts.py), forced onto the CPU compiler: bit for bit
against ml_dtypes and against the eager cast.

On a GPU the same functions compile to Triton; that code generator is not here, so this checks
what can be checked here: the traced arithmetic (an fp32 product, a saturating clamp, a
round-to-nearest-even cast) is the eager one, and specials keep their convention.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp8train import fused_casts
from fp8train.formats import E4M3, E5M2, cast_to_fp8
from tests.test_fp8_formats import all_finite_16bit, ref_bits


@pytest.fixture(autouse=True)
def compiled_or_fail():
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


def fused_bits(t: torch.Tensor, fmt, scale: torch.Tensor) -> np.ndarray:
    out = fused_casts.saturating_cast(t, scale, fmt.max, fmt.dtype, force=True)
    assert out.dtype == fmt.dtype and out.shape == t.shape
    return out.view(torch.uint8).numpy()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_bf16_value_scaled_matches_ml_dtypes_and_eager(fmt):
    # Every finite bf16 value times a scale that is not a power of two (the product rounds in
    # fp32 first): ml_dtypes of the same fp32 product, and the eager cast, byte for byte.
    t, _ = all_finite_16bit("bf16")
    scale = torch.tensor(0.37)
    prod = t.float().numpy() * np.float32(0.37)  # IEEE fp32 multiply, as the kernel's
    fused = fused_bits(t, fmt, scale)
    np.testing.assert_array_equal(fused, ref_bits(prod.astype(np.float64), fmt))
    np.testing.assert_array_equal(fused, cast_to_fp8(t, fmt, scale).view(torch.uint8).numpy())


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_specials_saturate_and_nan_stays(fmt):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e30, -1e30, 1.0])
    y = fused_casts.saturating_cast(x, torch.tensor(2.0), fmt.max, fmt.dtype, force=True).float()
    assert y[0] == fmt.max and y[1] == -fmt.max and y[5] == fmt.max and y[6] == -fmt.max
    assert torch.isnan(y[2])
    assert y[3] == 0 and not torch.signbit(y[3]) and torch.signbit(y[4])
    assert y[7] == 2.0


def test_only_cuda_with_the_switch_fuses_unless_forced(monkeypatch):
    x = torch.ones(4)
    monkeypatch.setenv(fused_casts.ENV, "1")
    assert not fused_casts.fusable(x)  # a CPU tensor: eager
    assert fused_casts.fusable(x, force=True)
    assert not fused_casts.fusable(torch.empty(4, device="meta"))  # a plan's tensors: eager


def test_a_compile_failure_falls_back_to_eager_once(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_casts, "_failed", False)
    monkeypatch.setattr(fused_casts, "_compiled_cast", lambda *args: broken)
    x = torch.tensor([1.0, -3.0])
    with pytest.warns(RuntimeWarning, match="compiled FP8 casts disabled"):
        y = fused_casts.saturating_cast(x, torch.tensor(2.0), E4M3.max, E4M3.dtype, force=True)
    assert y.float().tolist() == [2.0, -6.0]  # the eager cast's answer
    assert not fused_casts.fusable(x, force=True)  # off for the rest of the process

"""FP8 GEMM backends against float64 and against each other; backend selection."""

from __future__ import annotations

import pytest
import torch

from fp8train import gemm
from fp8train.formats import E4M3, E5M2
from fp8train.gemm import (
    BACKENDS,
    fp8_gemm,
    measure_gemm_backends,
    scaled_mm_available,
    select_gemm_backend,
    set_gemm_backend,
)
from fp8train.tensor import Float8Tensor

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch):
    monkeypatch.delenv(gemm.ENV_VAR, raising=False)
    monkeypatch.setattr(gemm, "_auto_choice", {})
    set_gemm_backend(None)
    yield
    set_gemm_backend(None)


def operand(shape, fmt, seed, scale) -> Float8Tensor:
    gen = torch.Generator().manual_seed(seed)
    return Float8Tensor.quantize(torch.randn(*shape, generator=gen), fmt, scale)


def ref64(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """float64 product of the exact FP8 values times both scale_inv."""
    a64 = a.data.double() * a.scale_inv.double()
    b64 = b.data.double() * b.scale_inv.double()
    return a64 @ b64.t()


SHAPES = [(64, 128, 32), (37, 50, 23), (1, 16, 16), (130, 7, 3)]  # aligned and not
FORMAT_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def backends():
    return [b for b in BACKENDS if b != "scaled_mm" or scaled_mm_available(CPU)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fa,fb", FORMAT_PAIRS, ids=lambda f: f.name)
def test_matches_float64(backend, m, k, n, fa, fb):
    a = operand((m, k), fa, 0, 40.0)
    b = operand((n, k), fb, 1, 3.3)
    got = fp8_gemm(a, b, backend=backend)
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref = ref64(a, b)
    # fp32 accumulation of k exact products: error ~ k * eps32 * sum|terms|.
    bound = k * 2**-23 * (a.dequantize().double().abs() @ b.dequantize().double().abs().t())
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()


@pytest.mark.skipif(not scaled_mm_available(CPU), reason="torch._scaled_mm missing on CPU")
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fa,fb", FORMAT_PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_backends_agree(m, k, n, fa, fb, out_dtype):
    a = operand((m, k), fa, 2, 17.0)
    b = operand((n, k), fb, 3, 0.7)
    x = fp8_gemm(a, b, out_dtype, backend="scaled_mm").double()
    y = fp8_gemm(a, b, out_dtype, backend="emulated").double()
    # Same exact products, different order of the final scale multiplies: a few ulps.
    eps = 2**-23 if out_dtype == torch.float32 else 2**-8
    scale = ref64(a, b).abs().max()
    torch.testing.assert_close(x, y, rtol=4 * eps, atol=4 * eps * scale.item())


@pytest.mark.parametrize("backend", backends())
def test_transposed_views_as_in_backward(backend):
    # dW = gᵀ·x arrives as two transposed (non-contiguous) views.
    g = operand((48, 32), E5M2, 4, 1000.0)
    x = operand((48, 64), E4M3, 5, 100.0)
    got = fp8_gemm(g.t(), x.t(), backend=backend)
    assert got.shape == (32, 64)
    torch.testing.assert_close(got.double(), ref64(g.t(), x.t()), rtol=1e-5, atol=1e-5)


def test_e5m2_pair_falls_back():
    a, b = operand((16, 32), E5M2, 6, 1.0), operand((16, 32), E5M2, 7, 1.0)
    got = fp8_gemm(a, b, backend="scaled_mm")
    torch.testing.assert_close(got.double(), ref64(a, b), rtol=1e-5, atol=1e-5)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        fp8_gemm(operand((4, 8), E4M3, 0, 1.0), operand((4, 9), E4M3, 0, 1.0))


def test_forced_backend_and_env_var(monkeypatch):
    set_gemm_backend("emulated")
    assert select_gemm_backend(CPU) == "emulated"
    assert select_gemm_backend(CPU, "emulated") == "emulated"
    set_gemm_backend("auto")
    monkeypatch.setenv(gemm.ENV_VAR, "emulated")
    assert select_gemm_backend(CPU) == "emulated"
    with pytest.raises(ValueError):
        set_gemm_backend("cublas")
    with pytest.raises(ValueError):
        select_gemm_backend(CPU, "fast")


def test_auto_picks_the_faster_once(monkeypatch):
    calls = []

    def fake(device, shape=None, reps=3):
        calls.append(device)
        return {"emulated": 11.0, "scaled_mm": 15.0}

    monkeypatch.setattr(gemm, "measure_gemm_backends", fake)
    assert select_gemm_backend(CPU) == "emulated"
    assert select_gemm_backend("cpu") == "emulated"
    assert len(calls) == 1  # cached per device type

    for timings, want in [((2.0, 1.0), "scaled_mm"), ((1.0, 0.95), "emulated")]:
        # A near-tie goes to emulated, so that the choice does not flip between processes.
        times = dict(zip(("emulated", "scaled_mm"), timings))
        monkeypatch.setattr(gemm, "_auto_choice", {})
        monkeypatch.setattr(gemm, "measure_gemm_backends", lambda *a, t=times, **k: t)
        assert select_gemm_backend(CPU) == want


def test_measure_returns_timings():
    times = measure_gemm_backends(CPU, (32, 32, 32), reps=1)
    assert set(times) == set(backends()) and all(t > 0 for t in times.values())

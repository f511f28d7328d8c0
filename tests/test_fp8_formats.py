"""FP8 casts against ml_dtypes, bit for bit, over every 16-bit input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train.formats import E4M3, E5M2, FORMATS, cast_to_fp8, widen
from fp8train.tensor import Float8Tensor

ML = {"E4M3": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2}
# Round-to-nearest sends |x| > max + ulp(max)/2 past max: 448 + 32/2, 57344 + 8192/2.
OVERFLOW_AT = {"E4M3": 464.0, "E5M2": 61440.0}
SRC = {"bf16": (torch.bfloat16, ml_dtypes.bfloat16), "fp16": (torch.float16, np.float16)}


def all_finite_16bit(name: str) -> tuple[torch.Tensor, np.ndarray]:
    """Every finite value of a 16-bit float type, as a torch tensor and a float64 array."""
    torch_dtype, np_dtype = SRC[name]
    bits = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # bf16 NaN payloads
        values = bits.view(np_dtype).astype(np.float64)
    keep = np.isfinite(values)
    t = torch.from_numpy(bits[keep].view(np.int16).copy()).view(torch_dtype)
    return t, values[keep]


def ref_bits(values: np.ndarray, fmt) -> np.ndarray:
    """ml_dtypes' cast of the clamped value: the saturating convention, independently."""
    clamped = np.clip(values, -fmt.max, fmt.max)
    return clamped.astype(ML[fmt.name]).view(np.uint8)


def ours_bits(t: torch.Tensor, fmt, scale=None) -> np.ndarray:
    return cast_to_fp8(t, fmt, scale).view(torch.uint8).numpy()


def test_format_constants_match_ml_dtypes():
    for fmt in (E4M3, E5M2):
        fi = ml_dtypes.finfo(ML[fmt.name])
        assert fmt.max == float(fi.max)
        assert fmt.min_normal == float(fi.smallest_normal)
        assert fmt.min_subnormal == float(fi.smallest_subnormal)
        assert FORMATS[fmt.name] is fmt
    assert E4M3.dtype == torch.float8_e4m3fn and E5M2.dtype == torch.float8_e5m2


@pytest.mark.parametrize("src", ["bf16", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_every_16bit_value_matches_ml_dtypes(src, fmt):
    t, values = all_finite_16bit(src)
    ours, ref = ours_bits(t, fmt), ref_bits(values, fmt)
    bad = np.flatnonzero(ours != ref)
    assert bad.size == 0, (
        f"{bad.size} mismatches, e.g. {values[bad[:5]]} -> {ours[bad[:5]]} vs {ref[bad[:5]]}"
    )


@pytest.mark.parametrize("src", ["bf16", "fp16"])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_overflow_saturates_where_ml_dtypes_does_not(src, fmt):
    t, values = all_finite_16bit(src)
    # Past the rounding boundary above max, a plain cast overflows to NaN (E4M3FN) or inf.
    over = np.abs(values) > OVERFLOW_AT[fmt.name]
    assert over.any()
    plain = values[over].astype(ML[fmt.name]).astype(np.float64)
    assert not np.isfinite(plain).any()
    ours = cast_to_fp8(t, fmt).float().numpy().astype(np.float64)[over]
    np.testing.assert_array_equal(ours, np.sign(values[over]) * fmt.max)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_specials(fmt):
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e30, -1e30])
    y = cast_to_fp8(x, fmt).float()
    assert y[0] == fmt.max and y[1] == -fmt.max
    assert torch.isnan(y[2])
    assert y[3] == 0 and not torch.signbit(y[3]) and torch.signbit(y[4])
    assert y[5] == fmt.max and y[6] == -fmt.max


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_scaled_cast_matches_ml_dtypes(fmt):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=gen) * 3
    scale = torch.tensor(37.3)  # not a power of two: the product rounds in fp32 first
    prod = x.numpy() * np.float32(37.3)  # IEEE fp32 multiply, same rounding as torch
    ref = ref_bits(prod.astype(np.float64), fmt)
    np.testing.assert_array_equal(ours_bits(x, fmt, scale), ref)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_float8_tensor_round_trip(fmt):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 128, generator=gen, dtype=torch.float64)
    scale = fmt.max / x.abs().max().item()
    q = Float8Tensor.quantize(x, fmt, scale)
    assert q.data.dtype == fmt.dtype and q.shape == x.shape and q.fmt is fmt
    assert q.scale_inv.dtype == torch.float32
    assert q.scale_inv.item() == pytest.approx(1 / scale, rel=1e-6)
    # Independent reference: ml_dtypes cast of x*scale, read back and divided in float64.
    prod = (x.float() * torch.tensor(scale, dtype=torch.float32)).numpy().astype(np.float64)
    ref = ref_bits(prod, fmt).view(ML[fmt.name]).astype(np.float64) * q.scale_inv.item()
    deq = q.dequantize(torch.float64)
    np.testing.assert_allclose(deq.numpy(), ref, rtol=1e-7, atol=0)
    assert sqnr_db(x, deq) >= (25 if fmt is E4M3 else 20)

    qt = q.t()
    assert qt.shape == (128, 256) and qt.scale_inv is q.scale_inv
    assert qt.data.data_ptr() == q.data.data_ptr()  # a view, not a copy
    torch.testing.assert_close(qt.dequantize(), q.dequantize().t(), rtol=0, atol=0)


def test_float8_tensor_validates():
    with pytest.raises(TypeError):
        Float8Tensor(torch.zeros(2, dtype=torch.float8_e5m2), torch.ones(()), E4M3)
    with pytest.raises(TypeError):
        Float8Tensor(torch.zeros(2).to(E4M3.dtype), torch.ones((), dtype=torch.float64), E4M3)


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_widen_is_every_byte_exactly_with_its_layout(fmt):
    """``widen`` (the emulated GEMMs' FP8 -> FP32; on the CPU E4M3 through a table) gives
    ml_dtypes' value of every byte (NaN where it has NaN) and ``.float()``'s bits, and keeps
    the layout ``.float()`` keeps: contiguous, transposed (which decides the GEMM kernel that
    reads it), and a strided slice."""
    nbits = np.arange(256, dtype=np.uint8)
    ref = nbits.view(ML[fmt]).astype(np.float32)
    data = torch.from_numpy(nbits.copy()).view(FORMATS[fmt].dtype)
    got = widen(data).numpy()
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    square = data.reshape(16, 16)
    rect = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (48, 80), dtype=np.uint8))
    for t in (square, square.t(), rect.view(FORMATS[fmt].dtype).t(), square[:, ::3]):
        w, f = widen(t), t.float()
        assert w.stride() == f.stride() and w.shape == f.shape
        assert torch.equal(w.view(torch.int32), f.view(torch.int32))

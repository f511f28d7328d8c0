"""The row- and block-scaled GEMM path on the kernels' terms (fp8train/block_scaled_mm.py,
blockwise.quantize_operand, gemm's dispatch), on the CPU.

- The cast unit (a tensor cast along each dimension, the transposed one written contiguous)
  equals ``quantize_blocks`` bit for bit, and its scale grids come out in cuBLASLt's layout.
- The scale layouts cuBLASLt reads (1 x 128 K-block-major; 128 x 128 padded along K to a
  multiple of 4, transposed: pytorch#166752) are handed to ``emulated_scaled_mm``, which reads
  them from memory as the kernel does and refuses what ATen refuses: its GEMM equals
  ``block_gemm`` on the original scales bit for bit, partial blocks included.
- A linear whose block GEMMs take the kernel path (the emulated kernel standing in for
  cuBLASLt's on the CPU) equals the emulation's linear bit for bit at te, O2 and O3; at O3 the
  GEMMs read the stored FP8 weight's bytes, never a cast of it.
- On CUDA only (skipped without it: the real kernels cannot run here), the real block-scaled
  and row-wise kernels against the emulation by DeepGEMM's criterion.
"""

from __future__ import annotations

import math

import pytest
import torch

from fp8train import block_scaled_mm as bsm
from fp8train import gemm
from fp8train.blockwise import (
    BlockFloat8Tensor,
    block_gemm,
    quantize_blocks,
    quantize_operand,
)
from fp8train.formats import E4M3, E5M2
from fp8train.gemm_backend import set_gemm_backend
from fp8train.linear import Linear
from fp8train.param_state import grad_slot
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

TILE, SQUARE = (1, 128), (128, 128)
CUDA = torch.cuda.is_available()


def randn(*shape, seed: int, device="cpu") -> torch.Tensor:
    """Values whose magnitudes change by binades along both dimensions, so that a scale
    read from the wrong block changes the result."""
    gen = torch.Generator().manual_seed(seed)
    rows = 2.0 ** (torch.arange(shape[0]) % 7 - 3)[:, None]
    cols = torch.logspace(-3, 3, shape[1], base=2.0)
    return (torch.randn(*shape, generator=gen) * rows * cols).to(device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = (lambda t: t.view(torch.uint8)) if a.dtype.itemsize == 1 else (lambda t: t)
    return a.dtype == b.dtype and torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("shape", [(200, 300), (256, 384), (130, 100), (1, 5)])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_the_cast_unit_is_quantize_blocks_in_the_kernels_layouts(shape, fmt):
    x = randn(*shape, seed=0)
    r, c = shape
    for block in (TILE, (1, c)):
        q = quantize_operand(x, fmt, block, margin=1, power_of_two=True)
        ref = quantize_blocks(x, fmt, block, 1, True)
        assert same(q.data, ref.data) and same(q.scale_inv, ref.scale_inv) and q.block == ref.block
        kb = q.scale_inv.shape[1]
        assert kb == 1 or q.scale_inv.stride() == (1, r)  # K-block-major: cuBLASLt's 1 x 128
    for block in (TILE, (1, r)):
        qt, ref = quantize_operand(x, fmt, block, True), quantize_blocks(x.t(), fmt, block)
        assert same(qt.data, ref.data) and same(qt.scale_inv, ref.scale_inv)
        assert qt.block == ref.block and qt.data.is_contiguous()  # xᵀ's bytes, contiguous
        rb = qt.scale_inv.shape[1]
        assert qt.scale_inv.stride() == ((1, c) if rb > 1 else (1, 1))
    with pytest.raises(ValueError, match="tiles along x's rows"):
        quantize_operand(x, fmt, SQUARE, transposed=True)


@pytest.mark.parametrize("rows, k", [(200, 300), (256, 512), (384, 640), (96, 1280)])
def test_kernel_scale_layouts(rows, k):
    x = randn(rows, k, seed=1)
    kb = math.ceil(k / 128)
    tiles = quantize_operand(x, E4M3, TILE)
    s = bsm.kernel_scale(tiles)
    assert s.data_ptr() == tiles.scale_inv.data_ptr() and s.stride() == (1, rows)  # no copy
    gathered = BlockFloat8Tensor(tiles.data, tiles.scale_inv.contiguous(), E4M3, TILE)
    s = bsm.kernel_scale(gathered)  # a grid cast elsewhere (all-gathered rows): laid out here
    assert s.stride() == (1, rows) and torch.equal(s, tiles.scale_inv)
    blocks = quantize_blocks(x, E4M3, SQUARE)
    s = bsm.kernel_scale(blocks)
    l4 = 4 * math.ceil(kb / 4)
    assert s.shape == (l4, math.ceil(rows / 128)) and s.stride() == (1, l4)
    assert torch.equal(s[:kb], blocks.scale_inv.t()) and not s[kb:].any()  # zero padding


def _pairs(m: int, k: int, n: int, seed: int, device="cpu"):
    """The three GEMMs of a linear as the block path casts them: y = x Wᵀ (1x128 by
    128x128), dx = g W (1x128 by Wᵀ's 128x128, its bytes transposed), dW = gᵀ x (1x128 by
    1x128)."""
    x, w = randn(m, k, seed=seed, device=device), randn(n, k, seed=seed + 1, device=device)
    g = randn(m, n, seed=seed + 2, device=device)
    w8 = quantize_blocks(w, E4M3, SQUARE, power_of_two=True)
    wt8 = w8.t()
    wt8 = BlockFloat8Tensor(wt8.data.contiguous(), wt8.scale_inv, E4M3, wt8.block)
    return {
        "forward": (quantize_operand(x, E4M3, TILE), w8),
        "input grad": (quantize_operand(g, E4M3, TILE), wt8),
        "weight grad": (
            quantize_operand(g, E4M3, TILE, True),
            quantize_operand(x, E4M3, TILE, True),
        ),
    }


@pytest.mark.parametrize("mkn", [(128, 384, 256), (200, 300, 200), (96, 1280, 130), (16, 640, 48)])
def test_emulated_kernel_on_cublaslt_layouts_equals_block_gemm(mkn):
    # Partial blocks: K = 300 (2 tiles and 44), N = 200 and 130, M = 200 (the weight
    # gradient's K); K blocks 3, 5 and 10 pad the 128x128 grid to 4, 8 and 12.
    for name, (a, b) in _pairs(*mkn, seed=3).items():
        if a.block[1] != 128 or b.block[1] != 128:
            continue  # a K under one block: fit_block shrank the tile, no kernel layout
        recipes = bsm.RECIPES[a.block], bsm.RECIPES[(128, 128) if b.block[0] > 1 else TILE]
        for out in (torch.float32, torch.bfloat16):
            got = bsm.emulated_scaled_mm(
                a.data, b.data.t(), bsm.kernel_scale(a), recipes[0],
                bsm.kernel_scale(b), recipes[1], None, out,
            )  # fmt: skip
            assert same(got, block_gemm(a, b, out)), (name, out)


def test_layouts_cublaslt_would_misread_are_refused():
    a, b = _pairs(128, 384, 256, seed=4)["forward"]
    mat_a, mat_b = a.data, b.data.t()
    tile, square = bsm.RECIPES[TILE], bsm.RECIPES[SQUARE]
    good_a, good_b = bsm.kernel_scale(a), bsm.kernel_scale(b)
    for scale_b in (b.scale_inv.t(), b.scale_inv):  # unpadded (3 K blocks), or untransposed
        with pytest.raises(ValueError, match="scale_b"):
            bsm.emulated_scaled_mm(mat_a, mat_b, good_a, tile, scale_b, square, None, torch.float32)
    with pytest.raises(ValueError, match="scale_a"):  # 1 x 128 scales row-major
        bsm.emulated_scaled_mm(
            mat_a, mat_b, a.scale_inv.contiguous(), tile, good_b, square, None, torch.float32
        )
    with pytest.raises(ValueError, match="column-major"):
        bsm.emulated_scaled_mm(mat_a, b.data, good_a, tile, good_b, square, None, torch.float32)


class _Spy:
    """The emulated kernel in cuBLASLt's place, recording what each call was handed."""

    def __init__(self):
        self.calls = []

    def __call__(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out_dtype):
        self.calls.append((mat_a, mat_b, recipe_a, recipe_b, bias, out_dtype))
        return bsm.emulated_scaled_mm(
            mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out_dtype
        )


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The kernel path bound on the CPU, with the emulated kernel (it fuses the bias)."""
    spy = _Spy()
    kernel = bsm.BlockKernel((torch.bfloat16, torch.float32), True, "test: emulated kernel")
    monkeypatch.setitem(bsm._bound, "cpu", kernel)
    monkeypatch.setattr(bsm, "_scaled_mm", spy)
    return spy


def _block_linear(level: str, backend: str, dtype=torch.float32) -> Linear:
    scaling = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
    torch.manual_seed(0)
    set_gemm_backend(backend)  # pinned: no timing inside tests
    try:
        layer = Linear(256, 384, recipe=get_recipe(level, scaling=scaling), dtype=dtype)
    finally:
        set_gemm_backend(None)
    layer.lower_weight_precision()
    assert layer.gemm_backend == backend
    return layer


def _run(layer: Linear, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(g)
    slot = grad_slot(layer.weight) if layer.lowered else None
    dw = [slot.data, slot.scale_inv] if slot is not None else [layer.weight.grad]
    return [y, x.grad, layer.bias.grad, *dw]


@pytest.mark.parametrize("level", ["te", "te:bf16", "O2", "O3"])
def test_linear_on_the_kernel_path_equals_the_emulation(kernel_on_cpu, level):
    lv, _, dtype = level.partition(":")
    dtype = torch.bfloat16 if dtype else torch.float32
    x, g = randn(256, 256, seed=5).to(dtype), randn(256, 384, seed=6).to(dtype)
    ref = _run(_block_linear(lv, "emulated", dtype), x, g)
    assert not kernel_on_cpu.calls
    got = _run(_block_linear(lv, "scaled_mm", dtype), x, g)
    assert all(same(a, b) for a, b in zip(got, ref))
    recipes = [(c[2], c[3]) for c in kernel_on_cpu.calls]
    square, tile = bsm.RECIPES[SQUARE], bsm.RECIPES[TILE]
    assert recipes == [(tile, square), (tile, square), (tile, tile)]  # y, dx, dW
    bias, out = kernel_on_cpu.calls[0][4:]
    assert (bias is not None) == (dtype == torch.bfloat16)  # a 16-bit bias in the epilogue
    assert out == dtype


def test_o3_block_gemms_read_the_stored_weight(kernel_on_cpu, monkeypatch):
    layer = _block_linear("O3", "scaled_mm")
    stored = layer.weight.detach()
    casts = []
    real = quantize_blocks

    def no_weight_cast(x, fmt, block, *args, **kwargs):
        casts.append(block)
        return real(x, fmt, block, *args, **kwargs)

    import fp8train.blockwise as blockwise

    monkeypatch.setattr(blockwise, "quantize_blocks", no_weight_cast)
    _run(layer, randn(256, 256, seed=7), randn(256, 384, seed=8))
    assert SQUARE not in casts  # no 128x128 cast in the step: the weight is not re-cast
    (_, fwd_b, *_), (_, dx_b, *_), _ = kernel_on_cpu.calls
    assert fwd_b.data_ptr() == stored.data_ptr()  # y = x Wᵀ reads the stored bytes themselves
    assert same(dx_b.t(), stored.t().contiguous())  # dx reads their transpose, a copy


def test_what_is_bound_where(capsys):
    assert bsm.bind("cpu") is None and bsm.bound(torch.device("cpu")) is None
    assert bsm.bind("meta") is bsm.PLANNED  # a plan stands for a Hopper run
    assert capsys.readouterr().err == ""  # only a CUDA binding says which path it took
    assert "has no torch.nn.functional.scaled_mm" in bsm.probe_reason(False, (9, 0))
    assert "sm_90 only (sm_89)" in bsm.probe_reason(True, (8, 9))
    assert "sm_90 only (sm_100)" in bsm.probe_reason(True, (10, 0))
    assert bsm.probe_reason(True, (9, 0)) is None


def test_the_probe_catches_a_misread_scale(monkeypatch):
    # bind's probe on the CPU, with the emulated kernel in cuBLASLt's place: it passes; with
    # one that reads the 128x128 grid with a leading dimension of Kb, not its padded L4 (what
    # pytorch#166752 fixed), it finds the disagreement; a refusal is reported in one line.
    cpu = torch.device("cpu")
    monkeypatch.setattr(bsm, "_scaled_mm", bsm.emulated_scaled_mm)
    assert bsm._try(cpu, torch.bfloat16, with_bias=False) is None
    assert bsm._try(cpu, torch.bfloat16, with_bias=True) is None
    assert bsm._try(cpu, torch.float32, with_bias=False) is None

    def unpadded(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out):
        if recipe_b == bsm.RECIPES[SQUARE]:
            kb = math.ceil(mat_a.shape[1] / 128)
            misread = scale_b.as_strided((kb, scale_b.shape[1]), (1, kb))
            scale_b = torch.nn.functional.pad(misread.t(), (0, scale_b.shape[0] - kb)).t()
        return bsm.emulated_scaled_mm(mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, bias, out)

    monkeypatch.setattr(bsm, "_scaled_mm", unpadded)
    assert "disagreed with the emulation" in bsm._try(cpu, torch.bfloat16, with_bias=False)

    def refusing(*args):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore")

    monkeypatch.setattr(bsm, "_scaled_mm", refusing)
    why = bsm._try(cpu, torch.bfloat16, with_bias=False)
    assert "refused" in why and "CUBLAS_STATUS_NOT_SUPPORTED" in why and "\n" not in why


def test_the_kernel_takes_only_what_it_runs():
    kernel = bsm.BlockKernel((torch.bfloat16,), False, "")
    (x8, w8), (g8, wt8) = list(_pairs(128, 384, 256, seed=9).values())[:2]
    assert bsm.fits(kernel, x8, w8, torch.bfloat16)
    assert not bsm.fits(None, x8, w8, torch.bfloat16)
    assert not bsm.fits(kernel, x8, w8, torch.float32)  # an output it was not found to write
    bias = torch.zeros(256, dtype=torch.bfloat16)
    assert not bsm.fits(kernel, x8, w8, torch.bfloat16, bias)  # would add it in FP32
    e5 = quantize_operand(randn(128, 384, seed=10), E5M2, TILE)
    assert not bsm.fits(kernel, e5, w8, torch.bfloat16)  # E4M3 operands only
    a, b = _pairs(128, 300, 256, seed=11)["forward"]
    assert not bsm.fits(kernel, a, b, torch.bfloat16)  # a partial K block
    a, b = _pairs(128, 384, 200, seed=12)["forward"]
    assert not bsm.fits(kernel, a, b, torch.bfloat16)  # a partial 128-row weight block


def test_deepgemm_difference():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(13))
    assert bsm.deepgemm_difference(x, x) == pytest.approx(0.0, abs=1e-15)
    assert bsm.deepgemm_difference(x, x * 1.01) == pytest.approx(0.01**2 / 2, rel=0.02)
    assert bsm.deepgemm_difference(x, -x) == pytest.approx(2.0)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: cuBLASLt's block-scaled and row-wise kernels")
@pytest.mark.parametrize("mkn", [(256, 512, 384), (128, 1280, 256), (4096, 2048, 2048)])
def test_cuda_kernels_against_the_emulation(mkn):
    """DeepGEMM's criterion, 1 - 2 sum(x y) / sum(x^2 + y^2) < 1e-3 in float64, for the three
    GEMMs of a linear on the block-scaled kernel (K = 1280: 10 K blocks, the 128x128 grid
    padded to 12) and on the row-wise one."""
    cuda = torch.device("cuda")
    kernel = bsm.bind(cuda)
    if kernel is None:
        pytest.skip(f"no block-scaled kernel bound here: {bsm._probe(cuda)[1]}")
    for name, (a, b) in _pairs(*mkn, seed=14, device=cuda).items():
        assert bsm.fits(kernel, a, b, torch.bfloat16), name
        for out in kernel.out_dtypes:
            got = gemm.fp8_gemm(a, b, out, backend="scaled_mm")
            want = block_gemm(a, b, torch.float32)
            assert bsm.deepgemm_difference(got, want) < 1e-3, (name, out)
    m, k, n = mkn
    x, w = randn(m, k, seed=15, device=cuda), randn(n, k, seed=16, device=cuda)
    a, b = quantize_operand(x, E4M3, (1, k)), quantize_operand(w, E4M3, (1, k))
    got = gemm.fp8_gemm(a, b, torch.bfloat16, backend="scaled_mm")
    assert bsm.deepgemm_difference(got, block_gemm(a, b, torch.float32)) < 1e-3, "row-wise"


@pytest.mark.skipif(not CUDA, reason="needs CUDA: cuBLASLt's block-scaled and row-wise kernels")
@pytest.mark.parametrize("level", ["te", "O3"])
@pytest.mark.parametrize("granularity", ["row", "block"])
def test_cuda_linear_on_the_kernels_against_the_emulation(level, granularity):
    """A BF16 linear's output and gradients on the kernels against the same linear on the
    emulation, by DeepGEMM's criterion (O3 stores its weight in blocks: block only)."""
    if level == "O3" and granularity == "row":
        pytest.skip("O3 refuses row-wise scales (a row-scaled FP8 weight)")
    if granularity == "block" and bsm.bind("cuda") is None:
        pytest.skip(f"no block-scaled kernel bound here: {bsm._probe(torch.device('cuda'))[1]}")
    grad = "e4m3" if granularity == "block" else "e5m2"
    scaling = ScalingRecipe(mode="current", granularity=granularity, grad_format=grad)
    results = []
    for backend in ("emulated", "scaled_mm"):
        torch.manual_seed(0)
        set_gemm_backend(backend)
        try:
            layer = Linear(1024, 768, recipe=get_recipe(level, "bf16", scaling), device="cuda")
        finally:
            set_gemm_backend(None)
        layer.lower_weight_precision()
        x = randn(512, 1024, seed=17, device="cuda").bfloat16().requires_grad_()
        y = layer(x)
        y.backward(randn(512, 768, seed=18, device="cuda").bfloat16())
        slot = grad_slot(layer.weight) if layer.lowered else None
        dw = slot.dequantize() if slot is not None else layer.weight.grad
        results.append((y, x.grad, dw))
    for name, want, got in zip(("y", "dx", "dW"), *results):
        assert bsm.deepgemm_difference(got.float(), want.float()) < 1e-3, (level, name)

"""Row-wise and block-wise FP8 scaling (fp8train/blockwise.py, block_linear.py) against
independent references: numpy float32 for the scale rule, ml_dtypes for the cast (bitwise on
the stored bytes), float64 for the GEMM with the same per-block accumulation."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from fp8train import gemm
from fp8train.blockwise import (
    BLOCK,
    BlockFloat8Tensor,
    block_amax,
    block_gemm,
    operand_block,
    per_element,
    quantize_blocks,
)
from fp8train.formats import E4M3, E5M2
from fp8train.linear import Linear
from fp8train.low_precision import ScaledTensor
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

ML = {"E4M3": ml_dtypes.float8_e4m3fn, "E5M2": ml_dtypes.float8_e5m2}


def ref_quantize(x: np.ndarray, fmt, block, margin=0, p2=False):
    """The rule, written again in numpy: per block, amax in float64 (exact: a max), scale in
    IEEE float32 as fp8train.scaling computes it (``fmt.max / 2**margin`` divided by amax, one
    correctly rounded division), for amaxes whose scale lies in [2^-126, 2^126], optionally
    rounded down to a power of two; a block with amax 0 (or one out of that range) keeps
    scale 1; the value times the scale in float32, saturated, cast by ml_dtypes."""
    r, c = x.shape
    br, bc = min(block[0], r), min(block[1], c)
    out = np.zeros((r, c), dtype=np.uint8)
    scales = np.zeros((-(-r // br), -(-c // bc)), dtype=np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = x[i * br : (i + 1) * br, j * bc : (j + 1) * bc].astype(np.float32)
            amax = np.float32(np.abs(tile).max())
            top = fmt.max / 2.0**margin
            highest = min(top * 2.0**126, float(np.finfo(np.float32).max))
            if top * 2.0**-126 <= float(amax) <= highest:
                s = np.float32(top) / amax
                if p2:
                    s = np.float32(2.0 ** np.floor(np.log2(np.float64(s))))
            else:
                s = np.float32(1.0)
            scales[i, j] = s
            prod = np.clip(tile * s, -fmt.max, fmt.max)
            out[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = prod.astype(ML[fmt.name]).view(
                np.uint8
            )
    return out, scales


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize(
    "block,margin,p2",
    [((1, 128), 0, False), ((128, 128), 1, True), ((1, 300), 0, False), ((64, 32), 0, True)],
    ids=["tile", "weight_block_pow2", "row", "odd_block"],
)
def test_quantize_blocks_matches_the_rule_bitwise(fmt, block, margin, p2):
    # 200 x 300: partial last blocks along both dimensions; one row of outliers 1000x larger
    # and one all-zero tile.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 300, generator=gen)
    x[7] *= 1000.0
    x[128:, 256:] = 0.0
    q = quantize_blocks(x, fmt, block, margin=margin, power_of_two=p2)
    ref_bytes, ref_scales = ref_quantize(x.numpy(), fmt, block, margin, p2)
    np.testing.assert_array_equal(q.data.view(torch.uint8).numpy(), ref_bytes)
    np.testing.assert_array_equal(q.scale_inv.numpy(), np.float32(1) / ref_scales)
    assert q.data.dtype == fmt.dtype and q.block == (min(block[0], 200), min(block[1], 300))


def test_dequantize_and_transpose():
    # Three column blocks whose magnitudes are 1e3 apart: each keeps its own scale, so each is
    # within E4M3's rounding of its own amax, not of the largest block's.
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=gen) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(128)
    q = quantize_blocks(w, E4M3, (BLOCK, BLOCK))
    scale = per_element(q.scale_inv.reciprocal(), q.block, (256, 384)).double()
    err = (q.dequantize().double() - w.double()).abs()
    # Half an ulp of the scaled value: 2^-4 of it when normal, 2^-10 (half the smallest
    # subnormal step) below; the dequantizing product adds one float32 rounding.
    bar = (2.0**-4 * (w.double() * scale).abs() + 2.0**-10) / scale * (1 + 2.0**-23)
    assert torch.all(err <= bar)
    qt = q.t()  # a weight's 128x128 blocks serve its transpose
    assert qt.block == (BLOCK, BLOCK) and torch.equal(qt.dequantize(), q.dequantize().t())


def test_specials_and_validation():
    x = torch.tensor([[float("nan"), 1.0], [0.0, 0.0], [float("inf"), 2.0]])
    q = quantize_blocks(x, E4M3, (1, 2))
    assert torch.isnan(q.dequantize()[0, 0])  # a NaN block keeps scale 1, the NaN stays
    assert q.scale_inv[1, 0] == 1.0 and q.dequantize()[1].abs().sum() == 0
    assert q.dequantize()[2, 0] == 448.0  # inf saturates
    with pytest.raises(TypeError, match="scale_inv"):
        BlockFloat8Tensor(q.data, torch.ones(2, 1), E4M3, (1, 2))
    with pytest.raises(ValueError, match="2-D"):
        quantize_blocks(torch.ones(2, 2, 2), E4M3, (1, 2))


def ref_gemm(a: BlockFloat8Tensor, b: BlockFloat8Tensor):
    """float64 with the same blocking: per K block the exact product of the FP8 values times
    both scales, summed; and the sum of magnitudes that bounds float32 rounding."""
    m, k = a.shape
    n = b.shape[0]
    bk = a.block[1]
    out = np.zeros((m, n))
    mag = np.zeros((m, n))
    ad, bd = a.data.double().numpy(), b.data.double().numpy()
    for j in range(-(-k // bk)):
        cols = slice(j * bk, (j + 1) * bk)
        sa = np.repeat(a.scale_inv[:, j].double().numpy(), a.block[0])[:m]
        sb = np.repeat(b.scale_inv[:, j].double().numpy(), b.block[0])[:n]
        scale = sa[:, None] * sb[None, :]
        out += (ad[:, cols] @ bd[:, cols].T) * scale
        mag += (np.abs(ad[:, cols]) @ np.abs(bd[:, cols]).T) * scale
    return out, mag


@pytest.mark.parametrize("granularity", ["row", "block"])
def test_block_gemm_against_float64(granularity):
    gen = torch.Generator().manual_seed(2)
    m, k, n = 96, 300, 200  # K: two full 128 tiles and a partial one
    x = torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, k)
    w = torch.randn(n, k, generator=gen)
    a = quantize_blocks(x, E4M3, operand_block(granularity, False, k))
    b = quantize_blocks(w, E4M3, operand_block(granularity, True, k))
    ref, mag = ref_gemm(a, b)
    ours = block_gemm(a, b).double().numpy()
    # float32 bound: each tile's sum of up to 128 products (exact products), two scalings,
    # one accumulation per tile: at most (128 + 2 + tiles) roundings of 2^-24 of the
    # magnitudes involved.
    tiles = -(-k // a.block[1])
    bar = (min(k, 128) + 2 + tiles) * 2.0**-24 * mag
    assert np.all(np.abs(ours - ref) <= bar)
    # Both backends. torch 2.13's CPU _scaled_mm takes row-wise scales; older ones (2.11, on
    # the GPU machine) assert per-tensor scales, and then "scaled_mm" must fall back to the
    # emulation for row operands as it does for block ones, not fail.
    for backend in gemm.BACKENDS:
        out = gemm.fp8_gemm(a, b, backend=backend).double().numpy()
        assert np.all(np.abs(out - ref) <= (k + 2 + tiles) * 2.0**-24 * mag), backend


def test_fp8_gemm_refuses_mixed_operands():
    a = quantize_blocks(torch.randn(4, 32), E4M3, (1, 32))
    from fp8train.tensor import Float8Tensor

    b = Float8Tensor.quantize(torch.randn(8, 32), E4M3, torch.tensor(1.0))
    with pytest.raises(TypeError, match="both operands"):
        gemm.fp8_gemm(a, b)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def linear_sqnrs(granularity: str, x: torch.Tensor, grad_format="e5m2") -> list[float]:
    """SQNR of y, dx, dW of the FP8 linear against the float64 linear on the same weights."""
    torch.manual_seed(0)
    mode = "delayed" if granularity == "tensor" else "current"
    scaling = ScalingRecipe(mode=mode, granularity=granularity, grad_format=grad_format)
    layer = Linear(x.shape[1], 160, recipe=get_recipe("te", scaling=scaling))
    w = layer.weight.detach().double().requires_grad_()
    xin, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    g = torch.randn(x.shape[0], 160, generator=torch.Generator().manual_seed(3))
    y = layer(xin)
    y.backward(g)
    y64 = x64 @ w.t() + layer.bias.detach().double()
    y64.backward(g.double())
    return [sqnr_db(y64, y), sqnr_db(x64.grad, xin.grad), sqnr_db(w.grad, layer.weight.grad)]


def test_linear_at_each_granularity_meets_the_sqnr_floors():
    x = torch.randn(192, 384, generator=torch.Generator().manual_seed(4))
    for granularity in ("tensor", "row", "block"):
        y, dx, dw = linear_sqnrs(granularity, x)
        # The design's floors: FP8 linear output >= 20 dB, gradients >= 18 dB.
        assert y >= 20 and dx >= 18 and dw >= 18, (granularity, y, dx, dw)


def test_outlier_channels_cost_tensor_scaling_and_not_blocks():
    # A few input channels 100x larger: one per-tensor scale pushes the rest toward E4M3's
    # subnormals; 1x128 tiles confine the damage to their own tiles.
    x = torch.randn(192, 384, generator=torch.Generator().manual_seed(5))
    x[:, [3, 77, 200]] *= 100.0
    tensor = linear_sqnrs("tensor", x)
    block = linear_sqnrs("block", x)
    row = linear_sqnrs("row", x)
    assert block[0] >= tensor[0] and block[2] >= tensor[2]
    assert block[0] >= row[0] - 0.5  # the outlier columns sit in every row: block >= row


def test_e4m3_gradients_and_row_block_trains_a_step():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(6))
    assert min(linear_sqnrs("block", x, grad_format="e4m3")) >= 18
    assert min(linear_sqnrs("tensor", x, grad_format="e4m3")) >= 18  # per-tensor takes it too
    layer = Linear(256, 128, recipe=get_recipe("te", scaling=ScalingRecipe(mode="current")))
    assert "E5M2" in repr(layer)
    e4 = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
    assert "E4M3/E4M3 block-wise" in repr(Linear(256, 128, recipe=get_recipe("te", scaling=e4)))


def test_recipe_and_levels_refuse_what_is_not_built():
    with pytest.raises(ValueError, match="mode to 'current'"):
        ScalingRecipe(granularity="block")
    with pytest.raises(ValueError, match="granularity"):
        ScalingRecipe(mode="current", granularity="tile")
    row = ScalingRecipe(mode="current", granularity="row")
    layer = Linear(128, 128, recipe=get_recipe("O3", scaling=row))
    with pytest.raises(NotImplementedError, match="granularity 'row' is not built"):
        layer.lower_weight_precision()


def test_the_config_refuses_e5m2_gradients_at_block():
    # cuBLASLt's block-scaled GEMM reads E4M3 operands only: a null grad format is E4M3 at
    # block (E5M2 elsewhere), an explicit E5M2 at block is refused in one line naming the key.
    from training.config_schema import ConfigError, PrecisionConfig

    block = {"fp8_granularity": "block", "fp8_recipe": "current"}
    assert PrecisionConfig(level="te", **block).recipe().scaling.grad_format == "e4m3"
    assert PrecisionConfig(level="O3").recipe().scaling.grad_format == "e5m2"
    row = PrecisionConfig(level="te", fp8_granularity="row", fp8_recipe="current")
    assert row.recipe().scaling.grad_format == "e5m2"
    with pytest.raises(ConfigError, match="set precision.fp8_grad_format=e4m3") as err:
        PrecisionConfig(level="O2", fp8_grad_format="e5m2", **block)
    assert "\n" not in str(err.value)
    e4 = PrecisionConfig(level="te", fp8_grad_format="e4m3")  # per tensor takes E4M3 too
    assert e4.recipe().scaling.grad_format == "e4m3"


def test_health_is_measured_per_block():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    x[:, 0] = 1e-12  # far below any block's subnormals: flushed to zero
    block = ScalingRecipe(mode="current", granularity="block")
    layer = Linear(256, 128, recipe=get_recipe("te", scaling=block))
    layer.track_health = True
    layer(x).sum().backward()
    stats = layer.fp8_stats()
    kinds = ("underflow", "saturated", "amax", "scale", "scale_spread")
    assert set(stats) == {f"{r}_{w}" for r in ("input", "weight", "grad_output") for w in kinds}
    assert stats["input_underflow"] == pytest.approx(64 / x.numel())
    assert stats["input_saturated"] == 0.0
    # The tensor's amax, the scale of the block holding it (448 / amax), and the binades
    # between the smallest and largest scale of the 1x128 tiles (the 1e-12 column is in the
    # first tile of each row, whose amax the other 127 values set, so it does not count).
    assert stats["input_amax"] == x.abs().max().item()
    assert stats["input_scale"] == pytest.approx(448 / x.abs().max().item(), rel=1e-6)
    tiles = x.abs().reshape(64, 2, 128).amax(-1)
    spread = torch.log2(tiles.max() / tiles.min()).item()
    assert stats["input_scale_spread"] == pytest.approx(spread, rel=1e-5)


def test_initialize_takes_the_granularity():
    # fp8train alone, in a plain PyTorch script: te with block scales trains; O3 stores its
    # FP8 weights in blocks.
    import fp8train

    block = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8train.initialize(model, opt, opt_level="te", scaling=block)
    assert "block-wise" in repr(model[0])
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(8))
    losses = []
    for _ in range(5):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    other = torch.nn.Sequential(torch.nn.Linear(256, 256))
    other, _ = fp8train.initialize(
        other, torch.optim.AdamW(other.parameters()), "O3", scaling=block
    )
    assert other[0].weight_scale_inv.shape == (2, 2)  # O3: FP8 weights in 128x128 blocks


def test_o2_block_gradient_lands_in_the_fp8_slot():
    # O2: the FP16 tensor-scaled master is dequantized for the block cast; the weight
    # gradient (an FP32 GEMM output) goes into the weight's block-scaled FP8 slot, not .grad.
    from fp8train.param_state import grad_slot

    block = ScalingRecipe(mode="current", granularity="block")
    torch.manual_seed(0)
    layer = Linear(256, 192, recipe=get_recipe("O2", scaling=block))
    layer.lower_weight_precision()
    assert layer.weight.dtype == torch.float16
    w64 = (layer.weight.detach().double() * layer.weight_scale_inv.double()).requires_grad_()
    x = torch.randn(96, 256, generator=torch.Generator().manual_seed(9))
    g = torch.randn(96, 192, generator=torch.Generator().manual_seed(10))
    x_in, x64 = x.clone().requires_grad_(), x.double().requires_grad_()
    y = layer(x_in)
    y.backward(g)
    (x64 @ w64.t() + layer.bias.detach().double()).backward(g.double())
    assert layer.weight.grad is None
    slot = grad_slot(layer.weight)
    assert slot.scale_inv.shape == (2, 2)  # the slot keeps one scale per 128x128 block
    dw = slot.dequantize()
    assert sqnr_db(w64.grad, dw) >= 18 and sqnr_db(x64.grad, x_in.grad) >= 18


def test_o3_block_weight_is_stored_in_blocks_and_stepped_through_its_master():
    # O3 at block: the FP8 weight is the E4M3 rounding of its value (of its FP16 master's: the
    # initial value rounded to tensor-scaled FP16 first, test_o3_initial_master) with one
    # power-of-two scale per 128x128 block (partial last blocks: 300 = 2 x 128 + 44,
    # 200 = 128 + 72), the forward reads those bytes as they are, and after each optimizer
    # step the weight is the block rounding of the FP16 master (bitwise: the same
    # quantize_blocks on the same value).
    from fp8train.optim import LowBitAdamW
    from fp8train.param_state import scale_block_of, scale_inv_of

    block = ScalingRecipe(mode="current", granularity="block")
    torch.manual_seed(0)
    layer = Linear(300, 200, recipe=get_recipe("O3", scaling=block))
    full = layer.weight.detach().clone()
    layer.lower_weight_precision()
    master16 = ScaledTensor.quantize(full, torch.float16).dequantize()
    expected = quantize_blocks(master16, E4M3, (128, 128), power_of_two=True)
    assert layer.weight.dtype == E4M3.dtype and layer.weight_scale_inv.shape == (2, 3)
    assert torch.equal(layer.weight.view(torch.uint8), expected.data.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, expected.scale_inv)
    exponents = torch.frexp(layer.weight_scale_inv).mantissa
    assert torch.all(exponents == 0.5)  # powers of two
    assert scale_block_of(layer.weight) == (128, 128)
    assert scale_inv_of(layer.weight) is layer.weight_scale_inv

    x = torch.randn(16, 300, generator=torch.Generator().manual_seed(11))
    x8 = quantize_blocks(x, E4M3, (1, 128))
    w8 = BlockFloat8Tensor(layer.weight.detach(), layer.weight_scale_inv, E4M3, (128, 128))
    assert torch.equal(layer(x).detach(), block_gemm(x8, w8) + layer.bias.detach())

    opt = LowBitAdamW(
        [layer.weight, layer.bias], lr=1e-2,
        exp_avg_dtype=E4M3.dtype, exp_avg_sq_dtype=torch.float16,
    )  # fmt: skip
    for _ in range(2):
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    state = opt.state[layer.weight]
    master = state["master"].float() * state["master_scale_inv"]
    again = quantize_blocks(master, E4M3, (128, 128), power_of_two=True)
    assert not torch.equal(layer.weight.float(), expected.data.float())  # it moved
    assert torch.equal(layer.weight.view(torch.uint8), again.data.view(torch.uint8))
    assert torch.equal(layer.weight_scale_inv, again.scale_inv)


def test_block_scaled_gradient_slot_accumulates_block_by_block():
    # The FP8 weight-gradient slot at block granularity: each accumulation casts the FP32 sum
    # with one scale per 128x128 block from that block's amax, by quantize_blocks' rule (checked
    # against numpy + ml_dtypes above), so the bytes and grids are equal to it bit for bit.
    from fp8train.low_precision import Fp8GradSlot

    gen = torch.Generator().manual_seed(12)
    g1 = torch.randn(300, 200, generator=gen) * 2.0 ** -(torch.arange(300) % 9)[:, None]
    g2 = torch.randn(300, 200, generator=gen) * 1e-3
    slot = Fp8GradSlot((300, 200), block=(128, 128))
    assert slot.units == 6 and slot.scale_inv.shape == (3, 2)
    total = g1
    for g in (g1, g2):
        slot.accumulate(g)
        expected = quantize_blocks(total, E4M3, (128, 128))
        assert torch.equal(slot.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(slot.scale_inv, expected.scale_inv)
        assert torch.equal(slot.amax, block_amax(total, (128, 128)))
        total = expected.dequantize() + g2
    slot.mul_(0.5)  # unscaling or clipping touches the scales only
    assert torch.equal(slot.dequantize(), expected.dequantize() * 0.5)

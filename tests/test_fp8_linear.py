"""The FP8-aware Linear: exactness without FP8, SQNR with it, checkpointed scaling state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.gemm import BACKENDS, scaled_mm_available
from fp8train.gemm_backend import set_gemm_backend
from fp8train.linear import Linear
from fp8train.param_state import fp8_grad_slot
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe

TE = get_recipe("te")


@pytest.fixture(
    autouse=True, params=[b for b in BACKENDS if b != "scaled_mm" or scaled_mm_available("cpu")]
)
def backend(request):
    set_gemm_backend(request.param)  # pinned: no timing inside tests
    yield request.param
    set_gemm_backend(None)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("level", [None, "fp32", "bf16", "fp16"])
def test_non_fp8_is_exactly_f_linear(level):
    recipe = None if level is None else get_recipe(level)
    torch.manual_seed(0)
    ours = Linear(32, 16, recipe=recipe)
    torch.manual_seed(0)
    ref = nn.Linear(32, 16)  # same init calls in the same order
    assert torch.equal(ours.weight, ref.weight) and torch.equal(ours.bias, ref.bias)
    assert list(ours.state_dict()) == list(ref.state_dict())
    x1 = randn(3, 5, 32, seed=1).requires_grad_()
    x2 = x1.detach().clone().requires_grad_()
    y1, y2 = ours(x1), F.linear(x2, ref.weight, ref.bias)
    assert torch.equal(y1, y2)
    y1.square().sum().backward()
    y2.square().sum().backward()
    assert torch.equal(x1.grad, x2.grad) and torch.equal(ours.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("mode", ["delayed", "current"])
@pytest.mark.parametrize("bias", [True, False])
def test_sqnr_against_float64(mode, bias):
    x, w, g = randn(256, 128, seed=1), randn(64, 128, seed=2), randn(256, 64, seed=3)
    b = randn(64, seed=4)
    lin = Linear(128, 64, bias=bias, recipe=get_recipe("te", scaling=ScalingRecipe(mode=mode)))
    with torch.no_grad():
        lin.weight.copy_(w)
        if bias:
            lin.bias.copy_(b)
    xr = x.clone().requires_grad_()
    y = lin(xr)
    y.backward(g)

    x64, w64, g64 = x.double(), w.double(), g.double()
    y64 = x64 @ w64.t() + (b.double() if bias else 0)
    assert y.dtype == torch.float32
    assert sqnr_db(y64, y) >= 25
    assert sqnr_db(g64 @ w64, xr.grad) >= 20
    assert sqnr_db(g64.t() @ x64, lin.weight.grad) >= 20
    if bias:
        torch.testing.assert_close(lin.bias.grad.double(), g64.sum(0), rtol=1e-5, atol=1e-5)


def test_output_dtype_follows_input_and_leading_dims():
    lin = Linear(64, 32, recipe=TE)
    x = randn(2, 3, 64, seed=5).to(torch.bfloat16).requires_grad_()
    y = lin(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and lin.weight.grad.dtype == torch.float32
    # The leading dims are only a reshape: same numbers as the 2-D call.
    lin2 = Linear(64, 32, recipe=TE)
    lin2.load_state_dict(lin.state_dict())
    lin.reset_fp8_state()
    lin2.reset_fp8_state()
    assert torch.equal(lin(x).reshape(6, 32), lin2(x.reshape(6, 64)))


def train_steps(lin: Linear, seeds, lr=0.1) -> list[torch.Tensor]:
    outs = []
    for s in seeds:
        x = randn(32, 48, seed=s) * (1 + s % 3)  # amax changes from step to step
        y = lin(x)
        y.backward(randn(32, 24, seed=s + 1000) * 1e-3)
        with torch.no_grad():
            for p in lin.parameters():
                p -= lr * p.grad
                p.grad = None
        outs.append(y.detach())
    return outs


def test_state_dict_round_trip_resumes_bit_identically():
    scaling = ScalingRecipe(amax_history_len=4, warmup_steps=2)
    torch.manual_seed(0)
    a = Linear(48, 24, recipe=get_recipe("te", scaling=scaling))
    train_steps(a, range(5))
    sd = {k: v.clone() for k, v in a.state_dict().items()}
    for role in ("fp8_input", "fp8_weight", "fp8_grad_output"):
        assert sd[f"{role}.step"].item() == 5 and sd[f"{role}.amax_history"].shape == (4,)
    b = Linear(48, 24, recipe=get_recipe("te", scaling=scaling))
    b.load_state_dict(sd)
    for ya, yb in zip(train_steps(a, range(5, 10)), train_steps(b, range(5, 10))):
        assert torch.equal(ya, yb)
    for k, v in a.state_dict().items():
        assert torch.equal(v, b.state_dict()[k]), k


def test_eval_and_no_grad_do_not_advance_state():
    lin = Linear(48, 24, recipe=TE)
    train_steps(lin, range(3))
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    lin.eval()
    with torch.no_grad():
        y = lin(randn(8, 48, seed=9) * 100)
    assert torch.isfinite(y).all()
    for k, v in lin.state_dict().items():
        assert torch.equal(v, before[k]), k
    lin.train()
    with torch.no_grad():  # training mode without autograd (e.g. a forward-only probe)
        lin(randn(8, 48, seed=9))
    assert lin.fp8_input.step.item() == 4


def test_inf_amax_keeps_scales_and_weights_finite_and_recovers():
    lin = Linear(48, 24, recipe=get_recipe("te", scaling=ScalingRecipe(amax_history_len=4)))
    train_steps(lin, range(3))
    x = randn(32, 48, seed=50)
    x[3, 7] = float("inf")
    g = randn(32, 24, seed=51)
    g[0, 0] = float("inf")
    y = lin(x)
    y.backward(g)
    assert torch.isfinite(y[:3]).all()  # rows without the inf are untouched by it
    for state in lin.fp8_states().values():
        assert torch.isfinite(state.scale).all() and torch.isfinite(state.amax_history).all()
    assert lin.fp8_input.nonfinite.item() == 1 and lin.fp8_grad_output.recover.item()
    # Saturation keeps the FP8 weight gradient finite, so the weights stay finite too.
    assert torch.isfinite(lin.weight.grad).all()
    with torch.no_grad():
        lin.weight -= 0.1 * lin.weight.grad
    assert torch.isfinite(lin.weight).all()
    # Next step: each role uses its own (current) amax again.
    x2 = randn(32, 48, seed=52) * 0.5
    lin(x2).backward(randn(32, 24, seed=53))
    assert lin.fp8_input.scale.item() == pytest.approx(448 / x2.abs().max().item(), rel=1e-6)
    assert not lin.fp8_input.recover.item() and not lin.fp8_grad_output.recover.item()


class _CountSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def test_training_step_has_no_host_sync():
    lin = Linear(48, 24, recipe=TE)
    x = randn(32, 48, seed=1).requires_grad_()
    with _CountSyncs() as counter:
        for _ in range(3):
            lin(x).sum().backward()
    assert counter.syncs == 0


def test_dtype_cast_meta_and_reporting():
    lin = Linear(16, 8, recipe=TE).to(torch.bfloat16)
    assert lin.weight.dtype == torch.bfloat16
    assert lin.fp8_input.scale.dtype == torch.float32  # the model cast did not round it
    assert lin(randn(4, 16, seed=0).to(torch.bfloat16)).dtype == torch.bfloat16
    stats = lin.fp8_stats()
    assert set(stats) == {
        f"{r}_{w}" for r in ("input", "weight", "grad_output") for w in ("amax", "scale")
    }
    assert all(isinstance(v, float) for v in stats.values())
    assert "fp8=E4M3/E5M2" in repr(lin) and Linear(4, 4).fp8_stats() == {}

    meta = Linear(16, 8, recipe=TE, device="meta")
    meta.to_empty(device="cpu")
    meta.reset_parameters()
    assert meta.fp8_weight.step.item() == 0 and meta.fp8_weight.scale.item() == 1.0


def _two_micro_batches(level: str, keep: bool):
    """Gradients of two micro-batches of one step through one FP8 linear on the cuBLASLt
    backend's path (ATen's reference kernel here), with the weight's transpose kept across
    them (``keep_weight_cast``, as the training loop sets it) or copied per backward."""
    torch.manual_seed(0)
    linear = Linear(64, 32, recipe=get_recipe(level))
    linear.lower_weight_precision()
    linear.gemm_backend = "scaled_mm"
    xs = [torch.randn(16, 64, requires_grad=True) for _ in range(2)]
    transposes = []
    for micro, x in enumerate(xs):
        linear.reuse_weight_cast, linear.keep_weight_cast = micro > 0, keep
        linear(x).square().sum().backward()
        transposes.append(None if linear._weight_cast is None else linear._weight_cast[2])
    linear.release_weight_cast()
    slot = fp8_grad_slot(linear.weight)  # O1-O3: the FP8 gradient slot, bytes and scale
    wgrad = [linear.weight.grad] if slot is None else [slot.data.view(torch.uint8), slot.scale_inv]
    return [x.grad for x in xs] + [*wgrad, linear.bias.grad], transposes


@pytest.mark.parametrize("level", ["te", "O2", "O3"])
def test_the_kept_weight_transpose_changes_no_bit_and_is_made_once_per_step(level):
    # Bitwise: the kept transpose holds the bytes the per-backward copy would make, and the
    # GEMMs read the same contiguous operands in the same order on the same shapes.
    kept, transposes = _two_micro_batches(level, keep=True)
    copied, none = _two_micro_batches(level, keep=False)
    for a, b in zip(kept, copied):
        assert torch.equal(a, b)
    assert transposes[0] is not None and transposes[1] is transposes[0]  # made once
    assert none == [None, None]


def test_backward_keeps_only_the_transposed_fp8_input():
    # The weight-gradient GEMM reads xᵀ: the forward keeps it (1 byte per element), not x.
    linear = Linear(64, 32, recipe=get_recipe("te"))
    linear.gemm_backend = "scaled_mm"
    x = torch.randn(16, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        linear(x)
    fp8 = [t for t in saved if t.dtype == torch.float8_e4m3fn]
    assert [tuple(t.shape) for t in fp8] == [(64, 16), (32, 64)]  # xᵀ and W
    assert all(t.is_contiguous() for t in fp8)

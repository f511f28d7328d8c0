"""The fused LowBitAdamW step (fp8train/fused_adam.py), compiled by inductor for the CPU,
against the reference step (the ``_foreach_*`` path of fp8train/optim.py).

What is checked, and why it can be exact: the compiled function traces the reference's
arithmetic op for op, and every op of it is correctly rounded IEEE arithmetic on both sides
except eager's CPU ``sqrt``, which is within an ulp but not exact (fused_adam's docstring). So
against a reference whose square root is made exact (``exact_sqrt``) the fused step must give
every bit of every weight, scale and state; against the reference as it is, the moments must
still be exact (they do not read the square root) and the weights within the rounding an ulp
of the denominator can move (derived at ``test_fused_tracks_the_eager_reference``). The bars
of tests/test_lowbit_adam.py (each step equals float64 AdamW rounded once; free-running
error; the O2 moments' regression) are run again on the fused path.

Compiling costs seconds on two cores: the compiled functions are cached per kind of parameter
in the process (``fused_adam.compiled_steps``), and the ``compiled`` fixture compiles the
mixed model's kinds once for the module; tensors stay tiny.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fp8train import fused_adam
from fp8train.blockwise import quantize_blocks
from fp8train.formats import E4M3
from fp8train.low_precision import Fp8GradSlot
from fp8train.optim import LowBitAdamW
from fp8train.param_state import fp8_grad_slot, scale_inv_of, set_grad_slot, set_scale_inv
from tests import test_lowbit_adam as lowbit

FP8 = E4M3.dtype
O1 = dict(exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32)
O2 = lowbit.O2
STEPS = 8


def exact_sqrt(tensors):
    # sqrt of an fp32 value in float64, rounded to fp32, is the correctly rounded fp32 sqrt
    # (53 >= 2 * 24 + 2 bits: no double-rounding error for a square root).
    return [t.double().sqrt().float() for t in tensors]


def _row_slot_param(w: torch.Tensor) -> nn.Parameter:
    """An O2 FP16 weight whose FP8 gradient has one scale per row (row granularity): the fused
    step takes it dequantised, as an FP32 gradient."""
    p = lowbit.scaled_param(w, torch.float16)
    set_grad_slot(p, Fp8GradSlot(p.shape, block=(1, p.shape[1])))
    return p


def _block_o3_param(w: torch.Tensor) -> nn.Parameter:
    """An O3 FP8 weight with one scale per 4x4 block: the reference path, even when fused."""
    stored = quantize_blocks(w, E4M3, (4, 4), power_of_two=True)
    p = nn.Parameter(stored.data)
    set_scale_inv(p, stored.scale_inv, stored.block)
    set_grad_slot(p, Fp8GradSlot(p.shape))
    return p


def mixed_params(seed: int = 0, rows: int = 6) -> list[nn.Parameter]:
    """One parameter of each kind the fused step takes, shapes following ``rows``."""
    torch.manual_seed(seed)
    return [
        nn.Parameter(torch.randn(rows + 2)),  # plain FP32 (bias): FP32 moments
        lowbit.scaled_param(torch.randn(rows + 2, 6), torch.float16),  # O2
        lowbit.scaled_param(torch.randn(rows, 5), torch.float16),  # O1 (FP32 moments)
        lowbit.scaled_param(torch.randn(rows, 8), FP8),  # O3, O2 moments
        _row_slot_param(torch.randn(rows + 1, 4)),  # O2, row-scaled FP8 gradient
    ]


def _groups(ps: list) -> list[dict]:
    return [
        {"params": [ps[0]], "weight_decay": 0.0},  # no decay, as biases usually are
        {"params": [ps[1], ps[3], ps[4]]},
        {"params": [ps[2]], "lr": 3e-3, **O1},
    ]


def _optimizer(ps: list, fused: bool) -> LowBitAdamW:
    return LowBitAdamW(_groups(ps), lr=1e-2, weight_decay=0.1, fused=fused, **O2)


def _run(pairs, gen: torch.Generator, steps: int = STEPS, reference_sqrt=None, spread=0.0):
    """``steps`` steps of each (params, optimizer) pair on the same gradients, the learning
    rate changing every step (a schedule); ``reference_sqrt`` patches the non-fused ones.
    ``spread``: gradient magnitudes spread over about ``e**(2 * spread)`` either way (6: 20
    of the 124 FP8 moments of ``mixed_params`` end among E4M3's subnormals)."""
    for i in range(steps):
        grads = None
        for params, opt in pairs:
            if grads is None:
                grads = [
                    torch.randn(p.shape, generator=gen)
                    * torch.exp(spread * torch.randn(p.shape, generator=gen))
                    for p in params
                ]
            for p, g in zip(params, grads):
                slot = fp8_grad_slot(p)
                if slot is None:
                    p.grad = g.clone()
                else:
                    slot.zero_()
                    slot.accumulate(g)
            for group in opt.param_groups:
                group["lr"] = group.setdefault("base_lr", group["lr"]) * (1 + i) / steps
            if reference_sqrt is not None and not opt.fused:
                with _patched_sqrt(reference_sqrt):
                    opt.step()
            else:
                opt.step()


class _patched_sqrt:
    def __init__(self, fn):
        self.fn = fn

    def __enter__(self):
        self.real, torch._foreach_sqrt = torch._foreach_sqrt, self.fn

    def __exit__(self, *exc):
        torch._foreach_sqrt = self.real


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.fixture(scope="module")
def compiled():
    """Compiles the mixed model's kinds once for the module; past dynamo's recompile limit a
    function would run eagerly without a word, so that is made an error here."""
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        params = mixed_params()
        _run([(params, _optimizer(params, fused=True))], torch.Generator().manual_seed(0), 2)
        yield


def test_backend_is_decided_at_construction():
    cpu = [nn.Parameter(torch.ones(2))]
    assert LowBitAdamW(cpu).fused is False  # the CPU keeps the reference by default
    assert LowBitAdamW(cpu, fused=True).fused is True
    assert LowBitAdamW([nn.Parameter(torch.ones(2, device="meta"))]).fused is False  # a plan


@pytest.mark.parametrize("spread", [0.0, 6.0], ids=["normal_grads", "wide_grads"])
def test_fused_step_is_the_reference_bit_for_bit(compiled, monkeypatch, spread):
    calls = []
    update = fused_adam.fused_update_
    monkeypatch.setattr(
        fused_adam, "fused_update_", lambda p, *a: (calls.append(id(p)), update(p, *a))
    )
    ref, ours = mixed_params(), mixed_params()
    ref_opt, opt = _optimizer(ref, fused=False), _optimizer(ours, fused=True)
    gen = torch.Generator().manual_seed(1)
    _run([(ref, ref_opt), (ours, opt)], gen, reference_sqrt=exact_sqrt, spread=spread)
    assert set(calls) == {id(p) for p in ours}  # every kind took the fused step
    lowbit.assert_same_bits(ref, ref_opt, ours, opt)
    if spread:  # the case is what it says: subnormal E4M3 moments were stored
        low = [opt.state[p]["exp_avg"] for p in ours if "exp_avg_scale_inv" in opt.state[p]]
        m = torch.cat([x.float().abs().flatten() for x in low])
        assert ((m > 0) & (m < 2.0**-6)).sum() >= 10
    assert all(opt.state[p]["step"] == STEPS for p in ours)


def _real(p, scale_inv) -> torch.Tensor:
    return p.detach().double() * (1.0 if scale_inv is None else scale_inv.double())


def test_fused_tracks_the_eager_reference(compiled):
    """Against the reference as it is (eager CPU sqrt, off by an ulp in ~0.6% of elements).

    Derivation. A denominator one fp32 ulp off moves the update u = s*m/d by about an ulp of
    u, and the new weight w + u, far larger than u, rounds the same unless that ulp of u
    crosses a rounding boundary of w's storage (probability about ulp(u) / ulp(w), small).
    Where it does, the stored value moves by one ulp of its storage (FP32, or FP16 at its
    power-of-two scale; O3's FP8 weight, cast from the master, by one E4M3 ulp at most). Such
    steps add: after T steps an element is within T ulps. The moments never read the
    denominator: they stay exact, and so do the scales of the moments.
    """
    ref, ours = mixed_params(3, rows=40), mixed_params(3, rows=40)
    ref_opt, opt = _optimizer(ref, fused=False), _optimizer(ours, fused=True)
    _run([(ref, ref_opt), (ours, opt)], torch.Generator().manual_seed(2))
    for a, b in zip(ref, ours):
        for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale_inv", "exp_avg_sq_scale_inv"):
            if key in ref_opt.state[a]:
                assert torch.equal(
                    lowbit.bits(ref_opt.state[a][key]), lowbit.bits(opt.state[b][key])
                )
        stored = [(a, scale_inv_of(a), b, scale_inv_of(b))]
        if "master" in ref_opt.state[a]:
            sa, sb = ref_opt.state[a], opt.state[b]
            stored.append(
                (sa["master"], sa["master_scale_inv"], sb["master"], sb["master_scale_inv"])
            )
        for x, x_scale, y, y_scale in stored:
            one = torch.ones(()) if x_scale is None else x_scale
            err = (_real(x, x_scale) - _real(y, y_scale)).abs()
            assert (err <= STEPS * lowbit.ulp(x, one)).all()
            assert (err > 0).float().mean() <= 0.01


@pytest.mark.parametrize("moments", [{}, O2], ids=["O1_moments", "O2_moments"])
@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16_weight", "fp8_weight"])
def test_each_step_is_float64_adamw_rounded_when_fused(compiled, monkeypatch, dtype, moments):
    monkeypatch.setattr(lowbit, "LowBitAdamW", functools.partial(LowBitAdamW, fused=True))
    lowbit.test_scaled_weight_each_step_is_float64_adamw_rounded(dtype, moments)


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16_weight", "fp8_weight"])
def test_free_running_tracks_float64_adamw_when_fused(compiled, monkeypatch, dtype):
    monkeypatch.setattr(lowbit, "LowBitAdamW", functools.partial(LowBitAdamW, fused=True))
    lowbit.test_scaled_weight_free_running_tracks_float64_adamw(dtype)


def test_lowbit_moments_track_adamw_when_fused(compiled, monkeypatch):
    # FP32 weights with O2 moments (a param group's override): the regression of
    # test_lowbit_adam with its bars (displacement 2**-3, loss 2**-5).
    monkeypatch.setattr(lowbit, "LowBitAdamW", functools.partial(LowBitAdamW, fused=True))
    lowbit.test_lowbit_moments_track_adamw(O2, 2.0**-3, 2.0**-5)


def test_no_recompile_across_steps_learning_rates_and_shapes(compiled):
    before = _unique_graphs()
    for seed, rows in ((5, 9), (6, 23)):  # new shapes of every kind, new learning rates
        params = mixed_params(seed, rows)
        _run([(params, _optimizer(params, fused=True))], torch.Generator().manual_seed(seed), 3)
    assert _unique_graphs() == before


def test_block_scaled_o3_weight_keeps_the_reference_path(compiled):
    def make():
        torch.manual_seed(4)
        return [_block_o3_param(torch.randn(10, 12)), *mixed_params(4)[:2]]

    ref, ours = make(), make()
    assert not fused_adam.fusable(ours[0], {"exp_avg": ours[0], "exp_avg_sq": ours[0]})
    ref_opt = LowBitAdamW(ref, lr=1e-2, **O2)
    opt = LowBitAdamW(ours, lr=1e-2, fused=True, **O2)
    _run([(ref, ref_opt), (ours, opt)], torch.Generator().manual_seed(3), 3, exact_sqrt)
    lowbit.assert_same_bits(ref, ref_opt, ours, opt)


def test_a_step_under_a_dispatch_mode_takes_the_reference(compiled):
    # Dynamo refuses to run under a (non-infra) dispatch mode, such as an accounting of the
    # step: that step takes the reference, which never reads a value on the host, and the
    # fused path stays on for the next.
    ref, ours = mixed_params(), mixed_params()
    ref_opt, opt = _optimizer(ref, fused=False), _optimizer(ours, fused=True)
    with lowbit._CountHostSyncs() as counter:
        _run([(ref, ref_opt), (ours, opt)], torch.Generator().manual_seed(1), 2)
    assert counter.count == 0 and opt.fused
    lowbit.assert_same_bits(ref, ref_opt, ours, opt)


def test_a_compile_failure_falls_back_to_the_reference(monkeypatch):
    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(fused_adam, "compiled_steps", lambda *args: broken)
    ref, ours = mixed_params(), mixed_params()
    ref_opt, opt = _optimizer(ref, fused=False), _optimizer(ours, fused=True)
    with pytest.warns(RuntimeWarning, match="fused step disabled"):
        _run([(ref, ref_opt), (ours, opt)], torch.Generator().manual_seed(1), 2)
    assert opt.fused is False
    lowbit.assert_same_bits(ref, ref_opt, ours, opt)  # step counters included

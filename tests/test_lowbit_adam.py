"""LowBitAdamW against torch.optim.AdamW (FP32) and a float64 AdamW (the independent references).

Scaled parameters are built by hand here the way the model layer builds them: an FP16 (O1/O2)
or FP8 (O3) ``nn.Parameter`` with an fp32 ``scale_inv`` attribute and an ``Fp8GradSlot`` in
``main_grad``.
"""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.formats import E4M3
from fp8train.low_precision import Fp8GradSlot, ScaledTensor
from fp8train.optim import LowBitAdamW, _add_update_
from fp8train.param_state import fp8_grad_slot, scale_inv_of, set_grad_slot, set_scale_inv

FP8 = E4M3.dtype
O2 = dict(exp_avg_dtype=FP8, exp_avg_sq_dtype=torch.float16)


def scaled_param(w: torch.Tensor, dtype: torch.dtype) -> nn.Parameter:
    stored = ScaledTensor.quantize(w, dtype)
    p = nn.Parameter(stored.data)
    set_scale_inv(p, stored.scale_inv)
    set_grad_slot(p, Fp8GradSlot(p.shape))
    return p


def value(p: torch.Tensor) -> torch.Tensor:
    return p.detach().float() * scale_inv_of(p)


def scale_or_one(p: torch.Tensor) -> torch.Tensor:
    """The per-tensor scale of a scaled parameter; 1 for a plain one."""
    scale_inv = scale_inv_of(p)
    return torch.ones(()) if scale_inv is None else scale_inv


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor, for bit-exact comparisons of any dtype (FP8 included)."""
    return t.detach().reshape(-1).view(torch.uint8)


def assert_same_bits(params_a, opt_a, params_b, opt_b) -> None:
    """Every weight, scale and optimizer state of two optimizers' parameters, bit for bit."""
    for a, b in zip(params_a, params_b, strict=True):
        assert torch.equal(bits(a), bits(b))
        assert torch.equal(scale_or_one(a), scale_or_one(b))
        for key, t in opt_a.state[a].items():
            assert torch.equal(bits(opt_b.state[b][key]), bits(t))


def ulp(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Spacing of the format around each stored element, in real units (float64)."""
    fi = torch.finfo(data.dtype)
    y = data.detach().double().abs().clamp(min=fi.smallest_normal)
    _, e = torch.frexp(y)  # y = m * 2**e, m in [0.5, 1): binade 2**(e-1), spacing eps times it
    return torch.ldexp(torch.full_like(y, fi.eps), e - 1) * scale_inv.double()


def within_rounding(ours: torch.Tensor, ref: torch.Tensor, half_ulp: torch.Tensor) -> None:
    # Beyond the storage rounding only fp32-vs-fp64 arithmetic differs: a few 2**-24 of the
    # operands' magnitudes (not of the result's, which may cancel), so relative to the amax.
    err = (ours.double() - ref).abs()
    bound = half_ulp + 2.0**-20 * ref.abs().amax()
    assert (err <= bound).all(), f"max err/bound {(err / bound).max().item():.3f}"


def random_grads(params, gen, scale=1.0):
    for p in params:
        g = torch.randn(p.shape, generator=gen) * scale
        slot = fp8_grad_slot(p)
        if slot is not None:
            slot.zero_()
            slot.accumulate(g)
        else:
            p.grad = g


def test_fp32_bit_identical_to_torch_adamw():
    torch.manual_seed(0)
    init = [torch.randn(7, 5), torch.randn(5), torch.randn(3, 4), torch.randn(2)]

    def groups(ps):
        return [
            {"params": ps[:2], "lr": 1e-2, "weight_decay": 0.1, "wd_mult": 1.0},
            {"params": ps[2:3], "lr": 3e-3, "weight_decay": 0.0, "betas": (0.8, 0.99)},
            {"params": ps[3:], "eps": 1e-3},
        ]

    for foreach in (False, True):
        ref = [nn.Parameter(w.clone()) for w in init]
        ours = [nn.Parameter(w.clone()) for w in init]
        opt_ref = torch.optim.AdamW(groups(ref), lr=1e-3, foreach=foreach)
        opt = LowBitAdamW(groups(ours), lr=1e-3)
        assert opt.param_groups[0]["wd_mult"] == 1.0
        gen = torch.Generator().manual_seed(1)
        for _ in range(100):
            random_grads(ref, gen)
            for a, b in zip(ours, ref):
                a.grad = b.grad.clone()
            opt_ref.step()
            opt.step()
        for a, b in zip(ours, ref):
            assert torch.equal(a, b)
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[a][key], opt_ref.state[b][key].to(a.device))


def test_update_paths_agree():
    """The packed-scalar update (CPU) and the one accelerators use round identically."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (7,)]
    ws = [torch.randn(s, generator=gen) for s in shapes]
    ms = [torch.randn(s, generator=gen) for s in shapes]
    ds = [torch.rand(s, generator=gen) + 1e-3 for s in shapes]
    step_sizes = -torch.rand(2, dtype=torch.float64, generator=gen) * 1e-2
    a, b = [w.clone() for w in ws], [w.clone() for w in ws]
    _add_update_(a, ms, ds, step_sizes, packed=True)
    _add_update_(b, ms, ds, step_sizes, packed=False)
    for x, y, w in zip(a, b, ws):
        assert torch.equal(x, y) and not torch.equal(x, w)


def _regression(make_opt, steps=100):
    """Minibatch MSE of a 2-layer GELU MLP on a random teacher's data; fixed seeds."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 32, generator=gen)
    w1, w2 = torch.randn(64, 32, generator=gen) * 0.5, torch.randn(4, 64, generator=gen) * 0.5
    y = torch.tanh(x @ w1.T) @ w2.T + 0.05 * torch.randn(512, 4, generator=gen)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    init = [p.detach().clone() for p in model.parameters()]
    opt = make_opt(list(model.parameters()))
    losses = []
    for i in range(steps):
        rows = slice(i * 64 % 512, i * 64 % 512 + 64)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y)
    return final, torch.stack(losses), [p.detach() for p in model.parameters()], init


@pytest.mark.parametrize(
    "moments, disp_bar, loss_bar",
    [(O2, 2.0**-3, 2.0**-5), (dict(exp_avg_sq_dtype=torch.float16), 2.0**-10, 2.0**-10)],
    ids=["e4m3_m+fp16_v", "fp16_v"],
)
def test_lowbit_moments_track_adamw(moments, disp_bar, loss_bar):
    """O2 moments on FP32 parameters vs torch.optim.AdamW, same data, init and seeds.

    Derivation. The update direction is m / sqrt(v). Storing m in E4M3 (3 mantissa bits)
    rounds it by at most half an ulp, 2**-4 relative (normal range); storing v in FP16 rounds
    it by 2**-11, i.e. sqrt(v) by 2**-12. So each update carries up to ~2**-4 relative error,
    and the total displacement W - W0 (a sum of updates) should differ from AdamW's by about
    2**-4 of its size; with FP16 v alone by about 2**-12.

    Measured (seeds 0-4, lr 1e-2 and 1e-3): displacement error ||W - W_ref|| / ||W_ref - W0||
    (worst layer) 0.032-0.067 with E4M3 m (0.064 here), 2.8e-4-3.6e-4 with FP16 v alone, as
    derived. Bars, with about 2x margin: 2**-3 and 2**-10. Final full-batch loss: +0.17% to
    +1.13% above AdamW (+0.58% here; nearest rounding of m biases slightly toward slower
    progress), per-step loss trajectory within 1.3%: bar 2**-5 (3.1%). FP16 v alone: loss
    differences below 1e-4: bar 2**-10.
    """
    ref = _regression(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01))
    low = _regression(lambda ps: LowBitAdamW([{"params": ps, **moments}], lr=1e-2))
    for w, w_ref, w0 in zip(low[2], ref[2], ref[3]):
        assert (w - w_ref).norm() / (w_ref - w0).norm() < disp_bar
    assert abs(low[0] / ref[0] - 1) < loss_bar
    assert ((low[1] / ref[1] - 1).abs() < loss_bar).all()


def _float64_step(p_value, grad, state, group) -> dict:
    """One torch.optim.AdamW step in float64 from the given weight value and moments."""
    q = nn.Parameter(p_value.double().clone())
    ref = torch.optim.AdamW(
        [q], lr=group["lr"], betas=group["betas"], eps=group["eps"],
        weight_decay=group["weight_decay"], foreach=False,
    )  # fmt: skip
    moment = {}
    for key in ("exp_avg", "exp_avg_sq") if state else ():
        t = state[key]
        si = state.get(f"{key}_scale_inv")
        moment[key] = (t.double() * si.double() if si is not None else t.double()).clone()
    if state:  # else: the first step, from zero moments on both sides
        ref.state[q] = {"step": state["step"].clone(), **moment}
    q.grad = grad.double()
    ref.step()
    return {"weight": q.detach(), **ref.state[q]}


@pytest.mark.parametrize("moments", [{}, O2], ids=["O1_moments", "O2_moments"])
@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16_weight", "fp8_weight"])
def test_scaled_weight_each_step_is_float64_adamw_rounded(dtype, moments):
    """Every step from the optimizer's own state equals float64 AdamW's step, rounded once.

    FP16 weights (O1/O2) and FP16 masters (O3) are within half an FP16 ulp (at the stored
    power-of-two scale) of the float64 result; stored moments within half an ulp of their
    format; the O3 FP8 weight is exactly the E4M3 rounding of the stored master.
    """
    torch.manual_seed(0)
    p = scaled_param(torch.randn(24, 16) * 0.1, dtype)
    scale_buffer = scale_inv_of(p)
    opt = LowBitAdamW([p], lr=1e-2, weight_decay=0.1, **moments)
    gen = torch.Generator().manual_seed(1)
    random_grads([p], gen, 1e-3)
    if dtype == FP8:
        # A first step with lr = wd = 0 leaves the weight alone: the master it creates must be
        # exactly the FP8 weight's value, and re-casting it must give back the same bytes.
        w0, bytes0 = value(p), bits(p).clone()
        group = opt.param_groups[0]
        group["lr"], group["weight_decay"] = 0.0, 0.0
        opt.step()
        st = opt.state[p]
        assert torch.equal(dequant(st["master"], st["master_scale_inv"]), w0)
        assert torch.equal(bits(p), bytes0)
        group["lr"], group["weight_decay"] = 1e-2, 0.1
    for _ in range(30):
        random_grads([p], gen, 1e-3)
        st = opt.state[p]
        before = dequant(st["master"], st["master_scale_inv"]) if dtype == FP8 else value(p)
        ref = _float64_step(before, fp8_grad_slot(p).dequantize(), st, opt.param_groups[0])
        opt.step()
        if dtype == FP8:
            w = dequant(st["master"], st["master_scale_inv"])
            w_half_ulp = ulp(st["master"], st["master_scale_inv"]) / 2
            recast = ScaledTensor.quantize(w, FP8)
            assert torch.equal(bits(p), bits(recast.data))
            assert torch.equal(scale_inv_of(p), recast.scale_inv)
        else:
            w, w_half_ulp = value(p), ulp(p, scale_inv_of(p)) / 2
            assert 32752 < p.detach().float().abs().max() <= 65504
        within_rounding(w, ref["weight"], w_half_ulp)
        assert scale_inv_of(p) is scale_buffer  # updated in place: the module's buffer
        assert torch.frexp(scale_inv_of(p))[0] == 0.5  # a power of two
        for key in ("exp_avg", "exp_avg_sq"):
            si = st.get(f"{key}_scale_inv", torch.ones(()))
            half = ulp(st[key], si) / 2 if f"{key}_scale_inv" in st else torch.zeros(())
            within_rounding(dequant(st[key], si), ref[key], half)
        assert st["step"] == ref["step"]


def dequant(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.float() * scale_inv


@pytest.mark.parametrize("dtype", [torch.float16, FP8], ids=["fp16_weight", "fp8_weight"])
def test_scaled_weight_free_running_tracks_float64_adamw(dtype):
    """100 steps with FP32 moments against float64 AdamW fed the same dequantized gradients.

    The gradients do not depend on the weights here, so the moments agree to fp32 arithmetic
    and the weights differ only by the storage roundings: weight decay shrinks an old error, so
    after T steps the error is at most the sum of the T half-ulps. The O3 FP8 weight adds one
    E4M3 rounding of the master on top.
    """
    torch.manual_seed(0)
    p = scaled_param(torch.randn(32, 32) * 0.05, dtype)
    opt = LowBitAdamW([p], lr=3e-3, weight_decay=0.1)
    q = nn.Parameter(value(p).double())
    ref = torch.optim.AdamW([q], lr=3e-3, weight_decay=0.1, foreach=False)
    bound = torch.zeros(p.shape, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        random_grads([p], gen, 1e-2)
        q.grad = fp8_grad_slot(p).dequantize().double()
        opt.step()
        ref.step()
        st = opt.state[p]
        stored = (st["master"], st["master_scale_inv"]) if dtype == FP8 else (p, scale_inv_of(p))
        bound += ulp(*stored) / 2 + 2.0**-20 * q.detach().abs()
        assert ((dequant(*stored).double() - q.detach()).abs() <= bound).all()
    assert ((value(p).double() - q.detach()).abs() <= bound + ulp(p, scale_inv_of(p)) / 2).all()
    assert (dequant(*stored).double() - q.detach()).norm() / q.detach().norm() < 2.0**-8


def _mixed_model():
    """One parameter of each kind: plain FP32 (bias), scaled FP16 (O1/O2), FP8 (O3)."""
    torch.manual_seed(0)
    return [
        nn.Parameter(torch.randn(8)),
        scaled_param(torch.randn(8, 6), torch.float16),
        scaled_param(torch.randn(6, 8), FP8),
    ]


def _snapshot(params):
    return [(p.detach().clone(), scale_or_one(p).clone()) for p in params]


def _rebuild(snapshot):
    out = []
    for data, scale_inv in snapshot:
        p = nn.Parameter(data.clone())
        if data.dtype != torch.float32:
            set_scale_inv(p, scale_inv.clone())
            set_grad_slot(p, Fp8GradSlot(p.shape))
        out.append(p)
    return out


def test_state_dict_round_trip_through_safetensors():
    safetensors = pytest.importorskip("safetensors.torch")
    params = _mixed_model()
    opt = LowBitAdamW(params, lr=1e-2, **O2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        random_grads(params, gen)
        opt.step()
    sd = opt.state_dict()
    keys = {k for st in sd["state"].values() for k in st}
    assert keys == {
        "step", "exp_avg", "exp_avg_scale_inv", "exp_avg_sq", "exp_avg_sq_scale_inv",
        "master", "master_scale_inv",
    }  # fmt: skip
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}  # plain: FP32 moments
    flat = {f"state.{i}.{k}": t for i, st in sd["state"].items() for k, t in st.items()}
    blob = safetensors.save(flat)
    restored_params = _rebuild(_snapshot(params))
    loaded = safetensors.load(io.BytesIO(blob).getvalue())
    state: dict[int, dict] = {}
    for name, t in loaded.items():
        _, i, key = name.split(".", 2)
        state.setdefault(int(i), {})[key] = t
    opt2 = LowBitAdamW(restored_params, lr=1e-2, **O2)
    opt2.load_state_dict({"state": state, "param_groups": sd["param_groups"]})
    for a, b in zip(params, restored_params):
        for key, t in opt.state[a].items():
            assert opt2.state[b][key].dtype == t.dtype and torch.equal(opt2.state[b][key], t)
    grads_gen = (torch.Generator().manual_seed(2), torch.Generator().manual_seed(2))
    for _ in range(5):
        random_grads(params, grads_gen[0])
        random_grads(restored_params, grads_gen[1])
        opt.step()
        opt2.step()
    assert_same_bits(params, opt, restored_params, opt2)


class _CountHostSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_step_never_synchronises_with_the_host():
    params = _mixed_model()
    opt = LowBitAdamW(params, lr=1e-2, **O2)
    gen = torch.Generator().manual_seed(1)
    with _CountHostSyncs() as counter:
        for _ in range(2):  # the first step also creates the states
            random_grads(params, gen)
            opt.step()
    assert counter.count == 0
    # The counter does see syncs: torch's AdamW reads its step with .item().
    q = nn.Parameter(torch.randn(3))
    q.grad = torch.randn(3)
    with _CountHostSyncs() as control:
        torch.optim.AdamW([q], foreach=False).step()
    assert control.count > 0


def test_param_without_grad_is_skipped_and_keeps_its_state():
    params = _mixed_model()
    never = nn.Parameter(torch.randn(4))
    opt = LowBitAdamW([*params, never], lr=1e-2, **O2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        random_grads(params, gen)
        opt.step()
    assert never not in opt.state
    before = {id(p): {k: t.clone() for k, t in opt.state[p].items()} for p in params}
    weights = _snapshot(params)
    opt.zero_grad()  # clears .grad and the FP8 gradient slots
    assert all(not fp8_grad_slot(p).has_data for p in params[1:]) and params[0].grad is None
    random_grads(params[2:], gen)
    opt.step()
    for p, (data, scale_inv) in zip(params[:2], weights):
        assert torch.equal(bits(p), bits(data))
        assert torch.equal(scale_or_one(p), scale_inv)
        for key, t in opt.state[p].items():
            assert torch.equal(bits(t), bits(before[id(p)][key]))
    assert opt.state[params[2]]["step"] == 4


def test_state_dtypes_and_bytes_by_role():
    """High-precision roles keep FP32 moments; O2 holds 1 + 2 bytes of moments per weight
    element, O3 adds a 2-byte master; scales and step counters add 12 bytes per tensor."""
    bias = nn.Parameter(torch.randn(10))
    w16 = scaled_param(torch.randn(100, 10), torch.float16)
    w8 = scaled_param(torch.randn(10, 100), FP8)
    opt = LowBitAdamW([bias, w16, w8], **O2)
    random_grads([bias, w16, w8], torch.Generator().manual_seed(0))
    opt.step()
    assert opt.state[bias]["exp_avg"].dtype == torch.float32
    assert opt.state[w16]["exp_avg"].dtype == FP8
    assert opt.state[w8]["exp_avg_sq"].dtype == torch.float16
    assert opt.state[w8]["master"].dtype == torch.float16
    assert opt.bytes_by_role() == {
        "master": 1000 * 2 + 4,
        "optimizer": 10 * 8 + 4 + 2 * (1000 * 3 + 12),
    }
    with pytest.raises(ValueError, match="exp_avg_sq_dtype"):
        LowBitAdamW([bias], exp_avg_sq_dtype=torch.bfloat16)


@pytest.mark.parametrize("chunk", [1, 50])
def test_chunked_update_is_bit_identical(chunk):
    """Updating in runs of ``chunk_elements`` (1: one tensor at a time; 50: runs of two) bounds
    the FP32 working copies and changes no bit of weights, scales or states."""
    params = _mixed_model() + _mixed_model()
    chunked = _rebuild(_snapshot(params))
    whole_opt = LowBitAdamW(params, lr=1e-2, **O2)
    chunked_opt = LowBitAdamW(chunked, lr=1e-2, chunk_elements=chunk, **O2)
    gens = (torch.Generator().manual_seed(3), torch.Generator().manual_seed(3))
    for _ in range(5):
        random_grads(params, gens[0])
        random_grads(chunked, gens[1])
        whole_opt.step()
        chunked_opt.step()
    assert_same_bits(params, whole_opt, chunked, chunked_opt)


def test_chunk_elements_must_be_positive():
    with pytest.raises(ValueError, match="chunk_elements=0"):
        LowBitAdamW([nn.Parameter(torch.ones(2))], chunk_elements=0)


def test_chunked_update_bounds_the_fp32_gradients_too():
    """An FP8 gradient slot's FP32 value is formed chunk by chunk, like the weights' and the
    moments' working copies: with one tensor per chunk, the most bytes the step allocates at
    once (counted on every op's outputs by training/planning/step_account.py) stay below two
    tensors' worth of the 6 FP32 working copies, whatever the number of tensors (32 here)."""
    from training.planning.step_account import StepAccount

    torch.manual_seed(0)
    params = [scaled_param(torch.randn(64, 64), FP8) for _ in range(32)]
    opt = LowBitAdamW(params, lr=1e-2, chunk_elements=1, **O2)
    gen = torch.Generator().manual_seed(3)
    random_grads(params, gen)
    opt.step()  # the states exist from here on, as in every later step
    random_grads(params, gen)
    with StepAccount() as account:
        account.start_step()
        opt.step()
    one_tensor = 64 * 64 * 4
    assert account.peak < 2 * 6 * one_tensor, account.peak / one_tensor

"""The training optimizer against torch.optim.AdamW, and clipping against torch's own."""

from types import SimpleNamespace

import torch

from fp8train.param_state import grad_slot
from fp8train.precision import get_recipe
from training.optimizer import build_optimizer, build_scheduler, clip_grad_norm

OPT = SimpleNamespace(
    type="adamw",
    lr=1e-2,
    min_lr=1e-3,
    weight_decay=0.1,
    adam_beta1=0.9,
    adam_beta2=0.95,
    adam_eps=1e-8,
    lr_warmup_iters=2,
    lr_decay_iters=None,
    lr_decay_style="cosine",
)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )


def _reference(model):
    ref = [p.detach().double().clone().requires_grad_() for p in model.parameters()]
    decay = [r for r, p in zip(ref, model.parameters()) if p.ndim >= 2]
    no_decay = [r for r, p in zip(ref, model.parameters()) if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=OPT.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
    )
    return ref, opt


def test_bf16_master_weights_follow_adamw_on_accumulated_fp32_grads():
    model = _model()
    for p in model.parameters():
        p.data = p.data.bfloat16()
    ref, ref_opt = _reference(model)  # starts from the same BF16-rounded values
    opt = build_optimizer(model, get_recipe("bf16"), OPT)
    for p in opt.optimizer.param_groups:
        p["lr"] = OPT.lr
        p["weight_decay"] = OPT.weight_decay * p["wd_mult"]
    x = torch.randn(2, 5, 8)
    for _ in range(3):
        bf16_grads = [torch.zeros_like(r) for r in ref]
        for micro in range(2):  # two micro-batches accumulate into the FP32 main_grad
            model(x[micro].bfloat16()).float().square().mean().backward()
            for acc, p in zip(bf16_grads, model.parameters()):
                acc += grad_slot(p).double() - acc  # the slot holds the running FP32 sum
        assert all(p.grad is None for p in model.parameters())
        for r, g in zip(ref, bf16_grads):
            r.grad = g
        ref_opt.step()
        opt.step()
        opt.zero_grad()
        for master, r in zip(opt.master_params, ref):
            torch.testing.assert_close(master.double(), r.detach(), rtol=1e-6, atol=1e-7)
        for p, master in zip(model.parameters(), opt.master_params):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.data, master.bfloat16())
    for index, p in enumerate(model.parameters()):
        assert opt.param_state_bytes(index) == (4 * p.numel(), 8 * p.numel())


def test_fp32_optimizer_state_round_trip():
    model = _model()
    opt = build_optimizer(model, get_recipe("te"), OPT)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    saved = {k: v.clone() for k, v in opt.state_tensors().items()}
    model2 = _model()
    model2.load_state_dict(model.state_dict())
    opt2 = build_optimizer(model2, get_recipe("te"), OPT)
    opt2.load_state_tensors(saved)
    for m in (model, model2):
        m(torch.ones(3, 8)).sum().backward()
    opt.step()
    opt2.step()
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


def test_scheduler_warmup_then_cosine_to_min():
    opt = build_optimizer(_model(), get_recipe("fp32"), OPT)
    sched = build_scheduler(opt, OPT, decay_iters=10)
    lrs = []
    for _ in range(10):
        sched.step(1)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] < lrs[1] == OPT.lr  # warm-up over 2 iterations
    assert abs(lrs[-1] - OPT.min_lr) < 1e-12
    assert opt.param_groups[1]["weight_decay"] == 0.0  # biases and norms are not decayed


def test_clip_matches_torch_and_clips_every_grad():
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) * 10, torch.randn(7) * 10, torch.randn(2, 2).bfloat16() * 10]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, 1.0)
    norm = clip_grad_norm(grads, 1.0)
    torch.testing.assert_close(norm, expected.float(), rtol=1e-3, atol=0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g.float(), p.grad.float(), rtol=1e-2, atol=1e-3)

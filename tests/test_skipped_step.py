"""A step with non-finite gradients is skipped on the device (issue 34, item 6).

The step decides nothing on the host: ``found_inf`` (the norm is not finite) goes to the
optimizer, which leaves every weight, master, moment, scale and step counter with its bits
(LowBitAdamW masks its own writes, torch's fused AdamW reads ``found_inf``; torch's foreach
AdamW, the CPU's, reads it in host memory), and to the loss scaler, which backs off. The
consecutive skips are counted on the device (training/step.py ``SkipCounter``) and checked when
the loop reads its losses, with the error naming the step at which the limit was reached.
Multi-rank runs (the distributed optimizer) are in tests/test_skipped_step_distributed.py.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from conftest import REPO, tiny_overrides

from data.sampler import micro_batches
from fp8train.optim import LowBitAdamW
from fp8train.param_state import fp8_grad_slot, scale_inv_of
from tests import test_lowbit_adam as lowbit
from tests.test_host_syncs import CASES, _build
from training.config import load_config
from training.loop import pretrain
from training.step import TrainingError, train_step

CONFIG = str(REPO / "configs/gpt_tiny.yaml")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _grads(params, gen, bad: float | None = None) -> None:
    """Fresh gradients (an FP8 slot's accumulated); ``bad``: one element of each is that."""
    for p in params:
        g = torch.randn(p.shape, generator=gen)
        if bad is not None:
            g.view(-1)[0] = bad
        slot = fp8_grad_slot(p)
        if slot is None:
            p.grad = g
        else:
            slot.zero_()
            slot.accumulate(g)


def _optimizer_bits(params, opt) -> list[torch.Tensor]:
    out = []
    for p in params:
        out += [_bits(p), _bits(lowbit.scale_or_one(p))]
        out += [_bits(t) for t in opt.state.get(p, {}).values()]
    return out


@pytest.mark.parametrize("fused", [False, True], ids=["reference", "fused"])
def test_lowbit_adamw_skips_on_the_device(fused):
    """Plain FP32, scaled FP16 (O2 moments) and FP8 (O3) parameters: a skipped first step
    creates zero states (step 0) and changes no bit; a later skipped step changes no bit of a
    weight, scale, moment, master or counter; ``found_inf`` clear gives the bits of a step
    without it, so the run ends where one that never saw the bad gradients does. The reference
    path reads nothing on the host (the fused one cannot run under the counting mode)."""
    ref, ours = lowbit._mixed_model(), lowbit._mixed_model()
    ref_opt = LowBitAdamW(ref, lr=1e-2, fused=fused, **lowbit.O2)
    opt = LowBitAdamW(ours, lr=1e-2, fused=fused, **lowbit.O2)
    ref_gen, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    counter = lowbit._CountHostSyncs() if not fused else None

    def skipped_step(bad: float, found_inf: torch.Tensor) -> None:
        had_states = bool(opt.state)
        before = _optimizer_bits(ours, opt)
        _grads(ours, torch.Generator().manual_seed(9), bad)
        if counter is None:
            opt.step(found_inf=found_inf)
        else:
            with counter:
                opt.step(found_inf=found_inf)
        after = _optimizer_bits(ours, opt)
        if not had_states:  # weights and scales only: the states are new
            after = [t for p in ours for t in (_bits(p), _bits(lowbit.scale_or_one(p)))]
        assert len(after) == len(before)
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

    skipped_step(math.inf, torch.tensor(1.0))  # before any state: states made, nothing moved
    assert all(opt.state[p]["step"] == 0 and not opt.state[p]["exp_avg"].any() for p in ours)
    for i in range(4):
        _grads(ref, ref_gen)
        ref_opt.step()
        _grads(ours, gen)
        if counter is None:
            opt.step(found_inf=torch.tensor(False))
        else:
            with counter:
                opt.step(found_inf=torch.tensor(False))
        if i == 1:
            skipped_step(math.nan, torch.tensor(True))
    lowbit.assert_same_bits(ref, ref_opt, ours, opt)
    assert all(opt.state[p]["step"] == 4 for p in ours)
    assert counter is None or counter.count == 0


def _state_bits(state) -> dict[str, torch.Tensor]:
    """Every weight (with its scale) and every optimizer state (moments, their scales, FP32
    or FP16 masters, step counters) of the run, as bytes."""
    out = {}
    for name, p in state.optimizer.param_names.items():
        out[name] = _bits(p)
        if scale_inv_of(p) is not None:
            out[f"{name}:scale_inv"] = _bits(scale_inv_of(p))
    for key, t in state.optimizer.state_tensors().items():
        out[key] = _bits(t)
    return out


def _poison(slot_too: bool):
    """A grad_hook that makes one FP32 gradient (and, ``slot_too``, one FP8 slot's amax)
    non-finite; it records which parameter's gradient comes first."""
    poisoned = []

    def hook(state) -> None:
        opt = state.optimizer
        names = opt.stepped_names()
        plain = [i for i, p in enumerate(opt.step_params) if fp8_grad_slot(p) is None]
        opt.grads()[-1].view(-1)[0] = math.inf  # the last FP32 gradient
        poisoned[:] = [names[plain[-1]]]
        if slot_too:  # the first FP8 slot: its amax overflowed
            slots = [i for i, p in enumerate(opt.step_params) if fp8_grad_slot(p) is not None]
            fp8_grad_slot(opt.step_params[slots[0]]).amax.fill_(math.inf)
            poisoned[:] = [names[min(slots[0], plain[-1])]]

    return hook, poisoned


@pytest.mark.parametrize(("level", "fused"), CASES, ids=[f"{lv}{'-fused' * f}" for lv, f in CASES])
def test_a_nonfinite_gradient_skips_the_step_bit_for_bit(
    tiny_data, tmp_path, monkeypatch, level, fused
):
    """At every level (fp32-te with the CPU's foreach AdamW and with the fused one a CUDA run
    builds): after a step has made the states, steps whose gradients are not finite change no
    bit of any weight, master, moment, scale or step counter; each is reported skipped with a
    non-finite norm and its first non-finite gradient; the dynamic loss scale halves after
    ``precision.hysteresis`` of them; and the next finite step updates again."""
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, level))
    state = _build(cfg, monkeypatch, fused)
    n_micro = state.plan.micro_batches
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
    assert not train_step(state, data, n_micro).skipped  # the states exist from here
    before, scale = _state_bits(state), state.scaler.loss_scale
    hook, poisoned = _poison(slot_too=state.optimizer.low_bit)
    overflows = cfg.precision.hysteresis if state.recipe.uses_loss_scaling else 2
    for _ in range(overflows):
        stats = train_step(state, data, n_micro, grad_hook=hook)
        assert stats.skipped and not math.isfinite(stats.grad_norm)
        first = int(stats.first_nonfinite)
        assert state.optimizer.stepped_names()[first] == poisoned[0]
        after = _state_bits(state)
        changed = [k for k in before if not torch.equal(before[k], after[k])]
        assert not changed, changed
    if state.recipe.uses_loss_scaling:
        assert state.scaler.loss_scale == scale / 2  # backed off once
    assert state.bytes_per_param is not None
    stats = train_step(state, data, n_micro)
    assert not stats.skipped and int(stats.first_nonfinite) == -1
    after = _state_bits(state)
    assert [k for k in before if k.endswith(":step")]
    assert all(not torch.equal(before[k], after[k]) for k in before if k.endswith(":step"))


def _stopped(tiny_data, tmp_path, interval: int) -> str:
    overrides = tiny_overrides(
        tiny_data, tmp_path, "fp32",
        **{"optimizer.lr": 1e30, "optimizer.min_lr": 0.0, "training.max_consecutive_skips": 3,
           "training.train_iters": 12, "training.eval_iters": 0, "logging.interval": interval,
           "checkpoint.save_interval": 0, "logging.tensorboard": False},
    )  # fmt: skip
    with pytest.raises(TrainingError) as err:
        pretrain(load_config(CONFIG, overrides))
    return str(err.value)


def test_consecutive_skips_stop_the_run_naming_the_step_that_reached_the_limit(tiny_data, tmp_path):
    """The limit's error is the same whether the loop reads the skips every step or 4 steps
    later: the iteration at which the consecutive skips reached the limit, the first
    non-finite gradient and the loss of that step."""
    every_step = _stopped(tiny_data, tmp_path / "every", 1)
    pattern = (
        r"training: 3 consecutive steps skipped for non-finite gradients, up to iteration "
        r"(\d+) \(training.max_consecutive_skips=3\); first non-finite gradient: \S+ \(rank 0\); "
        r"loss \S+, loss scale 1\. Lower optimizer.lr, check the data, or resume from an "
        r"earlier checkpoint"
    )
    match = re.fullmatch(pattern, every_step)
    assert match, every_step
    assert int(match.group(1)) % 4, "the deferred read below must come after the limit"
    assert _stopped(tiny_data, tmp_path / "deferred", 4) == every_step

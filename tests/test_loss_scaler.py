"""Dynamic loss scaler: growth, backoff with hysteresis, bounds, state round trip; Megatron's
DynamicGradScaler as the reference; no host read in the step's uses."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp8train.loss_scaler import ConstantLossScaler, DynamicLossScaler


def test_grows_after_interval_of_clean_steps():
    s = DynamicLossScaler(initial_scale=8.0, growth_interval=3, max_scale=64.0)
    for _ in range(2):
        s.update(found_inf=False)
    assert s.loss_scale == 8.0
    s.update(found_inf=False)
    assert s.loss_scale == 16.0


def test_hysteresis_delays_backoff_and_min_bounds():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, hysteresis=2, growth_interval=100)
    s.update(found_inf=True)
    assert s.loss_scale == 8.0  # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.loss_scale == 4.0
    s.update(found_inf=True)
    s.update(found_inf=True)
    s.update(found_inf=True)
    assert s.loss_scale == 2.0  # never below min


def test_growth_capped_and_state_round_trip():
    s = DynamicLossScaler(initial_scale=32.0, max_scale=64.0, growth_interval=1)
    for _ in range(5):
        s.update(found_inf=False)
    assert s.loss_scale == 64.0
    s.update(found_inf=True)
    t = DynamicLossScaler(initial_scale=32.0, max_scale=64.0, growth_interval=1)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


def test_bad_bounds_rejected():
    with pytest.raises(ValueError, match="min"):
        DynamicLossScaler(initial_scale=0.5, min_scale=1.0)


def test_constant_scaler_is_identity():
    s = ConstantLossScaler()
    s.update(found_inf=True)
    assert s.loss_scale == 1.0


def _megatron_scaler(initial: float, min_scale: float, interval: int, hysteresis: int):
    """megatron-core's own DynamicGradScaler with its tensors on the CPU (its constructor puts
    them on CUDA): ``update`` is Megatron's code as it runs in a Megatron job."""
    from data.indexed import import_megatron

    grad_scaler = import_megatron("megatron.core.optimizer.grad_scaler")
    ref = grad_scaler.DynamicGradScaler.__new__(grad_scaler.DynamicGradScaler)
    ref._scale = torch.tensor([initial], dtype=torch.float)
    ref.min_scale = torch.tensor([min_scale], dtype=torch.float)
    ref.growth_factor = torch.tensor([2.0], dtype=torch.float)
    ref.backoff_factor = torch.tensor([0.5], dtype=torch.float)
    ref.growth_interval, ref.hysteresis = interval, hysteresis
    ref._growth_tracker, ref._hysteresis_tracker = 0, hysteresis
    return ref


@pytest.mark.parametrize("interval,hysteresis", [(1, 1), (3, 2), (5, 3)])
def test_matches_megatron_dynamic_grad_scaler(interval, hysteresis):
    """A random run of clean and overflowing steps, fed as device bool tensors: after every
    step the scale and both trackers equal Megatron's (no max bound in reach)."""
    gen = torch.Generator().manual_seed(interval * 10 + hysteresis)
    ours = DynamicLossScaler(
        initial_scale=2.0**10, min_scale=2.0**-3, max_scale=2.0**60,
        growth_interval=interval, hysteresis=hysteresis,
    )  # fmt: skip
    ref = _megatron_scaler(2.0**10, 2.0**-3, interval, hysteresis)
    for step in range(300):
        found_inf = bool(torch.rand((), generator=gen) < (0.7 if step < 120 else 0.4))
        ours.update(found_inf=torch.tensor(found_inf))
        ref.update(found_inf)
        want = [float(ref._scale), ref._growth_tracker, ref._hysteresis_tracker]
        assert list(ours.state_dict().values()) == want, f"step {step}"


class _CountReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def test_scale_unscale_and_update_read_nothing_on_the_host():
    """The step's uses of the scaler stay on the device; only the log's ``loss_scale`` and a
    checkpoint's ``state_dict`` read it."""
    s = DynamicLossScaler(initial_scale=2.0**16, growth_interval=2)
    loss = torch.tensor(3.0)
    with _CountReads() as counted:
        scaled = s.scale(loss)
        inv = s.inv_scale
        s.update(found_inf=~torch.isfinite(scaled))
        s.update(found_inf=torch.tensor(False))
    assert counted.reads == 0
    assert float(scaled) == 3.0 * 2.0**16 and float(inv) == 2.0**-16
    assert s.loss_scale == 2.0**17


def test_inv_scale_rounds_as_the_host_reciprocal():
    """``inv_scale`` is the FP32 value of the host's ``1.0 / scale`` (what unscaled the
    gradients when the scale was a float), also for a scale that is no power of two."""
    for value in (3.0, 2.0**16, 7.0 * 2.0**5, 1.0):
        s = DynamicLossScaler(initial_scale=value, min_scale=0.5)
        want = torch.tensor(1.0 / value, dtype=torch.float32)
        assert torch.equal(s.inv_scale, want)


def test_fp16_loss_keeps_its_dtype_and_is_not_overflowed_by_the_scale():
    s = DynamicLossScaler(initial_scale=2.0**16)
    out = s.scale(torch.tensor(2.0**-10, dtype=torch.float16))
    assert out.dtype == torch.float16 and float(out) == 64.0


def test_state_dict_keeps_python_numbers_and_loads_old_and_megatron_forms():
    """Checkpoints (JSON metadata) always stored Python numbers under these keys: new ones
    still do, and an old dict, or Megatron's with a tensor scale, loads."""
    s = DynamicLossScaler(initial_scale=8.0, hysteresis=3)
    s.update(found_inf=torch.tensor(True))
    state = s.state_dict()
    assert state == {"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 2}
    assert [type(v) for v in state.values()] == [float, int, int]
    t = DynamicLossScaler()
    t.load_state_dict({"scale": 1024.0, "growth_tracker": 7, "hysteresis_tracker": 1})
    assert t.state_dict() == {"scale": 1024.0, "growth_tracker": 7, "hysteresis_tracker": 1}
    megatron = {"scale": torch.tensor([512.0]), "growth_tracker": 3, "hysteresis_tracker": 2}
    t.load_state_dict(megatron)
    assert t.state_dict() == {"scale": 512.0, "growth_tracker": 3, "hysteresis_tracker": 2}


def test_state_follows_the_loss_device():
    """Built without a device, the state moves to the loss's at the first ``scale`` (the
    meta device stands in for an accelerator here)."""
    s = DynamicLossScaler()
    s.scale(torch.ones((), device="meta"))
    assert s.device == torch.device("meta")
    s.update(found_inf=torch.zeros((), dtype=torch.bool, device="meta"))
    assert s.inv_scale.device == torch.device("meta")
    scale = s._scale
    assert s.to("meta") is s and s._scale is scale  # there already: the same storage
    assert ConstantLossScaler().to("meta").inv_scale is None

"""Dynamic loss scaler: growth, backoff with hysteresis, bounds, state round trip."""

import pytest

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

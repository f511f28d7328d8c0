"""Dynamic loss scaling for the FP16 levels (Megatron's DynamicGradScaler semantics).

The scale is a tensor so that checking for overflow, backing off and growing never needs a
host sync beyond the one ``found_inf`` the caller already pays to decide whether to skip a step.
"""

from __future__ import annotations

import torch

__all__ = ["DynamicLossScaler", "ConstantLossScaler"]


class ConstantLossScaler:
    """Scale 1.0 and never skips: the levels that need no loss scaling."""

    scale_value = 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def update(self, found_inf: bool) -> None:
        del found_inf

    @property
    def loss_scale(self) -> float:
        return 1.0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        del state


class DynamicLossScaler:
    """Grow the scale after clean steps, back off after ``hysteresis`` overflows.

    Hysteresis: an overflow only halves the scale once ``hysteresis`` overflows have been seen
    since the last growth/backoff, so one spike does not throw away a good scale (Megatron).
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
    ):
        if not (min_scale <= initial_scale <= max_scale):
            raise ValueError(
                f"loss scale: need min {min_scale} <= initial {initial_scale} <= max {max_scale}"
            )
        if growth_factor <= 1.0 or not (0.0 < backoff_factor < 1.0):
            raise ValueError("loss scale: growth_factor must be > 1 and backoff in (0, 1)")
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._scale = float(initial_scale)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def loss_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = min(self._scale * self.growth_factor, self.max_scale)

    def state_dict(self) -> dict:
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state: dict) -> None:
        self._scale = float(state["scale"])
        self._growth_tracker = int(state["growth_tracker"])
        self._hysteresis_tracker = int(state["hysteresis_tracker"])

"""Dynamic loss scaling for the FP16 levels (Megatron's DynamicGradScaler semantics).

The scale, the growth tracker and the hysteresis tracker are device tensors, updated in place by
tensor operations from a device ``found_inf``: scaling the loss, unscaling the gradients and
backing off or growing never read a value on the host, so they add no synchronisation to a step
(and keep their storage, as a CUDA graph needs). ``loss_scale`` (a float, for the log) and
``state_dict`` (Python numbers, as checkpoints have always stored them) do read the device: call
them on logging and saving steps only.
"""

from __future__ import annotations

import torch

__all__ = ["DynamicLossScaler", "ConstantLossScaler"]


class ConstantLossScaler:
    """Scale 1.0 and never skips: the levels that need no loss scaling."""

    scale_value = 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    @property
    def inv_scale(self) -> None:
        """Nothing to undo: the gradients are left untouched (not even multiplied by 1)."""
        return None

    def to(self, device: torch.device | str) -> ConstantLossScaler:
        del device
        return self

    def update(self, found_inf: torch.Tensor | bool) -> None:
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
    Unlike Megatron, the scale never grows past ``max_scale``.

    The state lives on ``device`` (default CPU) and follows the loss's device at the first
    ``scale``: a scaler built before the run knows its device needs no move of its own.
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
        device: torch.device | str | None = None,
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
        # FP32, as Megatron keeps it: the loss (FP32) is multiplied by exactly this value.
        self._scale = torch.tensor(float(initial_scale), dtype=torch.float32, device=device)
        self._growth_tracker = torch.zeros((), dtype=torch.int64, device=device)
        self._hysteresis_tracker = torch.full((), self.hysteresis, dtype=torch.int64, device=device)

    @property
    def device(self) -> torch.device:
        return self._scale.device

    def to(self, device: torch.device | str) -> DynamicLossScaler:
        """Move the state to ``device`` (nothing to do when it is there); returns self."""
        if self._scale.device == torch.device(device):
            return self
        self._scale = self._scale.to(device)
        self._growth_tracker = self._growth_tracker.to(device)
        self._hysteresis_tracker = self._hysteresis_tracker.to(device)
        return self

    @property
    def loss_scale(self) -> float:
        """The scale as a float: a host read, for logging steps only."""
        return float(self._scale)

    @property
    def inv_scale(self) -> torch.Tensor:
        """``1 / scale`` on the device, rounded as Megatron does it (in FP64, then to FP32):
        the same FP32 value as the host's ``1.0 / scale`` that multiplied FP32 gradients."""
        return torch.reciprocal(self._scale.double()).float()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if loss.device != self._scale.device:
            self.to(loss.device)
        if loss.dtype == torch.float32:
            return loss * self._scale
        # A 0-dim FP32 scale would promote a lower-precision 0-dim loss to FP32, where a Python
        # scale keeps its dtype: the product is taken in FP32 (as a Python scale's is, in
        # opmath) and rounded back, so an FP16 loss does not see 2**16 rounded to FP16 (inf).
        return (loss.float() * self._scale).to(loss.dtype)

    def update(self, found_inf: torch.Tensor | bool) -> None:
        """One step's update. ``found_inf``: a (device) bool tensor, or a bool. Pass the device
        tensor in a training step: a bool has to be copied to the device, which on CUDA makes
        the host wait (a pageable copy)."""
        inf = torch.as_tensor(found_inf, device=self._scale.device).to(torch.bool)
        # Megatron's branches as selections: every value is computed, the flags pick.
        growth = torch.where(inf, 0, self._growth_tracker + 1)
        hysteresis = self._hysteresis_tracker - inf.long()
        back_off = inf & (hysteresis <= 0)
        grow = ~inf & (growth == self.growth_interval)
        lower = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
        higher = torch.clamp(self._scale * self.growth_factor, max=self.max_scale)
        # ``grow`` needs a clean step, ``back_off`` an overflow: never both.
        scale = torch.where(back_off, lower, torch.where(grow, higher, self._scale))
        # In place: the tensors keep their storage (what a CUDA graph captured stays valid).
        self._scale.copy_(scale)
        self._growth_tracker.copy_(torch.where(grow, 0, growth))
        self._hysteresis_tracker.copy_(torch.where(grow, self.hysteresis, hysteresis))

    def state_dict(self) -> dict:
        """Python numbers (a host read), as checkpoints have always stored them (JSON)."""
        return {
            "scale": float(self._scale),
            "growth_tracker": int(self._growth_tracker),
            "hysteresis_tracker": int(self._hysteresis_tracker),
        }

    def load_state_dict(self, state: dict) -> None:
        """Numbers or tensors (Megatron stores its scale as one), filled in place."""
        self._scale.fill_(float(state["scale"]))
        self._growth_tracker.fill_(int(state["growth_tracker"]))
        self._hysteresis_tracker.fill_(int(state["hysteresis_tracker"]))

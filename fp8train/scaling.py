"""Per-tensor FP8 scaling: the recipe, the scale formula and the per-tensor state.

A tensor ``x`` is stored in FP8 as ``cast(x * scale)`` and read back as ``fp8 * scale_inv``.
``scale`` puts the tensor's amax just below the format's max (``fmt.max / amax / 2**margin``).

Delayed scaling (Transformer Engine / MS-AMP) takes the amax from a short history of past
steps instead of the tensor itself, so the cast never waits for a reduction over the tensor it
is casting; the cost is that a sudden jump saturates (see ``formats``). Two situations have no
useful history, and then the tensor's own amax is used ("current scaling"):

- the first ``warmup_steps`` updates (the history is empty or tiny), and
- the update right after an inf/NaN amax (a loss-scaler overflow or a real divergence). The
  non-finite amax is *counted* but never written into the history: one inf in a 16-step history
  would otherwise pin the scale at its fallback for 16 steps.

Everything that must survive a checkpoint is a tensor buffer of ``ScalingState`` (an
``nn.Module``), and the hot path never reads a value back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .formats import FP8Format

__all__ = ["ScalingRecipe", "ScalingState", "compute_scale"]

# Scales are clamped to [2**-126, 2**126] so that scale and 1/scale are both finite, normal
# fp32 numbers: an amax of 1e-40 would otherwise give scale = inf and 0 * inf = NaN.
_SCALE_MIN = 2.0**-126
_SCALE_MAX = 2.0**126


@dataclass(frozen=True)
class ScalingRecipe:
    """How per-tensor FP8 scales are chosen.

    mode: "delayed" (scale from the max of an amax history, MS-AMP/TE style) or "current"
    (scale from this tensor's own amax, computed now).
    """

    mode: str = "delayed"
    amax_history_len: int = 16
    margin: int = 0
    power_of_two: bool = False
    warmup_steps: int = 1  # delayed scaling uses current scaling for this many first steps

    def __post_init__(self):
        if self.mode not in ("delayed", "current"):
            raise ValueError(f"scaling mode {self.mode!r}: choose 'delayed' or 'current'")
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len}: must be >= 1")
        if self.margin < 0:
            raise ValueError(f"margin={self.margin}: must be >= 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps={self.warmup_steps}: must be >= 0")


def compute_scale(
    amax: torch.Tensor | float,
    fmt: FP8Format,
    margin: int = 0,
    power_of_two: bool = False,
    fallback: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """``fmt.max / amax / 2**margin`` as an fp32 tensor, optionally rounded down to a power of two.

    Where ``amax`` is 0, inf or NaN there is nothing to scale by, so ``fallback`` is returned
    (the previous scale when the caller has one; 1.0 otherwise). The result is always finite.
    """
    amax = torch.as_tensor(amax, dtype=torch.float32)
    if fallback is None:
        fallback = torch.ones_like(amax)
    scale = (fmt.max / amax / 2.0**margin).clamp(_SCALE_MIN, _SCALE_MAX)
    if power_of_two:
        # frexp is exact (log2 + floor can land on the wrong side of a power of two):
        # scale = m * 2**e with m in [0.5, 1), so scale / (2m) = 2**(e-1) exactly.
        mantissa, _ = torch.frexp(scale)
        scale = scale / (2.0 * mantissa)
    usable = (amax > 0) & torch.isfinite(amax)
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    return torch.where(usable, scale, fallback)


class ScalingState(nn.Module):
    """Scaling state of one tensor role (e.g. a linear layer's input): buffers only.

    Buffers (all persistent, so ``state_dict`` checkpoints them):
      amax_history [H] fp32   newest first; non-finite amaxes are stored as 0
      scale        []  fp32   the scale used by the latest update
      step         []  int64  number of updates
      recover      []  bool   the last amax was inf/NaN: use current scaling next
      nonfinite    []  int64  how many inf/NaN amaxes were seen (for logging)
    """

    def __init__(self, fmt: FP8Format, recipe: ScalingRecipe | None = None, device=None):
        super().__init__()
        self.fmt = fmt
        self.recipe = recipe or ScalingRecipe()
        h = self.recipe.amax_history_len
        self.register_buffer("amax_history", torch.zeros(h, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("recover", torch.zeros((), dtype=torch.bool, device=device))
        self.register_buffer("nonfinite", torch.zeros((), dtype=torch.int64, device=device))

    def reset(self) -> None:
        """Back to the initial state (e.g. after ``to_empty`` from the meta device)."""
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(1.0)
            self.step.zero_()
            self.recover.fill_(False)
            self.nonfinite.zero_()

    def _scale(self, amax: torch.Tensor) -> torch.Tensor:
        r = self.recipe
        return compute_scale(amax, self.fmt, r.margin, r.power_of_two, fallback=self.scale)

    @torch.no_grad()
    def scale_for(self, amax: torch.Tensor, update: bool = True) -> torch.Tensor:
        """The scale to cast a tensor whose amax is ``amax`` with; records it when ``update``.

        Returns a fresh fp32 scalar tensor (never an alias of the buffer).
        """
        amax = amax.detach().float().reshape(())
        current = self._scale(amax)
        if self.recipe.mode == "current":
            scale = current
        else:
            delayed = self._scale(self.amax_history.amax())
            use_current = (self.step < self.recipe.warmup_steps) | self.recover
            scale = torch.where(use_current, current, delayed)
        if update:
            self._record(amax, scale)
        return scale

    def _record(self, amax: torch.Tensor, scale: torch.Tensor) -> None:
        finite = torch.isfinite(amax)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = torch.where(finite, amax, torch.zeros_like(amax))
        self.scale.copy_(scale)
        self.step.add_(1)
        self.recover.copy_(~finite)
        self.nonfinite.add_((~finite).to(torch.int64))

    def _apply(self, fn, recurse=True):
        # model.half() / model.to(torch.bfloat16) must move this state, never round it:
        # a bf16 amax history or scale would change the numerics of every later step.
        for name, buf in self._buffers.items():
            if buf is None:
                continue
            moved = fn(buf)
            if moved.dtype != buf.dtype:
                moved = buf.to(device=moved.device)
            self._buffers[name] = moved
        return self

    def extra_repr(self) -> str:
        r = self.recipe
        return (
            f"{self.fmt.name}, mode={r.mode}, history={r.amax_history_len}, margin={r.margin}, "
            f"power_of_two={r.power_of_two}, warmup_steps={r.warmup_steps}"
        )

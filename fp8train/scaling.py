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

import math
from dataclasses import dataclass

import torch
from torch import nn

from .formats import FP8Format

__all__ = ["GRANULARITIES", "ScalingRecipe", "ScalingState", "compute_scale"]

GRANULARITIES = ("tensor", "row", "block")  # one scale per tensor, per row, per tile/block

# Scales are clamped to [2**-126, 2**126] so that scale and 1/scale are both finite, normal
# fp32 numbers: an amax of 1e-40 would otherwise give scale = inf and 0 * inf = NaN.
_SCALE_MIN = 2.0**-126
_SCALE_MAX = 2.0**126


@dataclass(frozen=True)
class ScalingRecipe:
    """How FP8 scales are chosen.

    mode: "delayed" (scale from the max of an amax history, MS-AMP/TE style) or "current"
    (scale from this tensor's own amax, computed now).
    granularity: "tensor" (one scale per tensor), "row" or "block" (one per row or tile of a
    GEMM operand, fp8train/blockwise.py; current scaling only).
    grad_format: the output gradient's FP8 format, "e5m2" (the hybrid recipe) or "e4m3" (the
    block recipes' choice: DeepSeek-V3, Transformer Engine's block scaling).
    """

    mode: str = "delayed"
    amax_history_len: int = 16
    margin: int = 0
    power_of_two: bool = False
    warmup_steps: int = 1  # delayed scaling uses current scaling for this many first steps
    granularity: str = "tensor"
    grad_format: str = "e5m2"

    def __post_init__(self):
        if self.mode not in ("delayed", "current"):
            raise ValueError(f"scaling mode {self.mode!r}: choose 'delayed' or 'current'")
        if self.granularity not in GRANULARITIES:
            raise ValueError(
                f"fp8 granularity {self.granularity!r}: choose one of {', '.join(GRANULARITIES)}"
            )
        if self.granularity != "tensor" and self.mode != "current":
            raise ValueError(
                f"fp8 granularity {self.granularity!r} scales from the current amax of each "
                "row or block: set the scaling mode to 'current' (delayed scaling keeps one "
                "amax history per tensor)"
            )
        if self.grad_format not in ("e5m2", "e4m3"):
            raise ValueError(f"fp8 grad format {self.grad_format!r}: choose 'e5m2' or 'e4m3'")
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
    scale = fmt.max / amax
    if margin:  # a division by 1.0 changes nothing but costs a launch
        scale = scale / 2.0**margin
    scale = scale.clamp(_SCALE_MIN, _SCALE_MAX)
    if power_of_two:
        # frexp is exact (log2 + floor can land on the wrong side of a power of two):
        # scale = m * 2**e with m in [0.5, 1), so scale / (2m) = 2**(e-1) exactly.
        mantissa, _ = torch.frexp(scale)
        scale = scale / (2.0 * mantissa)
    # 0 < amax < inf: false for 0, inf and NaN alike (isfinite costs four operations).
    usable = (amax > 0) & (amax < math.inf)
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    return torch.where(usable, scale, fallback)


def _scale_step(
    amax: torch.Tensor,
    history: torch.Tensor,
    scale_buf: torch.Tensor,
    step: torch.Tensor,
    recover: torch.Tensor,
    nonfinite: torch.Tensor,
    *,
    fmt: FP8Format,
    margin: int,
    power_of_two: bool,
    mode: str,
    warmup_steps: int,
    update: bool,
) -> torch.Tensor:
    """``ScalingState.scale_for`` on its buffers (updated in place when ``update``).

    Written for few operations: on a GPU each is a launch on one-element tensors, and a
    GPT-1.3B step at te ran about 400 of these updates (docs/BENCHMARKS.md, "GPU"). Current
    and delayed scaling share one ``compute_scale`` of the chosen amax, which is exact: it
    works element by element with the same fallback.
    """
    amax = amax.float().reshape(())
    if mode == "current":
        chosen = amax
    else:
        use_current = (step < warmup_steps) | recover
        chosen = torch.where(use_current, amax, history.amax())
    scale = compute_scale(chosen, fmt, margin, power_of_two, fallback=scale_buf)
    if update:
        finite = amax.abs() < math.inf  # false for inf and NaN
        newest = torch.where(finite, amax, 0.0).reshape(1)  # non-finite amaxes are stored as 0
        history.copy_(torch.cat((newest, history[:-1])))
        scale_buf.copy_(scale)
        step.add_(1)
        torch.logical_not(finite, out=recover)
        nonfinite.add_(recover)
    return scale


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

    @torch.no_grad()
    def scale_for(self, amax: torch.Tensor, update: bool = True) -> torch.Tensor:
        """The scale to cast a tensor whose amax is ``amax`` with; records it when ``update``.

        Returns a fresh fp32 scalar tensor (never an alias of the buffer).
        """
        r = self.recipe
        buffers = (self.amax_history, self.scale, self.step, self.recover, self.nonfinite)
        return _scale_step(
            amax.detach(),
            *buffers,
            fmt=self.fmt,
            margin=r.margin,
            power_of_two=r.power_of_two,
            mode=r.mode,
            warmup_steps=r.warmup_steps,
            update=update,
        )

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

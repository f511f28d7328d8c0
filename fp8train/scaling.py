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

__all__ = [
    "GRANULARITIES",
    "ScalingRecipe",
    "ScalingState",
    "amax_bounds",
    "compute_scale",
    "fold",
]

GRANULARITIES = ("tensor", "row", "block")  # one scale per tensor, per row, per tile/block

# Scales stay within [2**-126, 2**126] so that scale and 1/scale are both finite, normal fp32
# numbers: an amax of 1e-40 would otherwise give scale = inf and 0 * inf = NaN. An amax whose
# scale would leave the range keeps the fallback (``_scale_from``).
_SCALE_MIN = 2.0**-126
_SCALE_MAX = 2.0**126
_FP32_MAX = torch.finfo(torch.float32).max


@dataclass(frozen=True)
class ScalingRecipe:
    """How FP8 scales are chosen.

    mode: "delayed" (scale from the max of an amax history, MS-AMP/TE style) or "current"
    (scale from this tensor's own amax, computed now).
    granularity: "tensor" (one scale per tensor), "row" or "block" (one per row or tile of a
    GEMM operand, fp8train/blockwise.py; current scaling only).
    grad_format: the output gradient's FP8 format, "e5m2" (the hybrid recipe) or "e4m3" (the
    block recipes' choice: DeepSeek-V3, Transformer Engine's block scaling).
    fast_accum: the forward GEMM takes cuBLASLt's fast FP8 accumulation (Transformer Engine's
    and torchao's default; the two backward GEMMs never do). CUDA only.
    """

    mode: str = "delayed"
    amax_history_len: int = 16
    margin: int = 0
    power_of_two: bool = False
    warmup_steps: int = 1  # delayed scaling uses current scaling for this many first steps
    granularity: str = "tensor"
    grad_format: str = "e5m2"
    fast_accum: bool = True

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


def _scale_from(
    amax: torch.Tensor,
    max_value: torch.Tensor,
    lowest: torch.Tensor,
    highest: torch.Tensor,
    fallback: torch.Tensor,
    power_of_two: bool,
) -> torch.Tensor:
    """The one scale formula, element by element: ``max_value / amax`` (``max_value`` is the
    format's maximum over ``2**margin``), optionally rounded down to a power of two, where
    ``amax`` is in ``[lowest, highest]``; ``fallback`` elsewhere.

    The bounds (``amax_bounds``) are those amaxes whose scale is a normal fp32 number in
    [2**-126, 2**126], so scale and 1/scale are both finite: a zero, inf or NaN amax, or one
    so small or large that its scale would leave that range, has nothing to scale by. NaN as
    ``lowest`` says the amax is not wanted at all (delayed scaling takes ``fallback``). One
    clamp and one comparison decide it, NaN included. A correctly rounded division, so the
    scale of a tensor is the same bits whether it is computed for one tensor (a cast) or for
    a table of them (``fold``)."""
    scale = torch.div(max_value, amax)
    if power_of_two:
        # frexp is exact (log2 + floor can land on the wrong side of a power of two):
        # scale = m * 2**e with m in [0.5, 1), so scale / (2m) = 2**(e-1) exactly.
        mantissa, _ = torch.frexp(scale)
        scale = scale / (2.0 * mantissa)
    usable = amax == torch.clamp(amax, lowest, highest)  # NaN bounds or amax: never equal
    return torch.where(usable, scale, fallback)


def amax_bounds(max_value: float) -> tuple[float, float]:
    """``(lowest, highest)`` amax of ``_scale_from`` for one format maximum (over 2**margin):
    scales within [2**-126, 2**126], amaxes within the finite fp32 numbers. Public: a kernel
    that computes scales itself (fp8train/triton_cast_kernels.py) keeps the same bounds."""
    return max_value * _SCALE_MIN, min(max_value * _SCALE_MAX, _FP32_MAX)


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
    fallback = torch.as_tensor(fallback, dtype=torch.float32, device=amax.device)
    max_value = torch.full_like(amax, fmt.max / 2.0**margin)  # a fill, never a host copy
    low, high = amax_bounds(fmt.max / 2.0**margin)
    lowest, highest = torch.full_like(amax, low), torch.full_like(amax, high)
    return _scale_from(amax, max_value, lowest, highest, fallback, power_of_two)


# ``pending_amax`` when no cast has recorded an amax since the last fold (amaxes are >= 0 or
# NaN, so a negative value is never one).
_NOTHING_PENDING = -1.0


@torch.no_grad()
def fold(states: list[ScalingState]) -> None:
    """The bulk update: every state of ``states`` (one recipe) that a cast recorded an amax
    into since the last fold takes it into its history, and every state's next scales are
    computed, all in one set of operations on stacked rows whatever their number.

    For each recorded state, as one per-cast update would: the scale the cast used becomes
    ``scale`` (recomputed by the same formula), the amax enters the history newest first
    (a non-finite one as 0, counted in ``nonfinite``, and the next cast scales from its own
    amax: ``recover``), ``step`` counts it. Then for every state: ``fallback``, the scale
    the next cast takes unless it scales from its own amax (delayed scaling: from the
    history's max; the previous scale during warm-up, after a non-finite amax and in
    current mode), and ``current_lowest``, the smallest normal fp32 where the next cast
    scales from its own amax and NaN where not (``_scale_from``). Rows with nothing
    recorded keep their state; their next scales come out as before. No host read, no
    branch on values."""
    if not states:
        return
    recipe = states[0].recipe
    pow2 = recipe.power_of_two

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([getattr(s, name) for s in states])

    amax = stacked("pending_amax")
    max_value, lowest, highest = (
        stacked("max_value"),
        stacked("amax_lowest"),
        stacked("amax_highest"),
    )
    pending = amax != _NOTHING_PENDING
    wanted = stacked("current_lowest")
    used = _scale_from(amax, max_value, wanted, highest, stacked("fallback"), pow2)
    finite = amax.abs() < math.inf  # false for inf and NaN
    history = stacked("amax_history")
    rolled = torch.cat((torch.where(finite, amax, 0.0).unsqueeze(1), history[:, :-1]), 1)
    history = torch.where(pending.unsqueeze(1), rolled, history)
    scale = torch.where(pending, used, stacked("scale"))
    step = stacked("step") + pending
    recover = torch.where(pending, ~finite, stacked("recover"))
    nonfinite = stacked("nonfinite") + (pending & ~finite)
    if recipe.mode == "current":
        use_current = torch.ones_like(recover)
    else:
        use_current = (step < recipe.warmup_steps) | recover
    delayed = _scale_from(history.amax(1), max_value, lowest, highest, scale, pow2)
    out = {
        "amax_history": history,
        "scale": scale,
        "step": step,
        "recover": recover,
        "nonfinite": nonfinite,
        "fallback": torch.where(use_current, scale, delayed),
        "current_lowest": torch.where(use_current, lowest, math.nan),
        "pending_amax": torch.full_like(amax, _NOTHING_PENDING),
    }
    for name, value in out.items():
        torch._foreach_copy_([getattr(s, name) for s in states], list(value.unbind(0)))


class ScalingState(nn.Module):
    """Scaling state of one tensor role (e.g. a linear layer's input): buffers only.

    Buffers (persistent, so ``state_dict`` checkpoints them):
      amax_history [H] fp32   newest first; non-finite amaxes are stored as 0
      scale        []  fp32   the scale used by the latest update
      step         []  int64  number of updates
      recover      []  bool   the last amax was inf/NaN: use current scaling next
      nonfinite    []  int64  how many inf/NaN amaxes were seen (for logging)
    and, derived from those by ``fold`` (not checkpointed):
      pending_amax []  fp32   the amax a cast recorded since the last fold (-1: none)
      fallback     []  fp32   the next cast's scale unless it scales from its own amax
      current_lowest [] fp32  the least amax the next cast scales from (NaN: none, delayed)
      max_value    []  fp32   the format's maximum over 2**margin
      amax_lowest, amax_highest [] fp32  the amaxes that have a scale (``amax_bounds``)

    A cast asks ``cast_scale`` (a few element-wise operations) and records its amax; the
    state moves in ``fold``, for one state or, batched, for every state of a model
    (``fp8train.scaling_table``). ``managed`` says a model's table folds this state, so its
    linear does not fold it after each cast.
    """

    def __init__(self, fmt: FP8Format, recipe: ScalingRecipe | None = None, device=None):
        super().__init__()
        self.fmt = fmt
        self.recipe = recipe or ScalingRecipe()
        self.managed = False
        h = self.recipe.amax_history_len
        f32 = {"dtype": torch.float32, "device": device}
        self.register_buffer("amax_history", torch.zeros(h, **f32))
        self.register_buffer("scale", torch.ones((), **f32))
        self.register_buffer("step", torch.zeros((), dtype=torch.int64, device=device))
        self.register_buffer("recover", torch.zeros((), dtype=torch.bool, device=device))
        self.register_buffer("nonfinite", torch.zeros((), dtype=torch.int64, device=device))
        max_value = fmt.max / 2.0**self.recipe.margin
        low, high = amax_bounds(max_value)
        derived = {
            "pending_amax": _NOTHING_PENDING,
            "fallback": 1.0,
            "current_lowest": low,
            "max_value": max_value,
            "amax_lowest": low,
            "amax_highest": high,
        }
        for name, value in derived.items():
            self.register_buffer(name, torch.full((), value, **f32), persistent=False)
        # A checkpoint holds what the casts recorded; a loaded one is what the state is.
        self.register_state_dict_pre_hook(lambda module, *_: fold([module]))
        self.register_load_state_dict_post_hook(lambda module, _: module.refresh())
        self.refresh()

    def refresh(self) -> None:
        """Forget any recorded amax and derive the next scales from the persistent state
        (after loading it, or resetting it)."""
        if self.scale.is_meta:
            # A model built on the meta device (the planner, a deferred init) has no values
            # to fold; folding it anyway costs a meta dispatch per state and nothing else.
            return
        with torch.no_grad():
            self.pending_amax.fill_(_NOTHING_PENDING)
        fold([self])

    def reset(self) -> None:
        """Back to the initial state (e.g. after ``to_empty`` from the meta device)."""
        with torch.no_grad():
            self.amax_history.zero_()
            self.scale.fill_(1.0)
            self.step.zero_()
            self.recover.fill_(False)
            self.nonfinite.zero_()
            max_value = self.fmt.max / 2.0**self.recipe.margin
            low, high = amax_bounds(max_value)
            self.max_value.fill_(max_value)
            self.amax_lowest.fill_(low)
            self.amax_highest.fill_(high)
        self.refresh()

    @torch.no_grad()
    def cast_scale(self, amax: torch.Tensor, update: bool = True) -> torch.Tensor:
        """The scale to cast a tensor whose amax is ``amax`` with (a fresh fp32 scalar);
        records the amax for the next ``fold`` when ``update``."""
        scale = _scale_from(
            amax,
            self.max_value,
            self.current_lowest,
            self.amax_highest,
            self.fallback,
            self.recipe.power_of_two,
        )
        if update:
            self.pending_amax.copy_(amax)
        return scale

    def scale_for(self, amax: torch.Tensor, update: bool = True) -> torch.Tensor:
        """``cast_scale`` and, when ``update``, this state's fold at once: one tensor's
        scaling on its own, as a cast outside any table sees it."""
        scale = self.cast_scale(amax, update)
        if update:
            fold([self])
        return scale

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

"""Per-tensor FP8 scaling recipes. (Skeleton: the numerics helper fills in the state machinery.)"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ScalingRecipe"]


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

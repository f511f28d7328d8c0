"""``HealthRecord``: where an FP8 linear's tracked pass leaves its cast health.

A fixed set of named slots in one device tensor, written in place by the casts of a tracked
pass (``Linear.track_health``), with a flag per slot saying it was ever written. A dict filled
in the backward was a Python side effect that ``torch.compile`` cannot trace; in-place writes
into a tensor the graph closes over are ordinary graph mutations, so a compiled layer measures
health like an eager one (on a graph of its own, taken on logging steps only). Reading is for
logging.
"""

from __future__ import annotations

import torch

__all__ = ["HealthRecord", "health_keys"]

_PER_TENSOR = ("underflow", "saturated")
_PER_BLOCK = (*_PER_TENSOR, "amax", "scale", "scale_spread")


def health_keys(roles: tuple[str, ...], granularity: str) -> tuple[str, ...]:
    """``<role>_<what>`` for every role: underflow and saturation fractions, and at row/block
    granularity the amax, smallest scale and scale spread (``block_linear.block_health``)."""
    whats = _PER_TENSOR if granularity == "tensor" else _PER_BLOCK
    return tuple(f"{role}_{what}" for role in roles for what in whats)


class HealthRecord:
    """Slots named ``keys`` on ``device``; ``record[key] = value`` writes one (a 0-d tensor)."""

    def __init__(self, keys: tuple[str, ...], device=None):
        self.keys = tuple(keys)
        self._index = {key: i for i, key in enumerate(self.keys)}
        self.values = torch.zeros(len(self.keys), dtype=torch.float32, device=device)
        self.written = torch.zeros(len(self.keys), dtype=torch.bool, device=device)

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        i = self._index[key]
        self.values[i] = value
        self.written[i] = True

    def to(self, device) -> HealthRecord:
        """A fresh record on ``device`` (what a move keeps: nothing measured yet there)."""
        return HealthRecord(self.keys, device)

    def flat(self) -> torch.Tensor:
        """Values then written flags, as one float tensor: to read with other numbers in one
        device-to-host copy (``pick`` turns the copy into a dict)."""
        return torch.cat((self.values, self.written.float()))

    def pick(self, host: list[float]) -> dict[str, float]:
        """The written slots of a host copy of ``flat()``."""
        n = len(self.keys)
        return {k: v for k, v, w in zip(self.keys, host[:n], host[n:]) if w}

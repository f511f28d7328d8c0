"""Count the bytes each rank puts on the wire, per collective, so "FP8 on the wire" is measured.

Byte model (one model, used by every caller): the bytes **this rank sends** under the standard
bandwidth-optimal implementations, ring for reductions and gathers, pairwise for all-to-all.
With ``W`` ranks and ``n`` the byte size of the *full* (unsharded) tensor:

==================  ====================  ================================================
collective          bytes sent per rank   why
==================  ====================  ================================================
all_reduce          2 (W-1)/W * n         ring reduce-scatter, then ring all-gather
reduce_scatter      (W-1)/W * n           each of W-1 foreign shards leaves once
all_gather          (W-1)/W * n           own shard (n/W) forwarded W-1 times
all_to_all          (W-1)/W * n           the piece addressed to oneself stays local
broadcast           (W-1)/W * n           pipelined ring/tree, amortised per rank
==================  ====================  ================================================

Latency (message count) and headers are ignored: the model is about bandwidth, which is what
the FP8 gradient path changes. ``n`` is always the full tensor: for an all-gather whose input
is a local shard of ``c`` bytes, ``n = W * c`` (so the rank sends ``(W-1) * c``).

Meters are passed explicitly (``meter: CommMeter | None``), never looked up from a global, so
two trainers in one process, or a test, can each count their own traffic.
"""

from __future__ import annotations

from collections import defaultdict

import torch

__all__ = ["CommMeter", "wire_bytes", "COLLECTIVE_KINDS"]

# Factor f(W) with bytes sent = f(W) * full tensor bytes.
COLLECTIVE_KINDS = {
    "all_reduce": lambda w: 2.0 * (w - 1) / w,
    "reduce_scatter": lambda w: (w - 1) / w,
    "all_gather": lambda w: (w - 1) / w,
    "all_to_all": lambda w: (w - 1) / w,
    "broadcast": lambda w: (w - 1) / w,
}


def wire_bytes(kind: str, full_nbytes: int, world: int) -> int:
    """Bytes one rank sends for a ``kind`` collective over a full tensor of ``full_nbytes``.

    Exact integer arithmetic whenever ``full_nbytes`` is a multiple of ``world`` (the padded
    buffers of this project always are); otherwise rounded to the nearest byte.
    """
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; one of {sorted(COLLECTIVE_KINDS)}")
    if world <= 1:
        return 0
    factor = 2 if kind == "all_reduce" else 1
    return (factor * (world - 1) * int(full_nbytes) + world // 2) // world


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class CommMeter:
    """Bytes sent by this rank, keyed by ``(collective name, group name, dtype name)``.

    ``name`` is the caller's label for the collective (e.g. ``"reduce_scatter_fp8"``), not the
    kind: two all-gathers with different purposes stay apart in the summary. Step counters are
    cleared by ``reset_step``; totals accumulate for the meter's life.
    """

    def __init__(self):
        self._step: dict[tuple[str, str, str], int] = defaultdict(int)
        self._total: dict[tuple[str, str, str], int] = defaultdict(int)
        self._step_calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self._total_calls: dict[tuple[str, str, str], int] = defaultdict(int)
        self._step_elements: dict[str, int] = defaultdict(int)

    def record(
        self,
        name: str,
        group_name: str,
        dtype: torch.dtype | str,
        nbytes: int,
        elements: int | None = None,
    ) -> None:
        """Add ``nbytes`` sent by this rank (already under the byte model: see ``wire_bytes``).

        ``elements``: how many tensor elements those bytes carry (default: ``nbytes`` over the
        dtype's size; pass 0 for metadata such as scales, whose bytes are the collective's
        overhead), so ``bytes_per_element`` can say what one element costs on the wire.
        """
        key = (name, group_name, _dtype_name(dtype))
        self._step[key] += int(nbytes)
        self._total[key] += int(nbytes)
        self._step_calls[key] += 1
        self._total_calls[key] += 1
        if elements is None:
            size = (
                torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 1
            )
            elements = int(nbytes) // size
        self._step_elements[name] += int(elements)

    def record_collective(
        self,
        name: str,
        kind: str,
        group_name: str,
        dtype: torch.dtype | str,
        full_nbytes: int,
        world: int,
    ) -> int:
        """Record a ``kind`` collective over a full tensor of ``full_nbytes``; returns the bytes."""
        nbytes = wire_bytes(kind, full_nbytes, world)
        self.record(name, group_name, dtype, nbytes)
        return nbytes

    def reset_step(self) -> None:
        self._step.clear()
        self._step_calls.clear()
        self._step_elements.clear()

    def bytes_per_element(self) -> dict[str, float]:
        """Collective name -> this step's bytes sent per element sent (metadata included)."""
        summary = self.step_summary()
        return {name: summary[name] / n for name, n in self._step_elements.items() if n > 0}

    def step_summary(self) -> dict[str, int]:
        """Collective name -> bytes sent this step (summed over groups and dtypes)."""
        out: dict[str, int] = defaultdict(int)
        for (name, _, _), nbytes in self._step.items():
            out[name] += nbytes
        return dict(out)

    def step_detail(self) -> dict[tuple[str, str, str], int]:
        """``(name, group, dtype)`` -> bytes sent this step."""
        return dict(self._step)

    def step_calls(self) -> dict[str, int]:
        """Collective name -> number of calls this step."""
        out: dict[str, int] = defaultdict(int)
        for (name, _, _), calls in self._step_calls.items():
            out[name] += calls
        return dict(out)

    def totals(self) -> dict[tuple[str, str, str], int]:
        """``(name, group, dtype)`` -> bytes sent over the meter's life."""
        return dict(self._total)

    @property
    def step_bytes(self) -> int:
        return sum(self._step.values())

    @property
    def total_bytes(self) -> int:
        return sum(self._total.values())

    def wire_bytes_per_grad_element(
        self, num_grad_elements: int, names: list[str] | tuple[str, ...] | None = None
    ) -> float:
        """This step's bytes sent (only ``names`` when given) per gradient element.

        For gradient averaging over W ranks the floor is ``2 (W-1)/W * bytes per element``
        (any reduce-scatter + all-gather pays it), so FP8 gives 1.0 at W=2 and 1.5 at W=4,
        against 4.0 and 6.0 for an FP32 all-reduce.
        """
        if num_grad_elements <= 0:
            raise ValueError(f"num_grad_elements={num_grad_elements}: must be > 0")
        summary = self.step_summary()
        if names is not None:
            summary = {k: v for k, v in summary.items() if k in names}
        return sum(summary.values()) / num_grad_elements

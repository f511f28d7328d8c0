"""Which layers each pipeline rank holds: pure arithmetic, shared by models/ and the schedules.

Megatron's assignment. With ``P`` stages, ``V`` model chunks per stage (virtual pipeline; 1
without interleaving) and ``L`` layers, the model is cut into ``P * V`` equal pieces of
``n = L / (P * V)`` layers, dealt round-robin: chunk ``c`` of stage ``r`` holds layers
``[(c * P + r) * n, (c * P + r + 1) * n)``. So with P=2, V=2, L=8 stage 0 holds layers 0-1 and
4-5, stage 1 layers 2-3 and 6-7, and a micro-batch visits 0 -> 1 -> 0 -> 1. The embedding lives
on chunk 0 of stage 0, the final norm, head and loss on chunk V-1 of stage P-1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineLayout", "PipelineLayoutError"]


class PipelineLayoutError(ValueError):
    """An impossible split; the message names the config keys."""


@dataclass(frozen=True)
class PipelineLayout:
    num_layers: int
    stages: int = 1
    virtual: int = 1
    rank: int = 0

    def __post_init__(self):
        if self.stages < 1 or self.virtual < 1:
            raise PipelineLayoutError(
                f"parallel.pipeline={self.stages}, parallel.virtual_pipeline={self.virtual}: "
                "both must be >= 1"
            )
        pieces = self.stages * self.virtual
        if self.num_layers % pieces:
            raise PipelineLayoutError(
                f"model.num_layers ({self.num_layers}) must be divisible by parallel.pipeline * "
                f"parallel.virtual_pipeline ({self.stages} * {self.virtual} = {pieces})"
            )
        if not 0 <= self.rank < self.stages:
            raise PipelineLayoutError(f"pipeline rank {self.rank} outside {self.stages} stages")

    @property
    def layers_per_chunk(self) -> int:
        return self.num_layers // (self.stages * self.virtual)

    def chunk_layers(self, chunk: int, rank: int | None = None) -> range:
        """Global layer indices of ``chunk`` on ``rank`` (default: this rank)."""
        rank = self.rank if rank is None else rank
        n = self.layers_per_chunk
        start = (chunk * self.stages + rank) * n
        return range(start, start + n)

    def local_layers(self) -> list[int]:
        """Every global layer index this rank holds, chunk by chunk."""
        return [i for c in range(self.virtual) for i in self.chunk_layers(c)]

    def has_embedding(self, chunk: int | None = None) -> bool:
        """Whether this rank (or its ``chunk``) starts the model."""
        return self.rank == 0 and chunk in (None, 0)

    def has_head(self, chunk: int | None = None) -> bool:
        """Whether this rank (or its ``chunk``) ends the model: final norm, head, loss."""
        return self.rank == self.stages - 1 and chunk in (None, self.virtual - 1)

    @property
    def is_split(self) -> bool:
        return self.stages > 1

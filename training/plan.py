"""The run plan: what a run's config and world size decide before anything is built.

The pre-flight (training/preflight.py) works these out while checking them: the parallel
split, micro-batches per step, model chunks per stage, the rank that logs, and the checkpoint
the run starts from (its metadata read and format-checked once). The build
(``training.setup.build_run``), the loop and the checkpointer take them from here instead of
working them out again, so a rule changed in one place cannot disagree with a copy elsewhere.

Light on purpose (no torch): the launcher's pre-flight imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = ["ResumePlan", "RunPlan"]


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run starts from: ``path`` (an ``iter_*`` directory), whether only its
    weights are taken (``checkpoint.finetune``), and its ``metadata.json``, already checked to
    be of this format version and family."""

    path: Path
    weights_only: bool
    metadata: JsonObject

    @property
    def iteration(self) -> int:
        return self.metadata["iteration"]

    @property
    def gemm_backend(self) -> str | None:
        """The FP8 GEMM backend the run keeps (same arithmetic as before the stop); None for
        a fine-tune, which picks its own."""
        return None if self.weights_only else self.metadata.get("fp8_gemm_backend")

    @property
    def saved_structure(self) -> dict | None:
        """The checkpoint's model structure, whose padded vocabulary a resumed run keeps;
        None for a fine-tune (it pads for its own layout)."""
        return None if self.weights_only else self.metadata.get("model_structure")


@dataclass(frozen=True)
class RunPlan:
    """One run on ``world_size`` ranks: ``tensor`` x ``pipeline`` x ``data`` ranks,
    ``virtual_stages`` model chunks per pipeline stage (1: not interleaved),
    ``micro_batches`` per optimizer step on each data-parallel rank, and the checkpoint it
    resumes from (``resume``; None: a fresh start)."""

    world_size: int
    tensor: int
    pipeline: int
    data: int
    virtual_stages: int
    micro_batches: int
    resume: ResumePlan | None = None

    @property
    def logging_rank(self) -> int:
        """The rank that prints and writes metrics: the loss lives on the last pipeline
        stage, and of its data-parallel ranks the last one logs."""
        return self.world_size - 1

"""The run plan: what a run's config and world size decide before anything is built.

The pre-flight (training/preflight.py) works these out while checking them: the parallel
split, micro-batches per step, model chunks per stage, the rank that logs, and the checkpoint
the run starts from (its metadata read and format-checked once). The build
(``training.setup.build_run``), the loop and the checkpointer take them from here instead of
working them out again, so a rule changed in one place cannot disagree with a copy elsewhere.

``plan_parallel`` is the half that needs only the config and the world size; the launcher
runs it (through the pre-flight) before torchrun starts, and ``python -m training.config
--world-size N`` from the command line. Light on purpose (torch and the topology, no
megatron, no data): the pre-flight should cost a second, not the start-up of a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError
from parallel.pipeline.schedules import check_schedule
from parallel.topology import Topology, TopologyError
from training.config_schema import Config, ConfigError

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = ["ResumePlan", "RunPlan", "num_microbatches", "plan_parallel"]


@dataclass(frozen=True)
class ResumePlan:
    """The checkpoint a run starts from: ``path`` (an ``iter_*`` directory), whether only its
    weights are taken (``checkpoint.finetune``), and its ``metadata.json``, already checked to
    be of this format version and family. ``set_aside``: the subdirectory of
    ``checkpoint.dir`` its checkpoints move into before a fine-tune loads one of them (the
    run's own directory held another level's, training/resume_check.py); None otherwise."""

    path: Path
    weights_only: bool
    metadata: JsonObject
    set_aside: str | None = None

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


def num_microbatches(cfg: Config, data_parallel: int) -> int:
    t = cfg.training
    per_step = t.micro_batch_size * data_parallel
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"config: training.global_batch_size={t.global_batch_size} is not divisible by "
            f"training.micro_batch_size={t.micro_batch_size} x data-parallel size {data_parallel}"
        )
    return t.global_batch_size // per_step


def plan_parallel(cfg: Config, world_size: int) -> RunPlan:
    """The run's plan without its resume part (the split, micro-batches per step, model
    chunks per stage), checking every rule that needs the world size on the way, as one-line
    ``ConfigError``s naming the keys: the topology, sequence and batch splits, the pipeline
    split and schedule."""
    p = cfg.parallel
    try:
        topo = Topology(world_size=world_size, rank=0, tensor=p.tensor, pipeline=p.pipeline)
    except TopologyError as err:
        raise ConfigError(f"config: {err}") from None
    n_micro = num_microbatches(cfg, topo.data)
    try:
        layout = PipelineLayout(cfg.model.num_layers, topo.pipeline, p.virtual_stages)
        if layout.is_split:
            check_schedule(p.pipeline_schedule, layout.stages, n_micro, layout.virtual)
    except PipelineLayoutError as err:
        raise ConfigError(f"config: {err}") from None
    return RunPlan(
        world_size=world_size, tensor=topo.tensor, pipeline=topo.pipeline, data=topo.data,
        virtual_stages=p.virtual_stages, micro_batches=n_micro,
    )  # fmt: skip

"""Layout rules that need the world size: checked by ``build_run`` on every rank and, through
``python -m training.config --world-size N``, by ``make train`` before torchrun starts.

Light on purpose (torch and the topology, no megatron, no data): the pre-flight check should
cost a second, not the start-up of a run.
"""

from __future__ import annotations

from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError
from parallel.pipeline.schedules import check_schedule
from parallel.topology import Topology, TopologyError
from training.config_schema import Config, ConfigError

__all__ = ["check_layout", "num_microbatches"]


def num_microbatches(cfg: Config, data_parallel: int) -> int:
    t = cfg.training
    per_step = t.micro_batch_size * data_parallel
    if t.global_batch_size % per_step:
        raise ConfigError(
            f"config: training.global_batch_size={t.global_batch_size} is not divisible by "
            f"training.micro_batch_size={t.micro_batch_size} x data-parallel size {data_parallel}"
        )
    return t.global_batch_size // per_step


def check_layout(cfg: Config, world_size: int) -> int:
    """Every rule that needs the world size, as one-line ``ConfigError``s naming the keys:
    the topology, sequence and batch splits, the pipeline split and schedule. Returns the
    micro-batches per step. ``make train`` runs it (``python -m training.config --world-size``)
    before torchrun starts, so a bad layout costs one line rather than N tracebacks."""
    try:
        topo = Topology(
            world_size=world_size, rank=0, tensor=cfg.parallel.tensor,
            pipeline=cfg.parallel.pipeline,
        )  # fmt: skip
    except TopologyError as err:
        raise ConfigError(f"config: {err}") from None
    n_micro = num_microbatches(cfg, topo.data)
    try:
        layout = PipelineLayout(
            cfg.model.num_layers, topo.pipeline, cfg.parallel.virtual_pipeline or 1
        )
        if layout.is_split:
            check_schedule(cfg.parallel.pipeline_schedule, layout.stages, n_micro, layout.virtual)
    except PipelineLayoutError as err:
        raise ConfigError(f"config: {err}") from None
    return n_micro

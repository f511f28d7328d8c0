"""Layout rules that need the world size: checked by the pre-flight (training/preflight.py)
and, through ``python -m training.config --world-size N``, from the command line.

Light on purpose (torch and the topology, no megatron, no data): the pre-flight check should
cost a second, not the start-up of a run.
"""

from __future__ import annotations

from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError
from parallel.pipeline.schedules import check_schedule
from parallel.topology import Topology, TopologyError
from training.config_schema import Config, ConfigError
from training.plan import RunPlan

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


def check_layout(cfg: Config, world_size: int) -> RunPlan:
    """Every rule that needs the world size, as one-line ``ConfigError``s naming the keys:
    the topology, sequence and batch splits, the pipeline split and schedule. Returns the
    run's plan without its resume part (``RunPlan``: the split, micro-batches per step,
    model chunks per stage)."""
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

"""Pipeline parallelism: which layers live where (``layout``), in what order micro-batches move
(``schedules``), and the executor that moves them between stages (``engine``)."""

from parallel.pipeline.engine import PipelineEngine, PipelineGroups
from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError
from parallel.pipeline.schedules import (
    HOLD,
    SCHEDULES,
    Op,
    check_schedule,
    forward_only_ops,
    schedule_ops,
    send_releases,
    simulate,
    theoretical_bubble,
)

__all__ = [
    "PipelineEngine",
    "PipelineGroups",
    "PipelineLayout",
    "PipelineLayoutError",
    "HOLD",
    "SCHEDULES",
    "Op",
    "check_schedule",
    "forward_only_ops",
    "schedule_ops",
    "send_releases",
    "simulate",
    "theoretical_bubble",
]

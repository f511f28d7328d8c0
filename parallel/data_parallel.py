"""Data-parallel gradient averaging after the last micro-batch's backward.

High-precision gradients (FP32, or the FP32 main grads of bf16) travel in one flat FP32
all-reduce; the FP8 weight-gradient slots of O1-O3 travel as FP8 bytes with exact FP32 sums
(parallel/fp8_comm.py). Deliberately unbucketed for now: contiguous buffers with overlapped,
bucketed reduction replace this later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.fp8_comm import allreduce_fp8_grads, allreduce_fp32_grads

__all__ = ["reduce_gradients"]


def reduce_gradients(
    grads: list[torch.Tensor], slots: list, group: dist.ProcessGroup | None, meter=None
) -> None:
    """Mean of every gradient over ``group`` in place (no-op without a group)."""
    if group is None:
        return
    if grads:
        allreduce_fp32_grads(grads, group, meter)
    if slots:
        allreduce_fp8_grads(slots, group, meter)

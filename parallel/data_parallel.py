"""Plain data-parallel gradient averaging: one all-reduce per gradient, FP32 on the wire.

Deliberately simple for now; contiguous bucketed buffers with overlap replace it later.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["allreduce_gradients", "broadcast_parameters", "reduce_gradients"]


def _grad_of(param: torch.nn.Parameter) -> torch.Tensor | None:
    # Mixed-precision levels accumulate into an FP32 ``main_grad``; others use ``.grad``.
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def allreduce_gradients(params, group: dist.ProcessGroup | None) -> None:
    """Average every gradient over ``group`` (no-op when there is no group).

    The reduction runs in FP32 (the ``grad comm`` column of the table for fp32..te), then the
    SUM is divided by the group size so the result is the data-parallel mean.
    """
    if group is None:
        return
    world = dist.get_world_size(group)
    grads = [g for g in (_grad_of(p) for p in params) if g is not None]
    if not grads:
        return
    # One flat FP32 tensor: fewer collectives, and FP32 sums whatever dtype the grads are in.
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat.div_(world)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def broadcast_parameters(module: torch.nn.Module, group: dist.ProcessGroup | None, src: int):
    """Make every rank hold rank ``src`'s weights (the shared seed already should)."""
    if group is None:
        return
    for tensor in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(tensor.data, src=src, group=group)


def reduce_gradients(grads: list[torch.Tensor], slots: list, group, meter=None) -> None:
    """Data-parallel mean of every gradient: FP32 on the wire for high-precision gradients,
    FP8 bytes (exact FP32 sums) for the FP8 weight-gradient slots of O1-O3."""
    if group is None:
        return
    from parallel.fp8_comm import allreduce_fp8_grads, allreduce_fp32_grads

    if grads:
        allreduce_fp32_grads(grads, group, meter)
    if slots:
        allreduce_fp8_grads(slots, group, meter)

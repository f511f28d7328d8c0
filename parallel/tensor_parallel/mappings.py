"""Tier 1 of tensor parallelism: collectives as autograd Functions over an explicit group.

Each mapping is a pair (forward collective, backward collective) that are each other's
transpose, so autograd through a sharded model computes the gradient of the unsharded one:

=================================  ===========================  ============================
mapping                            forward                      backward
=================================  ===========================  ============================
copy_to_region                     identity                     all-reduce
reduce_from_region                 all-reduce                   identity
scatter_to_region (dim)            keep this rank's slice       all-gather
gather_from_region (dim)           all-gather                   keep this rank's slice
gather_from_sequence_region (1)    all-gather along sequence    reduce-scatter
reduce_scatter_to_sequence_region  reduce-scatter along seq.    all-gather
=================================  ===========================  ============================

Activations here are ``[batch, seq, hidden]`` (batch first), so the sequence dimension is 1,
not Megatron's 0. Slices are contiguous equal chunks in rank order; a dimension that does not
divide by the group size is an error, never a silent uneven split.

``group=None`` (or a group of one rank) means no tensor parallelism: every mapping returns its
input unchanged, with no autograd node. Groups are always passed in, never looked up.

Reduce-scatter: nccl uses its native kernel. Every other backend (gloo) runs it as an
all-to-all of the W slices followed by a local FP32 sum in rank order. gloo's own
reduce-scatter is recent (torch 2.13 has it, older releases raise); the all-to-all path works
on all of them, sends the same (W-1)/W of the tensor a ring reduce-scatter sends (all-reduce +
slice would send twice that), sums deterministically, and accumulates low-precision
activations in FP32. It is the pattern of the FP8 gradient reduce-scatter in
``parallel/fp8_comm.py``. ``reduce_scatter(..., native=True)`` forces the backend's kernel
(the tests check both paths agree on gloo).

``meter`` (a ``parallel.comm_meter.CommMeter``) records the bytes of every collective as it
runs, including those of backward, under the names ``tp_all_reduce``, ``tp_all_gather`` and
``tp_reduce_scatter`` (group name ``group_name``, default ``"tensor"``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.collective_paths import (
    all_gather_single,
    native_reduce_scatter,
    reduce_scatter_single,
)
from parallel.comm_meter import CommMeter

__all__ = [
    "PlannedGroup",
    "copy_to_region",
    "reduce_from_region",
    "scatter_to_region",
    "gather_from_region",
    "gather_from_sequence_region",
    "reduce_scatter_to_sequence_region",
    "group_size",
    "group_rank",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "split",
    "SEQUENCE_DIM",
]

SEQUENCE_DIM = 1  # [batch, seq, hidden]


class PlannedGroup:
    """A tensor-parallel group as a plan, not a connection: its size and one member's rank.

    Building a model slice on the meta device with it gives that slice's tensor names,
    shapes and layouts without starting any process (tools/convert_checkpoint.py writes a
    checkpoint for a layout it does not run). It cannot communicate: a model built on it is
    for inspection only, and a collective on it fails in torch.distributed.
    """

    def __init__(self, size: int, rank: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"PlannedGroup(size={self._size}, rank={self._rank})"


def group_size(group: dist.ProcessGroup | PlannedGroup | None) -> int:
    if isinstance(group, PlannedGroup):
        return group.size()
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | PlannedGroup | None) -> int:
    if isinstance(group, PlannedGroup):
        return group.rank()
    return 0 if group is None else dist.get_rank(group)


def _record(meter, kind: str, tensor: torch.Tensor, world: int, group_name: str) -> None:
    if meter is not None:
        meter.record_collective(f"tp_{kind}", kind, group_name, tensor.dtype, tensor.nbytes, world)


def _check_divisible(x: torch.Tensor, dim: int, world: int) -> int:
    size = x.shape[dim]
    if size % world:
        raise ValueError(
            f"dimension {dim} of a {tuple(x.shape)} tensor ({size}) is not divisible by the "
            f"tensor-parallel size {world}"
        )
    return size // world


# ---- plain collectives (no autograd); the Functions below and the layers build on them ----


def all_reduce(
    x: torch.Tensor, group, *, meter: CommMeter | None = None, group_name: str = "tensor"
) -> torch.Tensor:
    """Sum over the group into a new tensor (the input is never modified: autograd may hold it,
    and a gradient tensor may be shared by several branches)."""
    world = group_size(group)
    if world == 1:
        return x
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    _record(meter, "all_reduce", out, world, group_name)
    return out


def split(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous slice of ``dim`` (a copy, so the full tensor can be freed)."""
    world = group_size(group)
    if world == 1:
        return x
    n = _check_divisible(x, dim, world)
    return x.narrow(dim, group_rank(group) * n, n).contiguous()


def all_gather(
    x: torch.Tensor,
    group,
    dim: int = -1,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    # Gather along dim 0 (one flat, coalesced collective) and move the axis back.
    local = x.movedim(dim, 0).contiguous()
    out = local.new_empty((world * local.shape[0], *local.shape[1:]))
    all_gather_single(out, local, group=group)
    _record(meter, "all_gather", out, world, group_name)
    return out.movedim(0, dim).contiguous()


def reduce_scatter(
    x: torch.Tensor,
    group,
    dim: int = -1,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
    native: bool | None = None,
) -> torch.Tensor:
    """Sum over the group and keep this rank's slice of ``dim``.

    native: use the backend's reduce-scatter (default: only on nccl); otherwise all-to-all plus
    a local FP32 sum in rank order (module docstring).
    """
    world = group_size(group)
    if world == 1:
        return x
    dim = dim % x.dim()
    n = _check_divisible(x, dim, world)
    send = x.movedim(dim, 0).contiguous()  # slice r of dim is rows [r*n, (r+1)*n)
    if native is None:
        native = native_reduce_scatter(group)
    if native:
        out = send.new_empty((n, *send.shape[1:]))
        reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=group)
        _record(meter, "reduce_scatter", send, world, group_name)
    else:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        # Same byte model as a ring reduce-scatter: (W-1)/W of the full tensor leaves.
        _record(meter, "reduce_scatter", send, world, group_name)
        out = recv.view(world, n, *send.shape[1:]).sum(0, dtype=torch.float32).to(x.dtype)
    return out.movedim(0, dim).contiguous()


# ---- autograd Functions ----


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meter, group_name):
        ctx.group, ctx.meter, ctx.group_name = group, meter, group_name
        return x.view_as(x)  # a new tensor object, so autograd records this node

    @staticmethod
    def backward(ctx, g):
        return (
            all_reduce(g, ctx.group, meter=ctx.meter, group_name=ctx.group_name),
            None,
            None,
            None,
        )


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, meter, group_name):
        return all_reduce(x, group, meter=meter, group_name=group_name)

    @staticmethod
    def backward(ctx, g):
        return g, None, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, meter, group_name):
        ctx.group, ctx.dim = group, dim
        ctx.comm = {"meter": meter, "group_name": group_name}
        return split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim, **ctx.comm), None, None, None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, meter, group_name):
        ctx.group, ctx.dim = group, dim
        return all_gather(x, group, dim, meter=meter, group_name=group_name)

    @staticmethod
    def backward(ctx, g):
        return split(g, ctx.group, ctx.dim), None, None, None, None


class _GatherFromSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, meter, group_name):
        ctx.group, ctx.dim = group, dim
        ctx.comm = {"meter": meter, "group_name": group_name}
        return all_gather(x, group, dim, meter=meter, group_name=group_name)

    @staticmethod
    def backward(ctx, g):
        # Every rank used the whole gathered tensor, so each slice's gradient is the sum over
        # ranks of that slice's gradient.
        return reduce_scatter(g, ctx.group, ctx.dim, **ctx.comm), None, None, None, None


class _ReduceScatterToSequenceRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, meter, group_name):
        ctx.group, ctx.dim = group, dim
        ctx.comm = {"meter": meter, "group_name": group_name}
        return reduce_scatter(x, group, dim, meter=meter, group_name=group_name)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group, ctx.dim, **ctx.comm), None, None, None, None


def copy_to_region(
    x: torch.Tensor, group, *, meter: CommMeter | None = None, group_name: str = "tensor"
) -> torch.Tensor:
    """Identity forward, all-reduce backward: the input of a column-parallel GEMM."""
    if group_size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group, meter, group_name)


def reduce_from_region(
    x: torch.Tensor, group, *, meter: CommMeter | None = None, group_name: str = "tensor"
) -> torch.Tensor:
    """All-reduce forward, identity backward: the output of a row-parallel GEMM."""
    if group_size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group, meter, group_name)


def scatter_to_region(
    x: torch.Tensor,
    group,
    dim: int = -1,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """Keep this rank's slice of ``dim`` forward, all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group, dim, meter, group_name)


def gather_from_region(
    x: torch.Tensor,
    group,
    dim: int = -1,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """All-gather along ``dim`` forward, keep this rank's slice backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group, dim, meter, group_name)


def gather_from_sequence_region(
    x: torch.Tensor,
    group,
    dim: int = SEQUENCE_DIM,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """Sequence parallel: all-gather the sequence shards forward, reduce-scatter backward."""
    if group_size(group) == 1:
        return x
    return _GatherFromSequenceRegion.apply(x, group, dim, meter, group_name)


def reduce_scatter_to_sequence_region(
    x: torch.Tensor,
    group,
    dim: int = SEQUENCE_DIM,
    *,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """Sequence parallel: reduce-scatter along the sequence forward, all-gather backward."""
    if group_size(group) == 1:
        return x
    return _ReduceScatterToSequenceRegion.apply(x, group, dim, meter, group_name)

"""The sequence-parallel all-gather of a column-parallel layer's input, in FP8.

Under sequence parallelism each rank holds ``[b, s/W, h]`` and the column-parallel GEMM needs
all ``s`` rows. Gathering FP32 and casting afterwards puts 4 bytes per element on the wire;
casting first and gathering the FP8 bytes puts 1. For the gathered bytes to mean one tensor
the ranks must cast with one scale: the input amax is MAX-reduced over the tensor-parallel
group first (NaN turned into inf so MAX cannot drop it), and every rank's delayed-scaling
history then advances with the same amax, so the scales stay identical step after step. The
result is bit-identical to gathering in FP32 and casting the whole tensor. The input gradient
(FP32) is reduce-scattered back to the sequence shards as before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parallel.comm_meter import CommMeter
from parallel.tensor_parallel.mappings import SEQUENCE_DIM, all_gather, group_size, reduce_scatter

__all__ = ["SequenceGatherFp8"]


class SequenceGatherFp8:
    """Passed to ``fp8train.Linear.forward(x, input_comm=...)`` by ColumnParallelLinear."""

    def __init__(self, group, local_lead: torch.Size, meter: CommMeter | None = None):
        if len(local_lead) != 2:
            raise ValueError(f"expected a [b, s/tp, h] input, got leading shape {local_lead}")
        self.group, self.meter = group, meter
        self.world = group_size(group)
        self.batch, self.local_seq = local_lead

    def gathered_lead(self, lead: torch.Size) -> tuple[int, int]:
        return (self.batch, self.local_seq * self.world)

    def sync_amax(self, amax: torch.Tensor) -> torch.Tensor:
        agreed = torch.nan_to_num(amax.float(), nan=float("inf")).reshape(1).clone()
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        if self.meter is not None:
            self.meter.record_collective(
                "tp_amax_all_reduce", "all_reduce", "tensor", torch.float32, 4, self.world
            )
        return agreed[0]

    def gather(self, data: torch.Tensor) -> torch.Tensor:
        """This rank's FP8 rows ``[b*s/W, K]`` -> every rank's ``[b*s, K]``, as uint8 bytes."""
        return self.gather_rows(data.view(torch.uint8)).view(data.dtype)

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows ``[b*s/W, C]`` of any dtype -> every rank's ``[b*s, C]``."""
        local = t.reshape(self.batch, self.local_seq, t.shape[-1])
        full = all_gather(local, self.group, SEQUENCE_DIM, meter=self.meter)
        return full.reshape(-1, t.shape[-1])

    def scatter_grad(self, dx: torch.Tensor) -> torch.Tensor:
        """Input gradient of all rows ``[b*s, K]`` -> this rank's rows, summed over ranks."""
        k = dx.shape[-1]
        full = dx.view(self.batch, self.local_seq * self.world, k)
        mine = reduce_scatter(full, self.group, SEQUENCE_DIM, meter=self.meter)
        return mine.reshape(-1, k)

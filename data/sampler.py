"""Deterministic, exactly resumable micro-batch sampling (Megatron's pretraining sampler).

The dataset is already shuffled (megatron-core's shuffle index, or the dataset's own per-epoch
order), so sampling walks the global sample order sequentially: the global micro-batch ``j``
holds samples ``[consumed + j*M*D, consumed + (j+1)*M*D)`` with M the micro-batch size and D
the data-parallel size, and rank ``r`` takes the slice ``[r*M, (r+1)*M)`` of it. The only
state is ``consumed_samples`` (summed over all ranks), so resuming at ``k`` replays exactly
what the uninterrupted run saw after ``k`` samples, for any rank.

By default batches are assembled in the calling process: GPTDataset items are memory-mapped
slices, no worker processes are needed. Datasets that decode and augment every item (images)
may pass ``num_workers > 0``: a torch DataLoader then fetches the same index lists from the
sampler in worker processes and yields the batches in the sampler's order, so the batches do
not depend on ``num_workers``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["MicroBatchSampler", "collate", "micro_batches"]


class MicroBatchSampler:
    """Index lists for one data-parallel rank, like ``MegatronPretrainingSampler``.

    Only full global micro-batches are yielded (drop_last), so every rank yields the same
    number of batches and all ranks stay in lock-step.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
    ) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to draw from (total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_size={dp_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(
                f"consumed_samples {consumed_samples} is outside [0, total_samples={total_samples}]"
            )
        self.total_samples = int(total_samples)
        self.consumed_samples = int(consumed_samples)
        self.micro_batch_size = int(micro_batch_size)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.global_micro_batch = self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        return (self.total_samples - self.consumed_samples) // self.global_micro_batch

    def __iter__(self) -> Iterator[list[int]]:
        first = self.consumed_samples + self.dp_rank * self.micro_batch_size
        for j in range(len(self)):
            start = first + j * self.global_micro_batch
            yield list(range(start, start + self.micro_batch_size))


def collate(items: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-sample dicts into ``[b, s]`` tensors (dtypes kept: int64 ids, float mask)."""
    return {name: torch.stack([item[name] for item in items]) for name in items[0]}


def micro_batches(
    dataset: Any,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    total_samples: int | None = None,
    num_workers: int = 0,
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches for this rank starting after ``consumed_samples``.

    Each batch stacks the items' tensors under their keys, e.g. GPT's ``{"tokens": int64
    [b,s], "labels": int64 [b,s], "loss_mask": float32 [b,s], "position_ids": int64 [b,s]}``.
    ``total_samples`` defaults to ``len(dataset)``. ``num_workers > 0`` reads items in that
    many DataLoader worker processes (the dataset must pickle); the batches are the same.
    """
    if num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    total = len(dataset) if total_samples is None else int(total_samples)
    # Built here, not inside the generator, so bad arguments fail at the call site.
    sampler = MicroBatchSampler(total, consumed_samples, micro_batch_size, dp_rank, dp_size)
    if num_workers == 0:
        return (collate([dataset[i] for i in indices]) for indices in sampler)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=int(num_workers),
        persistent_workers=False,
    )
    # Wrapped so workers start at the first batch drawn, not when micro_batches is called.
    return (batch for batch in loader)

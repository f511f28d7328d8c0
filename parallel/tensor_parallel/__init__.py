"""Tensor (and sequence) parallelism in three tiers, after nanotron's ``tensor_parallel``:

1. ``mappings``: collectives as autograd Functions over an explicit process group;
2-3. ``layers``: column/row-parallel linears (each holding one FP8-aware ``fp8train.Linear``
   shard) and the vocab-parallel embedding; ``cross_entropy``: the vocab-parallel head's
   logits and the loss over them, never gathering the vocabulary.

Every entry point takes the tensor-parallel group as an argument; ``None`` means one rank.
"""

from __future__ import annotations

from .cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_logits
from .layers import (
    ColumnParallelLinear,
    ParallelLayer,
    RowParallelLinear,
    ShardLayout,
    VocabParallelBias,
    VocabParallelEmbedding,
    gather_full,
    is_parallel_layer,
    shard_from_full,
)
from .mappings import (
    SEQUENCE_DIM,
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
)

__all__ = [
    "SEQUENCE_DIM",
    "ColumnParallelLinear",
    "ParallelLayer",
    "RowParallelLinear",
    "ShardLayout",
    "VocabParallelEmbedding",
    "VocabParallelBias",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence_region",
    "gather_full",
    "is_parallel_layer",
    "reduce_from_region",
    "reduce_scatter_to_sequence_region",
    "scatter_to_region",
    "shard_from_full",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_logits",
]

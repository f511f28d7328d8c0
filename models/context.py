"""What every layer of a model needs to know about the run it is built for, in one object.

A model, its blocks and their linears are built against one ``BuildContext`` instead of five
threaded arguments (recipe, device, tensor-parallel group, sequence parallelism).
It holds a process group but never calls torch.distributed: parallel/'s layers do that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fp8train.precision import PrecisionRecipe

__all__ = ["BuildContext", "tp_size"]


def tp_size(group) -> int:
    """Ranks in a tensor-parallel group (None: no tensor parallelism)."""
    return 1 if group is None else group.size()


@dataclass(frozen=True)
class BuildContext:
    """recipe: the precision level's recipe with its FP8 scaling (None = plain FP32 linears);
    device: where parameters are built (None = the default device, "meta" = shapes only);
    tp_group: the tensor-parallel group (None or a 1-rank group = no TP); sequence_parallel:
    activations between the GEMMs are sequence shards of that group.
    materialize: False builds parallel layers without initialising them (their values are
    filled in afterwards, slice by slice, see ``models.base``). initialize: False leaves the
    whole model's values undefined (no initialisation, no replay): what a plan on fake
    tensors builds, where only shapes and dtypes count (training/planning/rank_plan.py). meter: the
    run's ``parallel.comm_meter.CommMeter`` (None: not counted), where every tensor-parallel
    collective of the model records its bytes, so the run's comm-bytes and a plan see the TP
    traffic beside the data-parallel and pipeline traffic."""

    recipe: PrecisionRecipe | None = None
    device: torch.device | str | None = None
    tp_group: object = None
    sequence_parallel: bool = False
    materialize: bool = field(default=True, compare=False)
    initialize: bool = field(default=True, compare=False)
    meter: object = field(default=None, compare=False)

    def __post_init__(self):
        if tp_size(self.tp_group) == 1:
            object.__setattr__(self, "tp_group", None)
        if self.sequence_parallel and self.tp_group is None:
            raise ValueError("sequence parallelism needs a tensor-parallel group of 2+ ranks")

    @property
    def tp(self) -> int:
        return tp_size(self.tp_group)

    def linear_kwargs(self) -> dict:
        """Keywords for ``fp8train.linear.Linear`` and the parallel linears."""
        return dict(recipe=self.recipe, device=self.device)

    def check_sequence_split(self, seq_length: int) -> None:
        """Sequence parallelism splits the sequence evenly over the tensor-parallel ranks."""
        if self.sequence_parallel and seq_length % self.tp:
            raise ValueError(
                f"model.seq_length={seq_length} is not divisible by parallel.tensor={self.tp} "
                "(sequence parallelism splits the sequence)"
            )

    def single(self) -> BuildContext:
        """The same run on one process: no TP, no SP (the reference the slices are cut from)."""
        return BuildContext(self.recipe, self.device, meter=self.meter)

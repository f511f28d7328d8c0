"""``ScalingTable``: one bulk scaling update per pass for every FP8 tensor of a model.

A linear's casts only ask their state for a scale and record their amax
(``ScalingState.cast_scale``); the table folds every recorded amax of the model into its
history and computes every next scale in one batch of operations per recipe
(``scaling.fold``), after the forward and again after the backward, as Transformer Engine's
bulk amax-and-scale update does. The cost of scaling bookkeeping per pass no longer grows with
the number of layers, and the casts inside a compiled layer are reads and one write.

Who folds, and when:
- ``training/`` calls ``fold`` after every micro-batch's forward and after its backward (the
  pipeline schedule's too);
- ``attach`` (used by ``fp8train.initialize``) folds after every training-mode forward of the
  model; what a backward recorded is folded by the next forward, which comes before the next
  backward, or by ``state_dict`` (a checkpoint holds what the casts recorded).
A state the table does not manage (a linear used on its own) is folded by its linear right
after its casts: the same arithmetic on one row.

Each role is cast at most once per pass for this to be the per-cast update of old: a linear
called twice in one forward records its second amax over the first.
"""

from __future__ import annotations

from torch import nn

from .scaling import ScalingState, fold

__all__ = ["ScalingTable", "attach"]


class ScalingTable:
    """Every ``ScalingState`` under ``model``, grouped by recipe, marked managed."""

    def __init__(self, model: nn.Module):
        self.groups: dict[object, list[ScalingState]] = {}
        for module in model.modules():
            if isinstance(module, ScalingState):
                module.managed = True
                self.groups.setdefault(module.recipe, []).append(module)

    def fold(self) -> None:
        """Take every recorded amax into its history and compute every next scale."""
        for states in self.groups.values():
            fold(states)


def attach(model: nn.Module) -> ScalingTable:
    """A table for ``model`` that folds after each training-mode forward of it."""
    table = ScalingTable(model)

    def after_forward(module, args, output):
        if module.training:
            table.fold()

    model.register_forward_hook(after_forward)
    return table

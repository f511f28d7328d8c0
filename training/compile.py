"""``training.compile``: each transformer layer compiled on its own, as torchtitan does.

Per layer, not the whole model: every layer of a model runs the same code on parameters of
the same shapes, so one compilation serves them all (dynamo keeps the parameters as graph
inputs), start-up stays bounded whatever the depth, and what cannot be traced (the pipeline
schedule, the data-parallel hooks, the loss over a sharded vocabulary) stays eager around
compiled blocks. Everything the precision levels add inside a layer traces whole: the FP8
casts and their scaling state, the three GEMMs, the FP8 weight-gradient hand-off (the slot's
sink, ``fp8train.low_precision``), recompute.

``fullgraph=True`` (a graph break is an error) except under tensor parallelism, whose
autograd collectives call ``torch.distributed`` in place and split the layer's graph there.
"""

from __future__ import annotations

import torch
from torch import nn

from models.transformer import TransformerLayer

__all__ = ["compile_enabled", "compile_layers"]


def compile_enabled(setting: bool | None, device: torch.device) -> bool:
    """``training.compile``: null means on for CUDA and off elsewhere."""
    return device.type == "cuda" if setting is None else bool(setting)


def compile_layers(model: nn.Module, *, tensor_parallel: bool, backend: str = "inductor") -> int:
    """Compile every ``TransformerLayer`` of ``model`` in place (``nn.Module.compile``: names,
    parameters and state dicts unchanged); returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.compile(fullgraph=not tensor_parallel, backend=backend)
            count += 1
    return count

"""Parameter state behind accessors (``fp8train.param_state``), the one registry of parallel
layer types, the layouts the layers report themselves, and ``canonical_name``'s one-walk map.

Single process, CPU, well under a second: the layouts under a real tensor-parallel group are
checked against the stored checkpoints by test_checkpoint_format.py and test_reshard.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import models.base
from fp8train.linear import Linear
from fp8train.low_precision import Fp8GradSlot
from fp8train.param_state import (
    fp8_grad_slot,
    grad_slot,
    scale_inv_of,
    set_grad_slot,
    set_scale_inv,
)
from fp8train.precision import get_recipe
from models.base import LayerDict, ParallelModel
from models.context import BuildContext
from parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    ParallelLayer,
    RowParallelLinear,
    ShardLayout,
    VocabParallelBias,
    VocabParallelEmbedding,
    is_parallel_layer,
)

SCALING_STATE = ("amax_history", "scale", "step", "recover", "nonfinite")


def test_grad_slot_accessors():
    p = nn.Parameter(torch.zeros(3, 2))
    assert grad_slot(p) is None and fp8_grad_slot(p) is None
    view = torch.zeros(6)[:6].view(3, 2)
    set_grad_slot(p, view)
    assert grad_slot(p) is view and fp8_grad_slot(p) is None
    slot = Fp8GradSlot(p.shape)
    set_grad_slot(p, slot)
    assert grad_slot(p) is slot and fp8_grad_slot(p) is slot
    with pytest.raises(ValueError, match="shape"):
        set_grad_slot(p, torch.zeros(2, 3))
    with pytest.raises(TypeError):
        set_grad_slot(p, [0.0] * 6)
    set_grad_slot(p, None)
    assert grad_slot(p) is None
    set_grad_slot(p, None)  # removing nothing is fine


def test_scale_inv_accessors_follow_the_linear_buffer():
    p = nn.Parameter(torch.zeros(2))
    assert scale_inv_of(p) is None
    with pytest.raises(TypeError):
        set_scale_inv(p, torch.ones(2))
    scale = torch.full((), 0.5)
    set_scale_inv(p, scale)
    assert scale_inv_of(p) is scale
    set_scale_inv(p, None)
    assert scale_inv_of(p) is None

    layer = Linear(8, 4, recipe=get_recipe("O2"))
    layer.lower_weight_precision()
    assert scale_inv_of(layer.weight) is layer.weight_scale_inv
    assert isinstance(fp8_grad_slot(layer.weight), Fp8GradSlot)
    layer.to("cpu")  # replaces the buffer: the parameter must follow it
    assert scale_inv_of(layer.weight) is layer.weight_scale_inv


def _concrete_subclasses(cls) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        if not sub.__name__.startswith("_"):
            out.add(sub)
        out |= _concrete_subclasses(sub)
    return out


def test_one_registry_of_parallel_layers():
    # The base class is the registry: every concrete parallel layer derives from it.
    concrete = {ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelBias}
    assert _concrete_subclasses(ParallelLayer) == concrete
    assert VocabParallelBias in _concrete_subclasses(ParallelLayer)
    layers = [
        ColumnParallelLinear(4, 8, group=None),
        RowParallelLinear(8, 4, group=None),
        VocabParallelEmbedding(16, 4, group=None),
        VocabParallelBias(16),
    ]
    assert all(is_parallel_layer(m) for m in layers)
    assert not is_parallel_layer(Linear(4, 4)) and not is_parallel_layer(nn.Embedding(4, 4))


def _split(layer) -> dict[str, tuple[int, int]]:
    return {
        name: (v.partition_dim, v.blocks)
        for name, v in layer.shard_layouts().items()
        if v.partition_dim is not None
    }


@pytest.mark.parametrize("level", ["fp32", "te", "O2"])
def test_layers_report_every_tensor_they_store(level):
    recipe = get_recipe(level)
    column = ColumnParallelLinear(4, 8, group=None, recipe=recipe, blocks=2)
    row = RowParallelLinear(8, 4, group=None, recipe=recipe)
    for layer in (column, row):
        layer.linear.lower_weight_precision()
        layouts = layer.shard_layouts()
        # The single-process names of exactly what the layer stores: ``linear.`` dropped.
        stored = {k.removeprefix(f"{layer.shard_child}.") for k in layer.state_dict()}
        assert set(layouts) == stored
        own = {k for k, v in layouts.items() if v.per_shard}
        expected = {
            f"fp8_{r}.{b}" for r in ("input", "weight", "grad_output") for b in SCALING_STATE
        }
        expected = (expected if recipe.fp8_gemm else set()) | (
            {"weight_scale_inv"} if layer.linear.lowered else set()
        )
        assert own == expected
    assert column.shard_layouts()["weight"] == ShardLayout(0, 2)
    assert column.shard_layouts()["bias"] == ShardLayout(0, 2)
    assert row.shard_layouts()["weight"] == ShardLayout(1)
    assert row.shard_layouts()["bias"] == ShardLayout()  # replicated: added after the reduction
    # What tensor_partitions reads: the split tensors' (dimension, blocks).
    assert _split(column) == {"weight": (0, 2), "bias": (0, 2)}
    assert _split(row) == {"weight": (1, 1)}
    assert VocabParallelEmbedding(16, 4, group=None).shard_layouts() == {"weight": ShardLayout(0)}
    assert VocabParallelBias(16).shard_layouts() == {"bias": ShardLayout(0)}


def test_shard_layout_refuses_nonsense():
    with pytest.raises(ValueError):
        ShardLayout(None, blocks=2)
    with pytest.raises(ValueError):
        ShardLayout(0, per_shard=True)


@dataclass
class _Config:
    num_layers: int = 2


class _Tiny(ParallelModel):
    """Parallel layers (built on one rank) in the places a family puts them."""

    def build(self, ctx: BuildContext) -> None:
        self.embed = VocabParallelEmbedding(16, 4, group=None, device=ctx.device)
        recipe = ctx.recipe
        self.layers = LayerDict(
            (
                str(i),
                nn.ModuleDict(
                    {
                        "fc1": ColumnParallelLinear(4, 8, group=None, recipe=recipe),
                        "fc2": RowParallelLinear(8, 4, group=None, recipe=recipe),
                    }
                ),
            )
            for i in self.pipeline.local_layers()
        )
        self.lm_bias = VocabParallelBias(16, device=ctx.device)

    def init_parameter(self, module_name, module, param_name, tensor) -> None:
        nn.init.zeros_(tensor)

    def forward_chunk(self, chunk, hidden, inputs):
        raise NotImplementedError

    def pipeline_copies(self) -> dict[str, bool]:
        return {}

    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        return (micro_batch_size, 4)


def test_canonical_name_walks_the_modules_once(monkeypatch):
    model = _Tiny(_Config(), BuildContext(get_recipe("te")))
    visits = []

    def counting(module):
        visits.append(module)
        return is_parallel_layer(module)

    monkeypatch.setattr(models.base, "is_parallel_layer", counting)
    model.refresh_names()
    names = model.canonical_state_dict()  # every state-dict key, one map
    walk = len(visits)
    assert walk == len(list(model.named_modules())) - 1  # one walk (the root is no layer)
    assert "layers.0.fc1.weight" in names and "layers.1.fc2.fp8_input.scale" in names
    assert "layers.0.fc1.bias" in names and "embed.weight" in names and "lm_bias.bias" in names
    assert not any(".linear." in n for n in names)
    assert model.canonical_name("layers.0.fc1.linear.weight_scale_inv") == (
        "layers.0.fc1.weight_scale_inv"
    )
    assert model.canonical_name("layers.0.fc1.weight") == "layers.0.fc1.weight"
    assert model.canonical_name("linear.weight") == "linear.weight"
    model.canonical_parameter_names()
    assert len(visits) == walk  # still the same map

    # A parallel layer added after the build is seen once the map is refreshed.
    model.extra = ColumnParallelLinear(4, 4, group=None)
    assert model.canonical_name("extra.linear.weight") == "extra.linear.weight"  # stale map
    model.refresh_names()
    assert model.canonical_name("extra.linear.weight") == "extra.weight"

"""Tiers 2-3 of tensor parallelism: column/row-parallel linears and the vocab-parallel embedding.

Each linear holds ONE ``fp8train.linear.Linear`` (``.linear``) of its shard's size, without
bias, so every shard has its own FP8 scaling state (a shard's amax is its own; sharing a scale
would need an amax all-reduce per GEMM for no accuracy gain) and the precision recipe applies
to the shard exactly as to an unsharded layer (``lower_weight_precision``, FP8 grad slots,
``fp8_stats`` all work on ``.linear``). The bias is the parallel module's own parameter,
because a row-parallel bias must be added once, after the reduction, not by every shard.

Weight layout (``[out, in]`` as in ``nn.Linear``):
  column: this rank holds rows ``[r*out/W, (r+1)*out/W)`` of the full weight and of the bias;
  row:    this rank holds columns ``[r*in/W, (r+1)*in/W)``; the bias is full and replicated.
``blocks=k`` (column only) says the output dimension is k equal concatenated blocks (SwiGLU's
fused ``[gate | up]`` is k=2): each block is split across ranks and this rank's pieces are
concatenated, so the local output is again ``[gate_r | up_r]`` and ``chunk(2, -1)`` still
pairs each gate with its own up column.

Initialisation: the FULL weight is built on the CPU on every rank, from the global RNG (or by
``init_method``), and each rank keeps its slice. With the same seed, a TP=W model therefore
holds exactly the weights of the TP=1 model, and CPU and CUDA runs agree. Without
``init_method`` the draws are nn.Linear's (kaiming-uniform weight, then uniform bias, in that
order), so the RNG stream matches a model built from ``nn.Linear``/``fp8train.Linear``; with
it, ``init_method(full_weight)`` fills the weight in place and the bias is zero (Megatron).
The inner Linear's own init runs under a forked RNG, so it draws nothing from the caller's.
On the meta device nothing is initialised: ``to_empty`` then ``reset_parameters()``.

Activations are ``[batch, seq, hidden]``; sequence parallelism shards dim 1.

Checkpoint layout. Every layer here derives from ``ParallelLayer`` (``is_parallel_layer``) and
says itself how each tensor it stores relates to the single-process one (``shard_layouts``):
split along a dimension (and in how many blocks), replicated, or per-shard state that each rank
keeps for itself (a shard's FP8 scaling state and weight scale: neither split nor replicated).
Under the single-process names: a parallel linear's inner ``linear`` drops out of them
(``shard_child``), so ``qkv.linear.weight`` is stored as ``qkv.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp8train import device as devices
from fp8train.linear import Linear
from fp8train.precision import PrecisionRecipe
from parallel.comm_meter import CommMeter
from parallel.tensor_parallel.fp8_gather import SequenceGatherFp8

from .mappings import (
    SEQUENCE_DIM,
    all_gather,
    copy_to_region,
    gather_from_region,
    gather_from_sequence_region,
    group_rank,
    group_size,
    reduce_from_region,
    reduce_scatter_to_sequence_region,
    scatter_to_region,
)

__all__ = [
    "ColumnParallelLinear",
    "ParallelLayer",
    "RowParallelLinear",
    "ShardLayout",
    "VocabParallelEmbedding",
    "VocabParallelBias",
    "is_parallel_layer",
    "shard_from_full",
    "gather_full",
]

InitMethod = Callable[[torch.Tensor], object]


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by {d} (tensor-parallel size x blocks)")
    return n // d


def shard_from_full(full: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """This rank's slice of ``full`` along ``dim`` (a new contiguous tensor).

    ``blocks > 1``: ``dim`` is that many equal concatenated blocks, each split across the
    ranks; this rank's piece of every block is concatenated in block order.
    """
    world, rank = group_size(group), group_rank(group)
    n = _divide(full.shape[dim], world * blocks, f"dimension {dim} size")
    pieces = [b.narrow(dim, rank * n, n) for b in full.chunk(blocks, dim)]
    return torch.cat(pieces, dim).contiguous() if blocks > 1 else pieces[0].contiguous()


def _shards_to_full(x: torch.Tensor, dim: int, world: int, blocks: int) -> torch.Tensor:
    """Reorder rank-major concatenated shards ``[s_0 | s_1 | ...]`` (each ``[b_0r | b_1r]``)
    into block-major order ``[b_00 b_01 ... | b_10 b_11 ...]``; differentiable."""
    if blocks == 1 or world == 1:
        return x
    x = x.movedim(dim, 0)
    n = x.shape[0] // (world * blocks)
    x = x.reshape(world, blocks, n, *x.shape[1:]).transpose(0, 1)
    return x.reshape(world * blocks * n, *x.shape[3:]).movedim(0, dim)


@torch.no_grad()
def gather_full(shard: torch.Tensor, dim: int, group, blocks: int = 1) -> torch.Tensor:
    """Inverse of ``shard_from_full``: every rank gets the full tensor (no autograd)."""
    world = group_size(group)
    return _shards_to_full(all_gather(shard.detach(), group, dim), dim, world, blocks)


def _default_device(device) -> torch.device:
    return torch.device(device) if device is not None else torch.get_default_device()


@dataclass(frozen=True)
class ShardLayout:
    """How one stored tensor of a parallel layer relates to the single-process tensor.

    ``partition_dim``: dimension of the full tensor split across the group (None: this rank
    stores the whole tensor); ``blocks``: that dimension is so many concatenated blocks, each
    split on its own (``shard_from_full``); ``per_shard``: state of this shard alone (e.g. its
    FP8 scaling state), which no single-process tensor is made of.
    """

    partition_dim: int | None = None
    blocks: int = 1
    per_shard: bool = False

    def __post_init__(self):
        # Checkpoint metadata is written from these fields as they are: refuse nonsense.
        if self.partition_dim is None and self.blocks != 1:
            raise ValueError("ShardLayout: blocks of a tensor that is not split")
        if self.partition_dim is not None and self.per_shard:
            raise ValueError("ShardLayout: a split tensor is not per-shard state")


_REPLICATED = ShardLayout()
_PER_SHARD = ShardLayout(per_shard=True)


class ParallelLayer(nn.Module):
    """Base of the tensor-parallel layers: the one registry of them (``is_parallel_layer``)."""

    # Child module whose tensors the single-process layer holds itself (a parallel linear's
    # inner shard ``linear``): its name is dropped from the single-process tensor names.
    shard_child: str | None = None

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """Every tensor of ``state_dict()``, under its single-process name relative to this
        layer (``weight``, ``fp8_input.scale``, ...) -> its ``ShardLayout``."""
        raise NotImplementedError


class _ParallelLinear(ParallelLayer):
    """Shared body: the inner shard Linear, the bias, full-weight init and loading."""

    partition_dim: int  # dimension of the full weight that is split: 0 column, 1 row
    bias_sharded: bool
    shard_child = "linear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        in_shard: int,
        out_shard: int,
        bias_size: int,
        *,
        group,
        recipe: PrecisionRecipe | None,
        bias: bool,
        skip_bias_add: bool,
        sequence_parallel: bool,
        init_method: InitMethod | None,
        blocks: int,
        meter: CommMeter | None,
        device,
        dtype,
        skip_init: bool = False,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.group, self.world = group, group_size(group)
        self.skip_bias_add, self.sequence_parallel = skip_bias_add, sequence_parallel
        self.init_method, self.blocks, self.meter = init_method, blocks, meter
        # The shard's own init is overwritten from the full weight: build it on the CPU with a
        # forked RNG so the caller's stream is untouched (not on meta + to_empty, whose
        # empty_like on meta imports sympy, seconds per process).
        build = "meta" if str(device) == "meta" else "cpu"
        with torch.random.fork_rng(devices=[]):
            self.linear = Linear(
                in_shard, out_shard, False, recipe=recipe, device=build,
                dtype=dtype,
            )  # fmt: skip
        self.bias = (
            nn.Parameter(torch.empty(bias_size, device=build, dtype=dtype)) if bias else None
        )
        if build != "meta":
            devices.move_module(self, _default_device(device))
            if not skip_init:  # skip_init: the caller fills the shard (models.base)
                self.reset_parameters()

    @property
    def weight(self) -> nn.Parameter:
        """This rank's weight shard (the inner Linear's parameter)."""
        return self.linear.weight

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """The weight is split; the bias split (column) or replicated (row); everything
        else the inner shard Linear stores (its FP8 scaling state, a lowered weight's
        ``weight_scale_inv``) is this shard's own: a shard's amax and scale are its own."""
        out = dict.fromkeys(self.linear.state_dict(keep_vars=True), _PER_SHARD)
        blocks = self.blocks if self.partition_dim == 0 else 1
        out["weight"] = ShardLayout(self.partition_dim, blocks)
        if self.bias is not None:
            out["bias"] = ShardLayout(0, self.blocks) if self.bias_sharded else _REPLICATED
        return out

    def reset_parameters(self) -> None:
        """Full-tensor init on the CPU, keep this rank's slice; fresh FP8 scaling state."""
        full_w = torch.empty(self.out_features, self.in_features)
        full_b = None
        if self.init_method is None:  # nn.Linear's draws, in nn.Linear's order
            nn.init.kaiming_uniform_(full_w, a=math.sqrt(5))
            if self.bias is not None:
                bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
                full_b = torch.empty(self.out_features).uniform_(-bound, bound)
        else:
            self.init_method(full_w)
            if self.bias is not None:
                full_b = torch.zeros(self.out_features)
        self.load_full_(full_w, full_b)
        self.linear.reset_fp8_state()

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Copy this rank's slice of a full ``[out, in]`` weight (and ``[out]`` bias) in place."""
        if self.linear.lowered:
            raise RuntimeError("load_full_ before lower_weight_precision: the weight is lowered")
        expected = (self.out_features, self.in_features)
        if tuple(weight.shape) != expected:
            raise ValueError(f"full weight of shape {tuple(weight.shape)}, expected {expected}")
        blocks = self.blocks if self.partition_dim == 0 else 1
        self.linear.weight.copy_(shard_from_full(weight, self.partition_dim, self.group, blocks))
        if self.bias is not None:
            if bias is None:
                raise ValueError("this layer has a bias: pass the full bias too")
            b = shard_from_full(bias, 0, self.group, self.blocks) if self.bias_sharded else bias
            self.bias.copy_(b)

    def _output(self, y: torch.Tensor, bias: torch.Tensor | None):
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, "
        s += f"tp={self.world}, bias={self.bias is not None}"
        if self.sequence_parallel:
            s += ", sequence_parallel=True"
        return s


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with W split along its output rows: ``[.., in] -> [.., out/W]``.

    gather_output: all-gather the output to ``[.., out]`` (otherwise each rank keeps its shard,
    the usual case: a row-parallel layer follows).
    skip_bias_add: return ``(y, bias_shard)`` without adding it (for a fused bias-activation).
    sequence_parallel: the input is ``[b, s/W, in]``, all-gathered along the sequence forward
    (reduce-scattered backward) instead of being copied; with an FP8 recipe the gather carries
    FP8 bytes cast with a group-agreed scale (1 byte per element on the wire).
    Returns ``y``, or ``(y, bias)`` when skip_bias_add.
    """

    partition_dim = 0
    bias_sharded = True
    # Under sequence parallelism with an FP8 recipe, gather the input as FP8 bytes (fp8_gather.py)
    # rather than FP32; off only to compare the two paths.
    fp8_gather = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group,
        recipe: PrecisionRecipe | None = None,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        blocks: int = 1,
        meter: CommMeter | None = None,
        device=None,
        dtype=None,
        skip_init: bool = False,
    ):
        if gather_output and (sequence_parallel or skip_bias_add):
            raise ValueError(
                "ColumnParallelLinear: gather_output does not combine with sequence_parallel "
                "(the output would be [b, s, out], not sequence-sharded) or skip_bias_add "
                "(the returned bias would be a shard of a gathered output)"
            )
        out_shard = _divide(out_features, group_size(group) * blocks, "out_features") * blocks
        # fmt: off
        super().__init__(
            in_features, out_features, in_features, out_shard, out_shard, group=group,
            recipe=recipe, bias=bias, skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel, init_method=init_method, blocks=blocks,
            meter=meter, device=device, dtype=dtype, skip_init=skip_init,
        )
        # fmt: on
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor):
        if self.sequence_parallel and self.linear.fp8 and self.fp8_gather:
            # Cast the sequence shard to FP8 with a group-agreed scale, gather the bytes.
            comm = SequenceGatherFp8(self.group, x.shape[:-1], self.meter)
            y = self.linear(x, input_comm=comm)  # [b, s, out/W]
        else:
            if self.sequence_parallel:
                x = gather_from_sequence_region(
                    x, self.group, SEQUENCE_DIM, meter=self.meter
                )  # [b,s,in]
            else:
                x = copy_to_region(x, self.group, meter=self.meter)  # grads of x summed
            y = self.linear(x)  # [.., out/W]
        if self.gather_output:
            if self.bias is not None:
                y = y + self.bias
            y = gather_from_region(y, self.group, -1, meter=self.meter)
            return _shards_to_full(y, y.dim() - 1, self.world, self.blocks)  # [.., out]
        return self._output(y, self.bias)


class RowParallelLinear(_ParallelLinear):
    """``y = x Wᵀ + b`` with W split along its input columns: ``[.., in/W] -> [.., out]``.

    input_is_parallel: the input already is this rank's ``in/W`` slice (the output of a
    column-parallel layer); otherwise it is full and split here.
    sequence_parallel: the partial outputs are reduce-scattered along the sequence, giving
    ``[b, s/W, out]``, instead of all-reduced.
    The bias is full on every rank and added once, after the reduction. Under sequence
    parallelism each rank adds it to its own sequence slice, so its gradient is all-reduced
    over the group in backward (``copy_to_region``) and every rank holds the full gradient.
    Returns ``y``, or ``(y, bias)`` when skip_bias_add.
    """

    partition_dim = 1
    bias_sharded = False

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group,
        recipe: PrecisionRecipe | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        init_method: InitMethod | None = None,
        meter: CommMeter | None = None,
        device=None,
        dtype=None,
        skip_init: bool = False,
    ):
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        in_shard = _divide(in_features, group_size(group), "in_features")
        # fmt: off
        super().__init__(
            in_features, out_features, in_shard, out_features, out_features, group=group,
            recipe=recipe, bias=bias, skip_bias_add=skip_bias_add,
            sequence_parallel=sequence_parallel, init_method=init_method, blocks=1,
            meter=meter, device=device, dtype=dtype, skip_init=skip_init,
        )
        # fmt: on
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = scatter_to_region(x, self.group, -1, meter=self.meter)  # [.., in/W]
        y = self.linear(x)  # [.., out], a partial sum over this rank's input slice
        bias = self.bias
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_region(y, self.group, SEQUENCE_DIM, meter=self.meter)
            if bias is not None:
                bias = copy_to_region(bias, self.group, meter=self.meter)
        else:
            y = reduce_from_region(y, self.group, meter=self.meter)
        return self._output(y, bias)


class VocabParallelEmbedding(ParallelLayer):
    """``nn.Embedding`` with the vocabulary split: rank r owns rows ``[r*V/W, (r+1)*V/W)``.

    Each rank looks up the tokens it owns (others give zero rows) and the partial embeddings
    are all-reduced, or reduce-scattered along the sequence when ``sequence_parallel`` (the
    output is then ``[b, s/W, h]``). Default init: N(0, 1) on the full table, as nn.Embedding;
    ``init_method(full_weight)`` otherwise. ``num_embeddings`` must divide by W (pad the
    vocabulary, e.g. ``models.gpt.pad_vocab_size(..., tp_size=W)``).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        group,
        init_method: InitMethod | None = None,
        sequence_parallel: bool = False,
        meter: CommMeter | None = None,
        device=None,
        dtype=None,
        skip_init: bool = False,
    ):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.world = group, group_size(group)
        self.init_method, self.sequence_parallel, self.meter = init_method, sequence_parallel, meter
        per_rank = _divide(num_embeddings, self.world, "num_embeddings")
        self.vocab_start = group_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim, device=device, dtype=dtype))
        if str(device) != "meta" and not skip_init:
            self.reset_parameters()

    def shard_layouts(self) -> dict[str, ShardLayout]:
        """The table is split along the vocabulary."""
        return {"weight": ShardLayout(0)}

    def reset_parameters(self) -> None:
        full = torch.empty(self.num_embeddings, self.embedding_dim)
        if self.init_method is None:
            nn.init.normal_(full)
        else:
            self.init_method(full)
        self.load_full_(full)

    @torch.no_grad()
    def load_full_(self, weight: torch.Tensor) -> None:
        self.weight.copy_(weight[self.vocab_start : self.vocab_end])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            out = F.embedding(tokens, self.weight)
        else:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local = (tokens - self.vocab_start).masked_fill(outside, 0)
            # Zeroing the rows (not just the ids) also zeroes their gradient into row 0.
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_region(
                out, self.group, SEQUENCE_DIM, meter=self.meter
            )
        return reduce_from_region(out, self.group, meter=self.meter)  # [b, s, h]

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.world}, "
            f"vocab=[{self.vocab_start}, {self.vocab_end})"
        )


class VocabParallelBias(ParallelLayer):
    """A bias over vocabulary-parallel logits ``[.., V/W]``: this rank's slice
    ``[r*V/W, (r+1)*V/W)`` of a ``[V]`` bias (an MLM head's output bias); the whole bias
    without a group. Zero-initialised; ``shard_layouts`` says how it is split."""

    def __init__(
        self, num_embeddings: int, *, group=None, device=None, dtype=None, skip_init=False
    ):
        super().__init__()
        self.num_embeddings, self.group = num_embeddings, group
        per_rank = _divide(num_embeddings, group_size(group), "num_embeddings")
        self.bias = nn.Parameter(torch.empty(per_rank, device=device, dtype=dtype))
        if str(device) != "meta" and not skip_init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.bias)

    def shard_layouts(self) -> dict[str, ShardLayout]:
        return {"bias": ShardLayout(0)}

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits + self.bias


def is_parallel_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a tensor-parallel layer (its tensors may be shards)."""
    return isinstance(module, ParallelLayer)

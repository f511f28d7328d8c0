"""Cross entropy over vocabulary-sharded logits, without ever gathering the full vocabulary.

Rank r holds logits ``z[..., r*V/W : (r+1)*V/W]``. With ``m = max_v z`` (a MAX all-reduce of
the local maxima), ``S = sum_v exp(z_v - m)`` and the target logit ``z_t - m`` (one SUM
all-reduce of both: the target's owner contributes it, the others zero),

    loss = log S - (z_t - m)
    d loss / d z_v = softmax_v - [v == t]

so each rank's gradient is its softmax shard minus the one-hot on the rank that owns the
target (Megatron's ``_VocabParallelCrossEntropy``). The largest tensors are ``[.., V/W]``:
the shifted logits (exponentiated, then normalised in place into the saved softmax) and, in
backward, the gradient written into that same buffer. Targets equal to ``ignore_index`` give
zero loss and zero gradient, as ``F.cross_entropy``.

The arithmetic is FP32 whatever the logits' dtype; the gradient is returned in that dtype.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.comm_meter import CommMeter

from .mappings import (
    SEQUENCE_DIM,
    copy_to_region,
    gather_from_sequence_region,
    group_rank,
    group_size,
)

__all__ = ["vocab_parallel_argmax", "vocab_parallel_cross_entropy", "vocab_parallel_logits"]


def _all_reduce_(x: torch.Tensor, op, group, meter, group_name: str) -> None:
    world = group_size(group)
    if world == 1:
        return
    dist.all_reduce(x, op=op, group=group)
    if meter is not None:
        meter.record_collective("tp_all_reduce", "all_reduce", group_name, x.dtype, x.nbytes, world)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, ignore_index, meter, group_name):
        vocab_shard = logits.shape[-1]
        start = group_rank(group) * vocab_shard
        z = logits.float()
        zmax = z.detach().amax(dim=-1)  # [..]
        _all_reduce_(zmax, dist.ReduceOp.MAX, group, meter, group_name)
        shifted = z - zmax.unsqueeze(-1)  # [.., V/W], new buffer (reused below)

        local = target - start
        owned = (local >= 0) & (local < vocab_shard)
        local = local.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(~owned, 0.0)

        exp = shifted.exp_()
        # One collective for both sums: [sum of exp, target logit].
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # [2, ..]
        _all_reduce_(sums, dist.ReduceOp.SUM, group, meter, group_name)
        sum_exp, target_logit = sums[0], sums[1]

        valid = target != ignore_index
        loss = (torch.log(sum_exp) - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, owned & valid, valid)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, owned, valid = ctx.saved_tensors
        # In place on the saved softmax (Megatron's memory saving); a second backward through
        # the same graph would fail autograd's version check, never give a wrong gradient.
        grad = softmax
        grad.scatter_add_(-1, local.unsqueeze(-1), -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss.float() * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    group,
    *,
    ignore_index: int = -100,
    meter: CommMeter | None = None,
    group_name: str = "tensor",
) -> torch.Tensor:
    """Per-token loss ``[b, s]`` of logits ``[b, s, V/W]`` (this rank's vocab slice, in rank
    order) against full-vocabulary ids ``target [b, s]``. Equals
    ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), reduction="none")``
    reshaped, forward and backward. ``group=None``: a single rank holding the whole vocabulary.
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(
            f"logits {tuple(logits_shard.shape)} and target {tuple(target.shape)}: the leading "
            "dimensions must match"
        )
    return _VocabParallelCrossEntropy.apply(
        logits_shard, target, group, ignore_index, meter, group_name
    )


def vocab_parallel_logits(
    x: torch.Tensor,
    weight: torch.Tensor,
    group,
    *,
    sequence_parallel: bool = False,
    meter: CommMeter | None = None,
) -> torch.Tensor:
    """Logits shard ``[b, s, V/W]`` of a (tied) vocab-parallel output head ``weight [V/W, h]``.

    The input is copied (or, under sequence parallelism, all-gathered from ``[b, s/W, h]``) so
    its gradient sums every vocabulary shard's contribution. Feed the result to
    ``vocab_parallel_cross_entropy``; the full-vocabulary logits never exist.
    """
    if sequence_parallel:
        x = gather_from_sequence_region(x, group, SEQUENCE_DIM, meter=meter)
    else:
        x = copy_to_region(x, group, meter=meter)
    return F.linear(x, weight)


@torch.no_grad()
def vocab_parallel_argmax(
    logits: torch.Tensor, group, *, meter: CommMeter | None = None, group_name: str = "tensor"
) -> torch.Tensor:
    """The full-vocabulary argmax ``[...]`` (int64 ids) of vocab-sharded logits ``[..., V/W]``
    (this rank's slice, in rank order), without gathering them: the largest value over the
    group, then the smallest id holding it (ties resolve as on one rank). Two small
    all-reduces; ``group=None``: a plain argmax."""
    if group_size(group) == 1:
        return logits.argmax(-1)
    local_max, local_idx = logits.max(-1)
    best = local_max.clone()
    _all_reduce_(best, dist.ReduceOp.MAX, group, meter, group_name)
    start = group_rank(group) * logits.shape[-1]
    none = torch.iinfo(torch.int64).max
    ids = torch.where(local_max == best, local_idx + start, torch.full_like(local_idx, none))
    _all_reduce_(ids, dist.ReduceOp.MIN, group, meter, group_name)
    return ids

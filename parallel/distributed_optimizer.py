"""ZeRO-1 pieces: who owns which parameter, and the all-gather of updated weights.

Ownership is by whole tensors: each data-parallel rank owns a set of parameters (their master
weights and optimizer states live only there), assigned largest first to the least-loaded rank.
Whole tensors (rather than Megatron's even element ranges) are what O3 needs: an FP8 weight, its
FP16 master and its moments each carry one per-tensor scale, and a scale must never span ranks.
The same rule at every level keeps one code path; with many tensors the balance is close to even
(``ownership_balance`` reports it).

After the owners step, ``gather_params`` sends every owner's updated weights to the other ranks
in the weights' own storage (FP8 bytes at O3, scaled FP16 at O1/O2, FP32 or BF16 otherwise),
with each scaled weight's ``scale_inv`` riding along: one all-to-all of raw bytes with uneven
splits, which is an all-gather of unequal pieces on gloo and nccl alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8train.param_state import scale_inv_of

__all__ = ["assign_owners", "ownership_balance", "ParamGather"]


def assign_owners(numels: list[int], world: int, classes: list | None = None) -> list[int]:
    """Owner rank of each tensor: largest first, each to the rank with the fewest elements so
    far (ties: lowest rank). Deterministic, so every rank computes the same answer.

    ``classes`` (one hashable per tensor) balances each class on its own: the linear weights
    the precision table governs (O3: 5 bytes of master + moments per element) and the
    embeddings, norms and biases (8 bytes of FP32 moments) are each spread evenly, so every
    rank's share of the linear weights is ~1/W even when one large embedding sits on one rank.
    """
    classes = classes or [0] * len(numels)
    owners = [0] * len(numels)
    for cls in dict.fromkeys(classes):
        load = [0] * world
        members = [i for i in range(len(numels)) if classes[i] == cls]
        for i in sorted(members, key=lambda i: (-numels[i], i)):
            rank = min(range(world), key=lambda r: (load[r], r))
            owners[i] = rank
            load[rank] += numels[i]
    return owners


def ownership_balance(numels: list[int], owners: list[int], world: int) -> float:
    """Largest rank's share over the even share (1.0 = perfectly even)."""
    load = [0] * world
    for n, r in zip(numels, owners):
        load[r] += n
    total = sum(load)
    return max(load) * world / total if total else 1.0


def _short(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return "fp8" if name.startswith("float8") else {"float16": "fp16"}.get(name, name)


class ParamGather:
    """All-gather of the owners' updated parameters over the data-parallel ``group``."""

    def __init__(self, params: list[torch.nn.Parameter], owners: list[int], group, meter=None):
        self.params, self.owners, self.group, self.meter = params, owners, group, meter
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # Bytes each rank contributes: its parameters' storage, then their scale_inv values.
        self.sizes = [0] * self.world
        for p, r in zip(params, owners):
            self.sizes[r] += p.nbytes + (4 if scale_inv_of(p) is not None else 0)
        self.mine = [p for p, r in zip(params, owners) if r == self.rank]

    @torch.no_grad()
    def gather(self) -> None:
        world, rank = self.world, self.rank
        device = self.params[0].device
        payload = self._pack(self.mine, device)
        send = payload.repeat(world)  # the same piece to every rank (own copy stays local)
        recv = torch.empty(sum(self.sizes), dtype=torch.uint8, device=device)
        dist.all_to_all_single(
            recv,
            send,
            output_split_sizes=list(self.sizes),
            input_split_sizes=[payload.numel()] * world,
            group=self.group,
        )
        self._record()
        offset = 0
        for r in range(world):
            piece = recv[offset : offset + self.sizes[r]]
            offset += self.sizes[r]
            if r != rank:
                self._unpack([p for p, o in zip(self.params, self.owners) if o == r], piece)

    @staticmethod
    def _pack(params, device) -> torch.Tensor:
        parts = [p.detach().reshape(-1).view(torch.uint8) for p in params]
        scales = [scale_inv_of(p) for p in params]
        scales = [s.detach().float().reshape(1) for s in scales if s is not None]
        if scales:
            parts.append(torch.cat(scales).view(torch.uint8))
        if not parts:
            return torch.empty(0, dtype=torch.uint8, device=device)
        return torch.cat(parts)

    @staticmethod
    def _unpack(params, piece: torch.Tensor) -> None:
        offset = 0
        for p in params:
            n = p.nbytes
            p.detach().reshape(-1).view(torch.uint8).copy_(piece[offset : offset + n])
            offset += n
        scaled = [p for p in params if scale_inv_of(p) is not None]
        if scaled:
            values = piece[offset : offset + 4 * len(scaled)].view(torch.float32)
            for p, value in zip(scaled, values):
                scale_inv_of(p).copy_(value)

    def _record(self) -> None:
        if self.meter is None:
            return
        # One name per storage dtype (all_gather_params_fp8, ..._fp16, ..._float32), each
        # weight's scale_inv metered as its overhead: bytes per element reads straight off.
        others = self.world - 1
        for p in self.mine:
            name = "all_gather_params_" + _short(p.dtype)
            self.meter.record(name, "data", p.dtype, others * p.nbytes, others * p.numel())
            if scale_inv_of(p) is not None:
                self.meter.record(name, "data", torch.float32, others * 4, elements=0)

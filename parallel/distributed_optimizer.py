"""ZeRO-1 pieces: who owns which parameter, and the all-gather of updated weights.

Ownership is by whole tensors: each data-parallel rank owns a set of parameters (their master
weights and optimizer states live only there), assigned largest first to the least-loaded rank.
Whole tensors (rather than Megatron's even element ranges) are what O3 needs: an FP8 weight, its
FP16 master and its moments each carry one per-tensor scale, and a scale must never span ranks.
The same rule at every level keeps one code path; with many tensors the balance is close to even
(``ownership_balance`` reports it).

After the owners step, ``ParamGather`` sends every owner's updated weights to the other ranks
in the weights' own storage (FP8 bytes at O3, scaled FP16 at O1/O2, FP32 or BF16 otherwise),
with each scaled weight's ``scale_inv`` riding along: one broadcast per owner of its packed
piece, into one reused buffer of the largest piece. That is an all-gather of unequal pieces on
gloo and nccl alike whose only temporary is ~1/W of the weights (an all-to-all would hold the
whole gathered model once more, and its send buffer W copies of the rank's own piece).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8train.param_state import scale_inv_of

from .comm_meter import wire_bytes

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


def _scale_count(p: torch.Tensor) -> int:
    """FP32 scale values that travel with ``p``: 0, 1 (per tensor) or its block grid's."""
    scale = scale_inv_of(p)
    return 0 if scale is None else scale.numel()


def _short(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    return "fp8" if name.startswith("float8") else {"float16": "fp16"}.get(name, name)


class ParamGather:
    """All-gather of the owners' updated parameters over the data-parallel ``group``."""

    def __init__(self, params: list[torch.nn.Parameter], owners: list[int], group, meter=None):
        self.params, self.owners, self.group, self.meter = params, owners, group, meter
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        # Bytes each rank contributes: its parameters' scale_inv values (one per tensor, or a
        # block grid), then their storage.
        self.sizes = [0] * self.world
        for p, r in zip(params, owners):
            self.sizes[r] += p.nbytes + 4 * _scale_count(p)
        self.of_rank = [[p for p, o in zip(params, owners) if o == r] for r in range(self.world)]
        self.mine = self.of_rank[self.rank]

    @torch.no_grad()
    def gather(self) -> None:
        largest = max(self.sizes, default=0)
        if largest == 0:
            return
        buffer = torch.empty(largest, dtype=torch.uint8, device=self.params[0].device)
        for r in range(self.world):
            piece = buffer[: self.sizes[r]]
            if piece.numel() == 0:
                continue
            if r == self.rank:
                self._pack(self.mine, piece)
            dist.broadcast(piece, group=self.group, group_src=r)
            if r != self.rank:
                self._unpack(self.of_rank[r], piece)
        self._record()

    @staticmethod
    def _pack(params, out: torch.Tensor) -> None:
        """``params``' scale_inv values, then their bytes, into ``out`` (their exact size).
        The scales go first: at the start of the buffer they are aligned for FP32."""
        scales = [scale_inv_of(p) for p in params]
        parts = [s.detach().float().reshape(-1).view(torch.uint8) for s in scales if s is not None]
        parts += [p.detach().reshape(-1).view(torch.uint8) for p in params]
        torch.cat(parts, out=out)

    @staticmethod
    def _unpack(params, piece: torch.Tensor) -> None:
        offset = 0
        for p in params:
            n = 4 * _scale_count(p)
            if n:
                scale = scale_inv_of(p)
                scale.copy_(piece[offset : offset + n].view(torch.float32).view(scale.shape))
                offset += n
        for p in params:
            n = p.nbytes
            p.detach().reshape(-1).view(torch.uint8).copy_(piece[offset : offset + n])
            offset += n

    def _record(self) -> None:
        if self.meter is None:
            return
        # Every rank sends (W-1)/W of each owner's piece (the broadcast byte model), under
        # one name per storage dtype (all_gather_params_fp8, ..._fp16, ..._float32), each
        # weight's scale_inv metered as its overhead: bytes per element reads straight off.
        world = self.world
        for params in self.of_rank:
            by_dtype: dict[torch.dtype, list[int]] = {}
            for p in params:
                counts = by_dtype.setdefault(p.dtype, [0, 0, 0])  # bytes, elements, scales
                counts[0] += p.nbytes
                counts[1] += p.numel()
                counts[2] += _scale_count(p)
            for dtype, (nbytes, numel, scales) in by_dtype.items():
                name = "all_gather_params_" + _short(dtype)
                self.meter.record(
                    name, "data", dtype, wire_bytes("broadcast", nbytes, world),
                    wire_bytes("broadcast", numel, world),
                )  # fmt: skip
                if scales:
                    sent = wire_bytes("broadcast", 4 * scales, world)
                    self.meter.record(name, "data", torch.float32, sent, elements=0)

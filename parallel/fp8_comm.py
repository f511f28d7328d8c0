"""Data-parallel averaging of FP8 weight gradients: 1 byte per element on the wire, one rounding.

MS-AMP all-reduces FP8 gradients through a patched NCCL that re-quantises the partial sum at
every ring hop, so the error grows with the number of ranks and the patch pins NCCL. Here the
bytes travel through standard collectives (as ``uint8``: gloo has no FP8 dtype) and the sum is
done in FP32 by the rank that owns each element:

1. Metadata: one all-gather of every rank's ``(scale_inv, amax)`` per scale unit (8 bytes per
   tensor, or per block of a block-scaled slot: row/block FP8 granularity; metered as overhead
   of ``reduce_scatter_fp8``).
   The max over ranks of ``amax`` bounds ``|mean|``, so it fixes the output scale before any
   data moves; a non-finite amax anywhere makes the tensor's result amax inf (the step's
   overflow check reads it). NaN is turned into inf first: a MAX that ignores NaN would hide it.
2. Reduce-scatter as all-to-all: all slots' FP8 bytes are flattened into one buffer padded to a
   multiple of W, and rank r receives chunk r from every rank.
3. Rank r decodes each received piece with the *sender's* ``scale_inv`` of its unit (no
   re-quantisation before sending), sums in FP32 and divides by W: the average of the ranks'
   FP8 gradients, exact up to FP32 rounding (``reduce_scatter_fp8`` returns this chunk).
4. The owned chunk is cast to E4M3 with the shared scale of each unit (the single FP8 rounding
   of the whole reduction) and all-gathered as ``uint8``; every rank assigns identical slots.

Wire bytes per gradient element (see ``comm_meter``): ``2 (W-1)/W`` plus padding and
``8 U (W-1) / N`` of metadata (U scale units: one per tensor, or one per 16384 elements at
128x128 blocks), i.e. ~1.0 at W=2 and ~1.5 at W=4 (an FP32 ring all-reduce: 4 and 6).

Only standard collectives and tensor-derived devices: the same code runs on gloo and nccl.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import torch.distributed as dist

from fp8train.formats import FP8Format, cast_to_fp8
from fp8train.low_precision import Fp8GradSlot
from fp8train.scaling import compute_scale

from .collective_paths import all_gather_single
from .comm_meter import CommMeter, wire_bytes

__all__ = [
    "Fp8ReduceScatter",
    "PendingFp8ReduceScatter",
    "launch_reduce_scatter_fp8",
    "reduce_scatter_fp8",
    "cast_owned_chunk",
    "finish_allreduce_fp8",
    "allreduce_fp8_grads",
    "allreduce_fp32_grads",
]


# A slot as the layout sees it: (elements, rows, columns, block rows, block columns); block
# (0, 0) for a slot with one scale. Hashable, so layouts are cached by their slots' specs.
SlotSpec = tuple[int, int, int, int, int]


def _spec(slot: Fp8GradSlot) -> SlotSpec:
    if slot.block is None:
        return (slot.data.numel(), 0, 0, 0, 0)
    rows, cols = slot.data.shape
    return (rows * cols, rows, cols, *slot.block)


def _runs(specs: tuple[SlotSpec, ...]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """The flat buffer as runs of elements that share one scale: (scale unit of each run, its
    length) and each slot's first unit (T + 1 offsets). A slot with one scale is one run; a
    block-scaled [R, C] slot is, row by row, one run per block column (row-major order)."""
    ids, lengths, units = [], [], [0]
    for n, rows, cols, br, bc in specs:
        base = units[-1]
        if br == 0:
            ids.append(np.array([base]))
            lengths.append(np.array([n]))
            units.append(base + 1)
            continue
        rb, cb = -(-rows // br), -(-cols // bc)
        row = np.full(cb, bc)
        row[-1] = cols - (cb - 1) * bc
        ids.append((base + (np.arange(rows) // br)[:, None] * cb + np.arange(cb)).reshape(-1))
        lengths.append(np.tile(row, rows))
        units.append(base + rb * cb)
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate(ids or [empty]), np.concatenate(lengths or [empty]), units


@dataclass
class _Layout:
    """Where each slot sits in the flat padded buffer, and which elements rank ``rank`` owns.

    Scales come per unit: a slot with one scale is one unit, a block-scaled slot one unit per
    block (``unit_offsets``: each slot's first unit, T + 1 entries, U units in all). The owned
    chunk ``[start, start + chunk)`` is described as segments: ``seg_ids[k]`` is the unit of
    segment k (``U`` for padding) and ``seg_lengths[k]`` its element count, so a per-unit vector
    expands to per-element with one ``repeat_interleave``.
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # T + 1 entries, offsets[-1] = total
    unit_offsets: tuple[int, ...]  # T + 1 entries, unit_offsets[-1] = U
    padded: int
    chunk: int
    start: int
    splits: tuple[int, ...]  # elements of the flat buffer going to each rank
    seg_ids: torch.Tensor  # int64 [S] (CPU master copy)
    seg_lengths: torch.Tensor  # int64 [S]
    _on_device: dict = field(default_factory=dict, repr=False)

    @property
    def total(self) -> int:
        return self.offsets[-1]

    @property
    def units(self) -> int:
        return self.unit_offsets[-1]

    def segments(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._on_device:
            self._on_device[device] = (self.seg_ids.to(device), self.seg_lengths.to(device))
        return self._on_device[device]

    def per_element(self, per_unit: torch.Tensor) -> torch.Tensor:
        """``per_unit`` [..., U+1] -> [..., chunk]: each owned element gets its unit's value."""
        ids, lengths = self.segments(per_unit.device)
        # output_size avoids a device->host sync on CUDA.
        return per_unit[..., ids].repeat_interleave(lengths, dim=-1, output_size=self.chunk)


@lru_cache(maxsize=256)
def _layout(
    specs: tuple[SlotSpec, ...], world: int, rank: int, bounds: tuple[int, ...] | None = None
) -> _Layout:
    """Equal chunks of the padded buffer by default; ``bounds`` (W+1 offsets, ending at the
    total) gives each rank its own range instead, e.g. whole tensors per owner."""
    numels = tuple(spec[0] for spec in specs)
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    total = offsets[-1]
    if bounds is None:
        chunk = -(-total // world)  # ceil
        padded = chunk * world
        splits = (chunk,) * world
    else:
        if len(bounds) != world + 1 or bounds[0] != 0 or bounds[-1] != total:
            raise ValueError(f"bounds {bounds} must be {world + 1} offsets from 0 to {total}")
        splits = tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        chunk, padded = splits[rank], total
    start = sum(splits[:rank])
    end = start + chunk
    # The runs that overlap [start, end), cut to it (numpy: real values even when the step
    # runs on fake tensors, as the planner does).
    run_ids, run_lengths, units = _runs(specs)
    run_starts = np.cumsum(run_lengths) - run_lengths
    lo = np.maximum(run_starts, start)
    hi = np.minimum(run_starts + run_lengths, end)
    keep = hi > lo
    ids, lengths = run_ids[keep].tolist(), (hi - lo)[keep].tolist()
    if end > max(start, total):
        ids.append(units[-1])  # padding
        lengths.append(end - max(start, total))
    return _Layout(
        numels=numels,
        offsets=tuple(offsets),
        unit_offsets=tuple(units),
        padded=padded,
        chunk=chunk,
        start=start,
        splits=splits,
        seg_ids=torch.tensor(ids, dtype=torch.int64),
        seg_lengths=torch.tensor(lengths, dtype=torch.int64),
    )


@dataclass
class Fp8ReduceScatter:
    """Result of the reduce-scatter half: this rank's FP32 average and the shared metadata.

    ``chunk`` holds flat elements ``[start, start + len(chunk))`` of the concatenation of all
    slots (row-major, in list order, zero padding at the end). ``amax`` [U] is the max over
    ranks (inf where any rank had inf/NaN) and ``found_inf`` a 0-d bool tensor.
    """

    chunk: torch.Tensor
    start: int
    amax: torch.Tensor
    found_inf: torch.Tensor
    fmt: FP8Format
    layout: _Layout


def _check_slots(slots: list[Fp8GradSlot]) -> FP8Format:
    fmt = slots[0].fmt
    device = slots[0].data.device
    for s in slots:
        if s.fmt != fmt or s.data.dtype != fmt.dtype:
            raise ValueError(f"all slots must share one FP8 format: {s.fmt} vs {fmt}")
        if s.data.device != device:
            raise ValueError(f"all slots must live on one device: {s.data.device} vs {device}")
    return fmt


def _local_amax(slots: list[Fp8GradSlot]) -> torch.Tensor:
    """Every slot's amax, one per scale unit [U]."""
    amax = torch.cat([s.amax.detach().float().reshape(-1) for s in slots])
    # NaN -> inf before any max: some backends' MAX (and a max that skips NaN) would hide it.
    return torch.where(torch.isnan(amax), torch.full_like(amax, float("inf")), amax)


class PendingFp8ReduceScatter:
    """A launched FP8 reduce-scatter: its two collectives are in flight; ``finish`` waits for
    them and does the FP32 decode and sum (step 3)."""

    def __init__(self, works, meta, recv, world, units, fmt, layout):
        self._works, self._meta, self._recv = works, meta, recv
        self._world, self._units, self.fmt, self.layout = world, units, fmt, layout

    def finish(self) -> Fp8ReduceScatter:
        for work in self._works:
            work.wait()
        world, u, layout = self._world, self._units, self.layout
        meta = self._meta.view(world, 2 * u)
        scale_inv_all = meta[:, :u]  # [W, U] each sender's own scale_inv
        amax = meta[:, u:].amax(dim=0)  # [U]; NaN already inf on every sender
        found_inf = ~torch.isfinite(amax).all()
        # 3. Decode with each sender's scale (padding gets scale 0), sum in FP32, divide by W.
        pad = torch.zeros(world, 1, dtype=torch.float32, device=meta.device)
        table = torch.cat([scale_inv_all, pad], dim=1)  # [W, U+1]
        pieces = self._recv.view(world, layout.chunk).view(self.fmt.dtype)
        # One sender at a time keeps the temporaries at O(chunk), not O(W * chunk); the fixed
        # rank order makes the FP32 sum deterministic.
        chunk = pieces[0].float() * layout.per_element(table[0])
        for src in range(1, world):
            chunk.add_(pieces[src].float() * layout.per_element(table[src]))
        chunk.div_(world)
        return Fp8ReduceScatter(chunk, layout.start, amax, found_inf, self.fmt, layout)


def launch_reduce_scatter_fp8(
    slots: list[Fp8GradSlot],
    group: dist.ProcessGroup,
    meter: CommMeter | None = None,
    group_name: str = "data",
    flat: torch.Tensor | None = None,
    bounds: tuple[int, ...] | None = None,
) -> PendingFp8ReduceScatter:
    """Steps 1-2 of the module docstring, asynchronously: metadata all-gather and FP8 all-to-all.

    ``flat``: the slots' bytes already laid out contiguously (uint8, the slots' data in order,
    then zero padding up to the layout's size), e.g. a gradient bucket whose slots are views
    into it: sent as is, no copy. ``bounds``: each rank's range of the flat buffer (see
    ``_layout``); default equal chunks. The slots must not change until ``finish``.
    """
    fmt = _check_slots(slots)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    device = slots[0].data.device
    layout = _layout(tuple(_spec(s) for s in slots), world, rank, bounds)
    units = layout.units

    # 1. Metadata: [scale_inv (U) | amax (U)] from every rank in one small collective, one
    # value per scale unit (a slot, or a block of a block-scaled slot).
    scales = torch.cat([s.scale_inv.detach().float().reshape(-1) for s in slots])
    local_meta = torch.cat([scales, _local_amax(slots)])
    # Flat output: gloo accepts only the concatenated form, not [W, 2U].
    meta = torch.empty(world * 2 * units, dtype=torch.float32, device=device)
    works = [all_gather_single(meta, local_meta, group=group, async_op=True)]
    if meter is not None:  # the scales are this collective's overhead: bytes, no elements
        meter.record(
            "reduce_scatter_fp8",
            group_name,
            torch.float32,
            wire_bytes("all_gather", meta.nbytes, world),
            elements=0,
        )

    # 2. Reduce-scatter as all-to-all on the raw bytes.
    if flat is None:
        send = torch.zeros(layout.padded, dtype=torch.uint8, device=device)
        if layout.total:
            torch.cat(
                [s.data.reshape(-1).view(torch.uint8) for s in slots], out=send[: layout.total]
            )
    else:
        if flat.numel() != layout.padded or flat.dtype != torch.uint8:
            raise ValueError(f"flat buffer must be {layout.padded} uint8, got {flat.numel()}")
        send = flat
    recv = torch.zeros(world * layout.chunk, dtype=torch.uint8, device=device)
    if layout.total:  # all slots empty: nothing to move
        works.append(
            dist.all_to_all_single(
                recv,
                send,
                output_split_sizes=[layout.chunk] * world,
                input_split_sizes=list(layout.splits),
                group=group,
                async_op=True,
            )
        )
    if meter is not None:
        sent = sum(n for r, n in enumerate(layout.splits) if r != rank)
        meter.record("reduce_scatter_fp8", group_name, torch.uint8, sent)
    return PendingFp8ReduceScatter(works, meta, recv, world, units, fmt, layout)


def reduce_scatter_fp8(
    slots: list[Fp8GradSlot],
    group: dist.ProcessGroup,
    meter: CommMeter | None = None,
    group_name: str = "data",
    bounds: tuple[int, ...] | None = None,
) -> Fp8ReduceScatter:
    """Steps 1-3 of the module docstring: metadata all-gather, FP8 all-to-all, FP32 sum / W."""
    return launch_reduce_scatter_fp8(slots, group, meter, group_name, bounds=bounds).finish()


def cast_owned_chunk(rs: Fp8ReduceScatter) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4's single rounding: ``(owned chunk in E4M3, scale per unit [U])``, the scale
    from the max-over-ranks amax, so every rank's chunk of a tensor (or block) uses the same
    one."""
    scale = compute_scale(rs.amax, rs.fmt)  # [U]; 1.0 where amax is 0 or non-finite
    one = torch.ones(1, dtype=torch.float32, device=scale.device)
    owned = cast_to_fp8(rs.chunk, rs.fmt, rs.layout.per_element(torch.cat([scale, one])))
    return owned, scale


def finish_allreduce_fp8(
    slots: list[Fp8GradSlot],
    rs: Fp8ReduceScatter,
    group: dist.ProcessGroup,
    meter: CommMeter | None = None,
    group_name: str = "data",
) -> torch.Tensor:
    """Step 4 after a reduce-scatter with equal chunks: round once, all-gather, assign."""
    world = dist.get_world_size(group)
    layout = rs.layout
    owned, scale = cast_owned_chunk(rs)
    gathered = torch.zeros(layout.padded, dtype=torch.uint8, device=owned.device)
    if layout.total:
        all_gather_single(gathered, owned.view(torch.uint8), group=group)
    if meter is not None:
        meter.record_collective(
            "all_gather_fp8", "all_gather", group_name, torch.uint8, gathered.nbytes, world
        )
    scale_inv = 1.0 / scale
    data = gathered.view(rs.fmt.dtype)
    for i, s in enumerate(slots):
        lo, hi = layout.offsets[i], layout.offsets[i + 1]
        u0, u1 = layout.unit_offsets[i], layout.unit_offsets[i + 1]
        grid = s.scale_inv.shape
        s.assign(
            data[lo:hi].view(s.data.shape), scale_inv[u0:u1].view(grid), rs.amax[u0:u1].view(grid)
        )
    return rs.found_inf


def allreduce_fp8_grads(
    slots: list[Fp8GradSlot],
    group: dist.ProcessGroup | None,
    meter: CommMeter | None = None,
    group_name: str = "data",
) -> torch.Tensor:
    """Average FP8 weight gradients over ``group`` in place; returns ``found_inf`` (0-d bool).

    Every rank ends with identical ``data``/``scale_inv``/``amax`` in each slot: the E4M3
    rounding of the exact (FP32) average with a scale from the max-over-ranks amax. ``amax`` is
    that max (an upper bound of the average's magnitude), inf where any rank overflowed.
    ``group=None`` (a single data-parallel rank) leaves the slots untouched.
    """
    if not slots:
        return torch.zeros((), dtype=torch.bool)
    if group is None or dist.get_world_size(group) == 1:
        return ~torch.isfinite(_local_amax(slots)).all()
    rs = reduce_scatter_fp8(slots, group, meter, group_name)
    return finish_allreduce_fp8(slots, rs, group, meter, group_name)


def allreduce_fp32_grads(
    tensors: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    meter: CommMeter | None = None,
    group_name: str = "data",
) -> None:
    """Average high-precision gradients (embeddings, norms, biases) over ``group`` in place.

    One flat FP32 all-reduce (fewer collectives; FP32 sums whatever dtype the tensors hold),
    then SUM / W. ``group=None`` is a no-op.
    """
    if group is None or not tensors:
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if meter is not None:
        meter.record_collective(
            "all_reduce_fp32", "all_reduce", group_name, torch.float32, flat.nbytes, world
        )
    flat.div_(world)
    offset = 0
    for g in tensors:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n

"""Contiguous gradient buffers, reduced over the data-parallel group bucket by bucket as
backward produces them (Megatron's DDP with ``overlap_grad_reduce``).

Storage follows the level's weight-gradient column: one flat FP32 buffer for the high-precision
gradients (every parameter's ``main_grad``, its ``fp8train.param_state.grad_slot``, is a view
into it; a post-accumulate hook adds each micro-batch's ``.grad`` there and frees it, so BF16
gradients also accumulate in FP32), and one flat FP8 buffer for the O1-O3 weight-gradient
slots with a region of FP32 ``scale_inv`` and ``amax`` values, one per parameter, or one per
block of a block-scaled slot (each ``Fp8GradSlot`` is bound to views of them).

Buckets: parameters are taken in reverse registration order (roughly the order backward
finishes them) and grouped per dtype into buckets of at least ``bucket_size`` elements. A
parameter is ready once its gradient has been accumulated for all ``n_micro`` micro-batches of
the step (counted by the hooks, so it works for any pipeline schedule and sends nothing before
the last micro-batch). When every parameter of a bucket is ready, that bucket's collective is
launched asynchronously, while backward carries on with earlier layers. Buckets launch in a
fixed order on every rank (a ready bucket waits for its predecessors), as collectives on one
group must be issued in the same order everywhere. ``finish`` launches whatever is left, waits
for everything and completes the reduction before the optimizer step.

Without a distributed optimizer each bucket is averaged everywhere (FP32: all-reduce; FP8: the
exact-sum reduce-scatter of ``fp8_comm`` plus an FP8 all-gather). With one (``owners`` given),
a bucket's parameters are ordered by owner and only reduce-scattered: each rank ends with the
average of the parameters it owns (FP8 rounded once, with the max-over-ranks amax), and the
other parameters' gradients are left stale and unused. The FP32 reduce-scatter is nccl's own,
in place in the buffer (uneven owner ranges: one grouped reduce per owner); on gloo it is an
all-to-all plus a rank-order FP32 sum, which is deterministic but receives W copies of the
rank's range (``parallel/collective_paths.py``).

Parameters in ``held`` (the tied embedding copied on two pipeline stages) get their own bucket
that ``finish`` reduces last, after a caller's hook (the sum over the two stages) has run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fp8train.param_state import fp8_grad_slot, grad_slot, set_grad_slot

from .collective_paths import native_reduce_scatter, reduce_scatter_single
from .fp8_comm import (
    cast_owned_chunk,
    finish_allreduce_fp8,
    launch_reduce_scatter_fp8,
)

__all__ = ["GradBuffers", "default_bucket_size"]


def default_bucket_size(data_parallel: int) -> int:
    """Megatron's default: max(40M, 1M x data-parallel size) elements."""
    return max(40_000_000, 1_000_000 * data_parallel)


@dataclass
class _Bucket:
    index: int
    fp8: bool
    params: list  # in storage order
    offset: int  # into the kind's flat buffer
    padded: int  # elements, including padding
    bounds: tuple[int, ...] | None  # owner ranges within the bucket (distributed optimizer)
    held: bool = False
    slot_base: int = 0  # the bucket's first scale unit in the scale / amax regions
    own: tuple[int, int] = (0, 0)  # this rank's params within the bucket (distributed opt.)
    ready: int = 0
    pending: object = None
    launched: bool = False
    slots: list = field(default_factory=list)


class GradBuffers:
    """Gradient storage and data-parallel reduction for ``params`` (one model replica's).

    ``group``: the data-parallel group (None: one replica, nothing to reduce). ``owners``: the
    distributed optimizer's owner rank per parameter (None: plain data parallelism).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group=None,
        *,
        bucket_size: int = 40_000_000,
        owners: list[int] | None = None,
        overlap: bool = True,
        held: set[int] = frozenset(),
        meter=None,
        group_name: str = "data",
        native: bool | None = None,
    ):
        self.params, self.group, self.meter, self.group_name = params, group, meter, group_name
        self.world = 1 if group is None else dist.get_world_size(group)
        # The distributed optimizer's FP32 reduce-scatter: the backend's own, in place (nccl;
        # ``native`` forces a choice), or gloo's deterministic all-to-all plus rank-order sum.
        self.native = (
            group is not None and native_reduce_scatter(group) if native is None else native
        )
        self.rank = 0 if group is None else dist.get_rank(group)
        self.overlap = overlap and self.world > 1
        self.owners = owners
        self.n_micro = 1
        self.launch_log: list[tuple[int, int]] = []  # (bucket, params still not ready) per launch
        device = params[0].device if params else torch.device("cpu")
        self._count: dict[int, int] = {}
        self._final = 0  # parameters whose gradient is final this step
        self._bucket_of: dict[int, _Bucket] = {}
        self.buckets: list[_Bucket] = []
        self._plan(bucket_size, held)
        self._n_params = sum(len(b.params) for b in self.buckets)
        self._allocate(device)
        self._next = 0  # first bucket not launched yet (launch order is fixed)

    # -- construction -------------------------------------------------------------------------
    def _plan(self, bucket_size: int, held: set[int]) -> None:
        index_of = {id(p): i for i, p in enumerate(self.params)}
        open_: dict[bool, list] = {False: [], True: []}
        sizes = {False: 0, True: 0}
        offsets = {False: 0, True: 0}
        groups: list[tuple[bool, list, bool]] = []
        for p in reversed(self.params):
            if id(p) in held:
                continue
            fp8 = fp8_grad_slot(p) is not None
            open_[fp8].append(p)
            sizes[fp8] += p.numel()
            if sizes[fp8] >= bucket_size:
                groups.append((fp8, open_[fp8], False))
                open_[fp8], sizes[fp8] = [], 0
        for fp8 in (False, True):
            if open_[fp8]:
                groups.append((fp8, open_[fp8], False))
        # Launch order = the order buckets are expected to fill: by the last-reached member
        # (backward reaches parameters roughly in reverse registration order).
        position = {id(p): k for k, p in enumerate(reversed(self.params))}
        groups.sort(key=lambda g: max(position[id(p)] for p in g[1]))
        held_params = [p for p in self.params if id(p) in held]
        if held_params:
            groups.append((False, held_params, True))
        for fp8, members, is_held in groups:
            bounds, own = None, (0, len(members))
            if self.owners is not None:
                members = sorted(members, key=lambda p: self.owners[index_of[id(p)]])
                ranks = [self.owners[index_of[id(p)]] for p in members]
                first = sum(ranks.count(r) for r in range(self.rank))
                own = (first, first + ranks.count(self.rank))
                per_rank = [0] * self.world
                for p, r in zip(members, ranks):
                    per_rank[r] += p.numel()
                bounds = tuple(sum(per_rank[:r]) for r in range(self.world + 1))
                padded = bounds[-1]
            else:
                total = sum(p.numel() for p in members)
                padded = -(-total // self.world) * self.world
            bucket = _Bucket(
                len(self.buckets), fp8, members, offsets[fp8], padded, bounds, held=is_held,
                own=own,
            )  # fmt: skip
            offsets[fp8] += padded
            self.buckets.append(bucket)
            for p in members:
                self._bucket_of[id(p)] = bucket
        self._sizes = offsets

    def _allocate(self, device) -> None:
        self.fp32 = torch.zeros(self._sizes[False], dtype=torch.float32, device=device)
        self.fp8 = torch.zeros(self._sizes[True], dtype=torch.uint8, device=device)
        # One scale and one amax per unit: a slot, or each block of a block-scaled slot.
        n_units = sum(fp8_grad_slot(p).units for b in self.buckets if b.fp8 for p in b.params)
        self.scale_inv = torch.ones(n_units, dtype=torch.float32, device=device)
        self.amax = torch.zeros(n_units, dtype=torch.float32, device=device)
        unit = 0
        for bucket in self.buckets:
            offset = bucket.offset
            bucket.slot_base = unit
            for p in bucket.params:
                n = p.numel()
                if bucket.fp8:
                    slot = fp8_grad_slot(p)
                    view = self.fp8[offset : offset + n].view(slot.fmt.dtype).view(p.shape)
                    grid, k = slot.scale_inv.shape, slot.units
                    scale_inv = self.scale_inv[unit : unit + k].view(grid)
                    slot.bind(view, scale_inv, self.amax[unit : unit + k].view(grid))
                    slot.on_accumulate = self._hook_for(p)
                    bucket.slots.append(slot)
                    unit += k
                else:
                    set_grad_slot(p, self.fp32[offset : offset + n].view(p.shape))
                    p.register_post_accumulate_grad_hook(_accumulate_then(self._hook_for(p)))
                offset += n

    def _hook_for(self, p) -> Callable[[], None]:
        key = id(p)

        def ready() -> None:
            self._count[key] = self._count.get(key, 0) + 1
            if self._count[key] == self.n_micro:
                self._final += 1
                bucket = self._bucket_of[key]
                bucket.ready += 1
                if self.overlap and bucket.ready == len(bucket.params):
                    self._launch_ready()

        return ready

    # -- a step -------------------------------------------------------------------------------
    def start_step(self, n_micro: int) -> None:
        """Call before the step's first forward: ``n_micro`` accumulations make a gradient."""
        self.n_micro = n_micro
        self._count.clear()
        self._final = 0
        for bucket in self.buckets:
            bucket.ready, bucket.pending, bucket.launched = 0, None, False
        self._next = 0
        self.launch_log.clear()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets):
            bucket = self.buckets[self._next]
            if bucket.held or bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        # Counted, not rescanned: this runs inside backward.
        self.launch_log.append((bucket.index, self._n_params - self._final))
        bucket.launched = True
        self._next = bucket.index + 1
        if self.world == 1:
            return
        if bucket.fp8:
            flat = self.fp8[bucket.offset : bucket.offset + bucket.padded]
            bucket.pending = launch_reduce_scatter_fp8(
                bucket.slots, self.group, self.meter, self.group_name, flat=flat,
                bounds=bucket.bounds,
            )  # fmt: skip
            return
        flat = self.fp32[bucket.offset : bucket.offset + bucket.padded]
        if bucket.bounds is None:
            bucket.pending = dist.all_reduce(flat, group=self.group, async_op=True)
            if self.meter is not None:
                self.meter.record_collective(
                    "all_reduce_fp32", "all_reduce", self.group_name, torch.float32,
                    flat.nbytes, self.world,
                )  # fmt: skip
            return
        splits = [b - a for a, b in zip(bucket.bounds[:-1], bucket.bounds[1:])]
        lo = bucket.bounds[self.rank]
        own = flat[lo : lo + splits[self.rank]]
        if self.native:
            # In place, no receive buffer: equal splits are one reduce-scatter (nccl's in-place
            # form, output at the rank's offset of the input); uneven ones a reduce per owner,
            # grouped by torch.
            if len(set(splits)) == 1:
                work = reduce_scatter_single(own, flat, group=self.group, async_op=True)
            else:
                pieces = list(flat.split(splits))
                work = dist.reduce_scatter(own, pieces, group=self.group, async_op=True)
            bucket.pending = (work, None)
        else:
            recv = torch.empty(self.world * splits[self.rank], dtype=flat.dtype, device=flat.device)
            work = dist.all_to_all_single(
                recv, flat, output_split_sizes=[splits[self.rank]] * self.world,
                input_split_sizes=splits, group=self.group, async_op=True,
            )  # fmt: skip
            bucket.pending = (work, recv)
        if self.meter is not None:
            sent = sum(n for r, n in enumerate(splits) if r != self.rank)
            self.meter.record("reduce_scatter_fp32", self.group_name, torch.float32, 4 * sent)

    def _complete(self, bucket: _Bucket) -> None:
        if self.world == 1:
            return
        if bucket.fp8:
            rs = bucket.pending.finish()
            bucket.pending = None  # its receive buffers go now, not at the next step
            if bucket.bounds is None:
                finish_allreduce_fp8(bucket.slots, rs, self.group, self.meter, self.group_name)
                return
            owned, scale = cast_owned_chunk(rs)  # the one E4M3 rounding, shared scale
            lo = bucket.offset + rs.start
            self.fp8[lo : lo + owned.numel()].copy_(owned.view(torch.uint8))
            # Owned slots get the shared scales and the max-over-ranks amaxes; the others keep
            # their local (unreduced, unused) contents, consistent with their bytes.
            i, j = (rs.layout.unit_offsets[k] for k in bucket.own)
            base = bucket.slot_base
            self.scale_inv[base + i : base + j].copy_(1.0 / scale[i:j])
            self.amax[base + i : base + j].copy_(rs.amax[i:j])
            return
        flat = self.fp32[bucket.offset : bucket.offset + bucket.padded]
        if bucket.bounds is None:
            bucket.pending.wait()
            flat.div_(self.world)
            return
        work, recv = bucket.pending
        bucket.pending = None  # the receive buffer goes with ``recv``, not at the next step
        work.wait()
        lo, hi = bucket.bounds[self.rank], bucket.bounds[self.rank + 1]
        if recv is None:  # reduced in place
            flat[lo:hi].div_(self.world)
            return
        flat[lo:hi].copy_(recv.view(self.world, -1).sum(dim=0).div_(self.world))

    def finish(self, before_held: Callable[[], None] | None = None) -> None:
        """Complete the step's reduction: launch what is left (in order), wait for it all; then
        ``before_held`` and the held-back buckets."""
        regular = [b for b in self.buckets if not b.held]
        for bucket in regular:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in regular:
            self._complete(bucket)
        if before_held is not None:
            before_held()
        for bucket in self.buckets:
            if bucket.held:
                self._launch(bucket)
                self._complete(bucket)

    def zero_(self) -> None:
        self.fp32.zero_()
        for bucket in self.buckets:
            for slot in bucket.slots:
                slot.zero_()


def _accumulate_then(ready: Callable[[], None]):
    def hook(param: torch.nn.Parameter) -> None:
        grad_slot(param).add_(param.grad)
        param.grad = None
        ready()

    return hook

"""Run a schedule's op list on one pipeline rank: point-to-point exchange and autograd.

Sends are eager (``isend`` the moment an output or input gradient exists) and receives block
until the op needing them runs. Any schedule that completes in lock-step also completes this way,
and ``schedules.simulate`` checks every schedule with exactly these rules. A send's payload must
stay alive until the send completes; a send is waited for, and its payload let go, at the first
receive that proves the peer has it (``schedules.send_releases``: the wait then returns at once,
gloo or NCCL, and cannot deadlock). A send no receive ever proves delivered (information flowing
one way: evaluation without virtual chunks, the backwards of ``all_forward_all_backward``, 1F1B's
cool-down) is waited for ``schedules.HOLD`` ops after it was posted: that wait blocks while the
receiver has not reached its receive, which it reaches without us (the schedule places these
waits so that none closes a cycle). Without that, every micro-batch would leave one
activation-sized buffer per direction until the step ends (12.6 MB a micro-batch at GPT-175B).
What still grows with the micro-batches: ``all_forward_all_backward``'s forward sends (each its
output, held for the backward anyway) and, with virtual chunks, its gradients and an evaluation
run chunk by chunk, which the next chunk takes only after all m micro-batches of the one before
(``schedules.forward_only_ops`` runs evaluation in groups of stages instead: bounded).
``is_completed`` cannot replace the waits: gloo's send reports completion only once waited for.

Activations travel on one process group and gradients on another (same ranks): the two streams
between a pair of ranks then never need to agree on an interleaving, which matters when a
stage's next and previous neighbour are the same rank (2 stages, interleaved).

Shapes and dtype are fixed in advance (``[micro_batch, seq (/ tp under sequence parallelism),
hidden]`` in the residual-stream dtype), so a receive needs no handshake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from parallel.pipeline.layout import PipelineLayout
from parallel.pipeline.schedules import Op

__all__ = ["PipelineGroups", "PipelineEngine"]


@dataclass
class PipelineGroups:
    """This rank's pipeline: its stage ranks (global, in stage order) and the groups over them."""

    ranks: list[int]
    activations: dist.ProcessGroup  # forward sends
    gradients: dist.ProcessGroup  # backward sends
    collectives: dist.ProcessGroup  # loss and norm sums over the stages

    def next_rank(self, stage: int) -> int:
        return self.ranks[(stage + 1) % len(self.ranks)]

    def prev_rank(self, stage: int) -> int:
        return self.ranks[(stage - 1) % len(self.ranks)]


class PipelineEngine:
    """Executes ``Op`` lists for one rank of a ``PipelineLayout``.

    ``forward(chunk, micro, x)`` runs one model chunk on one micro-batch; ``x`` is None for the
    first chunk of the model (it reads its own tokens) and the received activation otherwise.
    It returns the activation to send on, or, for the model's last chunk, the scalar to
    backpropagate (the scaled loss).
    """

    def __init__(
        self,
        layout: PipelineLayout,
        groups: PipelineGroups,
        shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        meter=None,
    ):
        self.layout, self.groups = layout, groups
        self.shape, self.dtype, self.device = tuple(shape), dtype, device
        self.meter = meter
        self._pending: dict[int, tuple[dist.Work, torch.Tensor]] = {}  # by the op that sent
        self.peak_pending = 0  # the most sends in flight at once in the last ``run``

    def _send(self, i: int, tensor: torch.Tensor, dst: int, group, name: str) -> None:
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise RuntimeError(
                f"pipeline stage {self.layout.rank} produced {tuple(tensor.shape)} {tensor.dtype}; "
                f"the schedule exchanges {self.shape} {self.dtype}"
            )
        payload = tensor.detach().contiguous()
        self._pending[i] = (dist.isend(payload, dst=dst, group=group), payload)
        self.peak_pending = max(self.peak_pending, len(self._pending))
        if self.meter is not None:
            self.meter.record(name, "pipeline", payload.dtype, payload.nbytes)

    def _recv(self, src: int, group) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=src, group=group)
        return buf

    def _release(self, ops: tuple[int, ...]) -> None:
        for i in ops:
            self._pending.pop(i)[0].wait()

    def _finish_sends(self) -> None:
        for work, _ in self._pending.values():
            work.wait()
        self._pending.clear()

    def run(
        self,
        ops: list[Op],
        forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
        backward: bool = True,
        after_backward: Callable[[], None] | None = None,
        releases: Sequence[tuple[int, ...]] | None = None,
    ) -> None:
        """Run ``ops`` (forward-only when ``backward`` is False: no graph, nothing stored);
        ``after_backward`` is called after each backward op (the FP8 scaling update).
        ``releases``: this rank's ``schedules.send_releases`` for the op lists of every rank
        ``ops`` belongs to; without it, every send is held until the end."""
        layout, groups = self.layout, self.groups
        stage = layout.rank
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        if releases is not None and len(releases) != len(ops):
            raise ValueError(f"{len(releases)} send releases for {len(ops)} ops")
        free = releases or [()] * len(ops)
        self.peak_pending = 0
        try:
            for i, op in enumerate(ops):
                first = layout.has_embedding(op.chunk)
                last = layout.has_head(op.chunk)
                if op.kind == "F":
                    x = None
                    if not first:
                        x = self._recv(groups.prev_rank(stage), groups.activations)
                        x.requires_grad_(backward)
                    self._release(free[i])
                    out = forward(op.chunk, op.micro, x)
                    if not last:
                        self._send(
                            i,
                            out,
                            groups.next_rank(stage),
                            groups.activations,
                            "pipeline_send_activations",
                        )
                    if backward:
                        saved[(op.chunk, op.micro)] = (x, out)
                    continue
                x, out = saved.pop((op.chunk, op.micro))
                grad = None if last else self._recv(groups.next_rank(stage), groups.gradients)
                self._release(free[i])  # an op without a receive may wait too (``hold``)
                if last:
                    out.backward()
                else:
                    torch.autograd.backward(out, grad_tensors=grad)
                if after_backward is not None:
                    after_backward()
                if not first:
                    self._send(
                        i,
                        x.grad,
                        groups.prev_rank(stage),
                        groups.gradients,
                        "pipeline_send_gradients",
                    )
        finally:
            self._finish_sends()
        if saved:
            raise RuntimeError(f"pipeline schedule left {len(saved)} forwards without backward")

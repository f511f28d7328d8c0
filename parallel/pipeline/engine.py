"""Run a schedule's op list on one pipeline rank: point-to-point exchange and autograd.

Sends are eager (``isend`` the moment an output or input gradient exists, waited for at the end
of the step) and receives block until the op needing them runs. Any schedule that completes in
lock-step also completes this way, and ``schedules.simulate`` checks every schedule with exactly
these rules. Activations travel on one process group and gradients on another (same ranks): the
two streams between a pair of ranks then never need to agree on an interleaving, which matters
when a stage's next and previous neighbour are the same rank (2 stages, interleaved).

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
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []

    def _send(self, tensor: torch.Tensor, dst: int, group, name: str) -> None:
        if tensor.dtype != self.dtype or tuple(tensor.shape) != self.shape:
            raise RuntimeError(
                f"pipeline stage {self.layout.rank} produced {tuple(tensor.shape)} {tensor.dtype}; "
                f"the schedule exchanges {self.shape} {self.dtype}"
            )
        payload = tensor.detach().contiguous()
        self._pending.append((dist.isend(payload, dst=dst, group=group), payload))
        if self.meter is not None:
            self.meter.record(name, "pipeline", payload.dtype, payload.nbytes)

    def _recv(self, src: int, group) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.recv(buf, src=src, group=group)
        return buf

    def _finish_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    def run(
        self,
        ops: list[Op],
        forward: Callable[[int, int, torch.Tensor | None], torch.Tensor],
        backward: bool = True,
        after_backward: Callable[[], None] | None = None,
    ) -> None:
        """Run ``ops`` (forward-only when ``backward`` is False: no graph, nothing stored);
        ``after_backward`` is called after each backward op (the FP8 scaling update)."""
        layout, groups = self.layout, self.groups
        stage = layout.rank
        saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        try:
            for op in ops:
                first = layout.has_embedding(op.chunk)
                last = layout.has_head(op.chunk)
                if op.kind == "F":
                    x = None
                    if not first:
                        x = self._recv(groups.prev_rank(stage), groups.activations)
                        x.requires_grad_(backward)
                    out = forward(op.chunk, op.micro, x)
                    if not last:
                        self._send(
                            out,
                            groups.next_rank(stage),
                            groups.activations,
                            "pipeline_send_activations",
                        )
                    if backward:
                        saved[(op.chunk, op.micro)] = (x, out)
                    continue
                x, out = saved.pop((op.chunk, op.micro))
                if last:
                    out.backward()
                else:
                    grad = self._recv(groups.next_rank(stage), groups.gradients)
                    torch.autograd.backward(out, grad_tensors=grad)
                if after_backward is not None:
                    after_backward()
                if not first:
                    self._send(
                        x.grad, groups.prev_rank(stage), groups.gradients, "pipeline_send_gradients"
                    )
        finally:
            self._finish_sends()
        if saved:
            raise RuntimeError(f"pipeline schedule left {len(saved)} forwards without backward")

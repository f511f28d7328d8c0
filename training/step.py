"""One training step and one evaluation: micro-batches with accumulation, data-parallel
reduction, unscaling, clipping, the optimizer step (skipped on a non-finite norm), and the step's
statistics; the mean validation value of each metric.

The step reads no value on the host: whether it is skipped is a device ``found_inf`` that the
optimizer (TrainOptimizer.found_inf) and the loss scaler act on, and the norm, the skip and the
first non-finite gradient stay on the device in ``StepStats``; ``SkipCounter`` counts skips
there and the loop checks them when it reads the losses (training/loop.py)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.sampler import micro_batches
from parallel.topology import gather_texts
from training.forward_backward import forward_backward, forward_only
from training.memory import model_state_bytes
from training.optimizer import clip_grad_norm, device_values, grad_squares
from training.setup import RunState

__all__ = ["SkipCounter", "StepStats", "TrainingError", "evaluate", "train_step"]


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _sum_over_replicas(values: torch.Tensor, state: RunState) -> torch.Tensor:
    """Sum over data-parallel replicas and pipeline stages (only the last holds the loss)."""
    if state.groups.data is not None:
        dist.all_reduce(values, group=state.groups.data)
    if state.groups.pipeline is not None:
        dist.all_reduce(values, group=state.groups.pipeline.collectives)
    return values


def _sync_shared_embedding(state: RunState) -> None:
    """Sum the gradients of parameters two stages hold (a tied embedding's first- and
    last-stage copies)."""
    for shared in state.model.shared_parameters():
        grad = state.optimizer.grad_of(shared)
        dist.all_reduce(grad, group=state.groups.embedding)
        state.meter.record_collective(
            "embedding_all_reduce", "all_reduce", "embedding", grad.dtype, grad.nbytes, 2
        )


def _means(reduced: torch.Tensor, clamp: bool = False) -> torch.Tensor:
    """Each metric's ``sum / count`` (on the device) from the family's ``[sum, count, ...]``."""
    sums, counts = reduced[0::2], reduced[1::2]
    return sums / (counts.clamp(min=1) if clamp else counts)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step reports.

    The step's losses, norm and skip stay on the device (``means``, ``norm``, ``found_inf``):
    ``losses``, ``loss``, ``grad_norm`` and ``skipped`` read them on first use, a host sync
    that the loop makes on logging steps only (training/loop.py).
    """

    metrics: tuple[str, ...]  # the family's metric names, its headline first
    means: torch.Tensor  # each metric's mean this step, in ``metrics`` order, on the device
    norm: torch.Tensor  # the gradient norm before clipping (0-d); not finite on a skipped step
    found_inf: torch.Tensor  # 0-d bool: skipped (no update, the loss scale backs off)
    # 0-d int64: this rank's first parameter (index in optimizer.step_params) whose gradient
    # norm is not finite, -1 for none; the gradients are zeroed after the step, so it is found
    # now, on the device, and named only if a run of skips stops the training (SkipCounter).
    first_nonfinite: torch.Tensor
    comm: dict[str, float]  # bytes this rank sent, per collective
    comm_per_element: dict[str, float]  # bytes per element each collective carried
    fp8_logged: bool  # FP8 cast health was measured (``health``)
    wire: float | None  # bytes per element of the FP8 gradient collectives (None: none)
    wire_all: float  # bytes per element of every gradient collective together

    @functools.cached_property
    def losses(self) -> dict[str, float]:
        """Every metric of the family, this step's mean (a host read, made once)."""
        return dict(zip(self.metrics, self.means.tolist()))

    @property
    def loss(self) -> float:
        """The family's headline metric (its first), this step's mean (a host read)."""
        return self.losses[self.metrics[0]]

    @functools.cached_property
    def grad_norm(self) -> float:
        """The gradient norm before clipping (a host read)."""
        return float(self.norm)

    @functools.cached_property
    def skipped(self) -> bool:
        """Whether the step was skipped (a host read)."""
        return bool(self.found_inf)


def train_step(
    state: RunState, data_iter, n_micro: int, health: bool = False, grad_hook=None
) -> StepStats:
    """One optimizer step over ``n_micro`` micro-batches. Returns step statistics.

    ``health``: measure FP8 cast underflow/saturation on the last micro-batch (for logging).
    ``grad_hook(state)``: called once the gradients are final (summed over pipeline copies,
    averaged over replicas, unscaled) and before clipping; tests read them there.
    """
    batches = [_to_device(next(data_iter), state.device) for _ in range(n_micro)]
    # The scaler's state on the run's device (a no-op once there): a pipeline stage without
    # the head never scales a loss, yet unscales and updates, which must not read the host.
    state.scaler.to(state.device)
    state.meter.reset_step()
    state.optimizer.buffers.start_step(n_micro)  # buckets reduce as backward fills them
    loss_and_tokens = forward_backward(state, batches, health=health)
    # Nothing after backward needs autograd: without it the step records no graph, and an
    # account of the step (training/planning/step_account.py) sees these ops outside "forward".
    with torch.no_grad():
        return _after_backward(state, loss_and_tokens, health, grad_hook)


def _after_backward(state: RunState, loss_and_tokens, health: bool, grad_hook) -> StepStats:
    """The step once backward has run: the gradients' reduction, unscaling, clipping, the
    optimizer, and the step's statistics."""
    opt, scaler = state.optimizer, state.scaler
    # Wait for the buckets; the tied embedding's two pipeline copies are summed before its
    # own (held-back) bucket is averaged over the replicas.
    opt.buffers.finish(before_held=lambda: _sync_shared_embedding(state))
    grads, slots = opt.grads(), opt.grad_slots()
    fp8_elements, all_elements = opt.grad_elements()
    unscale = scaler.inv_scale  # on the device (None: the loss was not scaled)
    if unscale is not None:
        # Also at a scale of 1 (x * 1 is x exactly), so that no host read decides it.
        if grads:
            torch._foreach_mul_(grads, unscale)
        for slot in slots:
            slot.mul_(unscale)  # exact: only the FP8 slot's scale changes
    if grad_hook is not None:
        grad_hook(state)
    pipeline = state.groups.pipeline
    squares = grad_squares(grads, slots, state.device)
    grad_norm = clip_grad_norm(
        grads,
        state.cfg.training.clip_grad,
        slots,
        tp_group=state.groups.tensor,
        sharded=opt.sharded_flags(),
        pp_group=pipeline.collectives if pipeline is not None else None,
        counted=opt.counted_flags(),
        dp_group=opt.norm_group,
        device=state.device,
        squares=squares,
    )
    # Skipped or not is decided on the device: the optimizer leaves every weight, master,
    # moment and step counter as it was where found_inf is set, and the scaler backs off.
    found_inf = torch.logical_not(torch.isfinite(grad_norm))
    first_nonfinite = _first_nonfinite(squares, opt.grad_positions())
    opt.found_inf = found_inf
    opt.step()
    comm = state.meter.step_summary()  # after the step: includes the weights' all-gather
    if state.bytes_per_param is None and opt.has_states:
        # Measured once, after the step (optimizer states exist) while gradients are alive.
        state.bytes_per_param = model_state_bytes(state.model, opt)
    scaler.update(found_inf=found_inf)
    state.scheduler.step(1)
    opt.zero_grad()
    means = _means(_sum_over_replicas(loss_and_tokens, state))  # read by the log, not here
    # Wire bytes per gradient element: of the FP8 weight-gradient collectives alone when there
    # are any (the "1 byte per element" claim at W=2), and of every gradient collective
    # together (neither the pipeline's activation sends nor the weights' all-gather are
    # gradient traffic). Per collective: bytes per element it carried, overhead included.
    fp8_bytes = sum(comm.get(k, 0) for k in ("reduce_scatter_fp8", "all_gather_fp8"))
    grad_bytes = sum(
        v for k, v in comm.items() if not k.startswith(("pipeline_", "all_gather_params"))
    )
    return StepStats(
        metrics=tuple(state.metrics),
        means=means,
        norm=grad_norm,
        found_inf=found_inf,
        first_nonfinite=first_nonfinite,
        comm=comm,
        comm_per_element=state.meter.bytes_per_element(),
        fp8_logged=health,
        wire=fp8_bytes / fp8_elements if fp8_elements else None,
        wire_all=grad_bytes / max(all_elements, 1),
    )


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. diverged); the message says why and what to change."""


def _first_nonfinite(squares: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """The smallest of ``positions`` (each gradient's parameter index, as
    ``TrainOptimizer.grad_positions``) whose squared norm in ``squares`` is not finite; -1 when
    none is (only the sum overflowed, or another rank's gradient). On the device."""
    if not positions:
        return torch.full((), -1, dtype=torch.int64, device=squares.device)
    none = torch.iinfo(torch.int64).max
    index = device_values(positions, torch.int64, squares.device)
    first = torch.where(torch.isfinite(squares), none, index).amin()
    return torch.where(first == none, -1, first)


def _nonfinite_name(state: RunState, index: int) -> str:
    """``"{name} (rank r)"`` of the first parameter whose gradient is not finite (``index``:
    this rank's, from ``StepStats.first_nonfinite``), the lowest rank that holds one first;
    "none found" when only the norm overflowed. Collective."""
    found = state.optimizer.stepped_names()[index] if index >= 0 else ""
    for rank, name in enumerate(gather_texts(found, state.device)):
        if name:
            return f"{name} (rank {rank})"
    return "none found"


class SkipCounter:
    """Skipped steps, counted on the device (training.max_consecutive_skips).

    No step reads whether it was skipped: ``record`` updates ``values`` with tensor operations
    and the loop reads them with the losses when it logs or saves, where ``check`` raises the
    limit's error for the first run of consecutive skips that reached it, naming the step at
    which it did (its iteration, first non-finite gradient and loss), however many steps later
    the read comes. Every rank sees the same skips (the norm is global), so every rank raises
    at the same read.
    """

    SIZE = 5  # [skipped steps in the run, consecutive skips now, iteration at which they first
    # reached the limit (0: not yet), that step's first non-finite gradient index, its loss]

    def __init__(self, state: RunState, skipped: int = 0):
        self.limit = state.cfg.training.max_consecutive_skips
        self.values = torch.tensor(
            [skipped, 0, 0, -1, math.nan], dtype=torch.float64, device=state.device
        )

    def record(self, stats: StepStats, iteration: int) -> None:
        """Count ``stats``'s step, the run's ``iteration``-th (on the device)."""
        total, streak, tripped, index, loss = self.values.unbind()
        skipped = stats.found_inf.to(torch.float64)
        streak = (streak + 1) * skipped  # 0 after a step that was not skipped
        trip = (streak >= (self.limit or math.inf)) & (tripped == 0)
        first = stats.first_nonfinite.to(torch.float64)
        update = [
            total + skipped,
            streak,
            torch.where(trip, iteration, tripped),
            torch.where(trip, first, index),
            torch.where(trip, stats.means[0].to(torch.float64), loss),
        ]
        self.values.copy_(torch.stack(update))

    def check(self, state: RunState, values: list[float]) -> int:
        """The run's skipped steps from ``values`` (``self.values`` as read); raises
        TrainingError when consecutive skips reached the limit. Collective when it raises."""
        skipped, _, tripped, index, loss = values
        if tripped:
            raise TrainingError(
                f"training: {self.limit} consecutive steps skipped for non-finite gradients, up "
                f"to iteration {int(tripped)} (training.max_consecutive_skips={self.limit}); "
                f"first non-finite gradient: {_nonfinite_name(state, int(index))}; loss "
                f"{loss:.4g}, loss scale {state.scaler.loss_scale:g}. Lower optimizer.lr, check "
                "the data, or resume from an earlier checkpoint"
            )
        return int(skipped)


@torch.no_grad()
def evaluate(state: RunState, n_micro: int) -> dict[str, float]:
    """Mean validation value of each metric over eval_iters global batches, always the same
    samples."""
    t = state.cfg.training
    topo = state.groups.topology
    state.model.eval()
    workers = state.family.loader_workers(state.cfg)
    it = micro_batches(
        state.valid_ds, 0, t.micro_batch_size, topo.dp_rank, topo.data, num_workers=workers
    )
    batches = []
    for _ in range(t.eval_iters * n_micro):
        try:
            batches.append(_to_device(next(it), state.device))
        except StopIteration:
            break
    totals = forward_only(state, batches)
    state.model.train()
    means = _means(_sum_over_replicas(totals, state), clamp=True)
    return dict(zip(state.metrics, means.tolist()))

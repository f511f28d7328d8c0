"""One training step and one evaluation: micro-batches with accumulation, data-parallel
reduction, unscaling, clipping, the optimizer step (skipped on a non-finite norm), and the step's
statistics; the mean validation value of each metric."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.sampler import micro_batches
from fp8train.optim_states import grad_of
from fp8train.param_state import grad_slot
from parallel.topology import gather_texts
from training.forward_backward import forward_backward, forward_only
from training.memory import model_state_bytes
from training.optimizer import clip_grad_norm
from training.setup import RunState

__all__ = ["StepStats", "TrainingError", "check_skips", "evaluate", "train_step"]


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

    The step's losses stay on the device (``means``): ``losses`` and ``loss`` read them on
    first use, a host sync that the loop makes on logging steps only (training/loop.py).
    """

    metrics: tuple[str, ...]  # the family's metric names, its headline first
    means: torch.Tensor  # each metric's mean this step, in ``metrics`` order, on the device
    grad_norm: float  # before clipping; not finite on a skipped step
    skipped: bool  # a non-finite norm: no update, the loss scale backs off
    nonfinite: str | None  # then: the first non-finite gradient, "name (rank r)"
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
    # account of the step (training/step_account.py) sees these ops outside "forward".
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
    )
    # The step's one host read of its own: whether to skip. torch's and LowBitAdamW's steps
    # (moments, step counters on the host) cannot yet be applied under a device-side mask
    # and leave a skipped step untouched; the norm for the log comes with the same read.
    norm = float(grad_norm)
    finite = math.isfinite(norm)
    nonfinite = None
    if finite:
        opt.step()
    else:  # named before the gradients are zeroed, for the error if skips go on
        nonfinite = _first_nonfinite_gradient(state)
    comm = state.meter.step_summary()  # after the step: includes the weights' all-gather
    if state.bytes_per_param is None and finite:
        # Measured once, after the step (optimizer states exist) while gradients are alive.
        state.bytes_per_param = model_state_bytes(state.model, opt)
    # Decided on the device, from the norm (a host bool would be copied up: a sync on CUDA).
    scaler.update(found_inf=torch.logical_not(torch.isfinite(grad_norm)))
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
        grad_norm=norm,
        skipped=not finite,
        nonfinite=nonfinite,
        comm=comm,
        comm_per_element=state.meter.bytes_per_element(),
        fp8_logged=health,
        wire=fp8_bytes / fp8_elements if fp8_elements else None,
        wire_all=grad_bytes / max(all_elements, 1),
    )


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. diverged); the message says why and what to change."""


def _first_nonfinite_gradient(state: RunState) -> str:
    """``"{name} (rank r)"`` of the first parameter whose gradient is not finite, the lowest
    rank that holds one first; "none found" when only the norm overflowed. Collective."""
    opt, found = state.optimizer, ""
    for name, p in opt.param_names.items():
        main = grad_slot(p)  # the FP32 buffer view, or an FP8 slot
        grad = main if isinstance(main, torch.Tensor) else grad_of(p)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            found = name
            break
    for rank, name in enumerate(gather_texts(found, state.device)):
        if name:
            return f"{name} (rank {rank})"
    return "none found"


def check_skips(state: RunState, consecutive: int, iteration: int, stats: StepStats) -> None:
    limit = state.cfg.training.max_consecutive_skips
    if limit and consecutive >= limit:
        raise TrainingError(
            f"training: {consecutive} consecutive steps skipped for non-finite gradients, up to "
            f"iteration {iteration} (training.max_consecutive_skips={limit}); first non-finite "
            f"gradient: {stats.nonfinite}; loss {stats.loss:.4g}, loss scale "
            f"{state.scaler.loss_scale:g}. Lower optimizer.lr, check the data, or resume from "
            "an earlier checkpoint"
        )


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

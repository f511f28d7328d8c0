"""Forward and backward over one step's micro-batches, with or without a pipeline.

Without pipeline parallelism this is gradient accumulation: each micro-batch's loss (mean over
its tokens, divided by the number of micro-batches, Megatron's normalisation) is backpropagated
in turn. With it, the same per-micro-batch losses are computed on the last stage and the
schedule's op list (``parallel/pipeline``) decides the order; every gradient is the same sum of
the same terms, so pipeline=P equals pipeline=1.

FP8 scaling moves in one bulk update per pass (``fp8train.scaling_table``): after every
micro-batch's forward and after its backward, whatever the schedule.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from fp8train.linear import Linear
from fp8train.scaling_table import ScalingTable
from parallel.pipeline import Op, forward_only_ops, schedule_ops, send_releases

__all__ = ["forward_backward", "forward_only", "new_totals", "track_health"]


def _autocast(state):
    dtype = state.recipe.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=state.device.type, dtype=dtype)


def _scaling_table(state) -> ScalingTable:
    if state.scaling_table is None:  # made once: the module tree does not change after setup
        state.scaling_table = ScalingTable(state.model)
    return state.scaling_table


def _loss_sums(state, output: torch.Tensor, batch: dict, totals: torch.Tensor) -> torch.Tensor:
    """Add the micro-batch's ``(sum, count)`` per metric into ``totals``; return its objective."""
    objective, sums = state.family.loss(output, batch)
    # A count given as a Python number (a label count) becomes a device value by a fill, not
    # an upload: copying host memory up waits for the stream on CUDA.
    pairs = [
        part.detach().float()
        if isinstance(part, torch.Tensor)
        else torch.full((), float(part), device=state.device)
        for name in state.metrics
        for part in sums[name]
    ]
    totals.add_(torch.stack(pairs))
    return objective


def new_totals(state) -> torch.Tensor:
    """``[sum, count]`` per metric of the run, in ``state.metrics`` order."""
    return torch.zeros(2 * len(state.metrics), device=state.device)


@functools.lru_cache(maxsize=8)
def _pipeline_ops(
    name: str, stages: int, rank: int, n_micro: int, virtual: int, forward_only: bool = False
) -> tuple[list[Op], list[tuple]]:
    """This rank's ops of a step and when it may let go of each send (``send_releases``,
    from every rank's op list); the same every step, so worked out once."""
    if forward_only:  # evaluation: in groups of stages, whatever the training schedule
        plans = [forward_only_ops(stages, r, n_micro, virtual) for r in range(stages)]
    else:
        plans = [schedule_ops(name, stages, r, n_micro, virtual) for r in range(stages)]
    return plans[rank], send_releases(plans, stages, virtual)[rank]


def _fp8_linears(state) -> list[Linear]:
    if state.fp8_linears is None:  # found once: the module tree does not change
        state.fp8_linears = [m for m in state.model.modules() if isinstance(m, Linear) and m.fp8]
    return state.fp8_linears


def track_health(state, on: bool) -> None:
    """Switch FP8 underflow/saturation measurement of every FP8 linear on or off."""
    for module in _fp8_linears(state):
        module.track_health = on


def _reuse_weight_casts(state, micro: int, n_micro: int) -> None:
    """The FP8 weights are cast by a step's first micro-batch and read again by the others
    (``Linear.weight_fp8``): the weights change only at the optimizer step. When others will
    read it, the first also keeps the weights' transposes (one per step), unless
    ``precision.keep_weight_transposes`` is off (each backward copies its own)."""
    keep = n_micro > 1 and state.cfg.precision.keep_weight_transposes
    for module in _fp8_linears(state):
        module.reuse_weight_cast = micro > 0
        module.keep_weight_cast = keep


def _release_weight_casts(state) -> None:
    for module in _fp8_linears(state):
        module.release_weight_cast()


def forward_backward(state, batches: list[dict], health: bool = False) -> torch.Tensor:
    """Forward and backward over ``batches`` (this step's micro-batches, on the device);
    gradients accumulate in the parameters. Returns ``[sum, count]`` per metric (the family's
    ``state.metrics``) of the micro-batches whose loss this rank computed (zeros on pipeline
    stages without the head).

    ``health``: measure FP8 cast underflow/saturation from the last micro-batch's forward on.
    """
    n_micro = len(batches)
    scaler = state.scaler
    totals = new_totals(state)
    model, family = state.model, state.family

    def loss_of(output: torch.Tensor, batch: dict) -> torch.Tensor:
        # The micro-batch's mean, averaged over micro-batches (Megatron), loss-scaled.
        return scaler.scale(_loss_sums(state, output, batch, totals) / n_micro)

    table = _scaling_table(state)
    try:
        if state.engine is None:
            for micro, batch in enumerate(batches):
                track_health(state, health and micro == n_micro - 1)
                _reuse_weight_casts(state, micro, n_micro)
                with _autocast(state):
                    output = model.forward_chunk(0, None, family.model_inputs(batch))
                table.fold()
                loss_of(output, batch).backward()
                table.fold()
            return totals
        layout = state.engine.layout

        def forward(chunk: int, micro: int, hidden):
            if health and micro == n_micro - 1:
                track_health(state, True)
            _reuse_weight_casts(state, micro, n_micro)
            batch = batches[micro]
            with _autocast(state):
                out = model.forward_chunk(chunk, hidden, family.model_inputs(batch))
            table.fold()
            return loss_of(out, batch) if layout.has_head(chunk) else out

        ops, releases = _pipeline_ops(
            state.cfg.parallel.pipeline_schedule,
            layout.stages,
            layout.rank,
            n_micro,
            layout.virtual,
        )
        state.engine.run(ops, forward, after_backward=table.fold, releases=releases)
        return totals
    finally:
        track_health(state, False)
        _release_weight_casts(state)


@torch.no_grad()
def forward_only(state, batches: list[dict]) -> torch.Tensor:
    """``[sum, count]`` per metric over ``batches`` without gradients (evaluation)."""
    totals = new_totals(state)
    model, family = state.model, state.family
    if state.engine is None:
        for batch in batches:
            with _autocast(state):
                output = model.forward_chunk(0, None, family.model_inputs(batch))
            _loss_sums(state, output, batch, totals)
        return totals
    layout = state.engine.layout

    def forward(chunk: int, micro: int, hidden):
        batch = batches[micro]
        with _autocast(state):
            out = model.forward_chunk(chunk, hidden, family.model_inputs(batch))
        if layout.has_head(chunk):
            _loss_sums(state, out, batch, totals)
        return out

    ops, releases = _pipeline_ops(
        "all_forward_all_backward", layout.stages, layout.rank, len(batches), layout.virtual, True
    )
    state.engine.run(ops, forward, backward=False, releases=releases)
    return totals

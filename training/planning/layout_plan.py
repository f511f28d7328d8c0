"""A whole run's plan: which ranks to plan, how many micro-batches to execute, and the
step's totals (tools/plan.py prints them).

Ranks: by default one per pipeline stage, its most loaded one: tensor-parallel ranks hold
equal shards, and of the data-parallel ranks the one the distributed optimizer gives the
most elements to (owners depend only on shapes, ``parameter_owners``).

Micro-batches: a step of n micro-batches repeats the same micro-batch work n times, so what
it computes and sends is ``a + b * n`` exactly (a: the once-per-step gradient reduction,
weight gathering and optimizer; b: one micro-batch's forward and backward with its pipeline
sends and tensor-parallel collectives). Its memory peak is a line in n too once the schedule
reaches its steady state (1F1B: ``pipeline + 1`` micro-batches; interleaved: twice
``pipeline``): what grows is what each micro-batch leaves until the step ends (its inputs,
moved to the device up front, and its loss). ``plan_stage`` therefore executes three real
steps, of ``n1`` (the steady state), ``n1 + d`` and ``n1 + 2d`` micro-batches, checks that
the peak of every phase of the step, in total and by category, lies on one line (within
``LINE_TOLERANCE``), and extends each phase's line to n; the step's peak is the highest of
them there, which need not be in the phase of the short steps' peak (a phase growing faster
overtakes it). Otherwise it runs all n (``exact=True`` always does). tests/test_planner.py
checks the extension against full steps.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from parallel.topology import Topology
from training.config_schema import Config
from training.planning.rank_plan import MetaStep, RankPlan, fake_world, plan_rank, plan_steps
from training.preflight import preflight
from training.run_plan import RunPlan

__all__ = [
    "StagePlan", "heaviest_data_rank", "micro_batch_steps", "plan_layout", "plan_layouts",
    "plan_stage",
]  # fmt: skip


@dataclass
class StagePlan:
    """One planned rank's step at the run's micro-batch count. ``executed``: the
    micro-batch counts of the steps actually run (one: exact; three: extended, module doc)."""

    result: RankPlan
    executed: tuple[int, ...]


def micro_batch_steps(plan: RunPlan) -> tuple[int, int, int] | None:
    """The three step sizes ``(n1, n1 + d, n1 + 2d)`` to execute instead of the plan's n, or
    None when n is small enough to run as it is."""
    pp, vp = plan.pipeline, plan.virtual_stages
    if pp == 1:
        n1, d = 2, 1
    elif vp > 1:
        n1, d = 2 * pp, pp  # interleaving needs multiples of the stage count
    else:
        n1, d = pp + 1, 1
    if plan.micro_batches <= n1 + 2 * d:
        return None
    return n1, n1 + d, n1 + 2 * d


def _line(a, b, k: float):
    """``a + (b - a) * k`` for numbers, and key by key for dicts; ints stay ints."""
    if isinstance(b, dict):
        keys = [*b, *(key for key in a if key not in b)]
        return {key: _line(a.get(key, 0), b.get(key, 0), k) for key in keys}
    value = a + (b - a) * k
    return round(value) if isinstance(b, int) else value


def _phase_steps(runs) -> dict[str, list[dict]]:
    """Per phase of the step: each run's peak in it, with its bytes by category then."""
    return {
        phase: [
            {"peak": r.memory.phase_peaks[phase], **r.memory.phase_at_peak[phase]} for r in runs
        ]
        for phase in runs[-1].memory.phase_peaks
    }


# How far off the line the three peaks may be: what the extension to n could then be off by,
# as a fraction of the peak. (Steps of a few micro-batches differ by a few dozen bytes of
# scalars besides the per-micro-batch inputs.)
LINE_TOLERANCE = 1e-4


def _is_line(runs, n: int) -> bool:
    """Whether the three runs' peaks of every phase (total and by category) lie on one line
    in n, closely enough that the extension to ``n`` is within ``LINE_TOLERANCE`` of the
    step's peak."""
    phases = [list(r.memory.phase_peaks) for r in runs]
    if not phases[-1] or any(sorted(p) != sorted(phases[-1]) for p in phases):
        return False
    d = runs[1].micro_batches - runs[0].micro_batches
    reach = (n - runs[-1].micro_batches) / d + 1  # steps of d from the last run to n, and one
    bar = LINE_TOLERANCE * runs[-1].memory.peak
    return all(
        abs(m[2][k] - 2 * m[1][k] + m[0][k]) * reach <= bar
        for m in _phase_steps(runs).values()
        for k in m[0]
    )


def _extend(runs, n: int) -> RankPlan:
    """The last run with every per-step count and each phase's memory peak taken from the
    line through the runs at n; the step's peak is the highest phase's there."""
    a, b = runs[0], runs[-1]
    k = (n - a.micro_batches) / (b.micro_batches - a.micro_batches)
    lines = {phase: _line(m[0], m[-1], k) for phase, m in _phase_steps(runs).items()}
    phase_at_peak = {
        phase: {c: v for c, v in m.items() if c != "peak"} for phase, m in lines.items()
    }
    phase_peaks = {phase: m["peak"] for phase, m in lines.items()}
    phase = max(phase_peaks, key=phase_peaks.__getitem__)  # the earliest of equal ones
    memory = dataclasses.replace(
        b.memory,
        peak=phase_peaks[phase],
        at_peak=phase_at_peak[phase],
        peak_phase=phase,
        phase_peaks=phase_peaks,
        phase_at_peak=phase_at_peak,
    )
    return dataclasses.replace(
        b,
        micro_batches=n,
        memory=memory,
        flops=_line(a.flops, b.flops, k),
        comm=_line(a.comm, b.comm, k),
        comm_groups=_line(a.comm_groups, b.comm_groups, k),
        traffic=_line(a.traffic, b.traffic, k),
        step_seconds=sum(r.step_seconds for r in runs),
        build_seconds=sum(r.build_seconds for r in runs),
    )


def heaviest_data_rank(cfg: Config, plan: RunPlan, stage: int) -> int:
    """The global rank of ``stage`` (tensor rank 0) at the data-parallel position the
    distributed optimizer gives the most elements (data rank 0 without one)."""
    topo = Topology(plan.world_size, 0, plan.tensor, plan.pipeline)
    ranks = topo.data_parallel_ranks()[stage * plan.tensor]  # (stage, tensor rank 0), by dp
    if plan.data == 1 or not cfg.optimizer.distributed:
        return ranks[0]
    from training.optimizer import parameter_owners, trainable_parameters
    from training.setup import build_run

    with fake_world(plan.world_size, ranks[0]), MetaStep():
        state = build_run(cfg, plan, planning=True)
        params = trainable_parameters(state.model)
        owners = parameter_owners(state.model, params, plan.data)
    load = [0] * plan.data
    for p, owner in zip(params, owners):
        load[owner] += p.numel()
    return ranks[max(range(plan.data), key=load.__getitem__)]


def plan_stage(cfg: Config, plan: RunPlan, rank: int, exact: bool = False, say=None) -> StagePlan:
    """The plan of ``rank`` at the run's micro-batches (module doc); ``say(line)``:
    progress."""
    steps = None if exact else micro_batch_steps(plan)
    if steps is not None:
        runs = plan_steps(cfg, plan, rank, steps, say=say)
        if _is_line(runs, plan.micro_batches):
            return StagePlan(_extend(runs, plan.micro_batches), steps)
        if say is not None:
            say(f"rank {rank}: the short steps are not on one line; the full step")
    return StagePlan(plan_rank(cfg, plan, rank, say=say), (plan.micro_batches,))


def say(line: str) -> None:
    """A progress line on stderr (``plan_layouts(progress=True)``; from worker processes too)."""
    print(f"plan: {line}", file=sys.stderr, flush=True)


def _job(job):
    cfg, plan, target, exact, progress = job
    kind, value = target
    tell = say if progress else None
    if kind == "stage" and tell is not None and plan.data > 1 and cfg.optimizer.distributed:
        tell(f"stage {value}: finding its most loaded data-parallel rank")
    rank = heaviest_data_rank(cfg, plan, value) if kind == "stage" else value
    return plan_stage(cfg, plan, rank, exact, tell)


def plan_layout(
    cfg: Config,
    world_size: int,
    ranks: list[int] | None = None,
    *,
    exact: bool = False,
    jobs: int | None = None,
    progress: bool = False,
) -> tuple[RunPlan, list[StagePlan]]:
    """Pre-flight ``cfg`` on ``world_size`` ranks (a ``ConfigError`` for a layout the run
    would refuse, same message) and plan ``ranks`` (default: each stage's most loaded rank,
    ``heaviest_data_rank``), in up to ``jobs`` processes (default: one per CPU core);
    ``progress``: lines on stderr as the plan goes (``say``)."""
    return plan_layouts([(cfg, world_size, ranks)], exact=exact, jobs=jobs, progress=progress)[0]


def plan_layouts(
    runs: list[tuple[Config, int, list[int] | None]],
    *,
    exact: bool = False,
    jobs: int | None = None,
    progress: bool = False,
) -> list[tuple[RunPlan, list[StagePlan]]]:
    """``plan_layout`` of several ``(config, world size, ranks)`` runs, their ranks planned in
    one pool of up to ``jobs`` processes (tables of several models and levels)."""
    work, sizes, plans = [], [], []
    for cfg, world_size, ranks in runs:
        plan = preflight(cfg, world_size)
        for rank in ranks or ():
            if not 0 <= rank < world_size:
                raise ValueError(f"--rank {rank}: the run has ranks 0..{world_size - 1}")
        targets = (
            [("rank", r) for r in ranks] if ranks else [("stage", s) for s in range(plan.pipeline)]
        )
        work += [(cfg, plan, t, exact, progress) for t in targets]
        sizes.append(len(targets))
        plans.append(plan)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(work)))
    start = time.perf_counter()
    if progress:
        say(f"{len(work)} rank(s) to plan in {jobs} process(es)")

    def finished(i: int, result: StagePlan) -> StagePlan:
        if progress:
            seconds = time.perf_counter() - start
            say(f"rank {result.result.rank} planned ({i} of {len(work)} done, {seconds:.0f} s)")
        return result

    if jobs == 1:
        done = [finished(i + 1, _job(w)) for i, w in enumerate(work)]
    else:
        # spawn: each plan makes its own fake process group, which a forked copy would share.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(jobs, mp_context=context) as pool:
            futures = {pool.submit(_job, w): i for i, w in enumerate(work)}
            done = [None] * len(work)
            for count, future in enumerate(as_completed(futures), 1):
                done[futures[future]] = finished(count, future.result())
    out, start = [], 0
    for plan, size in zip(plans, sizes):
        out.append((plan, done[start : start + size]))
        start += size
    return out

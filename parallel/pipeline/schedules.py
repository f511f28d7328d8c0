"""Pipeline schedules as plain op lists, plus a timing simulator for their bubbles.

A schedule is, per pipeline rank, the order in which that rank runs forward (``F``) and backward
(``B``) passes of (model chunk, micro-batch) pairs. Writing it down as data keeps the three
schedules a few lines each, lets one executor (``parallel/pipeline/engine.py``) run all of them,
and lets tests and ``benchmarks/bench_pipeline.py`` check them without processes.

- ``all_forward_all_backward`` (GPipe): every forward, then every backward (chunk by chunk
  with virtual chunks). Bubble ``(p-1)/(m+p-1)``, but all ``m`` micro-batches' activations
  are alive at once.
- ``1f1b`` without virtual chunks (PipeDream-Flush, Megatron's default): ``p - rank - 1`` warm-up
  forwards, then one forward and one backward in turn, then the remaining backwards. Same
  bubble, at most ``p`` micro-batches in flight.
- ``1f1b`` with ``V`` virtual chunks (Megatron's interleaved schedule): micro-batches move
  through chunks in groups of ``p``; the bubble shrinks to ``(p-1)/(V*m+p-1)`` for the price of
  ``V`` times the point-to-point traffic. Needs ``m`` a multiple of ``p``.

Backward passes of any one chunk run in micro-batch order 0, 1, ..., m-1, as the forwards do, so
gradients accumulate in the same order as with pipeline=1 (same sums, same rounding).
``forward_only_ops`` orders an evaluation pass (forwards only, any schedule) so that its sends in
flight do not grow with m; ``send_releases`` says when the engine may let each send go.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel.pipeline.layout import PipelineLayoutError

__all__ = [
    "HOLD",
    "SCHEDULES",
    "Op",
    "check_schedule",
    "forward_only_ops",
    "schedule_ops",
    "send_releases",
    "simulate",
    "theoretical_bubble",
]

SCHEDULES = ("1f1b", "all_forward_all_backward")


@dataclass(frozen=True)
class Op:
    kind: str  # "F" forward, "B" backward
    chunk: int
    micro: int


def check_schedule(name: str, stages: int, num_micro: int, virtual: int = 1) -> None:
    """Raise ``PipelineLayoutError`` (naming config keys) for a layout the schedule cannot run."""
    if name not in SCHEDULES:
        raise PipelineLayoutError(
            f"parallel.pipeline_schedule={name!r}: choose one of {', '.join(SCHEDULES)}"
        )
    if num_micro < 1:
        raise PipelineLayoutError(f"{num_micro} micro-batches per step: need at least one")
    if virtual > 1 and name == "1f1b":
        if num_micro < stages or num_micro % stages:
            raise PipelineLayoutError(
                f"interleaved 1F1B (parallel.virtual_pipeline={virtual}) needs the micro-batches "
                f"per step ({num_micro} = training.global_batch_size / (micro_batch_size x "
                f"data-parallel size)) to be a multiple of parallel.pipeline ({stages})"
            )


def _virtual_op(k: int, stages: int, virtual: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward or backward in the interleaved order:
    groups of ``stages`` micro-batches go through chunk 0, then chunk 1, ... (backwards through
    the chunks in reverse)."""
    group, within = divmod(k, stages * virtual)
    chunk = within // stages
    if not forward:
        chunk = virtual - 1 - chunk
    return chunk, group * stages + within % stages


def schedule_ops(name: str, stages: int, rank: int, num_micro: int, virtual: int = 1) -> list[Op]:
    """The ordered forward/backward ops of pipeline ``rank`` for one optimizer step."""
    check_schedule(name, stages, num_micro, virtual)
    total = num_micro * virtual

    def fwd(k: int) -> Op:
        return Op("F", *_virtual_op(k, stages, virtual, True))

    def bwd(k: int) -> Op:
        return Op("B", *_virtual_op(k, stages, virtual, False))

    if name == "all_forward_all_backward":
        # Chunk by chunk (any m, no grouping by p): every forward, then backwards in reverse.
        forwards = [Op("F", c, mu) for c in range(virtual) for mu in range(num_micro)]
        backwards = [Op("B", c, mu) for c in reversed(range(virtual)) for mu in range(num_micro)]
        return forwards + backwards
    if virtual == 1:
        warmup = min(stages - rank - 1, num_micro)
    elif num_micro == stages:
        warmup = total  # Megatron: nothing to interleave with, run every forward first
    else:
        warmup = min((stages - rank - 1) * 2 + (virtual - 1) * stages, total)
    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(warmup + k), bwd(k)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def forward_only_ops(stages: int, rank: int, num_micro: int, virtual: int = 1) -> list[Op]:
    """The forwards of an evaluation pass (no backward), any ``num_micro``: groups of
    ``stages`` micro-batches through chunk 0, then chunk 1, ... (interleaved 1F1B's forward
    order, the last group possibly short). Chunk by chunk instead, the first rank would take
    the last rank's outputs only after its own m forwards of the chunk before, and those m
    payloads would have to live until then; in groups, a few. Each chunk still sees the
    micro-batches in order, so the losses sum in the same order."""
    check_schedule("all_forward_all_backward", stages, num_micro, virtual)
    starts = list(range(0, num_micro - stages + 1, stages)) or [0]  # the last group takes
    ends = starts[1:] + [num_micro]  # the rest: a short group alone would stall the pipe
    return [
        Op("F", c, mu) for a, b in zip(starts, ends) for c in range(virtual) for mu in range(a, b)
    ]


def _producer(op: Op, rank: int, stages: int, virtual: int):
    """(rank, op) whose output ``op`` consumes from another rank, or None."""
    if op.kind == "F":
        if rank == 0 and op.chunk == 0:
            return None
        if rank > 0:
            return rank - 1, Op("F", op.chunk, op.micro)
        return stages - 1, Op("F", op.chunk - 1, op.micro)
    if rank == stages - 1 and op.chunk == virtual - 1:
        return None  # the loss: its own forward, earlier on this rank
    if rank < stages - 1:
        return rank + 1, Op("B", op.chunk, op.micro)
    return 0, Op("B", op.chunk + 1, op.micro)


HOLD = 2  # a send no receive proves delivered is waited for this many ops after it is posted


def send_releases(
    plans: list[list[Op]], stages: int, virtual: int = 1, hold: int | None = HOLD
) -> list[list[tuple]]:
    """When each rank waits for the sends it posts, so that their payloads can go.

    ``plans``: every rank's op list (training or forward-only). Returns, for rank ``r`` and its
    op ``i``, the indices of ``r``'s earlier ops whose sends ``r`` waits for once op ``i``'s own
    receive has completed. Mostly a send is proven received by then: the message op ``i`` takes
    left its sender after that sender (or a rank it heard from, and so on) had received ours.
    Vector clocks over the op lists: a clock entry is how many of a rank's ops have their
    receives done. Waiting on such a send returns at once.

    Where information only flows one way, no receive ever proves a send delivered: the backward
    sends of ``all_forward_all_backward`` (upstream, and nothing comes back before the step
    ends), 1F1B's cool-down, and every send of a forward-only pass without virtual chunks.
    Held to the step's end they grow with the micro-batches. With ``hold``, such a send is
    waited for ``hold`` ops after it was posted instead: that wait blocks until its receiver
    has reached the op receiving it, which (the receiver depending only on what was already
    sent) it does without us; the simulation below places the waits so that the dataflow stays
    acyclic (no deadlock on any interleaving), deferring one where it would not. A sender is
    then held back only when its receiver is ``hold`` ops behind, and the receiver sets the
    pace of a one-way chain anyway (``tests/test_pipeline_schedules.py`` times it: no step gets
    longer). ``hold=None``: proven releases only, the rest at the step's end.
    """
    never = _proven(plans, stages, virtual, None, set())[1]
    return _proven(plans, stages, virtual, hold, never)[0]


def _proven(plans, stages: int, virtual: int, hold: int | None, one_way: set):
    """``send_releases``'s simulation; returns (releases, the sends never released), the
    ``one_way`` sends (rank, op) waited for ``hold`` ops after they are posted."""
    index = [{op: i for i, op in enumerate(plan)} for plan in plans]
    source: list[list[tuple[int, int] | None]] = [[None] * len(plan) for plan in plans]
    consumer: dict[tuple[int, int], tuple[int, int]] = {}
    for r, plan in enumerate(plans):
        for i, op in enumerate(plan):
            need = _producer(op, r, stages, virtual)
            if need is not None:
                src = (need[0], index[need[0]][need[1]])
                source[r][i] = src
                consumer[src] = (r, i)
    clocks = [[0] * stages for _ in plans]
    sent: dict[tuple[int, int], list[int]] = {}  # a send's clock: what its sender knew
    open_sends: list[list[tuple[int, int, int]]] = [[] for _ in plans]  # (op, to rank, its op)
    releases: list[list[tuple]] = [[() for _ in plan] for plan in plans]
    pos = [0] * stages
    defer = -1  # a rank let past its unreachable waits once (they move to its next op)
    remaining = sum(len(p) for p in plans)
    while remaining:
        progressed = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                i, src = pos[r], source[r][pos[r]]
                if src is not None and src not in sent:
                    break
                known = list(clocks[r])
                if src is not None:
                    known = [max(a, b) for a, b in zip(known, sent[src])]
                known[r] = i + 1
                due = [
                    (s, q, j)
                    for s, q, j in open_sends[r]
                    if known[q] > j
                    or (hold is not None and (r, s) in one_way and s <= i - hold and pos[q] >= j)
                ]
                late = hold is not None and any(
                    (r, s) in one_way and s <= i - hold and known[q] <= j and pos[q] < j
                    for s, q, j in open_sends[r]
                )
                if late and defer != r:
                    break  # its receiver has not reached the receive yet
                defer = -1
                clocks[r] = known
                releases[r][i] = tuple(s for s, _, _ in due)
                open_sends[r] = [t for t in open_sends[r] if t not in due]
                if (r, i) in consumer:
                    sent[(r, i)] = list(known)
                    open_sends[r].append((i, *consumer[(r, i)]))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [r for r in range(stages) if pos[r] < len(plans[r])]
            ready = [r for r in stuck if (src := source[r][pos[r]]) is None or src in sent]
            if hold is None or not ready:
                raise RuntimeError(f"op lists deadlock: p={stages} v={virtual}")
            defer = ready[0]
    return releases, {(r, s) for r in range(stages) for s, _, _ in open_sends[r]}


def simulate(
    name: str,
    stages: int,
    num_micro: int,
    virtual: int = 1,
    t_forward: float = 1.0,
    t_backward: float = 2.0,
) -> dict:
    """Run the schedule on paper: ranks execute their ops in order, a received input is ready
    when its producer finishes (free communication), each chunk costs ``t / virtual``.

    Returns ``{"makespan", "busy": [per rank], "bubble": [per rank idle fraction]}``; raises
    ``RuntimeError`` if the schedule deadlocks (no rank can make progress).
    """
    plans = [schedule_ops(name, stages, r, num_micro, virtual) for r in range(stages)]
    done: list[dict[Op, float]] = [{} for _ in range(stages)]
    clock = [0.0] * stages
    busy = [0.0] * stages
    pos = [0] * stages
    remaining = sum(len(p) for p in plans)
    while remaining:
        progressed = False
        for r in range(stages):
            while pos[r] < len(plans[r]):
                op = plans[r][pos[r]]
                need = _producer(op, r, stages, virtual)
                ready = 0.0
                if need is not None:
                    src, src_op = need
                    if src_op not in done[src]:
                        break
                    ready = done[src][src_op]
                cost = (t_forward if op.kind == "F" else t_backward) / virtual
                start = max(clock[r], ready)
                clock[r] = start + cost
                busy[r] += cost
                done[r][op] = clock[r]
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule {name} deadlocks: p={stages} m={num_micro} v={virtual}")
    makespan = max(clock)
    return {
        "makespan": makespan,
        "busy": busy,
        "bubble": [1.0 - b / makespan for b in busy],
    }


def theoretical_bubble(stages: int, num_micro: int, virtual: int = 1) -> float:
    """Idle fraction of a step: ``(p-1)/(m+p-1)``, interleaved ``(p-1)/(V*m+p-1)`` (Narayanan
    et al. 2021, with uniform stage times)."""
    return (stages - 1) / (virtual * num_micro + stages - 1)

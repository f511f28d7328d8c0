"""Pipeline layout, schedules and executor, checked without a model.

The schedules are data, so most of their promises are checked here in one process, over many
(stages, micro-batches, virtual chunks): every (chunk, micro-batch) is run forward once and
backward once, each chunk's backwards run in micro-batch order (gradient accumulation then sums
in the same order as pipeline=1), 1F1B bounds the forwards in flight, nothing deadlocks, the
messages between two ranks are received in the order they are sent (the engine matches them by
order alone: no tags, no handshake), and the simulated bubbles equal the closed forms.

The executor then runs for real: ``PipelineEngine`` on 2 and 4 gloo ranks, interleaved and not,
both schedules, with a chain of tiny ``tanh(x @ W)`` chunks in float64. Every rank computes the
same chain in one process, micro-batch after micro-batch, and its gradients must come out
*bitwise* equal: same kernels, same accumulation order, so any misrouted or reordered message,
lost gradient or extra accumulation shows up.
"""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiproc import end_worker

from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError
from parallel.pipeline.schedules import (
    HOLD,
    SCHEDULES,
    Op,
    check_schedule,
    forward_only_ops,
    schedule_ops,
    send_releases,
    simulate,
    theoretical_bubble,
)


def _valid(name: str, p: int, m: int, v: int) -> bool:
    try:
        check_schedule(name, p, m, v)
    except PipelineLayoutError:
        return False
    return True


# Every layout the schedules accept in this range: 2 x 4 x 12 x 3 minus the rejected ones
# (and minus the known-bad ones above, tested on their own).
LAYOUTS = [
    (name, p, m, v)
    for name in SCHEDULES
    for p in range(1, 5)
    for m in range(1, 13)
    for v in range(1, 4)
    if _valid(name, p, m, v)
]


# ---------------------------------------------------------------------------------------------
# PipelineLayout


def test_layout_p2_v2_l8_deals_chunks_round_robin():
    layout = PipelineLayout(num_layers=8, stages=2, virtual=2, rank=0)
    assert layout.layers_per_chunk == 2
    assert list(layout.chunk_layers(0)) == [0, 1]
    assert list(layout.chunk_layers(1)) == [4, 5]
    assert list(layout.chunk_layers(0, rank=1)) == [2, 3]
    assert list(layout.chunk_layers(1, rank=1)) == [6, 7]
    assert layout.local_layers() == [0, 1, 4, 5]
    assert PipelineLayout(8, 2, 2, rank=1).local_layers() == [2, 3, 6, 7]
    assert layout.is_split and not PipelineLayout(8).is_split


@pytest.mark.parametrize(
    "layers,stages,virtual", [(1, 1, 1), (4, 1, 2), (8, 2, 1), (8, 2, 2), (12, 3, 2), (24, 4, 3)]
)
def test_layout_every_layer_owned_exactly_once_in_model_order(layers, stages, virtual):
    owners = {}
    for rank in range(stages):
        layout = PipelineLayout(layers, stages, virtual, rank)
        for chunk in range(virtual):
            for i in layout.chunk_layers(chunk):
                assert i not in owners, (i, owners[i], (rank, chunk))
                owners[i] = (rank, chunk)
        assert layout.local_layers() == [i for c in range(virtual) for i in layout.chunk_layers(c)]
    assert sorted(owners) == list(range(layers))
    # A micro-batch visits (rank 0, chunk 0), (1, 0), ..., (P-1, 0), (0, 1), ...: layer order.
    visits = [owners[i] for i in range(layers)]
    assert visits == sorted(visits, key=lambda rc: (rc[1], rc[0]))


@pytest.mark.parametrize("stages,virtual", [(1, 1), (2, 1), (2, 2), (4, 3)])
def test_layout_embedding_and_head_only_at_the_ends(stages, virtual):
    for rank in range(stages):
        layout = PipelineLayout(stages * virtual * 2, stages, virtual, rank)
        assert layout.has_embedding() == (rank == 0)
        assert layout.has_head() == (rank == stages - 1)
        for chunk in range(virtual):
            assert layout.has_embedding(chunk) == (rank == 0 and chunk == 0)
            assert layout.has_head(chunk) == (rank == stages - 1 and chunk == virtual - 1)


@pytest.mark.parametrize("layers,stages,virtual", [(6, 4, 1), (8, 2, 3), (4, 3, 1), (2, 2, 2)])
def test_layout_indivisible_layers_name_the_config_keys(layers, stages, virtual):
    with pytest.raises(PipelineLayoutError, match=r"model\.num_layers") as err:
        PipelineLayout(layers, stages, virtual)
    assert "parallel.pipeline" in str(err.value)
    assert "parallel.virtual_pipeline" in str(err.value)


def test_layout_rejects_empty_pipeline_and_foreign_rank():
    with pytest.raises(PipelineLayoutError, match=r"parallel\.pipeline=0"):
        PipelineLayout(4, stages=0)
    with pytest.raises(PipelineLayoutError, match=r"parallel\.virtual_pipeline=0"):
        PipelineLayout(4, stages=1, virtual=0)
    with pytest.raises(PipelineLayoutError, match="outside"):
        PipelineLayout(4, stages=2, rank=2)


# ---------------------------------------------------------------------------------------------
# Schedules as op lists


def test_layout_list_covers_both_schedules_and_interleaving():
    assert {name for name, *_ in LAYOUTS} == set(SCHEDULES)
    assert any(name == "1f1b" and v > 1 and p > 1 for name, p, _, v in LAYOUTS)
    assert len(LAYOUTS) > 150


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_chunk_microbatch_runs_forward_once_then_backward_once(name):
    for _, p, m, v in (lay for lay in LAYOUTS if lay[0] == name):
        for rank in range(p):
            ops = schedule_ops(name, p, rank, m, v)
            pairs = {(c, mu) for c in range(v) for mu in range(m)}
            forwards = [(op.chunk, op.micro) for op in ops if op.kind == "F"]
            backwards = [(op.chunk, op.micro) for op in ops if op.kind == "B"]
            assert {op.kind for op in ops} <= {"F", "B"}
            assert sorted(forwards) == sorted(pairs), (p, m, v, rank)
            assert sorted(backwards) == sorted(pairs), (p, m, v, rank)
            where = {(op.kind, op.chunk, op.micro): i for i, op in enumerate(ops)}
            for c, mu in pairs:
                assert where[("F", c, mu)] < where[("B", c, mu)], (p, m, v, rank, c, mu)


@pytest.mark.parametrize("name", SCHEDULES)
def test_each_chunk_runs_its_forwards_and_backwards_in_microbatch_order(name):
    # Backward order per chunk is the gradient accumulation order: it must be 0, 1, ..., m-1
    # as with pipeline=1 for the sums (and their rounding) to be the same.
    for _, p, m, v in (lay for lay in LAYOUTS if lay[0] == name):
        for rank in range(p):
            ops = schedule_ops(name, p, rank, m, v)
            for kind in "FB":
                for c in range(v):
                    micros = [op.micro for op in ops if op.kind == kind and op.chunk == c]
                    assert micros == list(range(m)), (p, m, v, rank, kind, c)


@pytest.mark.parametrize("p,m,v", [(2, 1, 2), (2, 3, 2), (3, 4, 2), (4, 6, 3)])
def test_all_forward_all_backward_interleaved_with_ragged_microbatches(p, m, v):
    # GPipe goes chunk by chunk, so any m works: every (chunk, micro) pair runs exactly once.
    name = "all_forward_all_backward"
    check_schedule(name, p, m, v)
    pairs = sorted((c, mu) for c in range(v) for mu in range(m))
    for rank in range(p):
        ops = schedule_ops(name, p, rank, m, v)
        assert sorted((op.chunk, op.micro) for op in ops if op.kind == "F") == pairs
        assert sorted((op.chunk, op.micro) for op in ops if op.kind == "B") == pairs


def _max_in_flight(ops: list[Op]) -> int:
    live = worst = 0
    for op in ops:
        live += 1 if op.kind == "F" else -1
        worst = max(worst, live)
    return worst


def test_1f1b_bounds_the_forwards_in_flight():
    for name, p, m, v in LAYOUTS:
        if name != "1f1b" or v != 1:
            continue
        for rank in range(p):
            ops = schedule_ops(name, p, rank, m, v)
            assert _max_in_flight(ops) == min(p - rank, m), (p, m, rank)
            # Megatron's warm-up: the first p - rank - 1 ops are forwards.
            warmup = min(p - rank - 1, m)
            assert [op.kind for op in ops[:warmup]] == ["F"] * warmup


def test_all_forward_all_backward_holds_every_microbatch():
    for name, p, m, v in LAYOUTS:
        if name == "all_forward_all_backward":
            assert _max_in_flight(schedule_ops(name, p, 0, m, v)) == m * v


def test_interleaved_1f1b_holds_fewer_than_all_forward_all_backward():
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 12, 3), (3, 9, 2)]:
        for rank in range(p):
            held = _max_in_flight(schedule_ops("1f1b", p, rank, m, v))
            assert held < m * v, (p, m, v, rank)


def _messages(name: str, p: int, m: int, v: int):
    """Per (src, dst, stream): the messages in the order src sends them and in the order dst
    receives them, by the engine's rules. A message is (producer's global chunk, micro)."""
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}
    last = p * v - 1
    for rank in range(p):
        for op in schedule_ops(name, p, rank, m, v):
            g = op.chunk * p + rank  # position of this chunk in the model
            if op.kind == "F":
                if g > 0:
                    received.setdefault(((rank - 1) % p, rank, "act"), []).append((g - 1, op.micro))
                if g < last:
                    sent.setdefault((rank, (rank + 1) % p, "act"), []).append((g, op.micro))
            else:
                if g < last:
                    received.setdefault(((rank + 1) % p, rank, "grad"), []).append(
                        (g + 1, op.micro)
                    )
                if g > 0:
                    sent.setdefault((rank, (rank - 1) % p, "grad"), []).append((g, op.micro))
    return sent, received


@pytest.mark.parametrize("name", SCHEDULES)
def test_messages_are_received_in_the_order_they_are_sent(name):
    # The engine's blocking recv takes whatever arrives next from that rank on that group.
    for _, p, m, v in (lay for lay in LAYOUTS if lay[0] == name):
        sent, received = _messages(name, p, m, v)
        assert sent == received, (p, m, v)


def _plans(name: str, p: int, m: int, v: int, forward_only: bool = False) -> list[list[Op]]:
    plans = [schedule_ops(name, p, r, m, v) for r in range(p)]
    return [[op for op in plan if op.kind == "F"] for plan in plans] if forward_only else plans


def _sends(plans: list[list[Op]], p: int, v: int) -> dict[tuple[int, int], tuple[int, int]]:
    """(rank, op index) of each send -> (rank, op index) of the op receiving it: the engine's
    rules, worked out from global chunk positions (independently of ``schedules._producer``)."""
    where = {}
    for r, plan in enumerate(plans):
        for i, op in enumerate(plan):
            where[(op.kind, op.chunk * p + r, op.micro)] = (r, i)
    sends = {}
    for r, plan in enumerate(plans):
        for i, op in enumerate(plan):
            g = op.chunk * p + r
            to = ("F", g + 1, op.micro) if op.kind == "F" else ("B", g - 1, op.micro)
            if to in where:
                sends[(r, i)] = where[to]
    return sends


def _happens_before(plans: list[list[Op]], sends) -> dict[tuple[int, int], set]:
    """For each op, every op (any rank) whose receive has completed before its own receive
    completes: program order plus messages, closed transitively."""
    into: dict[tuple[int, int], list] = {}
    for src, dst in sends.items():
        into.setdefault(dst, []).append(src)
    before: dict[tuple[int, int], set] = {}

    def visit(node):
        if node not in before:
            r, i = node
            got = {node}
            preds = ([(r, i - 1)] if i else []) + into.get(node, [])
            for pred in preds:
                got |= visit(pred)
            before[node] = got
        return before[node]

    for r, plan in enumerate(plans):
        for i in range(len(plan)):
            visit((r, i))
    return before


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("forward_only", [False, True], ids=["training", "forward_only"])
def test_sends_are_released_at_the_first_receive_that_proves_them_delivered(name, forward_only):
    # Waiting on a released send returns at once (its receiver has it), so the engine's
    # waits cannot deadlock; and no later than needed: one op earlier proves nothing.
    for _, p, m, v in (lay for lay in LAYOUTS if lay[0] == name and lay[1] > 1 and lay[2] <= 8):
        plans = _plans(name, p, m, v, forward_only)
        sends = _sends(plans, p, v)
        before = _happens_before(plans, sends)
        releases = send_releases(plans, p, v, hold=None)
        for r, plan in enumerate(plans):
            released = [s for i in range(len(plan)) for s in releases[r][i]]
            assert len(released) == len(set(released)), (name, p, m, v, r)
            for i in range(len(plan)):
                for s in releases[r][i]:
                    assert s < i and (r, s) in sends, (name, p, m, v, r, i, s)
                    assert sends[(r, s)] in before[(r, i)], (name, p, m, v, r, i, s)
                    assert sends[(r, s)] not in before[(r, i - 1)], (name, p, m, v, r, i, s)
            for s in set(i for rr, i in sends if rr == r) - set(released):
                assert sends[(r, s)] not in before[(r, len(plan) - 1)], (name, p, m, v, r, s)


def _most_in_flight(
    name: str, p: int, m: int, v: int, forward_only: bool = False, kind: str = "FB"
) -> list[int]:
    """Per rank: the most sends (of ops of ``kind``) posted and not yet released at once (the
    engine's count)."""
    return _in_flight(_plans(name, p, m, v, forward_only), p, v, kind)


def _in_flight(plans: list[list[Op]], p: int, v: int, kind: str = "FB") -> list[int]:
    sends, releases = _sends(plans, p, v), send_releases(plans, p, v)
    out = []
    for r, plan in enumerate(plans):
        live = worst = 0
        for i, op in enumerate(plan):
            live += ((r, i) in sends and op.kind in kind) - sum(
                plan[s].kind in kind for s in releases[r][i]
            )
            worst = max(worst, live)
        out.append(worst)
    return out


def _step_ends(plans, sends, releases, cost) -> list[float]:
    """Per rank, when its step ends (last op done and every send waited for) if each op takes
    ``cost(rank, op)`` and communication is free: an op starts once its rank's previous op, its
    input's producer and the receivers of the sends it waits for (having reached their
    receiving op) are done. Raises if that dataflow has a cycle (a deadlock)."""
    producer = {dst: src for src, dst in sends.items()}
    end: dict[tuple[int, int], float] = {}
    pos, remaining = [0] * len(plans), sum(map(len, plans))
    while remaining:
        progressed = False
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                i = pos[r]
                deps = [(r, i - 1)] if i else []
                deps += [producer[(r, i)]] if (r, i) in producer else []
                deps += [(q, j - 1) for q, j in (sends[(r, s)] for s in releases[r][i]) if j]
                if any(d not in end for d in deps):
                    break
                end[(r, i)] = max([end[d] for d in deps], default=0.0) + cost(r, plan[i])
                pos[r], remaining, progressed = i + 1, remaining - 1, True
        if not progressed:
            raise RuntimeError("the waits deadlock")
    out = []
    for r, plan in enumerate(plans):
        waited = {s for ops in releases[r] for s in ops}
        unwaited = [dst for (rr, s), dst in sends.items() if rr == r and s not in waited]
        last = [end[(q, j - 1)] if j else 0.0 for q, j in unwaited]  # the step's end waits
        out.append(max([end[(r, len(plan) - 1)], *last]))
    return out


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("forward_only", [False, True], ids=["training", "forward_only"])
def test_sends_no_receive_proves_are_waited_for_without_deadlock_or_delay(name, forward_only):
    # With ``hold`` the releases are the proven ones (same ops) plus, for a send no receive
    # ever proves, a wait ``hold`` ops or more after it was posted; that wait blocks until
    # the receiver reaches its receive. Checked on a timed model independent of
    # ``send_releases``: no cycle, and no step (slowest rank) gets longer, whether the last
    # stage is as fast, slower or faster than the others, nor, in training, any rank's.
    for _, p, m, v in (lay for lay in LAYOUTS if lay[0] == name and lay[1] > 1):
        plans = _plans(name, p, m, v, forward_only)
        sends = _sends(plans, p, v)
        proven, held = send_releases(plans, p, v, hold=None), send_releases(plans, p, v)
        for r, plan in enumerate(plans):
            never = {s for rr, s in sends if rr == r} - {s for ops in proven[r] for s in ops}
            for i in range(len(plan)):
                extra = set(held[r][i]) - set(proven[r][i])
                assert set(proven[r][i]) <= set(held[r][i]), (name, p, m, v, r, i)
                assert all(s in never and s <= i - HOLD for s in extra), (name, p, m, v, r, i)
        for slow in (1.0, 3.0, 0.5):

            def cost(r, op, p=p, slow=slow):
                return (1.0 if op.kind == "F" else 2.0) * (slow if r == p - 1 else 1.0)

            before = _step_ends(plans, sends, proven, cost)
            after = _step_ends(plans, sends, held, cost)
            assert max(after) == max(before), (name, p, m, v, slow)
            if not forward_only:  # forward-only: a rank ahead of a slow one waits (the end
                assert after == before, (name, p, m, v, slow)  # gathers them all anyway)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("p", [2, 3, 4])
def test_forward_only_sends_in_flight_are_bounded_without_interleaving(name, p):
    # Evaluation: nothing comes back, so no receive ever proves a send delivered; without
    # ``hold`` each micro-batch left one payload (no graph holds it) until the pass ended.
    for m in (2 * p, 4 * p, 16 * p):
        assert _most_in_flight(name, p, m, 1, forward_only=True) == [HOLD] * (p - 1) + [0]


@pytest.mark.parametrize("p,v", [(2, 2), (4, 2), (3, 3)])
def test_forward_only_interleaved_is_bounded_in_groups_not_chunk_by_chunk(p, v):
    # Interleaved, the last rank's sends wrap to the first, which takes them in its next
    # chunk. Chunk by chunk (``all_forward_all_backward``'s order, the evaluation's), it takes
    # them only after all its m forwards of the chunk before: m payloads must live somewhere,
    # whatever waits. In 1F1B's order (groups of p micro-batches through the chunks) the
    # count does not grow.
    grouped = [_most_in_flight("1f1b", p, k * p, v, forward_only=True) for k in (2, 4, 16)]
    assert grouped[0] == grouped[1] == grouped[2] and max(grouped[0]) <= 2 * p
    name = "all_forward_all_backward"
    chunked = [max(_most_in_flight(name, p, k * p, v, forward_only=True)) for k in (2, 4, 16)]
    assert chunked == [2 * p, 4 * p, 16 * p]


@pytest.mark.parametrize("p", [1, 2, 3, 4])
def test_forward_only_ops_are_bounded_and_no_slower_than_chunk_by_chunk(p):
    # Groups of p micro-batches through the chunks (the last group takes the rest: alone, a
    # short group would stall the pipe): every forward once, each chunk in micro-batch order
    # (losses sum as before), no step longer than chunk by chunk in the timed model, and the
    # sends in flight stop growing with m (at most 3p - 1 here, HOLD without interleaving).
    name = "all_forward_all_backward"
    for v in (1, 2, 3):
        for m in range(1, 13):
            plans = [forward_only_ops(p, r, m, v) for r in range(p)]
            chunked = _plans(name, p, m, v, forward_only=True)
            for plan in plans:
                for c in range(v):
                    assert [op.micro for op in plan if op.chunk == c] == list(range(m))
                assert sorted(plan, key=lambda op: (op.chunk, op.micro)) == chunked[0]
            if v == 1:
                assert plans == chunked
            for slow in (1.0, 3.0, 0.5):

                def cost(r, op, p=p, slow=slow):
                    return slow if r == p - 1 else 1.0

                grouped, before = (
                    max(_step_ends(x, _sends(x, p, v), send_releases(x, p, v), cost))
                    for x in (plans, chunked)
                )
                assert grouped <= before, (p, v, m, slow)
        counts = [max(_in_flight([forward_only_ops(p, r, k * p, v) for r in range(p)], p, v))
                  for k in (2, 4, 16)]  # fmt: skip
        assert counts[0] == counts[1] == counts[2] <= (HOLD if v == 1 else 3 * p - 1), (p, v)


@pytest.mark.parametrize("p,v", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
def test_all_forward_all_backward_sends_in_flight_never_exceed_the_activations(p, v):
    # All forwards first: every micro-batch's activations are held when the backwards begin,
    # the step's peak. A forward's send is its output, held for the backward anyway (the same
    # storage), and let go at the first backward's receive. A backward's send is the input's
    # gradient; without interleaving, nothing comes back upstream, and ``hold`` bounds them.
    # Interleaved, a chunk's gradients go to the previous rank's next chunk, which takes them
    # only after its own m backwards: they must live, and grow with m. What bounds them: each
    # is sent by a backward that has just freed its micro-batch's activations (the received
    # input among them, the same size), so at no op do gradients in flight plus micro-batches
    # held exceed m * v, the count at the end of the forwards.
    name = "all_forward_all_backward"
    for m in (2 * p, 4 * p, 16 * p):
        plans = _plans(name, p, m, v)
        sends, releases = _sends(plans, p, v), send_releases(plans, p, v)
        for r, plan in enumerate(plans):
            held = grads = 0
            for i, op in enumerate(plan):
                held += 1 if op.kind == "F" else -1
                grads += (op.kind == "B" and (r, i) in sends) - sum(
                    plan[s].kind == "B" for s in releases[r][i]
                )
                assert held + grads <= m * v, (p, v, m, r, i)
            freed = {plan[s]: i for i in range(len(plan)) for s in releases[r][i]}
            for i, op in enumerate(plan):  # a forward's payload is let go with its output
                if op.kind == "F" and (r, i) in sends:
                    assert freed[op] <= plan.index(Op("B", op.chunk, op.micro)), (p, v, m, r)
        if v == 1:
            assert max(_most_in_flight(name, p, m, v, kind="B")) <= HOLD, (p, m)


@pytest.mark.parametrize("p,v", [(2, 1), (3, 1), (4, 1), (2, 2), (4, 2), (3, 3)])
def test_1f1b_sends_in_flight_do_not_grow_with_the_microbatches(p, v):
    # Each micro-batch used to leave its sends' payloads until the step ended.
    small = _most_in_flight("1f1b", p, 2 * p, v)
    assert _most_in_flight("1f1b", p, 16 * p, v) == small
    assert max(small) <= 2 * p * v
    if v == 1:  # a forward's send is let go by that micro-batch's backward (with its output)
        plans = _plans("1f1b", p, 4 * p, 1)
        releases = send_releases(plans, p)
        for r in range(p - 1):
            freed = {plans[r][s]: i for i in range(len(plans[r])) for s in releases[r][i]}
            for i, op in enumerate(plans[r]):
                if op.kind == "B":
                    assert freed[Op("F", 0, op.micro)] <= i, (p, r, op)


@pytest.mark.parametrize("name,p,m,v", LAYOUTS, ids=lambda x: str(x))
def test_simulate_completes_and_matches_the_closed_form_bubble(name, p, m, v):
    result = simulate(name, p, m, v, t_forward=1.0, t_backward=2.0)
    assert result["busy"] == pytest.approx([3.0 * m] * p)
    if name == "all_forward_all_backward" and v > 1 and m < p:
        # Chunk-major GPipe with fewer micro-batches than stages: a chunk's micro-batches
        # cannot fill the pipeline before the next chunk needs it, so the closed form (which
        # assumes they can) is a lower bound here.
        assert max(result["bubble"]) >= theoretical_bubble(p, m, v) - 1e-9
        return
    assert max(result["bubble"]) == pytest.approx(theoretical_bubble(p, m, v), abs=1e-9)
    assert min(result["bubble"]) >= -1e-12


def test_theoretical_bubble_closed_forms():
    assert theoretical_bubble(1, 8) == 0.0
    assert theoretical_bubble(4, 8) == pytest.approx(3 / 11)
    assert theoretical_bubble(4, 8, 2) == pytest.approx(3 / 19)
    assert theoretical_bubble(2, 2, 3) == pytest.approx(1 / 7)


def test_simulated_bubble_with_uneven_forward_backward_costs():
    # The closed form holds for any t_f:t_b as long as every stage costs the same.
    for name, p, m, v in [
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 8, 2),
        ("all_forward_all_backward", 3, 5, 1),
    ]:
        result = simulate(name, p, m, v, t_forward=0.7, t_backward=3.1)
        assert max(result["bubble"]) == pytest.approx(theoretical_bubble(p, m, v), abs=1e-9)


def test_interleaving_strictly_lowers_the_bubble():
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p):
            plain = max(simulate("1f1b", p, m, 1)["bubble"])
            for v in (2, 3):
                interleaved = max(simulate("1f1b", p, m, v)["bubble"])
                assert interleaved < plain - 1e-9, (p, m, v, interleaved, plain)


@pytest.mark.parametrize("p,m", [(4, 2), (4, 6), (2, 3), (3, 4)])
def test_interleaved_1f1b_needs_a_multiple_of_the_stages(p, m):
    with pytest.raises(PipelineLayoutError) as err:
        check_schedule("1f1b", p, m, 2)
    assert "parallel.virtual_pipeline" in str(err.value)
    assert re.search(r"parallel\.pipeline\b(?!_)", str(err.value))
    with pytest.raises(PipelineLayoutError):
        schedule_ops("1f1b", p, 0, m, 2)
    # Without interleaving, or filling all forwards first, any micro-batch count works.
    check_schedule("1f1b", p, m, 1)
    check_schedule("all_forward_all_backward", p, m, 2)


def test_unknown_schedule_and_no_microbatches_are_rejected():
    with pytest.raises(PipelineLayoutError, match=r"parallel\.pipeline_schedule"):
        check_schedule("gpipe", 2, 4)
    with pytest.raises(PipelineLayoutError, match=r"parallel\.pipeline_schedule"):
        schedule_ops("interleaved", 2, 0, 4, 2)
    with pytest.raises(PipelineLayoutError, match="micro-batch"):
        check_schedule("1f1b", 2, 0)


# ---------------------------------------------------------------------------------------------
# The executor on real gloo ranks

BATCH, HIDDEN = 3, 5


def _weight(g: int) -> torch.Tensor:
    w = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(100 + g))
    return (w / HIDDEN**0.5).double().requires_grad_()


def _input(micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + micro)
    return torch.randn(BATCH, HIDDEN, generator=gen, dtype=torch.float64)


def _loss(y: torch.Tensor, m: int) -> torch.Tensor:
    return (y * y).sum() / m


def _reference(chunks: int, m: int):
    """The whole chain in one process, micro-batch after micro-batch: (grads, losses)."""
    weights = [_weight(g) for g in range(chunks)]
    losses = []
    for micro in range(m):
        x = _input(micro)
        for w in weights:
            x = torch.tanh(x @ w)
        loss = _loss(x, m)
        loss.backward()
        losses.append(loss.item())
    return [w.grad for w in weights], losses


def _engine_worker(rank: int, world: int, init_file: str, out_dir: str, configs) -> None:
    from parallel.pipeline.engine import PipelineEngine, PipelineGroups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=30),
    )  # fmt: skip
    ranks = list(range(world))
    groups = PipelineGroups(ranks, dist.new_group(ranks), dist.new_group(ranks), dist.group.WORLD)
    results = {}
    for name, m, v in configs:
        layout = PipelineLayout(world * v, world, v, rank)
        chunks = world * v
        weights = [_weight(c * world + rank) for c in range(v)]
        losses: dict[int, float] = {}

        def forward(chunk, micro, x, weights=weights, losses=losses, m=m, v=v, chunks=chunks):
            g = chunk * world + rank
            assert (x is None) == (g == 0)
            if x is not None:
                assert x.shape == (BATCH, HIDDEN) and x.dtype == torch.float64
            y = torch.tanh((_input(micro) if x is None else x) @ weights[chunk])
            if g == chunks - 1:
                loss = _loss(y, m)
                losses[micro] = loss.item()
                return loss
            return y

        engine = PipelineEngine(layout, groups, (BATCH, HIDDEN), torch.float64, torch.device("cpu"))
        plans = _plans(name, world, m, v)
        engine.run(plans[rank], forward, releases=send_releases(plans, world, v)[rank])
        results[f"{name}/m={m}/v={v}/pending/rank{rank}"] = engine.peak_pending
        ref_grads, ref_losses = _reference(chunks, m)
        key = f"{name}/m={m}/v={v}"
        for c, w in enumerate(weights):
            ref = ref_grads[c * world + rank]
            results[f"{key}/W{c * world + rank}"] = {
                "has_grad": w.grad is not None,
                "equal": w.grad is not None and torch.equal(w.grad, ref),
                "err": (w.grad - ref).abs().max().item() if w.grad is not None else None,
            }
        if layout.has_head():
            results[f"{key}/losses"] = {
                "equal": [losses.get(i) for i in range(m)] == ref_losses,
                "got": [losses.get(i) for i in range(m)],
            }
        # Forward only (evaluation): no graph, no backward ops, same losses; the schedule's
        # forwards ("eval") and ``forward_only_ops``'s groups ("grouped").
        for label, plans in (
            ("eval", _plans(name, world, m, v, forward_only=True)),
            ("grouped", [forward_only_ops(world, r, m, v) for r in range(world)]),
        ):
            losses.clear()
            with torch.no_grad():
                releases = send_releases(plans, world, v)[rank]
                engine.run(plans[rank], forward, backward=False, releases=releases)
            results[f"{key}/{label}_pending/rank{rank}"] = engine.peak_pending
            if layout.has_head():
                got = [losses.get(i) for i in range(m)]
                results[f"{key}/{label}_losses"] = {"equal": got == ref_losses, "got": got}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    end_worker()


# (schedule, micro-batches, virtual chunks) run in one set of processes per stage count: m < p,
# m == p and m > p without interleaving, m == p (all forwards first) and m == 2p interleaved.
ENGINE_CASES = {
    p: [
        (name, m, v)
        for name in SCHEDULES
        for m, v in dict.fromkeys([(1, 1), (p - 1, 1), (p, 1), (p + 1, 1), (p, 2), (2 * p, 2)])
    ]
    + [("1f1b", 4 * p, 1), ("1f1b", 4 * p, 2)]  # sends in flight do not grow with m
    + [("all_forward_all_backward", 4 * p, 1)]  # nor its backward's, nor evaluation's
    + [("all_forward_all_backward", 2 * p + 1, 2)]  # evaluation's groups, the last one longer
    for p in (2, 4)
}


@pytest.fixture(scope="module", params=sorted(ENGINE_CASES), ids=lambda p: f"pp{p}")
def engine_results(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"pipeline_engine_{world}")
    configs = ENGINE_CASES[world]
    # Forked, not spawned: the children inherit the imported torch. Fresh interpreters pay
    # ~1.5 s of imports per rank, over 15 s for 4 ranks on 2 busy cores (the ranks' own work
    # is under 2 s).
    mp.start_processes(
        _engine_worker,
        args=(world, str(out / "init"), str(out), configs),
        nprocs=world,
        start_method="fork",
    )
    merged = {}
    for rank in range(world):
        merged.update(json.loads((out / f"rank{rank}.json").read_text()))
    return world, merged


def test_engine_gradients_are_bitwise_those_of_one_process(engine_results):
    world, results = engine_results
    for name, m, v in ENGINE_CASES[world]:
        for g in range(world * v):
            r = results[f"{name}/m={m}/v={v}/W{g}"]
            assert r["has_grad"] and r["equal"], (name, m, v, g, r)


def test_engine_lets_sends_go_as_the_step_goes(engine_results):
    # The engine's count of sends in flight is the schedule's (``send_releases``), and with
    # 1F1B it does not grow from 2p (p + 1 without interleaving) to 4p micro-batches.
    world, results = engine_results
    for name, m, v in ENGINE_CASES[world]:
        got = [results[f"{name}/m={m}/v={v}/pending/rank{r}"] for r in range(world)]
        assert got == _most_in_flight(name, world, m, v), (name, m, v)
        got = [results[f"{name}/m={m}/v={v}/eval_pending/rank{r}"] for r in range(world)]
        assert got == _most_in_flight(name, world, m, v, forward_only=True), (name, m, v)
        if v == 1:  # evaluation without interleaving: ``hold``, from 2 to 4p micro-batches
            assert got == [min(HOLD, m)] * (world - 1) + [0], (name, m)
        plans = [forward_only_ops(world, r, m, v) for r in range(world)]
        got = [results[f"{name}/m={m}/v={v}/grouped_pending/rank{r}"] for r in range(world)]
        assert got == _in_flight(plans, world, v), (name, m, v)
    for v, fewer in ((1, world + 1), (2, 2 * world)):
        for r in range(world):

            def key(m, v=v, r=r):
                return f"1f1b/m={m}/v={v}/pending/rank{r}"

            assert results[key(4 * world)] == results[key(fewer)], (v, r)


def test_engine_losses_match_in_training_and_forward_only(engine_results):
    world, results = engine_results
    for name, m, v in ENGINE_CASES[world]:
        assert results[f"{name}/m={m}/v={v}/losses"]["equal"], (name, m, v)
        assert results[f"{name}/m={m}/v={v}/eval_losses"]["equal"], (name, m, v)
        assert results[f"{name}/m={m}/v={v}/grouped_losses"]["equal"], (name, m, v)

"""Pipeline bubble per schedule: the closed form, the schedule simulator, and the real engine.

    .venv/bin/python -m benchmarks.bench_pipeline [--stages 2 4] [--micro 4 8] [--t-forward 0.02]
        [--steps 3] [--write docs/BENCHMARKS.md]

For each schedule (all_forward_all_backward, 1f1b, 1f1b interleaved with ``--virtual`` chunks per
stage) and each (stages p, micro-batches m) this prints the theoretical bubble ``(p-1)/(m+p-1)``
(interleaved ``(p-1)/(v*m+p-1)``), the bubble ``schedules.simulate`` computes from the op lists
with free communication, and the bubble MEASURED by running ``PipelineEngine`` over real gloo
process groups with p processes on this machine.

Why the stages sleep instead of computing: a chunk's forward sleeps ``t_forward / v`` and its
backward (a tiny autograd function) ``t_backward / v``. Sleeping ranks do not compete for cores,
so 4 ranks on a 2-core machine still run their stages side by side, and what is measured is the
schedule and the point-to-point engine (blocking receives, eager sends, Python per op), not how
the OS shares CPUs among processes doing real GEMMs.

Measured bubble of a rank = 1 - (seconds inside forward/backward compute) / (step wall time, from
a barrier before the step to a barrier after it). One warm-up step, then ``--steps`` steps summed;
the table gives the max and the mean over ranks, and max / theory. Each rank waits for its sends
where ``schedules.send_releases`` says, as training does; the last column is the most sends a rank
held at once. ``--write`` puts the table with the date and the command between markers in the
benchmarks document.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import bench_docs  # noqa: E402
from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError  # noqa: E402
from parallel.pipeline.schedules import (  # noqa: E402
    check_schedule,
    schedule_ops,
    send_releases,
    simulate,
    theoretical_bubble,
)

__all__ = ["SCHEDULE_ROWS", "measure", "table", "write_section"]

# (label, schedule name, interleaved?) in table order.
SCHEDULE_ROWS = (
    ("all_forward_all_backward", "all_forward_all_backward", False),
    ("1f1b", "1f1b", False),
    ("1f1b interleaved", "1f1b", True),
)
SHAPE = (4, 8)  # the activation exchanged between stages: tiny, the p2p cost is latency


class _Busy:
    """Seconds this rank spent inside forward/backward compute."""

    def __init__(self):
        self.seconds = 0.0


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a stage's backward compute, timed."""

    @staticmethod
    def forward(ctx, x, seconds, busy):
        ctx.seconds, ctx.busy = seconds, busy
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        start = time.perf_counter()
        time.sleep(ctx.seconds)
        ctx.busy.seconds += time.perf_counter() - start
        return grad, None, None


def _worker(rank: int, world: int, init_file: str, out_dir: str, configs, args) -> None:
    from parallel.pipeline.engine import PipelineEngine, PipelineGroups

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )  # fmt: skip
    ranks = list(range(world))
    groups = PipelineGroups(ranks, dist.new_group(ranks), dist.new_group(ranks), dist.group.WORLD)
    t_f, t_b = args.t_forward, args.t_backward
    rows = []
    for label, name, m, v in configs:
        layout = PipelineLayout(world * v, world, v, rank)
        weights = [torch.ones(SHAPE, requires_grad=True) for _ in range(v)]
        busy = _Busy()

        def forward(chunk, micro, x, weights=weights, busy=busy, layout=layout, m=m, v=v):
            start = time.perf_counter()
            time.sleep(t_f / v)
            w = weights[chunk]
            y = _SleepInBackward.apply(w * 1.0 if x is None else x * w, t_b / v, busy)
            busy.seconds += time.perf_counter() - start
            return y.sum() / m if layout.has_head(chunk) else y

        engine = PipelineEngine(layout, groups, SHAPE, torch.float32, torch.device("cpu"))
        # As training runs it: each send waited for where send_releases says (mid-step).
        plans = [schedule_ops(name, world, r, m, v) for r in range(world)]
        ops, releases = plans[rank], send_releases(plans, world, v)[rank]
        walls, works = [], []
        for _ in range(1 + args.steps):
            busy.seconds = 0.0
            dist.barrier()
            start = time.perf_counter()
            engine.run(ops, forward, releases=releases)
            dist.barrier()
            walls.append(time.perf_counter() - start)
            works.append(busy.seconds)
        # Step 0 warms up.
        rows.append(
            {
                "label": label, "m": m, "v": v, "walls": walls[1:], "busy": works[1:],
                "in_flight": engine.peak_pending,
            }
        )  # fmt: skip
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def measure(stages: int, micros: list[int], args) -> list[dict]:
    """One row per (m, schedule) for ``stages`` ranks: theory, simulation, measurement."""
    configs = []
    for m in micros:
        for label, name, interleaved in SCHEDULE_ROWS:
            v = args.virtual if interleaved else 1
            try:
                check_schedule(name, stages, m, v)
            except PipelineLayoutError:
                continue  # interleaving needs m a multiple of p
            configs.append((label, name, m, v))
    with tempfile.TemporaryDirectory() as tmp:
        # Forked, not spawned: the children inherit the imported torch instead of paying its
        # import again per rank (many seconds with 4 ranks on 2 cores).
        mp.start_processes(
            _worker,
            args=(stages, str(Path(tmp) / "init"), tmp, configs, args),
            nprocs=stages,
            start_method="fork",
        )
        per_rank = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(stages)]
    rows = []
    for i, (label, name, m, v) in enumerate(configs):
        measured = [1.0 - sum(rk[i]["busy"]) / sum(rk[i]["walls"]) for rk in per_rank]
        sim = simulate(name, stages, m, v, args.t_forward, args.t_backward)
        rows.append(
            {
                "schedule": label,
                "p": stages,
                "m": m,
                "v": v,
                "theory": theoretical_bubble(stages, m, v),
                "simulated": max(sim["bubble"]),
                "max": max(measured),
                "mean": sum(measured) / len(measured),
                "step_ms": 1e3 * max(sum(rk[i]["walls"]) for rk in per_rank) / args.steps,
                "ideal_ms": 1e3 * sim["makespan"],
                "in_flight": max(rk[i]["in_flight"] for rk in per_rank),
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| schedule | p | m | v | theory | simulated | measured (max over ranks) "
        "| measured (mean) | max / theory | step ms (measured) | step ms (simulated) "
        "| sends in flight |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['schedule']} | {r['p']} | {r['m']} | {r['v']} | {r['theory']:.3f} | "
            f"{r['simulated']:.3f} | {r['max']:.3f} | {r['mean']:.3f} | "
            f"{r['max'] / r['theory']:.2f} | {r['step_ms']:.0f} | {r['ideal_ms']:.0f} | "
            f"{r['in_flight']} |"
        )
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """How far the measurement is from theory, and whether interleaving still wins, from the
    numbers themselves."""
    excess = [r["max"] - r["theory"] for r in rows]
    ratios = [r["max"] / r["theory"] for r in rows]
    extra_ms = [r["step_ms"] - r["ideal_ms"] for r in rows]
    groups: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        groups.setdefault((r["p"], r["m"]), {})[r["schedule"]] = r["max"]
    label = SCHEDULE_ROWS[-1][0]
    contested = [g for g in groups.values() if label in g and len(g) > 1]
    wins = sum(g[label] == min(g.values()) for g in contested)
    text = (
        f"Measured bubbles sit {min(excess) * 100:.1f} to {max(excess) * 100:.1f} percentage "
        f"points above the closed form (max / theory {min(ratios):.2f} to {max(ratios):.2f}): "
        f"each step takes {min(extra_ms):.0f} to {max(extra_ms):.0f} ms longer than the "
        "simulated schedule with free communication."
    )
    # A uniform schedule's critical path is 2 (v m + p - 1) ops of 1/v the stage time each.
    per_op = sorted(
        (r["step_ms"] - r["ideal_ms"]) / (2 * (r["v"] * r["m"] + r["p"] - 1)) for r in rows
    )[len(rows) // 2]
    text += (
        f" That is about {per_op:.1f} ms per op on the critical path (median), the cost the "
        "simulator treats as free: Python and autograd around each op, the gloo hand-off (a "
        "message is matched only when the op that needs it posts its receive) and waking a "
        "sleeping process. Interleaving runs v times as many ops, each 1/v as long, with v "
        "times the stage-to-stage hops, so it pays that cost v times over."
    )
    if contested:
        inter = [r["max"] / r["theory"] for r in rows if r["schedule"] == label]
        other = [r["max"] / r["theory"] for r in rows if r["schedule"] != label]
        text += (
            f" Max / theory averages {sum(inter) / len(inter):.2f} for {label} against "
            f"{sum(other) / max(len(other), 1):.2f} for the others, yet {label} has the lowest "
            f"measured bubble in {wins} of {len(contested)} (p, m) settings."
        )
    return text


HEADING = "## Pipeline bubble per schedule (CPU, gloo, sleeping stages)"


def write_section(doc: Path, body: str) -> None:
    """Replace the block between this tool's markers, or append it under its heading."""
    bench_docs.write_section(doc, body, "bench_pipeline", HEADING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--micro", type=int, nargs="+", help="micro-batches per step (default: p, 2p and 4p)"
    )
    parser.add_argument("--virtual", type=int, default=2, help="chunks per stage, interleaved")
    parser.add_argument("--t-forward", type=float, default=0.02, help="seconds per stage forward")
    parser.add_argument(
        "--t-backward", type=float, help="seconds per stage backward (default 2 x --t-forward)"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up")
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args()
    if args.t_backward is None:
        args.t_backward = 2 * args.t_forward
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    load = os.getloadavg()[0]
    rows = []
    for p in args.stages:
        rows += measure(p, args.micro or [p, 2 * p, 4 * p], args)
    result = table(rows)
    print(result)
    print()
    print(summary(rows))
    if args.write:
        command = bench_docs.command_line(
            ".venv/bin/python -m benchmarks.bench_pipeline", sys.argv[1:]
        )
        body = (
            f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} CPU cores, "
            f"torch {torch.__version__}, 1-minute load average {load:.1f} before the run, with "
            f"`{command}`: p gloo processes on this machine, "
            f"each stage's forward sleeps {args.t_forward * 1e3:g} ms / v and its backward "
            f"{args.t_backward * 1e3:g} ms / v, one warm-up step then {args.steps} timed steps. "
            "The stages sleep instead of computing so that the measurement is about the "
            "schedule and the point-to-point engine, not about p processes sharing the CPU "
            "cores. Bubble = 1 - (time inside forward/backward) / (step wall time between two "
            'barriers), per rank; "simulated" is `schedules.simulate` (same op lists, free '
            'communication), "theory" (p-1)/(v*m+p-1); "sends in flight" is the most sends a '
            "rank held at once (`PipelineEngine.peak_pending`, the sends waited for mid-step "
            "where `schedules.send_releases` places them, as in training).\n\n"
            f"{result}\n\n{summary(rows)}"
        )
        write_section(REPO / args.write, body)


if __name__ == "__main__":
    main()

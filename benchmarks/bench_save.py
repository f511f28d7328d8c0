"""The step stall of a checkpoint save: synchronous against asynchronous (async_save).

    .venv/bin/python -m benchmarks.bench_save [--world 2] [--level te] [--interval 5] [--saves 4]
        [--rounds 2] [--warmup 3] [--write docs/BENCHMARKS.md]

Forks ``--world`` gloo ranks, each building the tiny GPT of ``configs/gpt_tiny.yaml`` once
(``--layers`` changes its depth) and training it; the two modes take turns on the same model
in the same processes (``--rounds`` blocks of each, in alternating order, so that a load that
changes during the run weighs on both alike). A block is ``--saves`` save cycles of
``--interval`` steps, each cycle ending with a save into the mode's own directory, then
``--interval`` more steps, so the last background write overlaps training too, and a
``finish`` (the run's end) whose waiting counts as blocked time. Every step starts after a
barrier and is timed on every rank (``train_step``, the saver's ``poll``, the save); per step
the slowest rank counts. Per mode:

* clean step: the median of the steps that are neither save steps nor overlap a background
  write (none overlaps in the synchronous mode);
* save step: the median of the save steps' times, and the stall, that minus the clean step;
* blocked: the median time the main thread spent in the save call (copy to host memory and
  ``begin_save`` when asynchronous, the whole save when synchronous); poll/finish: the time in
  ``poll`` and ``finish`` (the per-step all-reduce while a save is in flight, publication, and
  waiting for a write that outlasted its cycle), per save;
* overlap: steps during which rank 0's writer thread ran (per save), and their median minus
  the clean step: what a background write costs the training it shares the cores with;
* write: how long rank 0's background write took (median);
* total extra per save: over every timed step, the sum of (step time minus clean step),
  divided by the number of saves: the whole wall-clock cost of saving, noise included.

``--write`` puts the table, the date, the machine, the load and the command between this
tool's markers in the benchmarks document.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: the ranks share the cores

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import bench_docs  # noqa: E402
from checkpoint.async_writer import CheckpointSaver  # noqa: E402
from data.sampler import micro_batches  # noqa: E402
from parallel.topology import destroy_distributed  # noqa: E402
from training.checkpointer import checkpoint_files  # noqa: E402
from training.config import load_config  # noqa: E402
from training.setup import build_run  # noqa: E402
from training.step import train_step  # noqa: E402

__all__ = ["MODES", "measure", "summarise", "table", "write_section"]

MODES = ("sync", "async")
CONFIG = "configs/gpt_tiny.yaml"
TAG = "bench_save"
HEADING = "## Checkpoint saving: step stall, synchronous against asynchronous (CPU)"


def _overrides(args, out: str) -> list[str]:
    values = {
        "precision.level": args.level,
        "model.num_layers": args.layers,
        "training.train_iters": args.warmup + 2 * args.rounds * args.interval * (args.saves + 1),
        "parallel.backend": "gloo",
        "precision.fp8_gemm_backend": "emulated",  # "auto" would time both backends first
        "data.cache_dir": str(REPO / ".cache" / "data"),  # the default corpus, built once
        "checkpoint.resume": "false",
        "logging.dir": f"{out}/run",
    }
    return [f"{k}={v}" for k, v in values.items()]


def _order(round_: int) -> tuple[str, ...]:
    return MODES if round_ % 2 == 0 else MODES[::-1]


def _worker(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    cfg = load_config(str(REPO / CONFIG), _overrides(args, out))
    state = build_run(cfg)
    topo = state.groups.topology
    n_micro = state.plan.micro_batches
    t = cfg.training
    data = micro_batches(state.train_ds, 0, t.micro_batch_size, topo.dp_rank, topo.data)
    savers = {
        mode: CheckpointSaver(
            Path(out, mode),
            device=state.device,
            rank=topo.rank,
            keep_last=2,
            asynchronous=mode == "async",
        )  # fmt: skip
        for mode in MODES
    }
    iteration, consumed, counters = 0, 0, {"skipped": 0, "nan": 0}

    def step() -> None:
        nonlocal iteration, consumed
        train_step(state, data, n_micro)
        iteration += 1
        consumed += t.global_batch_size

    for _ in range(args.warmup):
        step()
    records = []  # per timed step: mode, time, blocked in save, in poll/finish, writing, save
    for round_ in range(args.rounds):
        for mode in _order(round_):
            saver = savers[mode]
            n_steps = args.interval * (args.saves + 1)
            for i in range(1, n_steps + 1):
                dist.barrier()
                writing = saver.writing
                start = time.perf_counter()
                step()
                before = saver.blocked_seconds
                saver.poll()
                polled = saver.blocked_seconds - before
                save = i % args.interval == 0 and i <= args.interval * args.saves
                if save:
                    saver.save(iteration, *checkpoint_files(state, consumed, counters))
                if i == n_steps:
                    saver.finish()  # the run's end: a write still going is waited for
                spent = time.perf_counter() - start
                after = saver.blocked_seconds
                records.append({
                    "mode": mode, "time": spent, "save": save, "writing": writing,
                    "blocked": after - before - polled if save else 0.0,
                    "poll": polled if save else after - before,
                    "write": saver.last_write_seconds,
                })  # fmt: skip
    Path(out, f"rank{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    destroy_distributed()


def measure(args) -> tuple[list[dict], float]:
    """Fork the ranks, run every block; per timed step the slowest rank's numbers (and rank
    0's writer state). Also returns the megabytes one checkpoint holds."""
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _worker, args=(args.world, bench_docs.free_port(), args, out), nprocs=args.world,
            join=False, start_method="fork",
        )  # fmt: skip
        deadline = time.monotonic() + args.timeout
        while not context.join(timeout=1):  # raises with a failing rank's traceback
            if time.monotonic() > deadline:  # a hung collective would wait 30 minutes
                for process in context.processes:
                    process.kill()
                sys.exit(f"the ranks took over {args.timeout} s")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
        latest = Path(out, "sync", Path(out, "sync", "latest").read_text().strip())
        megabytes = sum(f.stat().st_size for f in latest.iterdir()) / 1e6
    steps = []
    for per_rank in zip(*ranks):
        steps.append({
            "mode": per_rank[0]["mode"], "save": per_rank[0]["save"],
            "writing": per_rank[0]["writing"], "write": per_rank[0]["write"],
            **{k: max(r[k] for r in per_rank) for k in ("time", "blocked", "poll")},
        })  # fmt: skip
    return steps, megabytes


def summarise(steps: list[dict], mode: str) -> dict:
    mine = [s for s in steps if s["mode"] == mode]
    saves = [s for s in mine if s["save"]]
    clean = statistics.median(s["time"] for s in mine if not s["save"] and not s["writing"])
    overlap = [s["time"] for s in mine if s["writing"] and not s["save"]]
    writes = [s["write"] for s in mine if s["write"]]
    save_step = statistics.median(s["time"] for s in saves)
    return {
        "mode": mode,
        "saves": len(saves),
        "clean": clean,
        "save_step": save_step,
        "stall": save_step - clean,
        "blocked": statistics.median(s["blocked"] for s in saves),
        "poll": sum(s["poll"] for s in mine) / len(saves),
        "overlap_steps": len(overlap) / len(saves),
        "overlap_extra": statistics.median(overlap) - clean if overlap else None,
        "write": statistics.median(writes) if writes else None,
        "total": sum(s["time"] - clean for s in mine) / len(saves),
    }


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(rows: list[dict]) -> str:
    sync = next(r for r in rows if r["mode"] == "sync")
    lines = [
        "| mode | saves | clean step s (median) | save step s (median) | stall per save s "
        "| blocked in save() s (median) | in poll/finish s per save | steps overlapping a "
        "write, per save | their extra s per step (median) | background write s (median) "
        "| total extra s per save | stall vs sync | blocked vs sync | total vs sync |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['saves']} | {r['clean']:.3f} | {r['save_step']:.3f} | "
            f"{r['stall']:.3f} | {r['blocked']:.3f} | {r['poll']:.3f} | "
            f"{r['overlap_steps']:.1f} | {_s(r['overlap_extra'])} | {_s(r['write'])} | "
            f"{r['total']:.3f} | {r['stall'] / sync['stall']:.2f}x | "
            f"{r['blocked'] / sync['blocked']:.2f}x | {r['total'] / sync['total']:.2f}x |"
        )
    return "\n".join(lines)


def write_section(doc: Path, body: str) -> None:
    """Replace the block between this tool's markers, or append it under its heading."""
    bench_docs.write_section(doc, body, TAG, HEADING)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2, help="gloo ranks (data parallel)")
    parser.add_argument("--level", default="te", help="precision level (the config's: te)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--interval", type=int, default=5, help="steps between saves")
    parser.add_argument("--saves", type=int, default=4, help="saves per block")
    parser.add_argument("--rounds", type=int, default=2, help="blocks of each mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args()
    if min(args.interval, args.saves, args.rounds, args.world) < 1 or args.warmup < 0:
        parser.error("--interval, --saves, --rounds, --world must be >= 1, --warmup >= 0")
    load, started = os.getloadavg()[0], time.monotonic()
    steps, megabytes = measure(args)
    elapsed, load_after = time.monotonic() - started, os.getloadavg()[0]
    rows = [summarise(steps, mode) for mode in MODES]
    result = table(rows)
    print(result)
    print(f"\n({elapsed:.0f} s; {megabytes:.1f} MB per checkpoint)")
    if args.write:
        opening = bench_docs.measured_with(
            "-m benchmarks.bench_save", sys.argv[1:], elapsed, load, load_after
        )
        body = (
            f"{opening}: {args.world} gloo processes training `{CONFIG}`'s model "
            f"({args.layers} layers, level {args.level}, {megabytes:.1f} MB per checkpoint on "
            "the local disk, files "
            f"fsynced), a save every {args.interval} steps, {args.saves} saves per block, "
            f"{args.rounds} blocks of each mode in alternating order on the same model in "
            "the same processes. Per step the slowest rank; 'clean' steps are neither save "
            "steps nor overlap a background write; the stall is the save step's median "
            "minus the clean median; 'blocked' is the main thread's time in the save call; "
            "poll/finish is the per-step agreement while a save is in flight, publication and "
            "any wait for a write that outlasted its cycle; total extra is the sum over all "
            f"steps of (step minus clean median) per save.\n\n{result}"
        )
        write_section(REPO / args.write, body)


if __name__ == "__main__":
    main()

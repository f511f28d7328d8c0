"""The planner (tools/plan.py) against real runs: three checks, each a table.

``python -m benchmarks.bench_plan layouts [--families gpt roberta vit] [--levels ...]``
    Fake equals real. Each tiny family at tensor 2 (sequence parallel) x pipeline 2 x data 2
    with the distributed optimizer, at every level: one real step in 8 gloo processes, each
    rank counted by ``training.planning.rank_plan.measure_rank``, against ``plan_rank`` of the same
    rank on meta tensors. Per (family, level): the largest gap over the 8 ranks of the peak
    and of any category at the peak (as a share of the peak), whether every rank's bytes per
    collective equal its run's ``comm-bytes`` and the bytes seen on its collectives, its
    FLOPs equal the run's, and all ranks' FLOPs against the family formula.

``python -m benchmarks.bench_plan rss [--levels te O2]``
    An independent measure: the growth of the resident set (``VmHWM`` after a reset) of a
    one-rank process that builds ``configs/gpt_125m.yaml`` and runs 2 steps, against the
    plan's peak of the same run.

``python -m benchmarks.bench_plan paper``
    FP8-LM's table (MS-AMP's GPT-7B / 13B / 175B on H100 under Megatron-LM) beside the plan
    of the same layouts at bf16, te and O3 with the distributed optimizer.

Every figure comes from this run; nothing is fitted. CPU only (the plan is device-free; the
real runs are gloo processes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchmarks import bench_docs

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("gpt", "roberta", "vit")
LEVELS = ("fp32", "bf16", "te", "O1", "O2", "O3")
WORLD = 8
GB = 1e9

__all__ = [
    "compare_all", "layout_check", "layout_overrides", "layouts_table", "main", "read_real",
    "rss_check", "rss_table",
]  # fmt: skip


def layout_overrides(family: str, level: str) -> list[str]:
    """TP2 (sequence parallel) x PP2 x DP2, the distributed optimizer, 4 micro-batches a
    step, 64 tokens: a small real step on 8 processes that still runs every collective. ViT:
    10 x 10 images, 25 patches and the class token, 26 tokens (no padding for the sequence
    split, which the formula would not count), 8 images a micro-batch so every FP8 GEMM's
    inner size is a multiple of 16 (``torch._scaled_mm`` on CUDA, and so in a plan, needs
    it; on CPU it does not, and the two would take different GEMM paths)."""
    if family == "vit":  # 2 micro-batches a step
        batch = ["model.image_size=10", "training.micro_batch_size=8"]
        batch.append("training.global_batch_size=32")
    else:
        batch = ["model.seq_length=64", "training.micro_batch_size=1"]
        batch.append("training.global_batch_size=8")
    return batch + [
        "parallel.tensor=2", "parallel.pipeline=2", "parallel.sequence_parallel=true",
        "optimizer.distributed=true", f"precision.level={level}",
        "precision.fp8_gemm_backend=scaled_mm",
    ]  # fmt: skip


def _config(family: str, level: str):
    from training.config import load_config

    path = str(REPO / "configs" / f"{family}_tiny.yaml")
    return load_config(path, layout_overrides(family, level), family=family)


def _as_dict(result) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(result)))


def _real_worker(rank: int, world: int, port: int, jobs: list, out: str) -> None:
    """One gloo rank: ``measure_rank`` of every (family, level) job, written as JSON."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.planning.rank_plan import measure_rank
    from training.run_plan import plan_parallel

    for family, level in jobs:  # later jobs reuse the process group and add their groups
        cfg = _config(family, level)
        result = measure_rank(cfg, plan_parallel(cfg, world))
        Path(out, f"{family}-{level}-{rank}.json").write_text(json.dumps(_as_dict(result)))
    destroy_distributed()


def real_runs(jobs: list[tuple[str, str]], out: str, timeout: float = 900) -> None:
    """Every job's real step on ``WORLD`` gloo processes; results in ``out``."""
    import torch.multiprocessing as mp

    context = mp.start_processes(
        _real_worker, args=(WORLD, bench_docs.free_port(), jobs, out), nprocs=WORLD, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"the real runs did not finish in {timeout} s")


def _plan_job(job) -> dict:
    family, level, rank = job
    from training.planning.rank_plan import plan_rank
    from training.run_plan import plan_parallel

    cfg = _config(family, level)
    # gloo's collectives (TP reduce-scatter as all-to-all plus a sum), as the real runs take.
    return _as_dict(plan_rank(cfg, plan_parallel(cfg, WORLD), rank, backend="gloo"))


def plans(jobs: list[tuple[str, str]], workers: int | None = None) -> dict:
    """(family, level, rank) -> the plan of that rank, as a dict."""
    work = [(f, lv, r) for f, lv in jobs for r in range(WORLD)]
    # spawn: each plan makes its own fake process group.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers or os.cpu_count() or 1, mp_context=context) as pool:
        return dict(zip(work, pool.map(_plan_job, work)))


def _formula(family: str, level: str) -> float:
    from families.base import get_family

    cfg = _config(family, level)
    fam = get_family(cfg.family)
    model = fam.planned_model_config(cfg, cfg.parallel.tensor)
    return fam.flops_per_step(model, cfg.training.global_batch_size)


def compare(family: str, level: str, real: list[dict], planned: list[dict]) -> dict:
    """One table row: the worst rank's gaps between plan and real run."""
    peak_gap = category_gap = 0.0
    comm_equal = wire_equal = flops_equal = phase_equal = True
    unmetered = 0
    for r, p in zip(real, planned, strict=True):
        rm, pm = r["memory"], p["memory"]
        peak_gap = max(peak_gap, abs(pm["peak"] / rm["peak"] - 1))
        for category, nbytes in rm["at_peak"].items():
            category_gap = max(category_gap, abs(pm["at_peak"][category] - nbytes) / rm["peak"])
        phase_equal &= pm["peak_phase"] == rm["peak_phase"]
        comm_equal &= p["comm"] == r["comm"]
        wire_equal &= p["wire"] == r["wire"]
        flops_equal &= p["flops"] == r["flops"]
        unmetered = max(unmetered, sum(r["wire"].values()) - sum(r["comm"].values()))
    executed = sum(sum(p["flops"].values()) for p in planned)
    return {
        "family": family,
        "level": level,
        "peak_gap": peak_gap,
        "category_gap": category_gap,
        "phase_equal": phase_equal,
        "comm_equal": comm_equal,
        "wire_equal": wire_equal,
        "unmetered_bytes": unmetered,
        "flops_equal": flops_equal,
        "flops_vs_formula": executed / _formula(family, level) - 1,
        "peaks_mb": [round(p["memory"]["peak"] / 1e6, 2) for p in planned],
    }


def read_real(out: str, jobs: list[tuple[str, str]]) -> dict:
    """(family, level) -> every rank's real result, as ``_real_worker`` wrote them."""
    return {
        (f, lv): [json.loads(Path(out, f"{f}-{lv}-{r}.json").read_text()) for r in range(WORLD)]
        for f, lv in jobs
    }


def compare_all(jobs: list[tuple[str, str]], real: dict, workers: int | None = None) -> list[dict]:
    """Plan every rank of every job and compare it with ``real`` (``read_real``)."""
    planned = plans(jobs, workers)
    return [
        compare(f, lv, real[(f, lv)], [planned[(f, lv, r)] for r in range(WORLD)]) for f, lv in jobs
    ]


def layout_check(jobs: list[tuple[str, str]], workers: int | None = None) -> list[dict]:
    """The rows of the ``layouts`` table (module doc) for (family, level) ``jobs``."""
    with tempfile.TemporaryDirectory() as out:
        real_runs(jobs, out)
        real = read_real(out, jobs)
    return compare_all(jobs, real, workers)


# ---- rss: the plan against the resident set of a real one-rank run ---------------------

RSS_STEPS = 2


def rss_overrides(level: str) -> list[str]:
    """configs/gpt_125m.yaml at ``level`` with one micro-batch of one 2048-token sequence a
    step (its 8 x 32 would take an hour a step on 2 cores), FP8 GEMMs through
    ``torch._scaled_mm`` (as a GPU and the plan run them; "auto" may pick the emulated
    GEMM on CPU, which makes FP32 copies)."""
    return [
        f"precision.level={level}", "precision.fp8_gemm_backend=scaled_mm",
        "training.micro_batch_size=1", "training.global_batch_size=1",
    ]  # fmt: skip


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _rss_child(level: str) -> dict:
    """In a fresh process: the growth of the resident set's high-water mark over building
    the run and ``RSS_STEPS`` real steps on real data (the optimizer on the accelerator's
    update path, as in ``measure_rank``)."""
    import torch

    from data.sampler import micro_batches
    from training.config import load_config
    from training.planning.rank_plan import accelerator_update
    from training.run_plan import plan_parallel
    from training.setup import build_run
    from training.step import train_step

    torch.set_num_threads(os.cpu_count() or 1)
    cfg = load_config(str(REPO / "configs" / "gpt_125m.yaml"), rss_overrides(level))
    plan = plan_parallel(cfg, 1)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    base = _status_kb("VmRSS")
    start = time.perf_counter()
    state = build_run(cfg, plan)
    accelerator_update(state)
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
    marks = [(_status_kb("VmHWM") - base) * 1024]  # after the build, then after each step
    for _ in range(RSS_STEPS):
        train_step(state, data, plan.micro_batches)
        marks.append((_status_kb("VmHWM") - base) * 1024)
    return {"growth": marks[-1], "marks": marks, "seconds": time.perf_counter() - start}


# glibc's allocator keeps freed heap memory for reuse, and its mmap threshold grows with the
# sizes freed, so tensors of a few MB end up in a heap that never shrinks: the resident set
# then holds what the process once freed. A fixed threshold gives every allocation of 128 KiB
# or more a mapping of its own, returned to the kernel when freed: the resident set follows
# the live tensors. Both are measured.
ALLOCATORS = {"glibc default": {}, "mmap threshold 128 KiB": {"MALLOC_MMAP_THRESHOLD_": "131072"}}


def rss_check(levels) -> list[dict]:
    """Per level: the real run's resident growth (a fresh process for each allocator
    setting) and the plan's peak of the same run."""
    import subprocess

    from training.config import load_config
    from training.planning.rank_plan import plan_rank
    from training.run_plan import plan_parallel

    rows = []
    for level in levels:
        real = {}
        for name, env in ALLOCATORS.items():
            child = subprocess.run(
                [sys.executable, "-m", "benchmarks.bench_plan", "_rss_child", level],
                cwd=REPO, capture_output=True, text=True, check=True,
                env={**os.environ, **env},
            )  # fmt: skip
            real[name] = json.loads(child.stdout.strip().splitlines()[-1])
        cfg = load_config(str(REPO / "configs" / "gpt_125m.yaml"), rss_overrides(level))
        memory = plan_rank(cfg, plan_parallel(cfg, 1), 0).memory
        rows.append(
            {"level": level, "real": real, "plan": memory.peak, "phase": memory.peak_phase,
             "at_peak": memory.at_peak}
        )  # fmt: skip
    return rows


def rss_table(rows: list[dict]) -> str:
    names = list(ALLOCATORS)
    head = " | ".join(f"real growth, {n} (GB) | plan / real" for n in names)
    lines = [
        f"| level | plan peak (GB) | {head} | peak phase | plan at the peak (GB) "
        "| real growth after build, step 1, step 2 (GB, each allocator) |",
        "|---|---|" + "---|---|" * len(names) + "---|---|---|",
    ]
    for r in rows:
        parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in r["at_peak"].items() if v)
        cells = " | ".join(
            f"{r['real'][n]['growth'] / GB:.3f} | {r['plan'] / r['real'][n]['growth']:.3f}"
            for n in names
        )
        marks = "; ".join(", ".join(f"{m / GB:.2f}" for m in r["real"][n]["marks"]) for n in names)
        lines.append(f"| {r['level']} | {r['plan'] / GB:.3f} | {cells} | {r['phase']} | {parts} "
                     f"| {marks} |")  # fmt: skip
    return "\n".join(lines)


def layouts_table(rows: list[dict]) -> str:
    same = {True: "equal", False: "DIFFER"}
    lines = [
        "| family | level | peak: plan vs real (worst rank) | any category (share of peak) "
        "| peak phase | comm-bytes | bytes on the collectives | not metered | FLOPs "
        "| all ranks' FLOPs vs formula | planned peaks by rank (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['family']} | {row['level']} | {row['peak_gap']:.3%} "
            f"| {row['category_gap']:.3%} | {same[row['phase_equal']]} "
            f"| {same[row['comm_equal']]} | {same[row['wire_equal']]} "
            f"| {row['unmetered_bytes']} B | {same[row['flops_equal']]} "
            f"| {row['flops_vs_formula']:+.2%} | {' '.join(map(str, row['peaks_mb']))} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="check", required=True)
    layouts = sub.add_parser("layouts", help="plan against 8-rank gloo runs")
    layouts.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    layouts.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    layouts.add_argument("--jobs", type=int, default=None, help="planning processes")
    rss = sub.add_parser("rss", help="plan against a real run's resident memory")
    rss.add_argument("--levels", nargs="+", default=["te", "O2"], choices=LEVELS)
    for check in (layouts, rss):
        check.add_argument("--write", help="markdown file to put the table into")
    child = sub.add_parser("_rss_child")  # one real run, in a fresh process (rss_check)
    child.add_argument("level", choices=LEVELS)
    args = parser.parse_args(argv)
    if args.check == "_rss_child":
        print(json.dumps(_rss_child(args.level)))
        return 0
    started, load = time.monotonic(), os.getloadavg()[0]
    argv = sys.argv[1:] if argv is None else argv
    tag = f"bench_plan_{args.check}"
    if args.check == "rss":
        text = rss_table(rss_check(args.levels))
        bench_docs.report(text, args.write, tag, "-m benchmarks.bench_plan", argv, started, load)
        return 0
    jobs = [(f, lv) for f in args.families for lv in args.levels]
    rows = layout_check(jobs, args.jobs)
    bench_docs.report(
        layouts_table(rows), args.write, tag, "-m benchmarks.bench_plan", argv, started, load
    )
    return 0 if all(r["comm_equal"] and r["flops_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

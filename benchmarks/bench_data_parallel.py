"""Data parallelism at every precision level: model-state bytes, bytes on the wire, step time.

    .venv/bin/python -m benchmarks.bench_data_parallel [--levels fp32 bf16 te O1 O2 O3] [--steps 4]
        [--warmup 2] [--layers 4] [--rounds 1] [--write docs/BENCHMARKS.md]

For each level, with the distributed optimizer (ZeRO-1) off and on, this forks ``--dp`` (4)
gloo ranks on this machine, each building the run from ``configs/gpt_tiny.yaml`` (its model
shape; ``--layers`` changes the depth) with data parallelism ``--dp``, and runs ``--warmup``
untimed then ``--steps`` timed ``train_step`` calls of ``--micro-batches`` micro-batches of
``--micro-batch-size`` sequences per rank. One table row per (level, optimizer mode):

* model-state bytes per parameter on a rank (weights, gradients, master weights, optimizer
  states, measured from the live tensors by ``training/memory.py`` after the first step), the
  max over ranks, for the linear (GEMM) weights the precision table governs and for all
  parameters, beside the linear weights' theory: ``weight + weight grad + (master + Adam m +
  Adam v) / W`` bytes with the distributed optimizer (W = data-parallel size; gradients are
  not sharded: ZeRO-1), the same without ``/ W`` otherwise;
* bytes a rank sends per step by collective (``stats.comm``, the comm meter's ring model)
  in MB (10^6 bytes), the mean over ranks (ranks differ under the distributed optimizer: each
  gathers the weights it owns), with the bytes per element sent, scales and padding included
  (``stats.comm_per_element``, the max over ranks); the total per rank, mean and max over
  ranks, and the mean total per model parameter;
* the median over the timed steps of the step time (per step, the slowest rank, each step
  started after a barrier) and its ratio to bf16 with the same optimizer mode, measured in
  the same invocation (``--rounds`` repeats every configuration in alternating order and pools
  the steps, so that a load changing during the run weighs on all levels alike); and the CPU
  seconds the ranks' processes used per step, added up (median over the timed steps), with
  its ratio to bf16: on a machine other jobs share, the wall clock follows their load, the CPU
  time much less.

fp16 (AMP) is not in the default list: CPUs have no fast FP16 GEMM (7 s per step for the tiny
GPT at 2 ranks, docs/BENCHMARKS.md). ``--write`` puts the table, the date, the machine and the
command between this tool's markers in the benchmarks document, with a paragraph generated
from the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: 4 ranks share the cores

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks import bench_docs  # noqa: E402
from data.sampler import micro_batches  # noqa: E402
from fp8train.precision import get_recipe  # noqa: E402
from parallel.topology import destroy_distributed  # noqa: E402
from training.config import load_config  # noqa: E402
from training.setup import build_run  # noqa: E402
from training.step import train_step  # noqa: E402

__all__ = ["LEVELS", "measure", "table", "summary", "theory_bytes", "write_section"]

LEVELS = ("fp32", "bf16", "te", "O1", "O2", "O3")
CONFIG = "configs/gpt_tiny.yaml"
TAG = "bench_data_parallel"
HEADING = "## Data parallelism per level: bytes per parameter, bytes on the wire, step time (CPU)"
_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def theory_bytes(level: str, world: int, distributed: bool) -> float:
    """Model-state bytes per linear-weight parameter on one rank, from the precision table."""
    r = get_recipe(level)
    sharded = (_SIZE[r.master_weight] if r.master_weight else 0) + _SIZE[r.adam_m] + _SIZE[r.adam_v]
    return _SIZE[r.weight] + _SIZE[r.weight_grad] + sharded / (world if distributed else 1)


def _overrides(level: str, distributed: bool, args) -> list[str]:
    steps = args.warmup + args.steps
    values = {
        "precision.level": level,
        "optimizer.distributed": str(distributed).lower(),
        "model.num_layers": args.layers,
        "training.micro_batch_size": args.micro_batch_size,
        "training.global_batch_size": args.micro_batch_size * args.micro_batches * args.dp,
        "training.train_iters": steps,
        "optimizer.lr_warmup_iters": 1,  # the shipped 20 would exceed the run's length
        "parallel.backend": "gloo",
        # "auto" would time both FP8 GEMM backends first; emulated is what it picks on a CPU.
        "precision.fp8_gemm_backend": "emulated",
        "data.cache_dir": str(REPO / ".cache" / "data"),  # the default corpus, built once
        "checkpoint.save_interval": 0,
        "checkpoint.resume": "false",
    }
    return [f"{k}={v}" for k, v in values.items()]


def _worker(rank: int, world: int, port: int, overrides: list[str], args, out: str) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    torch.set_num_threads(1)
    cfg = load_config(str(REPO / CONFIG), overrides + [f"logging.dir={out}/run"])
    state = build_run(cfg)
    topo = state.groups.topology
    n_micro = state.plan.micro_batches
    data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, topo.dp_rank, topo.data)
    times, cpu, losses, skipped, last = [], [], [], 0, None
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        stats = train_step(state, data, n_micro)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        losses.append(stats.loss)
        skipped += int(stats.skipped)
        if not stats.skipped:  # a skipped step updates nothing: its traffic is not the table's
            last = stats
    record = {
        "times": times[args.warmup :],
        "cpu": cpu[args.warmup :],
        "losses": losses,
        "skipped": skipped,
        "comm": last.comm if last else {},
        "per_element": last.comm_per_element if last else {},
        "bytes_per_param": state.bytes_per_param,
        "n_micro": n_micro,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    destroy_distributed()


def measure(level: str, distributed: bool, args) -> dict:
    """One (level, optimizer mode): ``--dp`` forked ranks; their records merged into a row."""
    world = args.dp
    with tempfile.TemporaryDirectory() as tmp:
        # Forked, not spawned: the ranks inherit the imported torch and training modules
        # instead of importing them again each (many seconds with 4 ranks on 2 cores).
        context = mp.start_processes(
            _worker,
            args=(world, bench_docs.free_port(), _overrides(level, distributed, args), args, tmp),
            nprocs=world,
            join=False,
            start_method="fork",
        )
        deadline = time.monotonic() + args.timeout
        while not context.join(timeout=1):  # raises with a failing rank's traceback
            if time.monotonic() > deadline:  # a hung collective would wait 30 minutes
                for process in context.processes:
                    process.kill()
                sys.exit(f"{level} (distributed={distributed}) took over {args.timeout} s")
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    steps = [max(rk["times"][i] for rk in ranks) for i in range(args.steps)]
    cpu = [sum(rk["cpu"][i] for rk in ranks) for i in range(args.steps)]
    names = sorted({name for rk in ranks for name in rk["comm"]})
    totals = [sum(rk["comm"].values()) for rk in ranks]

    def bpp(category: str) -> float:
        per_rank = [rk["bytes_per_param"] for rk in ranks]
        if any(b is None for b in per_rank):
            return math.nan  # every step skipped: nothing measured
        return max(b[category]["total"] for b in per_rank)

    return {
        "level": level,
        "distributed": distributed,
        "linear": bpp("linear"),
        "all": bpp("all"),
        "theory": theory_bytes(level, world, distributed),
        "comm": {name: statistics.mean(rk["comm"].get(name, 0) for rk in ranks) for name in names},
        "per_element": {
            name: max(rk["per_element"].get(name, 0.0) for rk in ranks) for name in names
        },
        "total_mb": statistics.mean(totals) / 1e6,
        "max_total_mb": max(totals) / 1e6,
        "per_param": statistics.mean(totals) / _num_params(ranks),
        "n_linear": _num_params(ranks, "linear"),
        "n_all": _num_params(ranks),
        "steps": steps,
        "step_s": statistics.median(steps),
        "cpus": cpu,
        "cpu_s": statistics.median(cpu),
        "skipped": max(rk["skipped"] for rk in ranks),
        "loss": ranks[0]["losses"][-1],
        "n_micro": ranks[0]["n_micro"],
    }


def _merge(rounds: list[dict]) -> dict:
    """One configuration's rows from several rounds: the step times pooled. Bytes are the
    same in every round (the same deterministic steps), the first round's are kept."""
    steps = [t for r in rounds for t in r["steps"]]
    cpus = [t for r in rounds for t in r["cpus"]]
    return {
        **rounds[0],
        "steps": steps,
        "step_s": statistics.median(steps),
        "cpus": cpus,
        "cpu_s": statistics.median(cpus),
        "skipped": max(r["skipped"] for r in rounds),
    }


def _num_params(ranks: list[dict], category: str = "all") -> float:
    b = next((rk["bytes_per_param"] for rk in ranks if rk["bytes_per_param"]), None)
    return b[category]["num-parameters"] if b else math.nan


def _ratio(row: dict, rows: list[dict], key: str = "step_s") -> float | None:
    """``row[key]`` over bf16's with the same optimizer mode (None without such a row)."""
    ref = [r for r in rows if r["level"] == "bf16" and r["distributed"] == row["distributed"]]
    return row[key] / ref[0][key] if ref else None


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def table(rows: list[dict]) -> str:
    lines = [
        "| level | distributed optimizer | bytes/param, linear weights (max over ranks) "
        "| theory | bytes/param, all parameters (max over ranks) "
        "| MB sent per step per rank, by collective (bytes per element sent) "
        "| MB sent per rank, total: mean (max) | bytes sent per parameter "
        "| step s (median) | vs bf16 | CPU s per step, all ranks (median) | vs bf16 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        wire = "; ".join(
            f"{name} {r['comm'][name] / 1e6:.2f} ({r['per_element'].get(name, math.nan):.3f})"
            for name in r["comm"]
        )
        lines.append(
            f"| {r['level']} | {'on' if r['distributed'] else 'off'} | {r['linear']:.3f} | "
            f"{r['theory']:g} | {r['all']:.3f} | {wire or '-'} | {r['total_mb']:.2f} "
            f"({r['max_total_mb']:.2f}) | {r['per_param']:.2f} | "
            f"{r['step_s']:.3f} | {_times(_ratio(r, rows))} | {r['cpu_s']:.3f} | "
            f"{_times(_ratio(r, rows, 'cpu_s'))} |"
        )
    return "\n".join(lines)


def _mode(r: dict) -> str:
    return f"{r['level']} {'distributed' if r['distributed'] else 'plain'}"


def summary(rows: list[dict], world: int) -> str:
    """What the numbers say, written from the numbers."""
    parts = []
    measured = [r for r in rows if math.isfinite(r["linear"])]
    over = [r for r in measured if r["linear"] > 1.01 * r["theory"]]
    if measured and not over:
        parts.append(
            "Bytes per linear-weight parameter match the theory column in every row (within "
            f"{max(abs(r['linear'] - r['theory']) for r in measured):.3f})."
        )
    elif over:
        parts.append(
            "Bytes per linear-weight parameter match the theory column except "
            + ", ".join(f"{_mode(r)} {r['linear']:.3f} against {r['theory']:g}" for r in over)
            + ". The distributed optimizer owns whole tensors, balanced per class of state cost"
            " (`assign_owners`), so a rank holds 1/W of the linear weights' states only when"
            " those tensors split evenly over the ranks."
        )
        if any(get_recipe(r["level"]).weight_grad != "fp8" for r in over):
            parts[-1] += (
                " Without FP8 gradient slots (fp32, bf16, te) every parameter is in one class:"
                " the rank that owns the large embedding gets fewer linear weights, the others"
                " more than 1/W of them."
            )
    o3 = next((r for r in rows if r["level"] == "O3" and r["distributed"]), None)
    if o3 is not None:
        rs = o3["per_element"].get("reduce_scatter_fp8", math.nan)
        ag = o3["per_element"].get("all_gather_params_fp8", math.nan)
        ok = o3["linear"] <= 3.3 and rs <= 1.05 and ag <= 1.05
        parts.append(
            f"O3 with the distributed optimizer at DP={world}: {o3['linear']:.3f} bytes per "
            f"linear weight (bar 3.3, theory 2 + 5/{world} = {2 + 5 / world:g}), "
            f"reduce_scatter_fp8 {rs:.3f} and all_gather_params_fp8 {ag:.3f} bytes per "
            f"element on the wire, per-tensor scales included (bar 1.05): "
            f"{'met' if ok else 'NOT met'}."
        )
    plain = {r["level"]: r for r in rows if not r["distributed"]}
    if "bf16" in plain and len(plain) > 1:
        share = 1 - plain["bf16"]["n_linear"] / plain["bf16"]["n_all"]
        ring = 2 * (world - 1) / world
        parts.append(
            f"Without the distributed optimizer every gradient is averaged by an all-reduce "
            f"({ring:g} times its bytes per element sent by each rank at W={world}): bf16 "
            f"sends {plain['bf16']['per_param']:.2f} bytes per parameter per step (FP32), "
            + ", ".join(
                f"{lv} {r['per_param']:.2f} ({r['per_param'] / plain['bf16']['per_param']:.2f}x)"
                for lv, r in plain.items()
                if lv != "bf16"
            )
            + f". At O1-O3 the linear weights' gradients travel as FP8 bytes ({ring:g} bytes "
            "per element: a reduce-scatter as an all-to-all, then an FP8 all-gather) while "
            "embeddings, norms and biases keep the FP32 all-reduce: in this model they are "
            f"{share:.0%} of the parameters."
        )
    pairs = [
        (r, p)
        for r in rows
        if r["distributed"]
        for p in rows
        if not p["distributed"] and p["level"] == r["level"]
    ]
    if pairs:
        parts.append(
            "The distributed optimizer replaces each all-reduce by a reduce-scatter to the "
            "owners and an all-gather of the updated weights in their storage dtype "
            "(all_gather_params_*), each half the all-reduce's bytes at the gradient's or the "
            "weight's width: it sends less where weights are stored narrower than gradients "
            "travel (BF16 weights, FP32 gradients), as much where they match (fp32, te, O3's "
            "FP8), more where they are wider (O1/O2's FP16 weights, FP8 gradients). Measured "
            "bytes sent, distributed over plain: "
            + ", ".join(f"{r['level']} {r['per_param'] / p['per_param']:.2f}x" for r, p in pairs)
            + ". Ownership of whole tensors makes ranks send unequal amounts (the total "
            "column's mean and max)."
        )
    timed = [r for r in rows if _ratio(r, rows) is not None]
    if timed:
        spread = max(timed, key=lambda r: max(r["steps"]) / min(r["steps"]))
        wall_spread = max(spread["steps"]) / min(spread["steps"])
        cpu_spread = max(max(r["cpus"]) / min(r["cpus"]) for r in timed)
        noisy = wall_spread - 1 > 2 * (cpu_spread - 1)
        parts.append(
            "Step time against bf16 with the same optimizer mode, wall clock / CPU time: "
            + ", ".join(
                f"{_mode(r)} {_ratio(r, rows):.2f}x / {_ratio(r, rows, 'cpu_s'):.2f}x"
                for r in timed
                if r["level"] != "bf16"
            )
            + f". Timed steps of one configuration spread by up to {wall_spread:.2f}x in wall "
            f"time ({_mode(spread)}) and {cpu_spread:.2f}x in CPU time (the sum over the ranks "
            "of the CPU seconds each process used during the step)"
            + (
                ": the wall clock followed the load of the machine as much as the level, the "
                "CPU time the work. "
                if noisy
                else ". "
            )
            + "Either is a "
            f"CPU number that says little about a GPU: the {world} ranks share "
            f"{os.cpu_count()} cores, so a step is compute on time-sliced cores and the "
            "collectives (gloo within one machine) are cheap next to it, and FP8 GEMMs are "
            "emulated (FP32 GEMMs over upcast values plus the casts and amax reductions) and "
            "the FP8/FP16 conversions of O1-O3 and of the low-bit Adam are software"
        )
        fp8 = [r for r in timed if get_recipe(r["level"]).fp8_gemm]
        if fp8 and all(_ratio(r, rows, "cpu_s") > 1 for r in fp8):
            parts[-1] += ", which is why every FP8 level costs more CPU time than bf16 here."
        else:
            parts[-1] += "."
    if not any(r["level"] == "fp16" for r in rows):
        parts.append(
            "fp16 (AMP) is left out: CPUs have no fast FP16 GEMM (about 7 s per step for this "
            "model at 2 ranks, the first section of this page)."
        )
    skipped = [r for r in rows if r["skipped"]]
    if skipped:
        parts.append(
            "Steps skipped by the dynamic loss scaler (an overflow halves the scale): "
            + ", ".join(f"{_mode(r)} {r['skipped']}" for r in skipped)
            + "; their bytes on the wire come from the last step that was not skipped."
        )
    return " ".join(parts)


def write_section(doc: Path, body: str) -> None:
    """Replace the block between this tool's markers, or append it under its heading."""
    bench_docs.write_section(doc, body, TAG, HEADING)


def _steps(n: int) -> str:
    return f"{n} step" + ("" if n == 1 else "s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=list(LEVELS))
    parser.add_argument(
        "--optimizer",
        choices=("both", "plain", "distributed"),
        default="both",
        help="distributed optimizer off (plain), on (distributed) or both",
    )
    parser.add_argument("--dp", type=int, default=4, help="data-parallel ranks")
    parser.add_argument("--steps", type=int, default=4, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=2, help="per rank per step")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every configuration this many times, in alternating order, and pool the "
        "step times (evens out a load that changes during the run)",
    )
    parser.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be >= 1, --warmup >= 0")
    modes = {"both": (False, True), "plain": (False,), "distributed": (True,)}[args.optimizer]
    load = os.getloadavg()[0]
    started = time.monotonic()
    configs = [(level, distributed) for level in args.levels for distributed in modes]
    runs: dict[tuple[str, bool], list[dict]] = {c: [] for c in configs}
    for round_ in range(args.rounds):
        for level, distributed in configs if round_ % 2 == 0 else configs[::-1]:
            r = measure(level, distributed, args)
            runs[level, distributed].append(r)
            print(
                f"round {round_ + 1}: {level:>5} distributed={str(distributed):5} "
                f"{r['step_s']:.3f} s/step, loss {r['loss']:.4f}, "
                f"linear {r['linear']:.3f} bytes/param",
                file=sys.stderr,
                flush=True,
            )
    rows = [_merge(runs[c]) for c in configs]
    elapsed = time.monotonic() - started
    load_after = os.getloadavg()[0]
    result, text = table(rows), summary(rows, args.dp)
    print(result)
    print()
    print(text)
    print(f"\n({elapsed:.0f} s)")
    if args.write:
        opening = bench_docs.measured_with(
            "-m benchmarks.bench_data_parallel", sys.argv[1:], elapsed, load, load_after
        )
        rounds = (
            f", every configuration measured {args.rounds} times in alternating order"
            if args.rounds > 1
            else ""
        )
        body = (
            f"{opening}: {args.dp} gloo processes on this machine, data parallelism {args.dp}, "
            f"`{CONFIG}`'s model with {args.layers} layers, {args.micro_batches} micro-batches "
            f"of {args.micro_batch_size} sequences per rank per step, {_steps(args.warmup)} "
            f"untimed then {_steps(args.steps)} timed{rounds}. Bytes per parameter: model "
            "state (weights, gradients, master weights, optimizer states) on one rank, "
            "measured from the live "
            "tensors, the max over ranks; theory for the linear weights is weight + weight "
            "grad + (master + Adam m + Adam v) / W with the distributed optimizer (ZeRO-1 "
            "keeps every gradient), without / W otherwise. MB sent: bytes a rank puts on the "
            "wire per step under the comm meter's ring model (10^6 bytes), the mean over "
            "ranks; in brackets the bytes per element sent by each collective, per-tensor "
            "scales and padding included, the max over ranks. Bytes sent per parameter: the "
            "mean total over the model's parameter count. Step time: per step the slowest "
            "rank, median over the timed steps; CPU time: per step the CPU seconds of the "
            f"{args.dp} processes added up, median over the timed steps; ratios are to bf16 "
            f"with the same optimizer mode in this run.\n\n{result}\n\n{text}"
        )
        write_section(REPO / args.write, body)


if __name__ == "__main__":
    main()

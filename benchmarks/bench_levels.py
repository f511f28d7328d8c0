"""Train a tiny model at several precision levels side by side and compare their losses.

    python -m benchmarks.bench_levels --levels bf16 te --iters 200 [--write docs/BENCHMARKS.md]
    python -m benchmarks.bench_levels --model roberta --config configs/roberta_tiny.yaml ...
    python -m benchmarks.bench_levels --levels bf16 te:bf16 O2:bf16  # param_dtype=bf16
    python -m benchmarks.bench_levels --levels bf16 te te@row te@block  # fp8_granularity
    python -m benchmarks.bench_levels --levels bf16 O2 O2@block+e4m3  # E4M3 gradients too
    python -m benchmarks.bench_levels --model vit ... --seeds 1234 1 2  # paired across seeds

Each level runs the real entry point through torchrun (same seed, same data, same config but
``precision.level``), one after the other on the same machine, so the timing ratios are
measured in one sitting. Prints a markdown table; ``--write`` also puts it into the benchmarks
document between markers, with the date and the command.

``--seeds`` runs every level once per seed (``training.seed``, which also draws ViT's
train/validation split) into ``--out``/seed<S>/<level> and prints one row per level: the mean
over seeds, and each level's difference to the reference paired within a seed (same split, same
initial weights), as the mean and the range over seeds. On a small validation set one seed's
difference is mostly that seed's luck; the range says how much.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from statistics import fmean

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_docs  # noqa: E402
from fp8train.precision import split_level  # noqa: E402
from training.config import granularity_overrides  # noqa: E402


def _tag(section: str) -> str:
    return f"bench_levels:{section}" if section else "bench_levels"


def _finished(metrics: Path, iters: int) -> bool:
    if not metrics.exists():
        return False
    lines = metrics.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1]).get("iteration") == iters


def run_level(
    level,
    iters,
    nproc,
    config,
    out: Path,
    extra: list[str],
    reuse: bool = False,
    model="gpt",
    threads: int = 1,
):
    run_dir = out / level
    spec, scaling = granularity_overrides(level)
    name, param_dtype = split_level(spec)  # "te:bf16": precision.param_dtype=bf16 too
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        f"pretrain_{model}.py",
        "--config",
        config,
        f"precision.level={name}",
        f"precision.param_dtype={param_dtype}",
        f"training.train_iters={iters}",
        f"logging.dir={run_dir}",
        "checkpoint.resume=false",
        "checkpoint.save_interval=0",
        *scaling,
        *extra,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    metrics = run_dir / "metrics.jsonl"
    if not (reuse and _finished(metrics, iters)):
        if metrics.exists():
            metrics.unlink()
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"level {level} failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    loss, second = _metrics(model)
    train = [r for r in records if loss in r]
    valid = [r for r in records if f"{loss} validation" in r]
    times = [r["iteration-time"] for r in train[1:]]  # the first interval includes warm-up
    return {
        "curve": [(r["iteration"], r[loss]) for r in train],
        "level": level,
        "first": train[0][loss],
        "final": train[-1][loss],
        "valid": valid[-1][f"{loss} validation"] if valid else float("nan"),
        "valid_second": valid[-1].get(f"{second} validation") if valid and second else None,
        "step_s": sum(times) / len(times),
        "bpp": train[-1]["bytes-per-param"],
    }


def _metrics(model: str) -> tuple[str, str | None]:
    """The family's headline loss and, for families that have one, its second metric (masked-LM
    or classification accuracy)."""
    from families import get_family

    names = get_family(model).metric_names
    return names[0], (names[1] if len(names) > 1 else None)


def table(rows: list[dict], reference: str, second: str | None = None) -> str:
    """One row per level; with ``second`` (a metric in [0, 1]) two more columns: its final
    validation value and the difference to the reference in percentage points."""
    ref = next(r for r in rows if r["level"] == reference)
    extra = second is not None and ref.get("valid_second") is not None
    head = (
        f"| level | first logged loss | final train loss | train vs {reference} | final valid loss "
        f"| valid vs {reference} |"
    )
    if extra:
        head += f" final valid {second} | vs {reference} (points) |"
    head += f" s/step | time vs {reference} |"
    # A level at row/block scales is also timed against its per-tensor twin in the same table
    # ("O2@block" against "O2"): the cost of the finer scales alone.
    by_level = {r["level"]: r for r in rows}
    twins = {
        r["level"]: by_level.get(r["level"].partition("@")[0]) for r in rows if "@" in r["level"]
    }
    twin_column = any(twins.values())
    if twin_column:
        head += " time vs per-tensor twin |"
    head += " model-state bytes/param |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        rel = (r["valid"] - ref["valid"]) / ref["valid"] * 100
        rel_train = (r["final"] - ref["final"]) / ref["final"] * 100
        line = (
            f"| {r['level']} | {r['first']:.4f} | {r['final']:.4f} | {rel_train:+.2f}% | "
            f"{r['valid']:.4f} | {rel:+.2f}% |"
        )
        if extra:
            points = (r["valid_second"] - ref["valid_second"]) * 100
            line += f" {r['valid_second']:.4f} | {points:+.2f} |"
        line += f" {r['step_s']:.3f} | {r['step_s'] / ref['step_s']:.2f}x |"
        if twin_column:
            twin = twins.get(r["level"])
            line += f" {r['step_s'] / twin['step_s']:.2f}x |" if twin else " |"
        # Three decimals: the scales of row/block levels add hundredths or less.
        line += f" {r['bpp']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def seeds_table(runs: dict[int, list[dict]], reference: str, second: str | None = None) -> str:
    """One row per level over the seeds of ``runs`` (seed -> that seed's rows, as ``run_level``
    returns them): mean final training and validation loss, the validation loss against the
    same seed's reference as mean and [min, max] in percent, and with ``second`` its mean and
    paired difference in points likewise."""
    seeds = sorted(runs)
    levels = [r["level"] for r in runs[seeds[0]]]
    by = {s: {r["level"]: r for r in runs[s]} for s in seeds}
    extra = second is not None and by[seeds[0]][reference].get("valid_second") is not None

    def paired(level, value):
        return [value(by[s][level], by[s][reference]) for s in seeds]

    def signed(x):  # +0.00 for a mean that rounds to zero from below, not -0.00
        return f"{round(x, 2) + 0.0:+.2f}"

    def spread(xs, unit=""):
        return f"{signed(fmean(xs))}{unit} [{signed(min(xs))}, {signed(max(xs))}]"

    head = (
        f"| level | seeds | mean final train loss | mean final valid loss "
        f"| valid vs {reference}: mean [min, max] |"
    )
    if extra:
        head += f" mean final valid {second} | vs {reference} (points): mean [min, max] |"
    head += " s/step (mean) |"
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for lv in levels:
        rows = [by[s][lv] for s in seeds]
        rel = paired(lv, lambda r, ref: (r["valid"] - ref["valid"]) / ref["valid"] * 100)
        line = (
            f"| {lv} | {len(seeds)} | {fmean([r['final'] for r in rows]):.4f} | "
            f"{fmean([r['valid'] for r in rows]):.4f} | "
            f"{spread(rel, '%')} |"
        )
        if extra:
            pts = paired(lv, lambda r, ref: (r["valid_second"] - ref["valid_second"]) * 100)
            line += f" {fmean([r['valid_second'] for r in rows]):.4f} | {spread(pts)} |"
        line += f" {fmean([r['step_s'] for r in rows]):.3f} |"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Training-loss curves of every level on one set of axes, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display on the benchmark machine
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for r in rows:
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, label=r["level"], linewidth=1.4)
    ax.set_xlabel("iteration")
    ax.set_ylabel("training loss (mean over the log interval)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def write_section(doc: Path, body: str, section: str = "") -> None:
    bench_docs.write_section(doc, body, _tag(section))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", nargs="+", default=["bf16", "te"])
    parser.add_argument("--reference", default="bf16")
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", default="gpt", help="model family: pretrain_<model>.py")
    parser.add_argument("--config", default="configs/gpt_tiny.yaml")
    parser.add_argument("--out", default="runs/bench_levels")
    parser.add_argument("--write", help="markdown file to put the table into")
    parser.add_argument("--plot", help="PNG file for the loss curves")
    parser.add_argument("--section", default="", help="name of the block to replace in --write")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="reuse a level's finished run in --out instead of training again",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="run every level at each training.seed and report means and paired differences",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per rank (OMP_NUM_THREADS); another count blocks the CPU's "
        "reductions differently, the same arithmetic otherwise: bf16 against itself",
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    args = parser.parse_args()
    second = _metrics(args.model)[1]

    def rows_of(out: Path, extra: list[str]) -> list[dict]:
        return [
            run_level(
                lv,
                args.iters,
                args.nproc,
                args.config,
                out,
                extra,
                args.reuse,
                args.model,
                args.threads,
            )
            for lv in args.levels
        ]

    if args.seeds:
        runs = {
            s: rows_of(REPO / args.out / f"seed{s}", [*args.overrides, f"training.seed={s}"])
            for s in args.seeds
        }
        rows = runs[args.seeds[0]]  # the curves plotted: the first seed's
        result = seeds_table(runs, args.reference, second)
    else:
        rows = rows_of(REPO / args.out, args.overrides)
        result = table(rows, args.reference, second)
    print(result)
    if args.plot:
        title = f"{args.config}, {args.iters} iterations, {args.nproc} ranks"
        plot(rows, REPO / args.plot, title + (f", seed {args.seeds[0]}" if args.seeds else ""))
    if args.write:
        command = bench_docs.command_line("python -m benchmarks.bench_levels", sys.argv[1:])
        body = (
            f"Measured {datetime.date.today().isoformat()} on {os.cpu_count()} CPU cores "
            f"with `{command}` ({args.nproc} gloo ranks, {args.iters} iterations, "
            f"`{args.config}`).\n\n{result}"
        )
        if args.plot:
            rel = os.path.relpath(REPO / args.plot, (REPO / args.write).parent)
            body += f"\n\n![training loss per level]({rel})"
        write_section(REPO / args.write, body, args.section)


if __name__ == "__main__":
    main()

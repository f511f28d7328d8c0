"""Benchmarks for a lent GPU: every precision level against plain PyTorch and torchao.

    python -m benchmarks.bench_gpu levels --size 1.3b [--compile] [--steps 10] [--json PATH]
    python -m benchmarks.bench_gpu levels --rows bf16+compile te:bf16+compile bf16 plain+compile ...
    python -m benchmarks.bench_gpu linear [--size 8192] [--json PATH]
    python -m benchmarks.bench_gpu max-size [--levels bf16 O2 O3] [--json PATH]
    ... [--write docs/BENCHMARKS.md]      # the table between this tool's markers
    python -m benchmarks.bench_gpu report RUN.json... [--merge] [--write docs/BENCHMARKS.md]

levels: one process (world size 1) trains a GPT with the project's own stack (load_config +
overrides, build_run, train_step) at each level (default bf16, te:bf16, O1:bf16, O2:bf16,
O3:bf16); then the same shape as plain PyTorch (transformers' GPT2LMHeadModel in bf16, torch
AdamW, SDPA attention) and with torchao's float8 training (tensorwise, rowwise) applied to
that plain model. ``--compile`` adds a compiled row beside each: "fp8train LEVEL + compile"
builds the run with ``training.compile=true`` (every transformer layer compiled, fullgraph,
as a training run on CUDA does by default), "PyTorch bf16 + compile" and "torchao float8
tensorwise + compile" wrap the whole plain model in ``torch.compile``. ``--rows`` names the
rows instead (LEVEL, LEVEL+compile, BASELINE, BASELINE+compile) in the order they run (most
valuable first, so that a device call cut short keeps those); the table lists them in a fixed
order (levels, each eager then compiled, then the baselines). Every row also runs
``--profile-steps`` steps under the profiler after the timed ones: kernels, ATen operators and
host time per step (the table's legend defines them). Tokens are synthetic (uniform random
ids, one batch repeated): throughput only, the losses mean nothing. Each row runs in a fresh
subprocess (a crash or an OOM costs that row only, its peak memory is its own, and a compiled
row compiles from an empty in-memory cache) unless ``--in-process``.

linear: forward + backward of one [M, K] x [K, N] linear (M = N = K = ``--size``): bf16
``torch.nn.Linear`` against ``fp8train.Linear`` under the te recipe and torchao's Float8Linear.

max-size: the most layers at a fixed width (``model.recompute=full``, micro-batch 1) that
complete one training step at each level, by doubling then bisecting the layer count, each
attempt in a fresh subprocess. ``--cap-params`` turns attempts above a parameter count into
failures without running them (how the CPU smoke test stays within seconds).

report: the tables of saved ``--json`` files (written after every row, so a run cut short
by a time limit still has the rows it finished), and ``--write`` puts them in the document.

Timers read after a device synchronisation; ratios are measured side by side in one run;
nothing is asserted about timings (tests/test_bench_gpu.py runs each subcommand tiny on CPU).

This file is the command line and the drivers; one training row is built and timed in
bench_gpu_rows.py, the linear rows in bench_gpu_linear.py, the max-size search in
bench_gpu_max_size.py, and the markdown tables in bench_gpu_tables.py.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import shlex
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks import bench_docs  # noqa: E402
from benchmarks import bench_gpu_tables as tables  # noqa: E402
from benchmarks.bench_gpu_linear import linear_rows  # noqa: E402
from benchmarks.bench_gpu_max_size import search_level  # noqa: E402
from benchmarks.bench_gpu_rows import ROW_PREFIX, SHAPES, device_info, measure_row, run_row  # noqa: E402
from fp8train import device as devices  # noqa: E402
from fp8train import gemm  # noqa: E402

__all__ = [
    "BASELINES",
    "DEFAULT_LEVELS",
    "LEVELS",
    "main",
    "row_specs",
    "row_token",
    "saved_report",
]

# "level:bf16" = the level with precision.param_dtype=bf16 (BF16 activations between the FP8
# GEMMs, as Transformer Engine runs them); the plain FP8 levels keep FP32 there.
LEVELS = ("bf16", "te", "O1", "O2", "O3", "te:bf16", "O1:bf16", "O2:bf16", "O3:bf16")
# "level@row" / "level@block": row- or block-wise FP8 scales (precision.fp8_granularity).
LEVELS += tuple(f"{lv}@{g}" for lv in ("te", "te:bf16", "O2:bf16") for g in ("row", "block"))
LEVELS += ("O3:bf16@block",)  # O3 refuses row-wise scales (a row-scaled FP8 weight)
# Issue 34's rows: BF16 activations between the FP8 GEMMs, as Transformer Engine runs them.
DEFAULT_LEVELS = ("bf16", "te:bf16", "O1:bf16", "O2:bf16", "O3:bf16")
BASELINES = ("plain", "torchao-tensorwise", "torchao-rowwise")
DEFAULT_BASELINES = ("plain", "torchao-tensorwise")
COMPILED = "+compile"  # a row token's suffix: "te:bf16+compile", "plain+compile"


# --------------------------------------------------------------------------- subcommands


def _finish(args, row: dict) -> dict:
    """Derived numbers, a progress line, and the JSON so far: a device call that runs out of
    time still leaves every finished row (and attempt) in ``--json``."""
    if row["status"] == "ok":
        row["tokens_per_s"] = row["tokens"] / row["step_s"]
        row["tflops"] = row["flops"] / row["step_s"] / 1e12
    rate = f", {row['tflops']:.3f} TFLOP/s" if row["status"] == "ok" else ""
    sys.stderr.write(f"[bench_gpu] {row['name']}: {row['status']}{rate}\n")
    args.done.append(row)
    _save_json(args, {"complete": False, "rows_so_far": args.done})
    return row


def _save_json(args, body: dict) -> None:
    if args.json:
        tag, heading = _tag(args)
        out = {"subcommand": args.command, "environment": args.env, "tag": tag, "heading": heading}
        out.update(body)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))


def _parse_row(text: str) -> str:
    """``--rows``: LEVEL or BASELINE, optionally with ``+compile``."""
    name = text.removesuffix(COMPILED)
    if name not in LEVELS and name not in BASELINES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a level ({', '.join(LEVELS)}) or a baseline ({', '.join(BASELINES)}), "
            f"either optionally followed by {COMPILED}"
        )
    return text


def _display_key(token: str) -> tuple:
    """The table's order: the levels as LEVELS lists them, then the baselines, each eager
    before compiled; independent of the order the rows ran in."""
    name = token.removesuffix(COMPILED)
    compiled = token.endswith(COMPILED)
    if name in LEVELS:
        return (0, LEVELS.index(name), compiled)
    return (1, BASELINES.index(name), compiled)


def row_specs(args) -> list[dict]:
    """The rows' specs, in the order they run: ``--rows``, else each of ``--levels`` then
    each of ``--baselines``, with its compiled twin after it under ``--compile``. Each spec
    carries ``order`` (its line in the table) and ``timeout`` (its subprocess's seconds)."""
    if args.rows:
        tokens = list(args.rows)
    else:
        twins = (lambda t: [t, t + COMPILED]) if args.compile else (lambda t: [t])
        tokens = [x for t in [*args.levels, *args.baselines] for x in twins(t)]
    if len(set(tokens)) != len(tokens):
        raise SystemExit(f"bench_gpu: a row is named twice in {tokens}")
    order = {t: i for i, t in enumerate(sorted(tokens, key=_display_key))}
    common = {
        "size": args.size,
        "layers": args.layers,
        "steps": args.steps,
        "warmup": args.warmup,
        "micro_batch": args.micro_batch,
        "recompute": args.recompute,
        "fp8_backend": args.fp8_backend,
        "build_on_device": args.build_on_device,
        "profile": args.profile,
        "profile_steps": args.profile_steps,
    }
    specs = []
    for token in tokens:
        name = token.removesuffix(COMPILED)
        compiled = token.endswith(COMPILED)
        spec = {**common, "order": order[token], "compile": compiled}
        if compiled:
            spec["compile_backend"] = args.compile_backend
        suffix = " + compile" if compiled else ""
        if name in LEVELS:
            spec.update(kind="project", name=f"fp8train {name}{suffix}", level=name)
        else:
            recipe = name.split("-", 1)[1] if name.startswith("torchao") else None
            label = f"torchao float8 {recipe}" if recipe else "PyTorch bf16"
            spec.update(kind="plain", name=label + suffix, recipe=recipe)
        # needs_s: the least time worth starting the row with at 1.3B on an H200 (an eager
        # row took 20-60 s; a compile adds tens of seconds per layer graph, about a minute
        # for the whole plain model, and took ~110 s for torchao's).
        timeout = args.compile_row_timeout if compiled else args.row_timeout
        needs = 30.0 if spec["kind"] == "project" else 60.0
        if compiled and spec.get("recipe"):
            timeout, needs = args.torchao_compile_timeout, 150.0
        needs = min(needs, timeout) if compiled else 15.0
        specs.append({**spec, "timeout": timeout, "needs_s": needs})
    return specs


def _run_rows(args, specs: list[dict]) -> list[dict]:
    """Each row under its own timeout, cut to what ``--time-limit`` leaves: a row started
    with less than it needs (``needs_s``) would only be killed, so it keeps its line in the
    table ("not run: ...") and later rows still run; the parent always writes its report (a
    device call's own ``timeout`` is then only a safety net)."""
    start, rows = time.monotonic(), []
    for spec in specs:
        timeout = spec["timeout"]
        if args.time_limit:
            left = args.time_limit - (time.monotonic() - start)
            if left < spec["needs_s"]:
                why = f"not run: out of time ({left:.0f} s left, needs {spec['needs_s']:.0f})"
                rows.append(_finish(args, {**spec, "status": why}))
                continue
            timeout = min(timeout, left - 5)
        began = time.monotonic()
        row = run_row(spec, args.in_process, timeout)
        rows.append(_finish(args, {**row, "row_s": time.monotonic() - began}))
    return rows


def cmd_levels(args) -> tuple[str, list[dict]]:
    rows = _run_rows(args, row_specs(args))
    info = _device_of(args, rows)
    cuda = info["device_type"] == "cuda"
    shape = SHAPES[args.size]
    micro = args.micro_batch or shape.micro_batch
    layers = args.layers or shape.layers
    backend = next((r.get("fp8_backend") for r in rows if r.get("fp8_backend")), None)
    compiled = next((r["compile_backend"] for r in rows if r.get("compile_backend")), None)
    memory = (
        "max allocated by the CUDA caching allocator"
        if cuda
        else "the process's max RSS (everything, not just tensors)"
    )
    how = (
        f" Compiled rows: torch.compile, backend {compiled}; fp8train's with "
        "training.compile=true (each transformer layer, fullgraph), the baselines' whole model."
        if compiled
        else ""
    )
    title = (
        f"GPT {args.size} ({layers} layers, hidden {shape.hidden}, {shape.heads} heads, "
        f"sequence {shape.seq}, vocabulary {shape.vocab} padded to a multiple of 128), "
        f"micro-batch {micro}, one process; {args.warmup} warm-up steps, then the median of "
        f"{args.steps}. Synthetic tokens (uniform random ids): throughput only. fp8train FP8 "
        f"GEMMs: {backend or '-'}. PyTorch bf16 = GPT2LMHeadModel (Conv1D as nn.Linear) with "
        "bf16 weights and AdamW states, SDPA, clipping, AdamW "
        f"{'fused' if cuda else 'foreach'}; torchao rows convert its linears except the head."
        f"{how} Peak memory: {memory}. {tables.peak_note(info)}. "
        f"{tables.levels_legend(args.profile_steps)}"
    )
    return _report(args, title, tables.levels_table(rows, info)), rows


def cmd_linear(args) -> tuple[str, list[dict]]:
    device = devices.get_device()
    rows = linear_rows(args, device, functools.partial(_finish, args))
    info = _device_of(args, [device_info(device)])
    s = args.size
    title = (
        f"Forward + backward of one linear layer, M = N = K = {s} (6·M·N·K FLOP per "
        f"iteration), no bias; median of {args.iters} after {args.warmup} warm-up iterations; "
        f"fp8train.Linear: delayed scaling, E4M3 forward, E5M2 gradients. {tables.peak_note(info)}."
    )
    return _report(args, title, tables.linear_table(rows, info)), rows


def cmd_max_size(args) -> tuple[str, list[dict]]:
    results, first = [], args.start_layers or SHAPES[args.size].layers
    start = first
    record = functools.partial(_finish, args)
    for level in args.levels:
        found = search_level(level, start, args, record)
        results.append(found)
        start = max(start, found["layers"])  # the next level starts where this one ended
    _device_of(args, [a for r in results for a in r["tried"]])
    shape = SHAPES[args.size]
    cap = f"; attempts above {args.cap_params:,} parameters not run" if args.cap_params else ""
    where = "all in this process" if args.in_process else "each attempt a fresh process"
    title = (
        f"Most layers of hidden {shape.hidden}, {shape.heads} heads, sequence {shape.seq}, "
        f"vocabulary {shape.vocab} that complete one training step on one process "
        f"(model.recompute=full, micro-batch {args.micro_batch or 1}): doubling from {first} "
        f"then bisection to {args.tolerance:.0%} or {args.budget_s:.0f} s per level, {where}{cap}."
    )
    return _report(args, title, tables.max_size_table(results)), results


# --------------------------------------------------------------------------- output


def environment(argv: list[str]) -> dict:
    """Date, torch and command; the device comes from the rows (``_device_of``)."""
    return {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "command": "python -m benchmarks.bench_gpu " + shlex.join(argv),
    }


def _device_of(args, rows: list[dict]) -> dict:
    """The device the rows ran on (asked here only when none ran), recorded in ``args.env``."""
    keys = ("device", "device_type", "capability")
    info = next((r for r in rows if "device" in r), None) or device_info(devices.get_device())
    args.env.update({k: info[k] for k in keys})
    return args.env


def _report(args, title: str, table: str) -> str:
    env = args.env
    cap = f" ({env['capability']})" if env["capability"] else ""
    return (
        f"Measured {env['date']} on {env['device']}{cap}, torch {env['torch']}, with "
        f"`{env['command']}`. {title}\n\n{table}"
    )


def _tag(args) -> tuple[str, str]:
    if args.command == "levels":
        return f"bench_gpu:levels:{args.size}", f"## GPU: precision levels, GPT {args.size}"
    if args.command == "linear":
        return "bench_gpu:linear", "## GPU: FP8 linear layer, forward + backward"
    return "bench_gpu:max-size", "## GPU: largest GPT one GPU trains, by level"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", help="write the rows to this file")
    common.add_argument("--write", help="markdown file to put the table into (between markers)")
    common.add_argument("--in-process", action="store_true", help="no subprocess per row")
    common.add_argument("--row-timeout", type=float, default=600, help="seconds per subprocess")
    common.add_argument("--fp8-backend", choices=gemm.BACKENDS, help="default: scaled_mm on CUDA")
    common.add_argument(
        "--compile", action="store_true", help="add a torch.compile'd row beside each row"
    )
    common.add_argument(
        "--build-on-device", action="store_true", help="build fp8train models on the device"
    )

    lv = sub.add_parser("levels", parents=[common], help="precision levels and baselines")
    lv.add_argument("--size", choices=SHAPES, default="1.3b")
    lv.add_argument("--steps", type=int, default=10)
    lv.add_argument("--warmup", type=int, default=3)
    lv.add_argument("--micro-batch", type=int, help="default: the shape's")
    lv.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    lv.add_argument("--layers", type=int, help="default: the shape's (a compile check: 2)")
    lv.add_argument("--levels", nargs="+", choices=LEVELS, default=list(DEFAULT_LEVELS))
    lv.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(DEFAULT_BASELINES))
    lv.add_argument(
        "--rows",
        nargs="+",
        type=_parse_row,
        metavar="ROW",
        help="LEVEL[+compile] or BASELINE[+compile], in the order to run them (replaces "
        "--levels, --baselines and --compile)",
    )
    lv.add_argument(
        "--compile-backend", default="inductor", help="dynamo backend of the compiled rows"
    )
    lv.add_argument(
        "--compile-row-timeout", type=float, default=600, help="seconds per compiled row"
    )
    lv.add_argument(
        "--torchao-compile-timeout", type=float, default=200, help="seconds per torchao+compile"
    )
    lv.add_argument(
        "--time-limit", type=float, help="seconds for all rows: later rows get what is left"
    )
    lv.add_argument("--profile-steps", type=int, default=2, help="steps profiled per row (0: none)")
    lv.add_argument(
        "--profile", action="store_true", help="each row also records its top operators"
    )

    li = sub.add_parser("linear", parents=[common], help="FP8 linear micro-benchmark")
    li.add_argument("--size", type=int, default=8192, help="M = N = K")
    li.add_argument("--iters", type=int, default=20)
    li.add_argument("--warmup", type=int, default=5)

    ms = sub.add_parser("max-size", parents=[common], help="largest GPT per level")
    ms.add_argument("--size", choices=SHAPES, default="1.3b", help="the width, heads, sequence")
    ms.add_argument("--levels", nargs="+", choices=LEVELS, default=["bf16", "O2", "O3"])
    ms.add_argument("--micro-batch", type=int, help="default 1")
    ms.add_argument("--start-layers", type=int, help="default: the shape's layer count")
    ms.add_argument("--max-layers", type=int, default=1024)
    ms.add_argument("--tolerance", type=float, default=0.1, help="relative bisection stop")
    ms.add_argument("--budget-s", type=float, default=300, help="search seconds per level")
    ms.add_argument("--cap-params", type=int, help="attempts above this many parameters fail")

    rp = sub.add_parser("report", help="print the tables of saved --json files")
    rp.add_argument("files", nargs="+")
    rp.add_argument("--write", help="markdown file to put each table into (between markers)")
    rp.add_argument(
        "--merge", action="store_true", help="one table of several levels runs (one machine)"
    )

    row = sub.add_parser("_row", help=argparse.SUPPRESS)  # one row, in a fresh process
    row.add_argument("spec")
    return parser


COMMANDS = {"levels": cmd_levels, "linear": cmd_linear, "max-size": cmd_max_size}


def saved_report(data: dict) -> str | None:
    """The report of a ``--json`` file; for a run that stopped early (a device call's time
    limit), the levels or linear table of the rows it finished. None when there is none."""
    if data.get("complete"):
        return data["report"]
    rows = data.get("rows_so_far", [])
    table = {"levels": tables.levels_table, "linear": tables.linear_table}.get(data["subcommand"])
    info = next((r for r in rows if "device" in r), None)
    if table is None or info is None:
        return None
    env = data["environment"]
    if data.get("merged"):
        how = f"{data['merged']} runs merged, one after the other on one machine"
    else:
        how = f"which stopped after {len(rows)} rows"
    legend = ""
    if data["subcommand"] == "levels" and rows[0].get("profile_steps"):
        legend = " " + tables.levels_legend(rows[0]["profile_steps"])
    return (
        f"Measured {env['date']} on {info['device']}, torch {env['torch']}, with "
        f"`{env['command']}`, {how}.{legend}\n\n{table(rows, info)}"
    )


def row_token(row: dict) -> str:
    """A levels row's ``--rows`` token, from its spec."""
    if row["kind"] == "project":
        name = row["level"]
    else:
        name = f"torchao-{row['recipe']}" if row.get("recipe") else "plain"
    return name + (COMPILED if row.get("compile") else "")


def merge_runs(runs: list[dict]) -> dict:
    """Several saved levels runs as one (a call cut short and the call on the same warm
    machine that ran the rest): for each row name the first run's row that ran, else the
    last one's status; the table's order is recomputed over all of them."""
    if {r["subcommand"] for r in runs} != {"levels"}:
        raise SystemExit("bench_gpu report --merge: levels runs only")
    by_name: dict[str, dict] = {}
    for run in runs:
        for row in run.get("rows") or run.get("rows_so_far", []):
            kept = by_name.get(row["name"])
            if kept is None or kept["status"] != "ok":
                by_name[row["name"]] = row
    rows = sorted(by_name.values(), key=lambda r: _display_key(row_token(r)))
    rows = [{**r, "order": i} for i, r in enumerate(rows)]
    env = dict(runs[0]["environment"])
    env["command"] = "`, then `".join(r["environment"]["command"] for r in runs)
    keys = ("subcommand", "tag", "heading")
    return {**{k: runs[0][k] for k in keys}, "environment": env, "complete": False,
            "merged": len(runs), "rows_so_far": rows}  # fmt: skip


def cmd_report(args) -> None:
    """Print (and with ``--write`` put into the document) the tables of saved runs; with
    ``--merge``, one table of all of them."""
    runs = [(path, json.loads(Path(path).read_text())) for path in args.files]
    if args.merge:
        runs = [("merged", merge_runs([data for _, data in runs]))]
    for path, data in runs:
        text = saved_report(data)
        if text is None:
            print(f"{path}: no table (an unfinished {data['subcommand']} run)\n")
            continue
        print(f"{text}\n")
        if args.write:
            bench_docs.write_section(Path(args.write), text, data["tag"], data["heading"])


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    if args.command == "_row":
        print(ROW_PREFIX + json.dumps(measure_row(json.loads(args.spec))), flush=True)
        return
    if args.command == "report":
        cmd_report(args)
        return
    args.env, args.done = environment(argv), []
    report, rows = COMMANDS[args.command](args)
    print(report)
    _save_json(args, {"complete": True, "rows": rows, "report": report})
    if args.write:
        tag, heading = _tag(args)
        bench_docs.write_section(Path(args.write), report, tag, heading)


if __name__ == "__main__":
    main()

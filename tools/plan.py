"""Plan a run at any scale on this machine: per-rank memory by category, FLOPs, bytes per
collective and a lower bound on H100 step time, from the project's own step executed on meta
tensors under a fake process group of N ranks (training/planning/rank_plan.py):

    .venv/bin/python tools/plan.py --config configs/gpt_175b.yaml --world-size 128 \\
        parallel.tensor=8 parallel.pipeline=4 precision.level=O3 optimizer.distributed=true

By default each pipeline stage's most loaded rank is planned (``--rank R`` plans one rank,
and is repeatable); ``--json PATH`` writes every figure. Progress goes to stderr (``--quiet``:
none), the plan to stdout, in tables that fit 100 columns. A layout the run would refuse is
one ``error:`` line (the pre-flight's message) and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
import warnings
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

from training.config import ConfigError, load_config  # noqa: E402
from training.preflight import PREFLIGHT_ERRORS  # noqa: E402

GB = 1e9
WIDTH = 100  # columns of a terminal the printed plan fits
_SHORT = {"activations": "activ", "temporaries": "temp", "optimizer": "optim"}
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}  # fmt: skip


def _family_flops(cfg, plan) -> float:
    from families.base import get_family

    family = get_family(cfg.family)
    config = family.planned_model_config(cfg, plan.tensor)
    return family.flops_per_step(config, cfg.training.global_batch_size)


def _wrap(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_on_hyphens=False)


def _table(cfg, plan, stages, bounds) -> str:
    from training.planning.step_account import CATEGORIES, PHASES
    from training.planning.step_time import H100

    lines = _wrap(
        f"plan: {cfg.family} {cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
        f"level {cfg.precision.level}, {plan.world_size} ranks = tensor {plan.tensor} x "
        f"pipeline {plan.pipeline} x data {plan.data}, {plan.micro_batches} micro-batches of "
        f"{cfg.training.micro_batch_size} per step, distributed optimizer "
        f"{'on' if cfg.optimizer.distributed else 'off'}"
    )
    lines += ["", "memory at the step's peak, GB (1e9 bytes), and where the step was then:"]
    head = ["rank", "stage", "params", *(_SHORT.get(c, c) for c in CATEGORIES), "peak", "phase"]
    rows = []
    for s in stages:
        r, m = s.result, s.result.memory
        rows.append([
            str(r.rank), str(r.stage), f"{r.parameters / 1e9:.3g}B",
            *(f"{m.at_peak[c] / GB:.2f}" for c in CATEGORIES), f"{m.peak / GB:.2f}",
            m.peak_phase,
        ])  # fmt: skip
    lines += _columns(head, rows, text=(len(head) - 1,))
    for phase in sorted({s.result.memory.peak_phase for s in stages}):
        lines += _wrap(f"  {phase}: {PHASES.get(phase, '')}")
    dtypes = sorted({d for s in stages for d in s.result.flops})
    lines += [
        "",
        "per step (this rank): GEMM TFLOP in all and by operand dtype; eager traffic, GB:",
    ]
    head = ["rank", "TFLOP", *(_DTYPES.get(d, d) for d in dtypes), "traffic"]
    rows = []
    for s in stages:
        r = s.result
        rows.append([str(r.rank), f"{sum(r.flops.values()) / 1e12:.4g}",
                     *(f"{r.flops.get(d, 0) / 1e12:.4g}" for d in dtypes),
                     f"{r.traffic / GB:.4g}"])  # fmt: skip
    lines += _columns(head, rows)
    executed = sum(sum(s.result.flops.values()) for s in stages) * plan.tensor * plan.data
    if len({s.result.stage for s in stages}) == plan.pipeline:  # every stage: the whole step
        formula = _family_flops(cfg, plan)
        lines += _wrap(
            f"all ranks: {executed / 1e15:.4g} PFLOP executed per step; the family's formula "
            f"(model FLOPs, no recompute): {formula / 1e15:.4g} PFLOP"
        )
    lines += ["", "bytes sent per step by collective (this rank), GB:"]
    lines += _by_rank(
        "collective", stages, lambda r: {k: f"{v / GB:.4g}" for k, v in r.comm.items()}
    )
    lines += ["", "H100 lower bound per step, seconds (an estimate: peaks below, no overlap loss):"]
    head = ["rank", "GEMM", "memory", "slowest link", "bubble", "step >="]
    rows = []
    for s in stages:
        b = bounds[s.result.rank]
        link = max(b.links.items(), key=lambda kv: kv[1][1], default=None)
        slowest = f"{link[0]} {link[1][1]:.3g}" if link else "-"
        rows.append([str(s.result.rank), f"{b.gemm:.3g}", f"{b.memory:.3g}", slowest,
                     f"x{b.bubble:.3f}", f"{b.step:.3g}"])  # fmt: skip
    lines += _columns(head, rows)
    if any(bounds[s.result.rank].links for s in stages):
        lines += ["", "links per process group, seconds (bytes sent / the link's bandwidth):"]
        lines += _by_rank(
            "group (link)",
            stages,
            lambda r: {
                f"{g} ({link})": f"{t:.3g}" for g, (link, t) in bounds[r.rank].links.items()
            },
        )
    tflops = ", ".join(f"{k} {v:g}" for k, v in H100.tflops.items())
    lines += _wrap(f"assumed: {H100.name}; dense TFLOP/s {tflops}")
    runs = {s.executed for s in stages}
    lines.append(
        "executed steps of "
        + "; ".join("/".join(map(str, e)) for e in sorted(runs))
        + f" micro-batches, extended to {plan.micro_batches} (training/planning/layout_plan.py)"
        if any(len(e) > 1 for e in runs)
        else f"executed: the full step of {plan.micro_batches} micro-batches"
    )
    return "\n".join(lines)


def _columns(head: list[str], rows: list[list[str]], text: tuple[int, ...] = ()) -> list[str]:
    """Columns of numbers, right-aligned; the columns ``text`` (indices) left-aligned."""
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:{'<' if i in text else '>'}{w}}}" for i, w in enumerate(widths))
    return [fmt.format(*row).rstrip() for row in (head, *rows)]


def _by_rank(name: str, stages, values) -> list[str]:
    """A table with one row per key of ``values(rank plan)`` and one column per planned rank,
    in blocks of as many ranks as fit ``WIDTH``: it stays narrow however many collectives
    or process groups there are."""
    per_rank = [(s.result.rank, values(s.result)) for s in stages]
    keys = sorted({k for _, v in per_rank for k in v})
    if not keys:
        return ["  (none)"]
    first = max(len(name), *(len(k) for k in keys))
    cell = max(len(x) for r, v in per_rank for x in (f"rank {r}", *v.values()))
    fit = max(1, (WIDTH - first) // (cell + 2))
    out = []
    for i in range(0, len(per_rank), fit):
        block = per_rank[i : i + fit]
        head = [name, *(f"rank {r}" for r, _ in block)]
        out += ([""] if i else []) + _columns(
            head, [[k, *(v.get(k, "-") for _, v in block)] for k in keys], text=(0,)
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="a training config (YAML)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="ranks (default: tensor x pipeline)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    parser.add_argument(
        "--rank",
        type=int,
        action="append",
        help="plan this rank (repeatable; default: each pipeline stage's most loaded rank)",
    )
    parser.add_argument("--json", type=Path, help="write the plan here as JSON")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="execute every micro-batch (default: three short steps, extended on their line)",
    )
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: cores)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        from training.planning.layout_plan import plan_layout
        from training.planning.step_time import step_bound

        cfg = load_config(str(args.config), args.overrides)
        world = args.world_size or cfg.parallel.tensor * cfg.parallel.pipeline
        plan, stages = plan_layout(
            cfg, world, args.rank, exact=args.exact, jobs=args.jobs, progress=not args.quiet
        )
    except (*PREFLIGHT_ERRORS, ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    bounds = step_bound(plan, [s.result for s in stages])
    print(_table(cfg, plan, stages, bounds))
    print(f"planned in {time.perf_counter() - start:.1f} s")
    if args.json:
        out = {
            "config": str(args.config),
            "overrides": args.overrides,
            "world_size": world,
            "plan": {k: v for k, v in asdict(plan).items() if k != "resume"},
            "ranks": [
                {
                    **asdict(s.result),
                    "executed": list(s.executed),
                    "step_bound": asdict(bounds[s.result.rank]),
                }
                for s in stages
            ],  # fmt: skip
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

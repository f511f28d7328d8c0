"""Plan a run at any scale on this machine: per-rank memory by category, FLOPs, bytes per
collective and a lower bound on H100 step time, from the project's own step executed on meta
tensors under a fake process group of N ranks (training/planner.py):

    .venv/bin/python tools/plan.py --config configs/gpt_175b.yaml --world-size 128 \\
        parallel.tensor=8 parallel.pipeline=4 precision.level=O3 optimizer.distributed=true

By default each pipeline stage's most loaded rank is planned (``--rank R`` plans one rank);
``--json PATH`` writes every figure. A layout the run would refuse is one ``error:`` line
(the pre-flight's message) and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
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
_SHORT = {"activations": "activ", "temporaries": "temp", "optimizer": "optim"}


def _family_flops(cfg, plan) -> float:
    from families.base import get_family

    family = get_family(cfg.family)
    config = family.planned_model_config(cfg, plan.tensor)
    return family.flops_per_step(config, cfg.training.global_batch_size)


def _table(cfg, plan, stages, bounds) -> str:
    from training.step_account import CATEGORIES
    from training.step_time import H100

    lines = [
        f"plan: {cfg.family} {cfg.model.num_layers} layers x {cfg.model.hidden_size}, "
        f"level {cfg.precision.level}, {plan.world_size} ranks = tensor {plan.tensor} x "
        f"pipeline {plan.pipeline} x data {plan.data}, {plan.micro_batches} micro-batches of "
        f"{cfg.training.micro_batch_size} per step, distributed optimizer "
        f"{'on' if cfg.optimizer.distributed else 'off'}",
        "",
        "memory at the step's peak, GB (1e9 bytes):",
    ]
    head = ["rank", "stage", "params", *(_SHORT.get(c, c) for c in CATEGORIES), "peak", "phase"]
    rows = []
    for s in stages:
        r, m = s.result, s.result.memory
        rows.append([
            str(r.rank), str(r.stage), f"{r.parameters / 1e9:.3g}B",
            *(f"{m.at_peak[c] / GB:.2f}" for c in CATEGORIES), f"{m.peak / GB:.2f}",
            m.peak_phase,
        ])  # fmt: skip
    lines += _columns(head, rows)
    lines += ["", "per step (this rank): GEMM TFLOP by dtype, eager traffic, bytes sent, GB:"]
    head = ["rank", "TFLOP", "by dtype", "traffic", "collectives (bytes sent)"]
    rows = []
    for s in stages:
        r = s.result
        dtypes = ", ".join(f"{d} {f / 1e12:.4g}" for d, f in sorted(r.flops.items()))
        comm = ", ".join(f"{k} {v / GB:.3g}" for k, v in sorted(r.comm.items()))
        rows.append([str(r.rank), f"{sum(r.flops.values()) / 1e12:.4g}", dtypes,
                     f"{r.traffic / GB:.4g}", comm])  # fmt: skip
    lines += _columns(head, rows)
    executed = sum(sum(s.result.flops.values()) for s in stages) * plan.tensor * plan.data
    if len({s.result.stage for s in stages}) == plan.pipeline:  # every stage: the whole step
        formula = _family_flops(cfg, plan)
        lines.append(
            f"all ranks: {executed / 1e15:.4g} PFLOP executed per step; the family's formula "
            f"(model FLOPs, no recompute): {formula / 1e15:.4g} PFLOP"
        )
    lines += ["", "H100 lower bound per step, seconds (an estimate: peaks below, no overlap loss):"]
    head = ["rank", "GEMM", "memory", "links (bytes sent / bandwidth)", "bubble", "step >="]
    rows = []
    for s in stages:
        b = bounds[s.result.rank]
        links = ", ".join(f"{g} {link} {t:.3g}" for g, (link, t) in sorted(b.links.items()))
        rows.append([str(s.result.rank), f"{b.gemm:.3g}", f"{b.memory:.3g}", links,
                     f"x{b.bubble:.3f}", f"{b.step:.3g}"])  # fmt: skip
    lines += _columns(head, rows)
    lines.append(f"assumed: {H100.name}; TFLOP/s {H100.tflops}")
    runs = {s.executed for s in stages}
    lines.append(
        "executed steps of "
        + "; ".join("/".join(map(str, e)) for e in sorted(runs))
        + f" micro-batches, extended to {plan.micro_batches} (training/plan_run.py)"
        if any(len(e) > 1 for e in runs)
        else f"executed: the full step of {plan.micro_batches} micro-batches"
    )
    return "\n".join(lines)


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*head), *(fmt.format(*row) for row in rows)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a training config (YAML)")
    parser.add_argument(
        "--world-size", type=int, default=None, help="ranks (default: tensor x pipeline)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides, key=value")
    who = parser.add_mutually_exclusive_group()
    who.add_argument("--rank", type=int, action="append", help="plan this rank (repeatable)")
    who.add_argument("--all-stages", action="store_true", help="each stage's most loaded rank")
    parser.add_argument("--json", type=Path, help="write the plan here as JSON")
    parser.add_argument("--exact", action="store_true", help="execute every micro-batch")
    parser.add_argument("--jobs", type=int, default=None, help="processes (default: cores)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        from training.plan_run import plan_run
        from training.step_time import step_bound

        cfg = load_config(str(args.config), args.overrides)
        world = args.world_size or cfg.parallel.tensor * cfg.parallel.pipeline
        plan, stages = plan_run(cfg, world, args.rank, exact=args.exact, jobs=args.jobs)
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

"""Which FP8 tensors lose the most: a run's per-layer FP8 health, read from its TensorBoard.

    .venv/bin/python tools/fp8_health_report.py runs/bench_vit_all/te runs/bench_vit_all/te@block
    .venv/bin/python tools/fp8_health_report.py RUN [RUN ...] --last 10 --top 8 [--write FILE]

A run logs, every ``logging.fp8_stats_interval`` steps, each FP8 layer's cast health per role
(input, weight, grad_output): the fraction of non-zero values that flush to zero
(``underflow``), that clip at the format's maximum (``saturated``), and at row/block
granularity the spread in binades between the blocks' scales. This tool averages them over
the last ``--last`` logged steps and prints, per run, the ``--top`` (layer, role) pairs by
underflow, beside their saturation; then each role's mean over all layers, one column per
run, so a per-tensor run and a block run of the same model compare side by side.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

KINDS = ("underflow", "saturated", "scale_spread")
ROLES = ("input", "weight", "grad_output")


def read_health(run_dir: Path, last: int) -> dict[tuple[str, str], dict[str, float]]:
    """``{(layer, role): {kind: mean over the last ``last`` logged steps}}`` of one run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = run_dir / "tensorboard"
    if not board.is_dir():
        raise FileNotFoundError(f"{board}: no TensorBoard directory (is {run_dir} a run?)")
    acc = EventAccumulator(str(board), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for tag in acc.Tags()["scalars"]:
        if not tag.startswith("fp8/"):
            continue
        layer, _, key = tag[len("fp8/") :].rpartition("/")
        role = next((r for r in ROLES if key.startswith(f"{r}_")), None)
        kind = key[len(role) + 1 :] if role else None
        if kind not in KINDS:
            continue
        values = [e.value for e in acc.Scalars(tag)][-last:]
        out[(layer, role)][kind] = sum(values) / len(values)
    if not out:
        raise ValueError(f"{board}: no FP8 health logged (logging.log_fp8_stats off, or no FP8)")
    return dict(out)


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.2e}"


def worst_table(name: str, health: dict, top: int) -> list[str]:
    rows = sorted(health.items(), key=lambda kv: -kv[1].get("underflow", 0.0))[:top]
    lines = [
        f"**{name}**: the {len(rows)} (layer, role) pairs with the most underflow",
        "",
        "| layer | role | underflow | saturated | scale spread (binades) |",
        "|---|---|---|---|---|",
    ]
    for (layer, role), kinds in rows:
        spread = kinds.get("scale_spread")
        lines.append(
            f"| {layer} | {role} | {_fmt(kinds.get('underflow'))} | "
            f"{_fmt(kinds.get('saturated'))} | {'' if spread is None else f'{spread:.1f}'} |"
        )
    return lines + [""]


def role_means(names: list[str], healths: list[dict]) -> list[str]:
    lines = [
        "Mean over layers, per role: " + ", ".join(f"`{n}`" for n in names),
        "",
        "| role | kind | " + " | ".join(names) + " |",
        "|---|---|" + "---|" * len(names),
    ]
    for role in ROLES:
        for kind in ("underflow", "saturated"):
            cells = []
            for health in healths:
                values = [k[kind] for (_, r), k in health.items() if r == role and kind in k]
                cells.append(_fmt(sum(values) / len(values)) if values else "")
            lines.append(f"| {role} | {kind} | " + " | ".join(cells) + " |")
    return lines


def report(runs: list[Path], last: int = 10, top: int = 8) -> str:
    healths = [read_health(r, last) for r in runs]
    names = [r.name for r in runs]
    lines = []
    for name, health in zip(names, healths):
        lines += worst_table(name, health, top)
    return "\n".join(lines + role_means(names, healths)) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (logging.dir)")
    parser.add_argument("--last", type=int, default=10, help="logged steps to average")
    parser.add_argument("--top", type=int, default=8, help="worst (layer, role) pairs per run")
    parser.add_argument("--write", type=Path, help="also write the report to this file")
    args = parser.parse_args(argv)
    try:
        text = report(args.runs, args.last, args.top)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(text, end="")
    if args.write:
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Tables from the planner (training/planning/layout_plan.py) at GPU scale: nothing here runs
on a GPU.

``python -m benchmarks.plan_tables paper``
    FP8-LM's GPT table (MS-AMP's docs: H100, Megatron-LM) beside the plan of the same
    layouts at bf16, te and O3 with the distributed optimizer: memory per GPU (the most
    loaded stage's peak) and weight-related communication per GPU and step (the weights'
    all-gather plus the weight gradients' reduce-scatter).

``python -m benchmarks.plan_tables largest``
    The most layers a GPT of the 1.3B width (configs/gpt_1.3b.yaml: hidden 2048, 16 heads,
    2048 tokens, full recompute) can have and still fit one 80 GB GPU, and 8 of them as 8
    data-parallel ranks with the distributed optimizer, at bf16, te, O2 and O3: predicted,
    until a GPU measures it.

Both print markdown tables; every figure is the plan's, nothing is fitted to the paper.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks import bench_docs

REPO = Path(__file__).resolve().parents[1]
GB = 1e9

__all__ = ["PAPER", "largest", "largest_table", "main", "paper", "paper_table"]

# FP8-LM (Peng et al. 2023), as MS-AMP's docs give it: (config, world size) -> GB per GPU for
# BF16 / TE / FP8-LM, and weight-related communication in GB for BF16 / FP8.
PAPER = {
    "gpt_7b": {"world": 32, "memory": (69.6, 77.3, 49.4), "comm": (37.2, 13.9)},
    "gpt_13b": {"world": 32, "memory": (68.2, 76.4, 48.9), "comm": (34.3, 12.4)},
    "gpt_175b": {"world": 128, "memory": (66.1, 69.6, 40.3), "comm": (23.4, 8.2)},
}
# "te:bf16" / "O3:bf16": the level with BF16 parameters outside its FP8 ones (precision.
# param_dtype=bf16), so the activations between the GEMMs are BF16, as in a Megatron-LM BF16
# model with Transformer Engine's FP8 GEMMs (FP8-LM's setup); the plain levels keep them FP32.
PAPER_LEVELS = ("bf16", "te", "te:bf16", "O3", "O3:bf16")
PAPER_COLUMN = {"bf16": 0, "te": 1, "O3": 2}  # FP8-LM's BF16 / TE / FP8-LM
# The collectives that move weights or weight gradients across data-parallel ranks.
WEIGHT_COMM = ("all_gather_params", "reduce_scatter_", "all_reduce_fp")


def _load(name: str, overrides: list[str]):
    from training.config import load_config

    return load_config(str(REPO / "configs" / f"{name}.yaml"), overrides)


def weight_comm(comm: dict[str, float]) -> float:
    """Bytes of the weight-related collectives in a rank's ``comm`` (bytes per collective)."""
    return sum(v for k, v in comm.items() if k.startswith(WEIGHT_COMM))


def paper(jobs: int | None = None) -> list[dict]:
    """One row per (model, level): the most loaded stage's peak and weight communication."""
    from training.planning.layout_plan import plan_layouts

    runs, keys = [], []
    for name, ref in PAPER.items():
        for level in PAPER_LEVELS:
            base, _, params = level.partition(":")
            cfg = _load(name, [
                f"precision.level={base}", f"precision.param_dtype={params or 'auto'}",
                "optimizer.distributed=true",
            ])  # fmt: skip
            runs.append((cfg, ref["world"], None))
            keys.append((name, level, cfg))
    rows = []
    for (name, level, cfg), (plan, stages) in zip(keys, plan_layouts(runs, jobs=jobs)):
        worst = max(stages, key=lambda s: s.result.memory.peak).result
        ref, dp = PAPER[name], plan.data
        # A mean data-parallel rank sends (W-1)/W of every weight and every gradient of its
        # slice (the planned rank, the most loaded, owns more than 1/W of them).
        end = worst.memory.end
        rows.append({
            "model": name, "level": level,
            "layout": f"TP{plan.tensor} PP{plan.pipeline} DP{dp}",
            "micro_batch": cfg.training.micro_batch_size,
            "sequence_parallel": cfg.parallel.sequence_parallel,
            "peak": worst.memory.peak, "phase": worst.memory.peak_phase, "stage": worst.stage,
            "backward": worst.memory.phase_peaks.get("backward", 0),
            "at_peak": worst.memory.at_peak,
            "weight_comm": max(weight_comm(s.result.comm) for s in stages),
            "weight_comm_mean": (dp - 1) / dp * (end["weights"] + end["grads"]),
            "paper_memory": ref["memory"][PAPER_COLUMN[level.split(":")[0]]],
            "paper_comm": ref["comm"][0] if level == "bf16" else (
                ref["comm"][1] if level.startswith("O3") else None),
        })  # fmt: skip
    return rows


def paper_table(rows: list[dict]) -> str:
    lines = [
        "| model | layout | level | plan: GB per GPU (stage, phase) | plan: backward peak "
        "| FP8-LM: GB per GPU | plan at the peak (GB) | plan: weight comm GB/step, this rank "
        "| mean rank | FP8-LM: weight comm GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in r["at_peak"].items() if v >= 0.05 * GB)
        paper_comm = "-" if r["paper_comm"] is None else f"{r['paper_comm']:.1f}"
        phase = r["phase"]
        lines.append(
            f"| {r['model']} | {r['layout']}, mbs {r['micro_batch']}"
            f"{', SP' if r['sequence_parallel'] else ''} | {r['level']} "
            f"| {r['peak'] / GB:.1f} ({r['stage']}, {phase}) | {r['backward'] / GB:.1f} "
            f"| {r['paper_memory']:.1f} | {parts} | {r['weight_comm'] / GB:.1f} "
            f"| {r['weight_comm_mean'] / GB:.1f} | {paper_comm} |"
        )
    return "\n".join(lines)


# ---- largest: how many layers fit -------------------------------------------------------

CAPACITY = 80e9  # bytes per GPU: "80 GB" (an H100 has 80 GiB, less what CUDA and NCCL take)
LARGEST_LEVELS = ("bf16", "te", "O2", "O3")
# name -> data-parallel ranks (the distributed optimizer shards the optimizer over them)
SETUPS = {"1 GPU": 1, "8 GPUs, data parallel, distributed optimizer": 8}


def _largest_cfg(level: str, data: int, layers: int):
    """configs/gpt_1.3b.yaml at ``level`` with ``layers`` layers and full recompute, one
    micro-batch of 4 x 2048 tokens per rank a step (more per step change only their few
    kilobytes of token ids), the distributed optimizer over ``data`` ranks."""
    mbs = 4  # the config's
    return _load("gpt_1.3b", [
        f"precision.level={level}", "model.recompute=full", f"model.num_layers={layers}",
        f"training.micro_batch_size={mbs}", f"training.global_batch_size={mbs * data}",
        f"optimizer.distributed={'true' if data > 1 else 'false'}",
    ])  # fmt: skip


def _peaks(points: list[tuple[str, int, int]], jobs) -> list[tuple[int, str, dict]]:
    """The planned peak, its phase and every phase's peak of each (level, data ranks,
    layers), in one pool."""
    from training.planning.layout_plan import plan_layouts

    runs = [(_largest_cfg(level, data, layers), data, None) for level, data, layers in points]
    out = []
    for _, stages in plan_layouts(runs, exact=True, jobs=jobs):
        memory = stages[0].result.memory
        out.append((memory.peak, memory.peak_phase, dict(memory.phase_peaks)))
    return out


def largest(jobs: int | None = None) -> list[dict]:
    """Per setup and level: the most layers whose planned peak fits ``CAPACITY``.

    Each layer adds the same weights, gradients, states and checkpointed input, so each
    phase's peak (forward, backward, the optimizer) is a line in the layers, and the step's
    peak the highest of those lines: they cross (the optimizer's temporaries grow with the
    parameters, the backward's logits do not), so the peak of a few layers alone does not
    extend. Three plans (2, 3, 4 layers) give the lines and check each is one (``bend``: the
    largest second difference, as a share of its phase's slope); the answer they give is then
    planned itself, and one layer more, so the table shows a planned fit and a planned miss.
    The lines are a first guess only: where a phase's peak is not a line (the low-bit
    optimizer's temporaries are bounded by its chunk, the step's by its largest tensor), the
    planner itself is searched until a fit and a miss are one layer apart (``rounds``)."""
    keys = [(setup, level) for setup in SETUPS for level in LARGEST_LEVELS]
    small = _peaks([(lv, SETUPS[st], k) for st, lv in keys for k in (2, 3, 4)], jobs)
    rows = []
    for i, (setup, level) in enumerate(keys):
        phases = [small[3 * i + j][2] for j in range(3)]
        lines, bend = {}, 0.0
        for phase in phases[2]:
            p2, p3, p4 = (ph.get(phase, 0) for ph in phases)
            slope = (p4 - p2) / 2
            lines[phase] = (p2, slope)
            bend = max(bend, abs(p4 - 2 * p3 + p2) / max(slope, 1))
        # The most layers at which every phase's line stays within capacity.
        layers = min(int((CAPACITY - p2) // slope) + 2 for p2, slope in lines.values() if slope > 0)
        rows.append({"setup": setup, "level": level, "layers": max(1, layers), "bend": bend,
                     "per_layer": max(slope for _, slope in lines.values())})  # fmt: skip
    # Then plan until each row has a planned fit with a planned miss one layer above it:
    # every round plans a guess and one layer more, and the next guess comes from the line
    # through the two nearest planned points, kept inside the bracket (the peak only grows
    # with the layers).
    for r in rows:
        r.update(fits={}, misses={}, rounds=0)
    pending = rows
    while pending:
        points = [(r["level"], SETUPS[r["setup"]], n) for r in pending
                  for n in (r["layers"], r["layers"] + 1)]  # fmt: skip
        found = _peaks(points, jobs)
        again = []
        for j, r in enumerate(pending):
            r["rounds"] += 1
            for k in (0, 1):
                peak, phase, _ = found[2 * j + k]
                (r["fits"] if peak <= CAPACITY else r["misses"])[r["layers"] + k] = (peak, phase)
            lo = max(r["fits"], default=0)
            hi = min(r["misses"], default=None)
            if lo and hi == lo + 1:
                (peak, phase), (over, _) = r["fits"][lo], r["misses"][hi]
                r.update(layers=lo, peak=peak, phase=phase, next=over, parameters=_parameters(lo))
                continue
            r["layers"] = _next_guess(r["fits"], r["misses"], lo, hi)
            again.append(r)
        pending = again
    return rows


def _next_guess(fits: dict, misses: dict, lo: int, hi: int | None) -> int:
    """Layers to plan next, strictly inside the bracket (``lo`` fits, ``hi`` misses)."""
    known = sorted({**fits, **misses}.items())
    below = [(n, p) for n, (p, _) in known if n <= lo] or [(0, 0.0)]
    above = [(n, p) for n, (p, _) in known if hi is not None and n >= hi]
    (n0, p0), (n1, p1) = (below[-1], above[0]) if above else (below[-2], below[-1])
    slope = (p1 - p0) / (n1 - n0) if n1 != n0 else 0.0
    guess = n1 + int((CAPACITY - p1) // slope) if slope > 0 else 2 * max(lo, 1)
    top = hi - 1 if hi is not None else max(guess, lo + 1)
    return max(lo + (1 if lo else 0), min(guess, top), 1)


def _parameters(layers: int) -> int:
    """A GPT's parameter count at ``layers`` layers: per layer the QKV and output
    projections, the 4h MLP, their biases and two norms (12h^2 + 13h); the tied embedding,
    the learned positions and the final norm once."""
    from families.base import get_family

    cfg = _largest_cfg("bf16", 1, layers)
    config = get_family(cfg.family).planned_model_config(cfg, 1)
    h = config.hidden_size
    positions = config.max_position_embeddings or config.seq_length
    embeddings = (config.vocab_size + positions) * h
    return layers * (12 * h * h + 13 * h) + embeddings + 2 * h


def largest_table(rows: list[dict]) -> str:
    lines = [
        f"Predicted (plan only, capacity {CAPACITY / GB:.0f} GB per GPU):",
        "",
        "| setup | level | layers | parameters | planned peak (GB) | phase "
        "| one layer more (GB) | GB per layer | line bend | planning rounds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setup']} | {r['level']} | {r['layers']} | {r['parameters'] / 1e9:.2f} B "
            f"| {r['peak'] / GB:.1f} | {r['phase']} | {r['next'] / GB:.1f} "
            f"| {r['per_layer'] / GB:.3f} | {r['bend']:.1e} | {r['rounds']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.plan_tables",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("table", choices=("paper", "largest"))
    parser.add_argument("--jobs", type=int, default=None, help="planning processes")
    parser.add_argument("--write", help="markdown file to put the table into")
    args = parser.parse_args(argv)
    started, load = time.monotonic(), os.getloadavg()[0]
    text = paper_table(paper(args.jobs)) if args.table == "paper" else largest_table(
        largest(args.jobs))  # fmt: skip
    bench_docs.report(
        text, args.write, f"plan_tables_{args.table}", "-m benchmarks.plan_tables",
        sys.argv[1:] if argv is None else argv, started, load,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

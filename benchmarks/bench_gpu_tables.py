"""The markdown tables of benchmarks/bench_gpu.py, from its rows and the device they ran on.

Throughput, MFU against the dense peak the trainer itself would use, peak memory and speed
ratios between rows measured side by side; a row that did not run keeps its line with its
status.
"""

from __future__ import annotations

import functools
import math

import torch

from fp8train.machine_cache import remember
from training.flops import measure_cpu_peak_tflops, peak_tflops_for

__all__ = [
    "levels_legend",
    "levels_table",
    "linear_table",
    "max_size_table",
    "peak_note",
    "peak_tflops",
]

GIB = 2**30


def peak_tflops(info: dict, gemm_dtype: str) -> float:
    """The MFU denominator as the trainer picks it (training/metrics.py ``mfu_peak``): a known GPU's
    dense peak for the GEMM dtype, else (on a CPU) the best measured fp32 matmul rate; NaN
    for a GPU the peak table does not know."""
    known = peak_tflops_for(info["device"], gemm_dtype)
    if known is not None:
        return known
    return _cpu_peak() if info["device_type"] == "cpu" else math.nan


@functools.cache
def _cpu_peak() -> float:
    # Once per run: it is measured again at every call, and two columns of one table must
    # divide by the same number.
    cpu = torch.device("cpu")
    value, _ = remember("fp32-matmul-tflops", cpu, measure_cpu_peak_tflops, best=max)
    return float(value)


def peak_note(info: dict) -> str:
    if info["device_type"] == "cpu":
        return f"MFU against this CPU's best measured fp32 matmul rate ({_cpu_peak():.3g} TFLOP/s)"
    bf16, fp8 = peak_tflops(info, "bf16"), peak_tflops(info, "fp8")
    return f"MFU against the dense peaks {_num(bf16)} (BF16) and {_num(fp8)} (FP8) TFLOP/s"


def _num(x: float) -> str:
    """Three significant digits below 100 (CPU smoke runs), whole numbers above."""
    return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"


def _pct(x: float) -> str:
    return "-" if not math.isfinite(x) else f"{x:.1%}"


def _f(value, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


LEVELS_HEAD = (
    "| row | tokens/s | ms/step | vs fp8train bf16 + compile | vs fp8train bf16 | "
    "peak memory GiB | memory vs fp8train bf16 | kernels/step | host ms/step | "
    "ATen ops/step | first step s | dynamo graphs (breaks) | TFLOP/s | MFU (BF16 peak) | "
    "MFU (own GEMM peak) | model-state bytes/param |"
)


def levels_legend(profile_steps: int) -> str:
    """What the levels table's columns mean (printed above it)."""
    return (
        "Columns: vs ...: tokens/s against that row of this table (same card, same call); "
        "compiled rows are meant to be read against 'fp8train bf16 + compile'. "
        f"Kernels, ATen ops and host time come from torch.profiler over {profile_steps} more "
        "steps after the timed ones: kernels/step = the profiler's device events other than "
        "memcpy/memset; ATen ops/step = ATen operators dispatched from outside another ATen "
        "operator (by Python, the autograd engine or compiled code), on every thread; host "
        "ms/step = a step's wall time on the host less the time its threads spent blocked on "
        "the device (cuda*Synchronize and cudaMemcpy* calls), i.e. what issuing the step costs "
        "the host, profiler overhead (about a microsecond per recorded operator or launch) "
        "included: where it nears ms/step the step is host-bound. First step s = the first "
        "warm-up step, which holds a compiled row's compilation. Dynamo graphs (breaks): "
        "graphs compiled and graph breaks in a compiled row."
    )


def _ratio(row: dict, ref: dict | None, key: str) -> str:
    """``row[key] / ref[key]``, when both rows ran."""
    if not (ref and row["status"] == ref["status"] == "ok"):
        return "-"
    return f"{row[key] / ref[key]:.2f}x"


def _ms(seconds) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _graphs(row: dict) -> str:
    if "graphs" not in row:
        return "-"
    return f"{row['graphs']} ({row['graph_breaks']})"


def levels_table(rows: list[dict], info: dict) -> str:
    """One row per level and baseline, in each row's ``order`` (the table's fixed order,
    whatever order they ran in); MFU against the BF16 dense peak (comparable across rows) and
    against the peak of the row's own GEMM dtype (what the trainer logs)."""
    bf16_peak = peak_tflops(info, "bf16")
    rows = sorted(rows, key=lambda r: r.get("order", 0))  # stable: old runs keep theirs
    by_name = {r["name"]: r for r in rows}
    eager, compiled = by_name.get("fp8train bf16"), by_name.get("fp8train bf16 + compile")
    lines = [LEVELS_HEAD, "|---" * LEVELS_HEAD.count(" | ") + "|---|"]
    for r in rows:
        if r["status"] != "ok":
            status = " ".join(r["status"].replace("|", "/").split())
            lines.append(f"| {r['name']} | {status} |" + " - |" * 14)
            continue
        own = peak_tflops(info, r["gemm"])
        warm = r.get("warmup_s") or [None]
        lines.append(
            f"| {r['name']} | {r['tokens_per_s']:,.0f} | {r['step_s'] * 1e3:.1f} | "
            f"{_ratio(r, compiled, 'tokens_per_s')} | {_ratio(r, eager, 'tokens_per_s')} | "
            f"{r['peak_bytes'] / GIB:.2f} | {_ratio(r, eager, 'peak_bytes')} | "
            f"{_f(r.get('kernels_per_step'), ',.0f')} | {_ms(r.get('host_s'))} | "
            f"{_f(r.get('aten_ops_per_step'), ',.0f')} | {_f(warm[0], '.1f')} | {_graphs(r)} | "
            f"{_num(r['tflops'])} | {_pct(r['tflops'] / bf16_peak)} | {_pct(r['tflops'] / own)} | "
            f"{_f(r['bytes_per_param'], '.1f')} |"
        )
    return "\n".join(lines)


def linear_table(rows: list[dict], info: dict) -> str:
    bf16_peak, fp8_peak = peak_tflops(info, "bf16"), peak_tflops(info, "fp8")
    ref = rows[0]
    lines = [
        "| layer | ms (median) | TFLOP/s | speed vs bf16 | % of BF16 dense peak "
        "| % of FP8 dense peak |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['name']} | {r['status']} | - | - | - | - |")
            continue
        lines.append(
            f"| {r['name']} | {r['step_s'] * 1e3:.3f} | {_num(r['tflops'])} | "
            f"{ref['step_s'] / r['step_s']:.2f}x | {_pct(r['tflops'] / bf16_peak)} | "
            f"{_pct(r['tflops'] / fp8_peak)} |"
        )
    return "\n".join(lines)


def max_size_table(results: list[dict]) -> str:
    ref = next((r for r in results if r["level"] == "bf16" and r["params"]), None)
    lines = [
        "| level | most layers that trained | first that did not (why) | parameters per GPU | "
        "peak memory GiB | params vs bf16 | attempts | search s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        bad = "-" if r["bad"] is None else f"{r['bad']} ({r['why']})"
        ratio = f"{r['params'] / ref['params']:.2f}x" if ref and r["params"] else "-"
        peak = _f(r["peak_bytes"] / GIB if r["peak_bytes"] else None, ".2f")
        lines.append(
            f"| {r['level']} | {r['layers']} | {bad} | {r['params']:,} | {peak} | {ratio} | "
            f"{r['attempts']} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)

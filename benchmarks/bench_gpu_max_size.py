"""The search of ``benchmarks/bench_gpu.py max-size``: the most layers at a fixed width that
complete one training step at a precision level, by doubling then bisecting the layer count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.bench_gpu_rows import FAMILY, model_config, run_config, run_row
from models.context import BuildContext
from parallel.pipeline import PipelineLayout

__all__ = ["largest_fitting", "parameter_count", "search_level"]


def parameter_count(spec: dict) -> int:
    """Parameters of the spec's GPT at its layer count, from two models built on the meta
    device (no memory, no init): the count is linear in the layers."""

    def built(layers: int) -> int:
        cfg = run_config({**spec, "layers": layers})
        ctx = BuildContext(cfg.precision.recipe(), device="meta")
        model = FAMILY.build_model(model_config(cfg), ctx, PipelineLayout(layers))
        return sum(p.numel() for p in model.parameters())

    one, two = built(1), built(2)
    return one + (two - one) * (spec["layers"] - 1)


def largest_fitting(fits, start: int, limit: int, tolerance: float, deadline: float):
    """``(largest n that fits, smallest that did not or None)``: doubling from ``start`` until
    a failure, then bisection until they are within ``tolerance`` (relative, at least 1).
    Stops early at ``deadline`` (time.monotonic) with the range known so far."""
    ok, bad, n = 0, None, start
    while bad is None and time.monotonic() < deadline:
        if not fits(n):
            bad = n
        elif n >= limit:
            ok = n
            break
        else:
            ok, n = n, min(2 * n, limit)
    while bad is not None and bad - ok > max(1, int(ok * tolerance)):
        if time.monotonic() >= deadline:
            break
        mid = (ok + bad) // 2
        if fits(mid):
            ok = mid
        else:
            bad = mid
    return ok, bad


def search_level(level: str, start: int, args, record: Callable[[dict], dict]) -> dict:
    """The most layers ``level`` trains for one step. Every attempt goes through ``record``
    (the command line's progress line and ``--json`` so far) as soon as it has run."""
    attempts = []
    base = {
        "kind": "project",
        "level": level,
        "size": args.size,
        "micro_batch": args.micro_batch or 1,
        "recompute": "full",
        "steps": 1,
        "warmup": 0,
        "fp8_backend": args.fp8_backend,
        "build_on_device": args.build_on_device,
    }

    def fits(layers: int) -> bool:
        spec = {**base, "name": f"{level} {layers} layers", "layers": layers}
        params = parameter_count(spec)
        if args.cap_params and params > args.cap_params:
            row = {**spec, "status": "over --cap-params", "params": params}
        else:
            row = run_row(spec, args.in_process, args.row_timeout)
        attempts.append(record(row))
        return row["status"] == "ok"

    began = time.monotonic()
    ok, bad = largest_fitting(fits, start, args.max_layers, args.tolerance, began + args.budget_s)
    best = next((a for a in attempts if a.get("layers") == ok and a["status"] == "ok"), {})
    why = next((a["status"] for a in attempts if a.get("layers") == bad), None)
    return {
        "level": level,
        "layers": ok,
        "bad": bad,
        "why": why,
        "params": best.get("params", 0),
        "peak_bytes": best.get("peak_bytes"),
        "attempts": len(attempts),
        "seconds": time.monotonic() - began,
        "tried": attempts,
    }

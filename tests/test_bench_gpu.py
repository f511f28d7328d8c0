"""CPU smoke test of benchmarks/bench_gpu.py: every subcommand at tiny size for a step or two.

Checks the tables have a row per level and baseline with finite numbers, and that torchao's
rows say "torchao not installed" where it is missing. Nothing about timings is asserted
(benchmarks print tables; they are never timed asserts). On a CUDA machine the same test runs
the tiny rows on the GPU, a cheap check before the full-size runs of docs/GPU_RUNBOOK.md.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest

from benchmarks import bench_gpu
from benchmarks.bench_gpu_max_size import largest_fitting, parameter_count
from fp8train import device as devices

TORCHAO = importlib.util.find_spec("torchao") is not None
BASELINES = ["PyTorch bf16", "torchao float8 tensorwise"]
CPU = devices.get_device().type == "cpu"


def _run(tmp_path, capsys, *argv: str) -> tuple[list[dict], str]:
    """Run a subcommand in this process; its JSON rows and the printed table."""
    out = tmp_path / "rows.json"
    bench_gpu.main([*argv, "--json", str(out)])
    return json.loads(out.read_text())["rows"], capsys.readouterr().out


def _finite(row: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(row[key], (int, float)) and math.isfinite(row[key]), (key, row)


def _torchao_row(row: dict, table: str) -> bool:
    """Checks a torchao row's status; True when it ran (and its numbers need checking)."""
    if TORCHAO:
        assert row["status"] == "ok", row["status"]
        return True
    assert row["status"] == "torchao not installed"
    assert f"| {row['name']} | torchao not installed |" in table
    return False


def test_levels_rows(tmp_path, capsys):
    argv = ["levels", "--size", "tiny", "--steps", "2", "--warmup", "1", "--in-process"]
    rows, table = _run(tmp_path, capsys, *argv)
    project = [f"fp8train {lv}" for lv in bench_gpu.DEFAULT_LEVELS]
    assert [r["name"] for r in rows] == project + BASELINES
    assert (
        "Synthetic tokens" in table
        and "torch " in table
        and "-m benchmarks.bench_gpu levels" in table
    )
    for row in rows:
        assert f"| {row['name']} |" in table
        if row["name"].startswith("torchao") and not _torchao_row(row, table):
            continue
        assert row["status"] == "ok", row["status"]
        _finite(row, "step_s", "tokens_per_s", "tflops", "peak_bytes", "loss", "params")
        assert row["tokens_per_s"] > 0 and row["tflops"] > 0
        if row["name"].startswith("fp8train"):
            _finite(row, "bytes_per_param")
        # The profiled steps: no device kernels on the CPU, but operators and host time.
        _finite(row, "host_s", "aten_ops_per_step")
        assert row["profiled_steps"] == 2 and row["host_s"] > 0 and row["aten_ops_per_step"] > 0
        if CPU:
            assert row["kernels_per_step"] is None
        else:
            assert row["kernels_per_step"] > 0
    # The baseline is the same model: GPT2LMHeadModel of the project's shape, same parameters.
    by_name = {r["name"]: r for r in rows}
    assert by_name["PyTorch bf16"]["params"] == by_name["fp8train bf16"]["params"]

    # `report` puts a saved run's table into a document; a run cut short keeps its rows.
    saved, doc = tmp_path / "rows.json", tmp_path / "BENCHMARKS.md"
    bench_gpu.main(["report", str(saved), "--write", str(doc)])
    assert "<!-- bench_gpu:levels:tiny:begin -->" in doc.read_text()
    data = json.loads(saved.read_text())
    partial = {**data, "complete": False, "rows_so_far": data["rows"][:2]}
    text = bench_gpu.saved_report(partial)
    assert "stopped after 2 rows" in text and "| fp8train te:bf16 |" in text
    assert "| fp8train O1:bf16 |" not in text
    # --merge: a run cut short and the one that ran the rest, as one table in its own order.
    rest = {**data, "rows": [{**r, "order": 0} for r in reversed(data["rows"][2:])]}
    merged = bench_gpu.merge_runs([partial, rest])
    assert [r["name"] for r in merged["rows_so_far"]] == [r["name"] for r in rows]
    assert "2 runs merged" in bench_gpu.saved_report(merged)


def test_levels_compiled_row(tmp_path, capsys):
    """A compiled row builds its run with training.compile=true (every layer compiled,
    fullgraph) and reports what dynamo did; aot_eager keeps it to seconds on the CPU. Rows run
    in the order given and are listed in the table's own order."""
    argv = ["levels", "--size", "tiny", "--steps", "1", "--warmup", "2", "--in-process"]
    argv += ["--rows", "te:bf16+compile", "bf16", "--compile-backend", "aot_eager"]
    rows, table = _run(tmp_path, capsys, *argv)
    assert [r["name"] for r in rows] == ["fp8train te:bf16 + compile", "fp8train bf16"]
    compiled, eager = rows
    assert compiled["status"] == "ok", compiled["status"]
    assert (compiled["compile"], compiled["compile_backend"]) == (True, "aot_eager")
    assert compiled["compiled_modules"] == 2 and compiled["graph_breaks"] == 0  # both layers
    assert compiled["graphs"] >= 1 and "graphs" not in eager
    _finite(compiled, "step_s", "tokens_per_s", "host_s", "aten_ops_per_step", "loss")
    assert len(compiled["warmup_s"]) == 2
    lines = [ln for ln in table.splitlines() if ln.startswith("| fp8train")]
    assert lines[0].startswith("| fp8train bf16 |")  # the table's order, not the run's
    assert lines[1].startswith("| fp8train te:bf16 + compile |")
    assert f" | {compiled['graphs']} (0) | " in lines[1]
    assert "backend aot_eager" in table and "host ms/step = " in table


def test_level_rows_specs_and_time_limit(tmp_path, capsys):
    """--compile puts a compiled twin after each row; torchao's compiled row gets its own
    timeout; rows that --time-limit leaves no time for keep their line."""
    args = bench_gpu._parser().parse_args(["levels", "--compile", "--levels", "te:bf16"])
    specs = bench_gpu.row_specs(args)
    names = [s["name"] for s in specs]
    assert names == [
        "fp8train te:bf16", "fp8train te:bf16 + compile", "PyTorch bf16",
        "PyTorch bf16 + compile", "torchao float8 tensorwise",
        "torchao float8 tensorwise + compile",
    ]  # fmt: skip
    assert [s["order"] for s in specs] == list(range(6))
    assert [s["timeout"] for s in specs] == [600, 600, 600, 600, 600, 200]
    assert [s["needs_s"] for s in specs] == [15, 30, 15, 60, 15, 150]
    assert all(s["kind"] == "project" for s in specs[:2]) and specs[1]["level"] == "te:bf16"
    with pytest.raises(SystemExit):
        bench_gpu._parser().parse_args(["levels", "--rows", "te:bf16+eager"])
    argv = ["levels", "--size", "tiny", "--rows", "plain", "bf16", "--time-limit", "1"]
    rows, table = _run(tmp_path, capsys, *argv)
    assert [r["status"] for r in rows] == ["not run: out of time (1 s left, needs 15)"] * 2
    assert "| fp8train bf16 | not run: out of time (1 s left, needs 15) |" in table


def test_linear_rows_and_write(tmp_path, capsys):
    doc = tmp_path / "BENCHMARKS.md"
    argv = ["linear", "--size", "64", "--iters", "2", "--warmup", "1", "--write", str(doc)]
    rows, table = _run(tmp_path, capsys, *argv)
    names = [r["name"] for r in rows]
    assert names[0] == "torch.nn.Linear bf16" and len(names) == 5
    assert sum(n.startswith("fp8train.Linear te") for n in names) == 2
    for row in rows:
        if row["name"].startswith("torchao") and not _torchao_row(row, table):
            continue
        assert row["status"] == "ok", row["status"]
        _finite(row, "step_s", "tflops")
    text = doc.read_text()
    assert "<!-- bench_gpu:linear:begin -->" in text and "| torch.nn.Linear bf16 |" in text


def test_max_size_in_process(tmp_path, capsys):
    two = parameter_count({"size": "tiny", "layers": 2, "steps": 1, "warmup": 0})
    argv = ["max-size", "--size", "tiny", "--start-layers", "1", "--cap-params", str(two)]
    results, table = _run(tmp_path, capsys, *argv, "--in-process")
    assert [r["level"] for r in results] == ["bf16", "O2", "O3"]
    for r in results:
        assert (r["layers"], r["bad"], r["why"]) == (2, 3, "over --cap-params")
        assert r["params"] == two and r["peak_bytes"] > 0
        assert f"| {r['level']} | 2 | 3 (over --cap-params) |" in table


def test_max_size_attempt_in_subprocess(tmp_path, capsys):
    one = parameter_count({"size": "tiny", "layers": 1, "steps": 1, "warmup": 0})
    argv = ["max-size", "--size", "tiny", "--levels", "bf16", "--start-layers", "1"]
    (result,), _ = _run(tmp_path, capsys, *argv, "--cap-params", str(one))
    assert (result["layers"], result["bad"]) == (1, 2)
    ran = result["tried"][0]  # the one attempt that ran, in a fresh process
    assert ran["status"] == "ok" and ran["params"] == one
    _finite(ran, "step_s", "peak_bytes", "loss")


def test_largest_fitting_doubles_then_bisects():
    tried = []

    def fits(n: int) -> bool:
        tried.append(n)
        return n <= 37

    assert largest_fitting(fits, 4, 1024, 0.0, math.inf) == (37, 38)
    assert tried[:5] == [4, 8, 16, 32, 64]  # doubling until the first failure
    exact, tried[:] = len(tried), []
    ok, bad = largest_fitting(fits, 4, 1024, 0.1, math.inf)
    assert ok <= 37 < bad and bad - ok <= max(1, int(ok * 0.1)) and len(tried) < exact
    assert largest_fitting(lambda n: True, 3, 20, 0.1, math.inf) == (20, None)
    assert largest_fitting(lambda n: False, 4, 20, 0.1, math.inf) == (0, 1)


def test_gpu_call_plan(tmp_path, capsys):
    """tools/gpu_call.sh's decisions: compiled rows whose check failed are dropped, building
    on the device is kept only if the eager check row ran, and the follow-up call runs the
    rows the first did not finish (not those that failed for a reason of their own)."""
    from benchmarks import gpu_call_plan

    def row(level, status, compiled=False, **extra):
        name = f"fp8train {level}" + (" + compile" if compiled else "")
        return {"kind": "project", "level": level, "name": name, "compile": compiled,
                "status": status, **extra}  # fmt: skip

    ok = {"step_s": 0.1, "warmup_s": [30.0], "graphs": 1, "graph_breaks": 0}
    check = tmp_path / "check.json"
    rows = [row("bf16", "ok", True, **ok), row("O3:bf16", "failed: Unsupported: x", True),
            row("O1:bf16", "failed: timed out after 150 s", True),
            row("bf16", "failed: RuntimeError: y", build_on_device=True)]  # fmt: skip
    check.write_text(json.dumps({"rows_so_far": rows}))
    lines = gpu_call_plan.check([str(check), str(tmp_path / "missing.json")])
    assert lines[0].startswith("fp8train bf16 + compile: ok, graphs 1 (breaks 0)")
    assert lines[-2:] == ["DROP O3:bf16+compile", "BUILD_ON_DEVICE 0"]

    run = tmp_path / "levels.json"
    done = [row("bf16", "ok", True), row("te:bf16", "failed: Unsupported: z", True),
            row("bf16", "failed: timed out after 85 s"),
            row("te:bf16", "not run: out of time")]  # fmt: skip
    run.write_text(json.dumps({"rows": done}))
    tokens = ["bf16+compile", "te:bf16+compile", "bf16", "te:bf16", "O2:bf16"]
    assert gpu_call_plan.rest(str(run), tokens) == ["bf16", "te:bf16", "O2:bf16"]
    assert gpu_call_plan.rest(str(tmp_path / "none.json"), tokens) == tokens
    # Several calls on one machine: a row any of them ran is done.
    later = tmp_path / "levels_rest.json"
    again = [row("bf16", "ok"), row("O2:bf16", "failed: timed out after 40 s")]
    later.write_text(json.dumps({"rows": again}))
    assert gpu_call_plan.rest([str(run), str(later)], tokens) == ["te:bf16", "O2:bf16"]
    gpu_call_plan.main(["rest", str(run), str(later), *tokens])
    assert capsys.readouterr().out.split() == ["te:bf16", "O2:bf16"]

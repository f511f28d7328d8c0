"""tools/gpu_call.sh's plan, dry: the script runs for real with a stand-in ``python3`` on PATH
that answers every GPU-bound command (levels rows, optimizer, GEMMs, pytest, the cast unit)
with made-up lines and JSON, and runs benchmarks.gpu_call_plan, whose decisions the script
follows, for real. Checked, over `compile`, `compile-rest` and `rowblock` on one machine's
work folder: the rows each call asks for (in the runbook's order, less those whose compile
check failed, in every later call too; less the block rows when no block-scaled kernel
binds), that a call runs only the rows the earlier ones did not finish, the kernel tests once,
and at most 8 files in $OUT (what the device tool brings back)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")

# The stand-in python3. A levels row "costs" 45 s of --time-limit (eager 20, PyTorch compiled
# 70): rows past the limit are "not run: out of time", as bench_gpu writes them.
FAKE = r"""
import json, os, subprocess, sys
args = sys.argv[1:]
log = open(os.environ["FAKE_LOG"], "a")
mod = args[1] if args[:1] == ["-m"] else None
if args[:1] == ["-c"]:
    print("BLOCK_KERNEL", os.environ["FAKE_BLOCK_KERNEL"]) if "BLOCK_KERNEL" in args[1] else None
    sys.exit(0)
if mod == "pip" or args[2:3] == ["report"]:  # the wheels; a levels table
    sys.exit(0)
if mod == "benchmarks.gpu_call_plan":
    sys.exit(subprocess.call([os.environ["REAL_PYTHON"], *args]))
if mod == "benchmarks.bench_gpu" and args[2] == "levels":
    rows = args[args.index("--rows") + 1:]
    rows = rows[: next((i for i, a in enumerate(rows) if a.startswith("--")), len(rows))]
    out = args[args.index("--json") + 1]
    limit = float(args[args.index("--time-limit") + 1]) if "--time-limit" in args else 1e9
    used, done = 0.0, []
    for token in rows:
        name, compiled = token.removesuffix("+compile"), token.endswith("+compile")
        plain = name == "plain" or name.startswith("torchao")
        cost = (70 if plain else 45) if compiled else 20
        row = {"kind": "plain", "recipe": name.partition("-")[2] or None} if plain else {
            "kind": "project", "level": name, "build_on_device": "--build-on-device" in args}
        row.update(name=token, compile=compiled, status="ok", step_s=0.3, warmup_s=[30.0])
        if token in os.environ.get("FAKE_FAIL", "").split():
            row["status"] = "failed: Unsupported: made up"
        elif "--layers" not in args and used + cost > limit:
            row["status"] = "not run: out of time"
        else:
            used += cost
        done.append(row)
    json.dump({"complete": True, "rows": done}, open(out, "w"))
    if "--layers" not in args:
        log.write(json.dumps({"levels": os.path.basename(out), "rows": rows}) + "\n")
    sys.exit(0)
log.write(json.dumps({"run": mod or args[0]}) + "\n")
if mod == "benchmarks.bench_fp8_gemm":
    print("block kernel: made up")
"""


def _call(tmp_path, phase: str, seconds: int, block_kernel: int) -> tuple[list, list[str]]:
    """Run ``phase``; the levels calls (JSON name, rows asked) and the other commands."""
    bin_dir, out = tmp_path / "bin", tmp_path / f"out_{phase}"
    bin_dir.mkdir(exist_ok=True)
    out.mkdir()
    (tmp_path / "fake.py").write_text(FAKE)
    python3 = bin_dir / "python3"
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "fake.py"}" "$@"\n')
    python3.chmod(0o755)
    log = tmp_path / f"log_{phase}.jsonl"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "OUT": str(out),
        "GPU_CALL_WORK": str(tmp_path / "work"),
        "FAKE_LOG": str(log),
        "FAKE_BLOCK_KERNEL": str(block_kernel),
        "FAKE_FAIL": "O3:bf16+compile",  # its compile check fails
        "REAL_PYTHON": sys.executable,
    }
    script = [str(REPO / "tools" / "gpu_call.sh"), phase, str(seconds)]
    run = subprocess.run(["bash", *script], cwd=REPO, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert len(list(out.iterdir())) <= 8, sorted(p.name for p in out.iterdir())
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    levels = [(e["levels"], e["rows"]) for e in lines if "levels" in e]
    return levels, [e["run"] for e in lines if "run" in e]


def _statuses(tmp_path, name: str) -> dict[str, str]:
    rows = json.loads((tmp_path / "work" / name).read_text())["rows"]
    return {r["name"]: r["status"] for r in rows}


def test_the_three_calls_run_each_row_once_in_order(tmp_path):
    levels, other = _call(tmp_path, "compile", 400, block_kernel=1)
    first = [
        "bf16+compile", "te:bf16+compile", "te:bf16@row+compile", "te:bf16@block+compile",
        "O2:bf16+compile", "O3:bf16@block+compile", "plain+compile",
    ]  # fmt: skip
    ((name, rows),) = levels
    assert len(list((tmp_path / "work").glob("check_*.json"))) == 8  # 7 compiled, 1 eager
    assert name == "levels.json" and rows[: len(first)] == first
    assert "O3:bf16+compile" not in rows  # its check failed
    ran = [r for r, s in _statuses(tmp_path, "levels.json").items() if s == "ok"]
    # A row that does not fit what is left is not started; a cheaper later one may be.
    assert ran[:4] == first[:4] and len(ran) < len(rows)
    assert other == ["benchmarks.bench_optimizer", "benchmarks.bench_fp8_gemm", "pytest",
                     "benchmarks.bench_optimizer", "benchmarks.bench_optimizer"]  # fmt: skip

    levels, other = _call(tmp_path, "compile-rest", 240, block_kernel=1)
    ((name, rest),) = levels
    assert name == "levels_rest.json" and rest == [r for r in rows if r not in ran]
    assert "pytest" not in other  # the kernel tests ran to the end in the first call
    assert (tmp_path / "out_compile-rest" / "levels_merged.md").exists()

    levels, other = _call(tmp_path, "rowblock", 540, block_kernel=1)
    ((name, asked),) = levels
    done = set(ran) | {r for r, s in _statuses(tmp_path, "levels_rest.json").items() if s == "ok"}
    everything = [  # less O3:bf16+compile, dropped by its check
        "te:bf16+compile", "te:bf16@row+compile", "te:bf16@block+compile",
        "O3:bf16@block+compile", "O2:bf16@block+compile", "te:bf16@row", "te:bf16@block",
    ]  # fmt: skip
    assert name == "levels_rowblock.json" and asked == [r for r in everything if r not in done]
    assert other == ["benchmarks.bench_cast"]


def test_without_the_block_kernel_no_block_row_runs(tmp_path):
    levels, _ = _call(tmp_path, "compile", 400, block_kernel=0)
    ((_, rows),) = levels
    assert rows[:4] == ["bf16+compile", "te:bf16+compile", "te:bf16@row+compile", "O2:bf16+compile"]
    assert not [r for r in rows if "@block" in r]
    check = sorted(p.name for p in (tmp_path / "work").glob("check_*block*.json"))
    assert check == ["check_O3_bf16@block.json", "check_te_bf16@block.json"]  # still checked

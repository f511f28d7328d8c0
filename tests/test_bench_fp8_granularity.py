"""benchmarks/bench_fp8_granularity.py at a small size: every row of every case, and the table
written between its markers."""

from __future__ import annotations

import re

from benchmarks import bench_fp8_granularity as bench


def test_table_rows_and_write(tmp_path, capsys):
    doc = tmp_path / "BENCH.md"
    bench.main(["--tokens", "64", "--size", "256", "--write", str(doc)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(bench.CASES) * len(bench.ROWS)
    text = doc.read_text()
    assert "bench_fp8_granularity:begin" in text and "--tokens 64" in text
    values = {}
    for line in rows[1:]:
        case, name, *db = [c.strip() for c in line.strip("|").split("|")]
        values[case, name] = [float(v) for v in db]
        assert all(re.fullmatch(r"-?\d+\.\d", v) for v in db)
    # Blocks confine an outlier input channel to its own tiles: y is at least tensor's.
    outlier = "outlier input channels"
    assert values[outlier, "block"][0] >= values[outlier, "tensor (torchao tensorwise)"][0]


def test_bench_levels_level_specs():
    # "level@granularity+grad_format" (bench_levels, grad_fidelity): the overrides a row runs with.
    from training.config import granularity_overrides

    assert granularity_overrides("O2") == ("O2", [])
    assert granularity_overrides("te:bf16@row") == (
        "te:bf16",
        ["precision.fp8_granularity=row", "precision.fp8_recipe=current"],
    )
    assert granularity_overrides("O3@block+e4m3") == (
        "O3",
        [
            "precision.fp8_granularity=block",
            "precision.fp8_recipe=current",
            "precision.fp8_grad_format=e4m3",
        ],
    )


def test_bench_levels_seeds_table_pairs_within_a_seed():
    # Each level is compared with the reference of its own seed (same split, same initial
    # weights); the row gives the mean and range of those paired differences over the seeds.
    from benchmarks.bench_levels import seeds_table

    def row(level, valid, acc, final=1.0):
        return {"level": level, "final": final, "valid": valid, "valid_second": acc,
                "step_s": 0.5, "first": 2.0, "bpp": 16.0}  # fmt: skip

    runs = {
        1: [row("bf16", 0.10, 0.97), row("te", 0.11, 0.96)],
        2: [row("bf16", 0.20, 0.95), row("te", 0.19, 0.955)],
    }
    lines = seeds_table(runs, "bf16", "accuracy").splitlines()
    assert lines[0].count("|") == lines[1].count("|") == 9
    cells = [c.strip() for c in lines[3].strip("|").split("|")]
    # +10% on seed 1, -5% on seed 2; -1 point and +0.5 points.
    assert cells == ["te", "2", "1.0000", "0.1500", "+2.50% [-5.00, +10.00]", "0.9575",
                     "-0.25 [-1.00, +0.50]", "0.500"]  # fmt: skip
    ref = [c.strip() for c in lines[2].strip("|").split("|")]
    assert ref[4] == "+0.00% [+0.00, +0.00]"


def test_bench_levels_table_times_each_granularity_against_its_twin():
    from benchmarks.bench_levels import table

    def row(level, step_s, bpp=16.0):
        return {"level": level, "first": 2.0, "final": 1.0, "valid": 1.0, "step_s": step_s,
                "bpp": bpp}  # fmt: skip

    rows = [row("bf16", 0.5), row("O2", 1.0), row("O2@block", 1.5, 8.015625), row("te@row", 2.0)]
    lines = table(rows, "bf16").splitlines()
    assert "time vs per-tensor twin" in lines[0]
    cells = {
        ln.split("|")[1].strip(): [c.strip() for c in ln.strip("|").split("|")] for ln in lines[2:]
    }
    assert cells["O2@block"][-2:] == ["1.50x", "8.016"]
    assert cells["te@row"][-2] == ""  # no per-tensor te in the table
    assert cells["O2"][-3:] == ["2.00x", "", "16.000"]
    # Without row/block levels the table keeps its columns.
    assert "twin" not in table(rows[:2], "bf16")


def test_bench_levels_names_the_kernel_switch_in_the_measured_command():
    # A bf16-against-itself control differs from its run only by ATEN_CPU_CAPABILITY: the
    # table's command line (every CPU benchmark's, bench_levels' among them) must say so, and
    # say nothing when it was not set.
    from benchmarks.bench_docs import command_line

    launch, argv = "python -m benchmarks.bench_levels", ["--levels", "bf16", "--seeds", "1", "2"]
    plain = "python -m benchmarks.bench_levels --levels bf16 --seeds 1 2"
    assert command_line(launch, argv, {"OMP_NUM_THREADS": "1"}) == plain
    assert command_line(launch, argv, {"ATEN_CPU_CAPABILITY": "default"}) == (
        "ATEN_CPU_CAPABILITY=default " + plain
    )

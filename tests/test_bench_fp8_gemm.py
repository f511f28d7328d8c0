"""benchmarks/bench_fp8_gemm.py on the CPU: its table has every column (the per-tensor
backends, and fp8_gemm per tensor, row and block as a linear calls it), each row/block cell
says whether it ran a scaled-GEMM kernel or the emulation, and ``--device cuda`` without CUDA
is one line. Nothing about timings is asserted (tools/gpu_call.sh runs it on the GPU)."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_fp8_gemm
from fp8train import device as devices
from fp8train.gemm import cpu_takes_rowwise, fp8_gemm


def test_the_cpu_table_names_what_each_column_ran(capsys):
    bench_fp8_gemm.main(["--device", "cpu", "--reps", "1", "--shapes", "128x256x128"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("shape"))
    for column in ("fp32", "bf16", "scaled_mm", "emulated", "tensor", "row", "block", "check"):
        assert column in header, column
    row = next(line for line in lines if line.lstrip().startswith("128x256x128")).split()
    # shape, fp32, bf16, scaled_mm, emulated, best, tensor, row, block, blk 1x128, check
    assert len(row) == 11, row
    block, tiles = row[8], row[9]
    assert block.endswith("*") and tiles.endswith("*")  # no block-scaled kernel on the CPU
    assert row[7].endswith("*") != cpu_takes_rowwise()
    assert "  block: emulation (2 mm) at 128x256x128" in lines
    assert "block kernel: not bound on cpu (the emulation)" in lines
    if cpu_takes_rowwise():  # the row-wise result checked against the emulation
        assert float(row[10]) < 1e-3
        assert "  row: _scaled_mm at 128x256x128" in lines


def test_ran_tells_a_kernel_from_the_emulation():
    x = torch.randn(16, 256)
    tensor = bench_fp8_gemm.operands("tensor", x, x)
    assert bench_fp8_gemm.ran(lambda: fp8_gemm(*tensor, backend="emulated")) == "emulation (1 mm)"
    blocks = bench_fp8_gemm.operands("block", x, x)
    assert blocks[1].block == (16, 128) and blocks[0].block == (1, 128)
    assert bench_fp8_gemm.ran(lambda: fp8_gemm(*blocks, backend="scaled_mm")) == "emulation (2 mm)"
    assert bench_fp8_gemm.ran(lambda: fp8_gemm(*tensor, backend="scaled_mm")) == "_scaled_mm"


@pytest.mark.skipif(devices.is_cuda(), reason="CUDA is here")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(SystemExit, match="no CUDA device here") as err:
        bench_fp8_gemm.main(["--device", "cuda"])
    assert "\n" not in str(err.value)

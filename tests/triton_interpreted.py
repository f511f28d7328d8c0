"""The checks of ``tests/test_triton_cast.py`` that run the Triton kernels under Triton's
interpreter on the CPU, in a process of their own: ``TRITON_INTERPRET=1`` must be set before
triton decorates a kernel, and the pytest process may have decorated them already (on CUDA).

``python tests/triton_interpreted.py`` prints one JSON object: the interpreter defect found
(``defect``: what the unpatched conversion gives for the probes), per case of
``tests/triton_cast_cases.py`` the mismatches with ``blockwise.quantize_operand`` and per
Linear step those with the torch cast's step (empty: bit for bit the same).

Triton 3.9.0's interpreter converts fp32 to fp8 by truncating the mantissa and adding the
cut-off bit without carrying it into the exponent (1.983 -> 1.0 in E4M3, not 2.0), and rounds
ties away from zero; on the GPU Triton rounds to nearest even, as torch does. Only where the probe
shows the defect is the interpreter's conversion replaced, for fp32 -> fp8 alone, by torch's
correctly rounded cast: the harness is patched, never the kernel.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from fp8train import block_scaled_mm as bsm  # noqa: E402
from fp8train.formats import E4M3, E5M2  # noqa: E402
from tests.triton_cast_cases import CASES, LINEARS, linear_step  # noqa: E402

# Values whose fp32 -> fp8 rounding the defect gets wrong: a carry into the next binade
# (1.983 -> 2.0 in E4M3, 1.9 -> 2.0 in E5M2), a tie to even (1.0625 -> 1.0 in E4M3).
PROBES = [1.983, 1.9, 1.0625, -1.983, 0.3, 448.0]
_FP8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}


@triton.jit
def _convert(x_ptr, e4_ptr, e5_ptr, N: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, N))
    tl.store(e4_ptr + tl.arange(0, N), x.to(tl.float8e4nv))
    tl.store(e5_ptr + tl.arange(0, N), x.to(tl.float8e5))


def interpreter_defect() -> dict[str, list[int]]:
    """What the interpreter's fp32 -> fp8 conversion gives for ``PROBES`` where torch's
    correctly rounded cast differs (bytes by format; empty: no defect)."""
    x = torch.tensor(PROBES + [0.0] * (8 - len(PROBES)))
    e4, e5 = torch.empty(8, dtype=E4M3.dtype), torch.empty(8, dtype=E5M2.dtype)
    _convert[(1,)](x, e4, e5, N=8)
    found = {}
    for name, got, dtype in (("e4m3", e4, E4M3.dtype), ("e5m2", e5, E5M2.dtype)):
        want = x.to(dtype).view(torch.uint8)
        if not torch.equal(got.view(torch.uint8), want):
            found[name] = got.view(torch.uint8).tolist()
    return found


def patch_interpreter() -> None:
    """The interpreter's fp32 -> fp8 conversion done by torch's cast (round to nearest even)."""
    convert = interpreter._convert_float

    def rounded(data, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype in _FP8:
            values = np.frombuffer(data.tobytes(), dtype=np.float32).reshape(data.shape)
            fp8 = torch.from_numpy(values.copy()).to(_FP8[output_dtype])
            return fp8.view(torch.uint8).numpy()
        return convert(data, input_dtype, output_dtype, rounding_mode)

    interpreter._convert_float = rounded


def main() -> None:
    defect = interpreter_defect()
    if defect:
        patch_interpreter()
    report = {"defect": defect, "patched_defect": interpreter_defect() if defect else {}}
    report["cases"] = {name: check("cpu") for name, check in CASES.items()}
    # The emulated block-scaled kernel bound for the CPU, as tests/test_block_compile.py does:
    # the layouts cuBLASLt reads, so the weight kernel writes Wᵀ's copy.
    bsm._bound["cpu"] = bsm.BlockKernel((torch.bfloat16, torch.float32), True, "emulated")
    bsm._scaled_mm = bsm.emulated_scaled_mm
    report["linears"] = {
        f"{s} {b}": linear_step(s, b, "cpu", kernels=True, compiled=(False,)) for s, b in LINEARS
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()

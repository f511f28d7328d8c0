"""The Triton cast unit (``fp8train.triton_cast``, issue 35): one read of a tensor writes
both orientations, bit for bit what ``blockwise.quantize_operand`` (the emulation) writes.

- On the CPU, under Triton's interpreter (``tests/triton_interpreted.py``, in a process of
  its own: ``TRITON_INTERPRET=1`` must precede the kernels' decoration): every case of
  ``tests/triton_cast_cases.py`` (1 x 128 tiles and row scales both ways, 128 x 128 weight
  blocks with their transposed copy; E4M3 and E5M2, partial tiles, bf16, margins,
  power-of-two scales, a zero tile, inf/NaN) equals the emulation in bytes, scale bits and
  layouts; and a row- and block-scaled Linear step (te, O1, O3; emulated GEMMs and the
  emulated block-scaled kernel, so Wᵀ is the weight kernel's copy) with the kernels equals
  the step with the torch cast, bit for bit (eager: a traced kernel call under the
  interpreter reads fake data). Triton 3.9.0's interpreter rounds fp32 -> fp8 wrongly: a
  test shows the probe that finds it and that the harness's patch (torch's cast) fixes it.
- Compiled for sm_90 here (triton's own ptxas, no GPU): one correctly rounded fp32 -> FP8
  conversion, IEEE division only, no register spill, 16-byte loads and stores.
- On fake and meta tensors the ops only allocate, in the emulation's shapes and layouts, and
  trace as one graph with no break, symbolic sizes included.
- With the kernels bound, a Linear step dispatches them (one per tensor and its transpose)
  and none of the torch cast's operators; the binding: the torch ops on the CPU and meta,
  the kernels on CUDA (sm_90+); without triton, fp8train imports and trains as before.
- CUDA only (skipped here): the cases again on the device, with a GPT-1.3B-sized tensor of
  each kind; a row- and block-scaled Linear step with the kernels bound equals the step
  with the torch cast, bit for bit, eager and compiled (``fullgraph=True``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from conftest import REPO

from fp8train import triton_cast
from fp8train.blockwise import quantize_operand
from fp8train.formats import E4M3, E5M2
from fp8train.gemm_backend import set_gemm_backend
from tests.test_block_compile import _linear  # a 256 -> 384 layer, level@granularity

pytestmark = pytest.mark.skipif(not triton_cast.available(), reason="triton is not installed")

CUDA = torch.cuda.is_available() and triton_cast.bind("cuda")
TRITON = version("triton") if triton_cast.available() else None
PTX_FP8 = {"fp8e4nv": "e4m3", "fp8e5": "e5m2"}  # Triton's FP8 type -> PTX's


@pytest.fixture(scope="module")
def interpreted() -> dict:
    """The report of ``tests/triton_interpreted.py`` (one process for every case)."""
    run = subprocess.run(
        [sys.executable, str(REPO / "tests" / "triton_interpreted.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_interpreter_defect_is_found_and_patched(interpreted):
    # The probes' bytes from the unpatched interpreter: 1.983 -> 0x38 (1.0) in E4M3 where
    # torch (and the GPU) give 0x40 (2.0). A triton without the defect patches nothing.
    if TRITON == "3.9.0":
        assert interpreted["defect"]["e4m3"][0] == 0x38, interpreted["defect"]
        assert torch.tensor(1.983).to(E4M3.dtype).view(torch.uint8).item() == 0x40
    assert interpreted["patched_defect"] == {}


def test_the_kernels_equal_the_emulation_under_the_interpreter(interpreted):
    from tests.triton_cast_cases import CASES

    assert set(interpreted["cases"]) == set(CASES)
    wrong = {name: found for name, found in interpreted["cases"].items() if found}
    assert not wrong, json.dumps(wrong, indent=1)


@pytest.mark.parametrize("granularity", ["block", "row"])
def test_on_fake_and_meta_tensors_the_ops_allocate_the_emulations_layouts(granularity):
    from torch._subclasses.fake_tensor import FakeTensorMode

    x = torch.randn(200, 300)
    tiles = granularity == "block"
    want = quantize_operand(x, E5M2, (1, 128) if tiles else (1, 300))
    want_t = quantize_operand(x, E5M2, (1, 128) if tiles else (1, 200), True)
    with FakeTensorMode() as mode:
        x8, xt8 = triton_cast.quantize_pair(mode.from_tensor(x), E5M2, granularity)
    x8m, _ = triton_cast.quantize_pair(x.to("meta"), E5M2, granularity)
    for got, ref in ((x8, want), (xt8, want_t), (x8m, want)):
        for part in ("data", "scale_inv"):
            a, b = getattr(got, part), getattr(ref, part)
            assert (a.shape, a.dtype, got.block) == (b.shape, b.dtype, ref.block)
            assert a.stride() == b.stride() or a.shape[-1] == 1


def test_the_ops_trace_as_one_graph_on_meta():
    import torch._dynamo as dynamo

    def unit(x):
        a, b = triton_cast.quantize_pair(x, E4M3, "block")
        w, wt = triton_cast.quantize_weight(x, E4M3, transposed=True)
        return a.data, a.scale_inv, b.data, b.scale_inv, w.data, wt.data

    dynamo.reset()
    explained = dynamo.explain(unit)(torch.empty(256, 384, device="meta"))
    reasons = [str(b.reason)[:200] for b in explained.break_reasons]
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), reasons
    # Symbolic sizes (a compiled step whose token count varies) size the outputs too.
    dynamic = torch.compile(unit, fullgraph=True, dynamic=True, backend="aot_eager")
    for m, k in ((256, 384), (300, 200)):
        x8, sinv, xt8, sinvt, w8, wt8 = dynamic(torch.empty(m, k, device="meta"))
        assert (sinv.shape, sinvt.shape, wt8.shape) == (
            (m, -(-k // 128)),
            (k, -(-m // 128)),
            (k, m),
        )
    assert hasattr(torch.ops.fp8train, "cast_pair") and hasattr(torch.ops.fp8train, "cast_blocks")


def _lowered(kernel, fp8: str, constexprs: dict) -> tuple[str, str]:
    """``kernel`` compiled for sm_90 here, without a GPU (triton's own ptxas), specialized as
    the JIT specializes a launch on a contiguous bf16 ``x`` whose sizes are multiples of 16
    (unit stride a constant; pointers, row stride and sizes divisible by 16): its PTX and
    cuobjdump's resource usage (registers, stack, local memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"x_ptr": "*bf16", "x8_ptr": f"*{fp8}", "xt8_ptr": f"*{fp8}"}
    constexprs = {**constexprs, "sxk": 1}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name.endswith("_ptr") or name in ("sxm", "M", "K"):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = types.get(name, "*fp32")
        else:
            signature[name] = "i32" if name in ("sxm", "sxk", "M", "K") else "fp32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": triton_cast.kernels()._WARPS}
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([tool, "-res-usage", cubin.name], capture_output=True, text=True)
    return compiled.asm["ptx"], usage.stdout


@pytest.mark.skipif(TRITON != "3.9.0", reason="ASTSource's signature format is triton 3.9.0's")
def test_for_sm_90_the_kernels_round_once_divide_exactly_and_never_spill():
    # What the interpreter cannot show: the GPU's code. fp32 -> FP8 in one correctly rounded
    # conversion (no fp16 step), IEEE division (Triton's "/" is div.full, approximate) and
    # products, a tile that fits in registers (a spill to the stack costs bandwidth), and
    # 16-byte loads and stores (the transposed tile goes through shared memory, not out
    # byte by byte).
    k = triton_cast.kernels()
    flags = {"POW2": True, "BK": k.TILE}
    kernels = [
        (k._cast_kernel, "fp8e4nv", {**flags, "ROWS": False, "WRITE_X": True, "WRITE_T": True}),
        (k._cast_kernel, "fp8e5", {**flags, "ROWS": True, "WRITE_X": True, "WRITE_T": True}),
        (k._blocks_kernel, "fp8e4nv", {**flags, "WRITE_T": True}),
        (k._amax_kernel, "fp8e4nv", {"ROWS": True, "COLS": True, "BK": k.TILE}),
    ]
    for kernel, fp8, constexprs in kernels:
        rows = constexprs.get("ROWS") and kernel is k._cast_kernel
        ptx, usage = _lowered(kernel, fp8, {**constexprs, "BM": k._ROWS_BM if rows else k.TILE})
        name = f"{kernel.fn.__name__} {constexprs}"
        assert re.search(r"STACK:0\b", usage) and re.search(r"LOCAL:0\b", usage), name + usage
        memory = set(re.findall(r"(?:ld|st)\.global[\w.]*", ptx))
        assert "ld.global.v4.b32" in memory and "st.global.b8" not in memory, f"{name}: {memory}"
        if kernel is k._amax_kernel:
            continue
        conversions = set(re.findall(r"cvt\.[\w.]+", ptx))
        assert f"cvt.rn.satfinite.{PTX_FP8[fp8]}x2.f32" in conversions, name
        assert not any(".f16.f32" in c for c in conversions), f"{name}: {conversions}"
        divisions = set(re.findall(r"div\.[\w.]+", ptx))
        assert divisions == {"div.rn.f32"}, f"{name}: {divisions}"
        # x * scale rounds once, as torch's product: no fused multiply-add, no flushed
        # subnormals (a bf16 activation can be one).
        assert not re.search(r"\bfma\.|\.ftz\b", ptx), name


@pytest.mark.parametrize(
    "spec, casts",
    [
        # x and g: one cast_pair each (both orientations); the weight's blocks and Wᵀ's copy
        # one cast_blocks; at row the weight is one more cast_pair.
        ("te@block", {"fp8train.cast_pair": 2, "fp8train.cast_blocks": 1}),
        ("te@row", {"fp8train.cast_pair": 3}),
    ],
)
def test_with_the_kernels_bound_a_step_casts_through_them_alone(spec, casts):
    # Bits cannot tell the kernels from the torch cast: the operators a step dispatches can.
    # On meta (the ops only allocate there) with the kernel GEMMs a plan assumes.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Operators(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    for kernels in (True, False):
        layer = _linear(spec, "scaled_mm", "meta", torch.bfloat16)
        layer.cast_kernels = kernels
        x = torch.empty(2, 128, 256, device="meta", dtype=torch.bfloat16, requires_grad=True)
        with Operators() as ops:
            layer(x).float().sum().backward()
        ours = {op: n for op, n in ops.seen.items() if op.startswith("fp8train.")}
        # The torch cast's tile maxima (aten.amax) are gone with the kernels, none left over.
        assert (ours, ops.seen["aten.amax"] == 0) == ((casts, True) if kernels else ({}, False))


def test_without_triton_fp8train_imports_and_casts_with_torch():
    # A CPU install without triton: a finder that refuses it stands in for its absence.
    script = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] == "triton":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Refuse())
import torch
from fp8train import triton_cast
from fp8train.linear import Linear
from fp8train.precision import get_recipe
from fp8train.scaling import ScalingRecipe
scaling = ScalingRecipe(mode="current", granularity="block", grad_format="e4m3")
layer = Linear(256, 128, recipe=get_recipe("te", scaling=scaling))
layer(torch.randn(4, 256)).sum().backward()
print(triton_cast.available(), triton_cast.bind("cuda"), layer.cast_kernels)
print("triton" in sys.modules)
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["False"] * 4


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_binding_takes_the_torch_cast_off_cuda(device):
    assert triton_cast.bind(device) is False
    layer = _linear("te@block", "emulated", device)
    assert layer.cast_kernels is False


needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA sm_90+ with triton: the real kernels")


@needs_cuda
def test_the_kernels_equal_the_emulation_on_cuda():
    from tests.triton_cast_cases import CUDA_CASES

    wrong = {name: found for name, check in CUDA_CASES.items() if (found := check("cuda"))}
    assert not wrong, json.dumps(wrong, indent=1)


@needs_cuda
def test_a_linear_step_with_the_kernels_equals_the_torch_cast_on_cuda():
    from tests.triton_cast_cases import LINEARS, linear_step

    wrong = {f"{s} {b}": found for s, b in LINEARS if (found := linear_step(s, b, "cuda"))}
    assert not wrong, json.dumps(wrong, indent=1)


def test_a_linear_step_with_the_kernels_equals_the_torch_cast_under_the_interpreter(
    interpreted,
):
    from tests.triton_cast_cases import LINEARS

    assert set(interpreted["linears"]) == {f"{s} {b}" for s, b in LINEARS}
    wrong = {name: found for name, found in interpreted["linears"].items() if found}
    assert not wrong, json.dumps(wrong, indent=1)


@needs_cuda
def test_a_linear_moved_to_cuda_binds_the_kernels():
    layer = _linear("te@block", "emulated", "cpu")
    assert layer.cast_kernels is False
    set_gemm_backend("emulated")
    try:
        assert layer.to("cuda").cast_kernels is True
    finally:
        set_gemm_backend(None)

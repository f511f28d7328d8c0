"""The cases of ``tests/test_triton_cast.py``: each casts one tensor with the Triton cast
unit (``fp8train.triton_cast``) and with ``blockwise.quantize_operand``, the emulation, and
lists every difference (bytes, scale_inv bits, shapes, strides, blocks); none: bit for bit.

No side effect on import: ``tests/triton_interpreted.py`` runs them on the CPU under
Triton's interpreter (in a process of its own), the CUDA tests in the pytest process.
"""

from __future__ import annotations

import torch
import torch._dynamo as dynamo

from fp8train import triton_cast
from fp8train.blockwise import WEIGHT_BLOCK, BlockFloat8Tensor, quantize_operand
from fp8train.formats import E4M3, E5M2
from fp8train.param_state import grad_value
from tests.test_block_compile import _linear  # a 256 -> 384 layer, level@granularity

__all__ = ["CASES", "CUDA_CASES", "LINEARS", "differences", "linear_step", "operand"]


def differences(name: str, got: BlockFloat8Tensor, want: BlockFloat8Tensor) -> list[str]:
    """How ``got`` differs from ``want``: block, format, bytes, scale bits, layouts."""
    out = []
    if got.block != want.block or got.fmt != want.fmt:
        out.append(f"{name}: block/format {got.block} {got.fmt} != {want.block} {want.fmt}")
    for part in ("data", "scale_inv"):
        a, b = getattr(got, part), getattr(want, part)
        # The stride of a dimension of size 1 says nothing about the layout (is_contiguous).
        strides = [[s for s, n in zip(t.stride(), t.shape) if n > 1] for t in (a, b)]
        if a.shape != b.shape or strides[0] != strides[1] or a.dtype != b.dtype:
            out.append(
                f"{name}.{part}: {tuple(a.shape)} {a.stride()} {a.dtype} != "
                f"{tuple(b.shape)} {b.stride()} {b.dtype}"
            )
            continue
        view = torch.uint8 if part == "data" else torch.int32
        bits, ref = a.view(view).flatten(), b.view(view).flatten()
        bad = (bits != ref).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            out.append(f"{name}.{part}: {len(bad)} differ, first at {i}: {bits[i]} != {ref[i]}")
    return out


def operand(shape, seed, special=None, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Normal values spread over 12 binades across rows and columns (scales differ from
    tile to tile); ``special``: ``zero`` (an all-zero 128 x 128 tile: scale 1) or
    ``nonfinite`` (inf, -inf and NaN in the first tile: scale 1 for their rows, columns,
    tiles and block, the inf saturating, the NaN kept)."""
    g = torch.Generator().manual_seed(seed)
    m, k = shape
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]
    x = x * torch.logspace(-2, 2, k)[None, :]
    if special == "zero":
        x[:128, 128:256] = 0.0
    elif special == "nonfinite":
        x[0, 0], x[1, 2], x[3, 1] = float("inf"), float("-inf"), float("nan")
    return x.to(device, dtype)


def check_pair(
    shape, fmt, granularity, margin=0, pow2=False, special=None, dtype=None, device="cpu",
    alone=False, strided=False,
):  # fmt: skip
    """``quantize_pair`` against ``quantize_operand`` of x and, transposed, of xᵀ, written
    together and (``alone``) each without the other; ``strided``: x a transposed view (a
    gradient autograd hands over need not be contiguous)."""
    if strided:
        x = operand(shape[::-1], sum(shape), special, dtype or torch.float32, device).t()
    else:
        x = operand(shape, sum(shape), special, dtype or torch.float32, device)
    m, k = shape
    tiles = granularity == "block"
    want = quantize_operand(x, fmt, (1, 128) if tiles else (1, k), False, margin, pow2)
    want_t = quantize_operand(x, fmt, (1, 128) if tiles else (1, m), True, margin, pow2)
    out = []
    for write in ((True, True), (True, False), (False, True)) if alone else ((True, True),):
        x8, xt8 = triton_cast.quantize_pair(x, fmt, granularity, margin, pow2, write)
        if (x8 is None) == write[0] or (xt8 is None) == write[1]:
            out.append(f"{write}: returned {x8 is not None, xt8 is not None}")
            continue
        if write[0]:
            out += differences(f"x8 {write}", x8, want)
        if write[1]:
            out += differences(f"xt8 {write}", xt8, want_t)
    return out


def check_weight(shape, fmt, margin=0, pow2=False, special=None, dtype=None, device="cpu"):
    """``quantize_weight`` against ``quantize_operand`` in 128 x 128 blocks and the
    transposed contiguous copy ``block_linear._transposed`` makes of it."""
    w = operand(shape, sum(shape) + 1, special, dtype or torch.float32, device)
    want = quantize_operand(w, fmt, WEIGHT_BLOCK, False, margin, pow2)
    t = want.t()
    want_t = BlockFloat8Tensor(t.data.contiguous(), t.scale_inv, fmt, t.block)
    out = []
    for transposed in (False, True):
        w8, wt8 = triton_cast.quantize_weight(w, fmt, margin, pow2, transposed)
        out += differences(f"w8 transposed={transposed}", w8, want)
        if transposed:
            out += differences("wt8", wt8, want_t)
        elif wt8 is not None:
            out.append("wt8 written without transposed")
    return out


# name -> check(device): partial tiles (200x300, 1x129, 257x64), whole ones (128x128), both
# formats, bf16 input, margins, power-of-two scales, a zero tile, inf/NaN.
CASES = {
    "block e4m3 200x300": lambda d: check_pair((200, 300), E4M3, "block", device=d, alone=True),
    "block e5m2 200x300": lambda d: check_pair((200, 300), E5M2, "block", device=d),
    "block e4m3 128x128": lambda d: check_pair((128, 128), E4M3, "block", device=d),
    "block e4m3 1x129": lambda d: check_pair((1, 129), E4M3, "block", device=d),
    "block e4m3 257x64": lambda d: check_pair((257, 64), E4M3, "block", device=d),
    "block e4m3 bf16": lambda d: check_pair(
        (200, 300), E4M3, "block", dtype=torch.bfloat16, device=d
    ),
    "block e4m3 margin 2 pow2": lambda d: check_pair((200, 300), E4M3, "block", 2, True, device=d),
    "block e5m2 margin 1 pow2": lambda d: check_pair((257, 64), E5M2, "block", 1, True, device=d),
    "block e4m3 strided": lambda d: check_pair((200, 300), E4M3, "block", device=d, strided=True),
    "block e4m3 zero tile": lambda d: check_pair(
        (200, 300), E4M3, "block", special="zero", device=d
    ),
    "block e4m3 inf/nan": lambda d: check_pair(
        (200, 300), E4M3, "block", special="nonfinite", device=d
    ),
    "block e5m2 inf/nan": lambda d: check_pair(
        (200, 300), E5M2, "block", special="nonfinite", device=d
    ),
    "row e4m3 200x300": lambda d: check_pair((200, 300), E4M3, "row", device=d, alone=True),
    "row e5m2 200x300": lambda d: check_pair((200, 300), E5M2, "row", device=d),
    "row e4m3 128x128": lambda d: check_pair((128, 128), E4M3, "row", device=d),
    "row e4m3 1x129": lambda d: check_pair((1, 129), E4M3, "row", device=d),
    "row e4m3 bf16": lambda d: check_pair((257, 64), E4M3, "row", dtype=torch.bfloat16, device=d),
    "row e4m3 margin 1 pow2": lambda d: check_pair((257, 64), E4M3, "row", 1, True, device=d),
    "row e4m3 strided": lambda d: check_pair((257, 64), E4M3, "row", device=d, strided=True),
    "row e4m3 zero tile": lambda d: check_pair((200, 300), E4M3, "row", special="zero", device=d),
    "row e4m3 inf/nan": lambda d: check_pair(
        (200, 300), E4M3, "row", special="nonfinite", device=d
    ),
    "weight e4m3 200x300": lambda d: check_weight((200, 300), E4M3, device=d),
    "weight e4m3 257x64 pow2": lambda d: check_weight((257, 64), E4M3, 0, True, device=d),
    "weight e4m3 zero block": lambda d: check_weight((300, 300), E4M3, special="zero", device=d),
    "weight e4m3 inf/nan": lambda d: check_weight((200, 300), E4M3, special="nonfinite", device=d),
}

# On a GPU, also the size of a GPT-1.3B step's tensors: many programs, contended atomics.
CUDA_CASES = {
    **CASES,
    "block e4m3 bf16 8192x2048": lambda d: check_pair(
        (8192, 2048), E4M3, "block", dtype=torch.bfloat16, device=d
    ),
    "row e4m3 bf16 8192x2048": lambda d: check_pair(
        (8192, 2048), E4M3, "row", dtype=torch.bfloat16, device=d
    ),
    "weight e4m3 2048x8192": lambda d: check_weight((2048, 8192), E4M3, device=d),
}


def _step(layer, device, compiled: bool) -> list[torch.Tensor | None]:
    """One forward and backward on a bf16 input: output, input grad, parameter grads."""
    x = torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(1))
    x = x.to(device, torch.bfloat16).requires_grad_()
    run = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    y = run(x)
    y.float().square().sum().backward()
    return [y, x.grad, grad_value(layer.weight), grad_value(layer.bias)]


def linear_step(
    spec: str, backend: str, device, kernels: bool | None = None, compiled=(False, True)
) -> list[str]:
    """A bf16 ``Linear`` step (``spec``: level@granularity) with the cast kernels against the
    same step with the torch cast, eager and compiled (``fullgraph=True``, ``aot_eager``: the
    traced operations run as eager runs them); the differences, none: bit for bit.
    ``kernels``: set the layer's binding (the CPU binds the torch cast); None: as bound.
    ``compiled``: which to run (Triton's interpreter runs eager only: a traced kernel call
    under it reads the data of fake tensors)."""
    reference = _linear(spec, backend, device, torch.bfloat16)
    reference.cast_kernels = False
    want = _step(reference, device, False)
    out = []
    for traced in compiled:  # a fresh layer each: O1-O3 accumulate into FP8 slots
        layer = _linear(spec, backend, device, torch.bfloat16)
        if kernels is not None:
            layer.cast_kernels = kernels
        if layer.cast_kernels is not True:
            return [f"the kernels are not bound on {device}"]
        dynamo.reset()
        got = _step(layer, device, traced)
        for name, a, b in zip(("y", "dx", "dW", "db"), got, want):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                out.append(f"{name} compiled={traced} differs")
    return out


# (spec, GEMM backend) of the Linear steps: both granularities, a stored FP8 weight (O3), an
# FP8 weight gradient slot (O1, O3), the emulated GEMMs and the kernels' (on the CPU the
# emulated block-scaled kernel stands in for cuBLASLt's: Wᵀ is then the kernels' copy).
LINEARS = [
    (spec, backend)
    for spec in ("te@block", "O3@block", "te@row", "O1@row")
    for backend in ("emulated", "scaled_mm")
]

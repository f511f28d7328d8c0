"""``Linear``: the one linear layer every model GEMM goes through, FP8-aware.

Without an FP8 recipe it is ``F.linear`` and nothing else. With one, the three GEMMs of a
linear layer run in FP8 with the "hybrid" formats (docs/ARCHITECTURE.md, "FP8 linear"):

    forward      y  = x(E4M3) · W(E4M3)ᵀ          [M,K] x [N,K]ᵀ -> [M,N]
    input grad   dx = g(E5M2) · W(E4M3)           [M,N] x [N,K]  -> [M,K]
    weight grad  dW = gᵀ(E5M2) · x(E4M3)          [N,M] x [M,K]  -> [N,K]

E5M2 for the gradient because gradients span a wider range than they need precision. Only the
FP8 copies of x and W are saved for backward (a quarter of fp32 activation memory). Bias add and
bias grad stay in fp32.

Scaling state (one ``ScalingState`` per role) lives in persistent buffers, so a checkpoint of
``model.state_dict()`` resumes with the same scales. A cast only asks its state for a scale and
records its amax; the state moves in one bulk update per pass (``scaling.fold``), run by the
model's ``scaling_table.ScalingTable``, or by this linear right after its casts when no table
manages its states. The state advances only in training mode: evaluation reads the scales but
does not change them, so validation never perturbs training.

The weight is cast once per optimizer step (``Linear.weight_fp8``), and the FP32 weight
gradient of an FP8 gradient slot reaches the slot through autograd (the slot's ``sink``), so a
layer traces whole under ``torch.compile`` (docs/ARCHITECTURE.md, "FP8 speed").

Activation recompute (``torch.utils.checkpoint``) runs a forward twice for one backward. The
second run must neither advance the scaling state again nor cast with a different scale (the
delayed scale has moved on by then), or recompute would change the numerics. So a checkpointed
region records the scale of every forward cast (``recompute_scale_contexts``) and its
recompute replays them in the same order.
"""

from __future__ import annotations

import contextlib
import math
import threading

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .block_linear import BlockFp8LinearFunction, uses_layouts, weight_operands
from .blockwise import WEIGHT_BLOCK, quantize_blocks
from .formats import E4M3, E5M2, cast_health
from .gemm import fp8_gemm, prepare_scaled_gemm
from .gemm_backend import select_gemm_backend
from .health_record import HealthRecord, health_keys
from .low_precision import Fp8GradSlot, ScaledTensor
from .param_state import (
    drop_initial_master,
    fp8_grad_slot,
    set_grad_slot,
    set_initial_master,
    set_scale_inv,
    take_initial_master,
)
from .precision import PrecisionRecipe
from .scaling import ScalingState, fold
from .tensor import Float8Tensor
from .triton_cast import bind as bind_cast_kernels

__all__ = [
    "Fp8LinearFunction",
    "Linear",
    "compiled_recompute_contexts",
    "recompute_scale_contexts",
]

ROLES = ("input", "weight", "grad_output")


class _ScaleLog:
    """The forward-cast scales of one checkpointed region, in call order."""

    def __init__(self) -> None:
        self.entries: list[tuple[ScalingState, torch.Tensor]] = []
        self.pos = 0

    def replay(self, state: ScalingState) -> torch.Tensor:
        if self.pos >= len(self.entries) or self.entries[self.pos][0] is not state:
            # A different call sequence would pair scales with the wrong tensors: refuse.
            raise RuntimeError(
                "activation recompute: the recomputed forward does not cast the same FP8 "
                "tensors in the same order as the original forward"
            )
        scale = self.entries[self.pos][1]
        self.pos += 1
        return scale


# (log, replaying) of the region being run on this thread. Thread-local: CUDA backward (and so
# the recompute) runs on autograd's device thread, and each thread sets its own.
_local = threading.local()


def _active_log() -> tuple[_ScaleLog | None, bool]:
    return getattr(_local, "active", (None, False))


class _ScaleLogContext:
    """Makes ``log`` the active one (recording, or replaying when ``replay``) inside the block.
    A class, not a generator, so one instance can be entered again: a second backward through
    a retained graph recomputes again."""

    def __init__(self, log: _ScaleLog, replay: bool) -> None:
        self.log, self.replay = log, replay
        self.previous: list[tuple[_ScaleLog | None, bool]] = []

    def __enter__(self) -> None:
        if self.replay:
            self.log.pos = 0
        else:
            self.log.entries.clear()
        self.previous.append(_active_log())
        _local.active = (self.log, self.replay)

    def __exit__(self, *exc) -> None:
        _local.active = self.previous.pop()


def recompute_scale_contexts() -> tuple[contextlib.AbstractContextManager, ...]:
    """``(forward, recompute)`` context managers for ``torch.utils.checkpoint``'s ``context_fn``.

    Inside ``forward`` every FP8 forward cast records the scale it used (and updates the
    scaling state as usual); inside ``recompute`` the casts reuse those scales in order and
    leave the state alone, so the recomputed FP8 tensors are bit-identical to the originals.
    """
    log = _ScaleLog()
    return _ScaleLogContext(log, replay=False), _ScaleLogContext(log, replay=True)


def _quantize(
    x: torch.Tensor,
    state: ScalingState,
    update: bool,
    health=None,
    role: str = "",
    scale: torch.Tensor | None = None,
    transpose: bool = False,
) -> Float8Tensor:
    if scale is None:
        scale = state.cast_scale(x.abs().amax(), update=update)
    q = Float8Tensor.quantize(x, state.fmt, scale, transpose)
    if health is not None:
        _record_health(health, role, x, q, scale)
    return q


def _forward_quantize(
    x: torch.Tensor,
    state: ScalingState,
    update: bool,
    health,
    role: str,
    amax_sync=None,
    transpose: bool = False,
) -> Float8Tensor:
    """A forward-pass cast, recorded or replayed when inside a checkpointed region.

    ``amax_sync``: turns the local amax into the one every rank that shares this tensor uses
    (a MAX all-reduce), so their FP8 bytes share one scale and can be concatenated.
    ``transpose``: also write the transposed layout (``Float8Tensor.quantize``).
    """
    log, replay = _active_log()
    if replay:
        # The original forward already updated the state and measured cast health.
        return _quantize(x, state, False, None, role, log.replay(state), transpose)
    amax = x.abs().amax()
    if amax_sync is not None:
        amax = amax_sync(amax)
    scale = state.cast_scale(amax, update=update)
    if torch.compiler.is_compiling():
        scale = torch.ops.fp8train.forward_scale(scale)  # kept for a compiled recompute
    if log is not None:
        log.entries.append((state, scale))  # a fresh tensor: later updates do not touch it
    return _quantize(x, state, update, health, role, scale, transpose)


# Compiled, a checkpointed region's recompute is part of the backward graph: it would
# compute each forward cast's scale again from the scaling buffers, which the forward has
# updated in place by then. The scale passes through this operator, which the compiled
# recompute's policy saves (compiled_recompute_contexts): the recompute casts with the
# forward's scales, as the eager replay does.
@torch.library.custom_op("fp8train::forward_scale", mutates_args=())
def _forward_scale(scale: torch.Tensor) -> torch.Tensor:
    return scale.clone()


@_forward_scale.register_fake
def _(scale):
    return torch.empty_like(scale)


def _save_forward_scales(ctx, op, *args, **kwargs):
    if op is torch.ops.fp8train.forward_scale.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def compiled_recompute_contexts():
    """``context_fn`` for ``torch.utils.checkpoint`` inside a compiled region: recompute
    everything but the forward casts' scales (``recompute_scale_contexts`` is the eager
    counterpart; compile takes only selective-checkpoint contexts)."""
    return create_selective_checkpoint_contexts(_save_forward_scales)


def _record_health(
    health: HealthRecord, role: str, x: torch.Tensor, q: Float8Tensor, scale: torch.Tensor
) -> None:
    """``formats.cast_health`` of one per-tensor cast, under ``<role>_underflow`` and
    ``<role>_saturated``."""
    health[f"{role}_underflow"], health[f"{role}_saturated"] = cast_health(x, q.data, q.fmt, scale)


class Fp8LinearFunction(torch.autograd.Function):
    """``y = x Wᵀ + b`` with all three GEMMs in FP8. x is 2-D [M, K]; W [N, K]; b [N] or None."""

    @staticmethod
    def forward(
        ctx,
        x,
        weight,
        bias,
        wgrad_sink,
        w8_data,
        w8_scale_inv,
        w8_t,
        x_state,
        w_state,
        g_state,
        update,
        health,
        input_comm=None,
        backend="emulated",
        fast_accum=False,
    ):
        # input_comm (sequence parallelism): x is this rank's rows; they are cast with a scale
        # agreed over the group, the FP8 bytes all-gathered (1 byte per element on the wire),
        # and the input gradient reduce-scattered back to this rank's rows.
        # cuBLASLt reads the weight-gradient GEMM's operands as xᵀ and gᵀ row-major: the casts
        # write those layouts beside their own (one pass when compiled). The emulation reads
        # any layout. Decided by the backend bound at build time, never by values.
        layouts = backend == "scaled_mm"
        sync = None if input_comm is None else input_comm.sync_amax
        x8 = _forward_quantize(
            x, x_state, update, health, "input", sync, transpose=layouts and input_comm is None
        )
        if input_comm is not None:  # all rows, the transposed layout made after the gather
            rows = input_comm.gather(x8.data)
            x8 = Float8Tensor(rows, x8.scale_inv, E4M3, rows.t().contiguous() if layouts else None)
        # Linear.weight_fp8; None at O3, where the stored weight is the FP8 operand (one
        # tensor is not passed twice: compile refuses duplicate inputs). ``w8_t``: its
        # transpose, cast once per step where later micro-batches read it (else None).
        w8 = Float8Tensor(weight if w8_data is None else w8_data, w8_scale_inv, E4M3, w8_t)
        if update and not x_state.managed:  # no model table folds them: fold them now
            fold([x_state, w_state])
        # The activation's dtype written directly, the bias added before its one rounding
        # (inside the GEMM on CUDA).
        y = fp8_gemm(x8, w8, x.dtype, backend, bias=bias, fast_accum=fast_accum)
        # Only xᵀ is kept for backward (the weight-gradient GEMM's operand): the same bytes.
        # Where the cast wrote no transpose, x itself (a saved view of an intermediate would
        # alias it, which a compiled autograd function refuses); backward takes the view.
        ctx.x_transposed = x8.data_t is not None
        x_keep = x8.data_t if ctx.x_transposed else x8.data
        if input_comm is not None and not ctx.x_transposed and torch.compiler.is_compiling():
            x_keep = x_keep.clone()  # the gathered rows are a view of the collective's buffer
        ctx.save_for_backward(x_keep, x8.scale_inv, w8.data, w8.scale_inv, w8_t)
        ctx.g_state, ctx.update, ctx.health = g_state, update, health
        ctx.backend, ctx.sink = backend, wgrad_sink is not None
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.input_comm = input_comm
        return y

    @staticmethod
    def backward(ctx, g):
        x_keep, x_sinv, w_data, w_sinv, w_t = ctx.saved_tensors
        xt8 = Float8Tensor(x_keep if ctx.x_transposed else x_keep.t(), x_sinv, E4M3)  # xᵀ [K, M]
        w8 = Float8Tensor(w_data, w_sinv, E4M3, w_t)
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        need_x, need_w, need_b, need_sink = ctx.needs_input_grad[:4]
        need_w = need_sink if ctx.sink else need_w
        dx = dw = db = None
        if need_x or need_w:
            transpose = need_w and ctx.backend == "scaled_mm"  # gᵀ for the weight gradient
            g8 = _quantize(g, ctx.g_state, ctx.update, ctx.health, "grad_output", None, transpose)
            if ctx.update and not ctx.g_state.managed:
                fold([ctx.g_state])
            if need_x:
                dx = fp8_gemm(g8, w8.t(), out_dtype=x_dtype, backend=ctx.backend)  # [M,N]·[N,K]
                if ctx.input_comm is not None:
                    dx = ctx.input_comm.scatter_grad(dx)  # back to this rank's rows
            if need_w:
                out = torch.float32 if ctx.sink else w_dtype
                dw = fp8_gemm(g8.t(), xt8, out_dtype=out, backend=ctx.backend)
        if need_b:
            db = g.float().sum(0).to(b_dtype)
        # FP8 weight-gradient levels: the FP32 weight gradient goes to the slot's sink (its
        # hook accumulates it into the FP8 slot), the weight itself gets none from autograd.
        dw, dsink = (None, dw) if ctx.sink else (dw, None)
        return dx, dw, db, dsink, *[None] * 12


class Linear(nn.Module):
    """Drop-in for ``nn.Linear`` (same parameters, same default init) with an FP8 path.

    recipe: the precision level; FP8 GEMMs when ``recipe.fp8_gemm``, otherwise plain F.linear.
    Its ``scaling`` says how the FP8 scales are chosen (``get_recipe(level, scaling=...)``;
    default ``ScalingRecipe()``: delayed, history 16).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe: PrecisionRecipe | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.recipe = recipe
        self.fp8 = recipe is not None and recipe.fp8_gemm
        self.scaling = recipe.scaling if self.fp8 else None  # read on every cast: kept near
        # Cast health (underflow/saturation fractions) is measured only while track_health is
        # set, e.g. for one micro-batch of a logging step: it costs a pass over each tensor.
        self.track_health = False
        # The FP8 GEMM backend, decided when the weight lands on its device (here, and again
        # in _apply when it moves to another kind of device), never per call: the forward
        # reads a string, so a compiled step holds no lookup of a global or the environment.
        self.gemm_backend: str | None = None
        self._backend_device: str | None = None
        # Row/block casts by the Triton kernels (triton_cast), bound with the GEMM backend.
        self.cast_kernels = False
        # The weight's FP8 cast, kept for the micro-batches of one step (weight_fp8):
        # reuse_weight_cast reads it; keep_weight_cast says later micro-batches will, so the
        # cast also writes the transpose that the input-gradient GEMM reads, kept with it.
        # Per tensor (data, scale_inv, data_t); at row/block the GEMMs' two weight operands
        # (w8, wt8), kept only with keep_weight_cast (_block_weight_cast).
        self.reuse_weight_cast = False
        self.keep_weight_cast = False
        self._weight_cast: tuple | None = None
        self.health: HealthRecord | None = None
        if self.fp8:
            self.health = HealthRecord(health_keys(ROLES, self.scaling.granularity), device)
            self.fp8_input = ScalingState(E4M3, self.scaling, device)
            self.fp8_weight = ScalingState(E4M3, self.scaling, device)
            grad_fmt = E4M3 if self.scaling.grad_format == "e4m3" else E5M2
            self.fp8_grad_output = ScalingState(grad_fmt, self.scaling, device)
        self.reset_parameters()
        self._bind_gemm_backend()

    @property
    def lowered(self) -> bool:
        """Whether the weight is stored below FP32 (scaled FP16 at O1/O2, FP8 at O3)."""
        return self.weight.dtype in (torch.float16, E4M3.dtype)

    @torch.no_grad()
    def lower_weight_precision(self) -> None:
        """Store the weight as the recipe's ``weight`` column says, after initialisation.

        O1/O2: an FP16 tensor with a power-of-two per-tensor scale (``weight_scale_inv``); it
        is the master weight, there is no FP32 copy. O3: FP8 E4M3 with its scale (the FP16
        master lives in the optimizer): one per tensor, or at granularity ``block`` one
        power-of-two scale per 128x128 block (``weight_scale_inv`` is their grid). Where the
        recipe's weight gradient is FP8, the weight gets an ``Fp8GradSlot`` as
        ``weight.main_grad`` and autograd never sees a weight grad.
        """
        recipe = self.recipe
        if recipe is None or recipe.weight not in ("fp16", "fp8") or self.lowered:
            return
        if not self.fp8:
            raise ValueError(f"level {recipe.level}: a {recipe.weight} weight needs FP8 GEMMs")
        granularity = self.scaling.granularity
        if granularity == "row" and recipe.weight == "fp8":
            raise NotImplementedError(
                f"level {recipe.level} with fp8 granularity 'row' is not built: O3 stores its "
                "FP8 weights per tensor or in 128x128 blocks (granularity 'block'), whose "
                "transpose serves the input gradient; a row-scaled weight would need a second "
                "stored copy"
            )
        stored, master = self._stored_weight(self.weight.detach().float())
        if stored.scale_inv.dim():
            self.weight_block = WEIGHT_BLOCK
        self.weight = nn.Parameter(stored.data)
        self.register_buffer("weight_scale_inv", stored.scale_inv)
        if master is not None:
            set_initial_master(self.weight, master.data, master.scale_inv)
        if recipe.weight_grad == "fp8":
            # The weight gradient's FP8 storage is scaled like the GEMM operands: per tensor,
            # per row (along K, like the weight) or per 128x128 block.
            block = {"tensor": None, "row": (1, self.in_features), "block": WEIGHT_BLOCK}
            slot = Fp8GradSlot(self.weight.shape, self.weight.device, block[granularity])
            set_grad_slot(self.weight, slot)
        self._link_weight_attributes()

    def _stored_weight(self, value: torch.Tensor):
        """``(stored, master)``: FP32 ``value`` in the recipe's weight storage (a
        ``ScaledTensor``, or at O3 with ``block`` a ``BlockFloat8Tensor``), and at O3 the
        tensor-scaled FP16 master it is the E4M3 rounding of (else None)."""
        master = None
        if self.recipe.weight == "fp8":
            # O3's FP16 master starts from the initial value, not from the FP8 weight (see
            # param_state: a master on E4M3's grid holds the weight still for the first steps).
            # The FP8 weight is its E4M3 rounding, as after every optimizer step.
            master = ScaledTensor.quantize(value, torch.float16)
            value = master.dequantize()
            if self.scaling.granularity == "block":
                # One power-of-two scale per 128x128 block: the blocks the GEMMs read, so the
                # stored weight is both GEMMs' operand and is never cast again in a step.
                return quantize_blocks(value, E4M3, WEIGHT_BLOCK, power_of_two=True), master
        dtype = torch.float16 if self.recipe.weight == "fp16" else E4M3.dtype
        return ScaledTensor.quantize(value, dtype), master

    @torch.no_grad()
    def assign_weight(self, value: torch.Tensor) -> None:
        """Put ``value`` (the weight's shape, any float dtype) into the lowered weight in place
        (the Parameter and its scale buffer stay the objects that optimizers and gradient
        buffers hold), rounded as the lowering rounds; at O3 with the FP16 rounding of
        ``value`` as the master's start (a fine-tune's load from a finer checkpoint)."""
        if not self.lowered:
            raise ValueError("assign_weight: the weight is not lowered; copy into it instead")
        if tuple(value.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"assign_weight: {tuple(value.shape)} for a weight of {tuple(self.weight.shape)}"
            )
        stored, master = self._stored_weight(value.to(self.weight.device, torch.float32))
        self.weight.copy_(stored.data)
        self.weight_scale_inv.copy_(stored.scale_inv)
        if master is not None:
            set_initial_master(self.weight, master.data, master.scale_inv)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A loaded weight replaces the one the initial master was the finer value of.
        if prefix + "weight" in state_dict:
            drop_initial_master(self.weight)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _link_weight_attributes(self) -> None:
        # The optimizer reads the scale through the parameter; keep it the module's buffer.
        if hasattr(self, "weight_scale_inv"):
            set_scale_inv(self.weight, self.weight_scale_inv, getattr(self, "weight_block", None))

    def _apply(self, fn, recurse=True):
        master = take_initial_master(self.weight)  # (a move may replace the Parameter)
        out = super()._apply(fn, recurse)
        self._link_weight_attributes()  # .to(device) replaces buffers: re-point the attribute
        if master is not None:  # it goes where the weight went, and stays FP16
            set_initial_master(self.weight, *(t.to(self.weight.device) for t in master))
        self._bind_gemm_backend()
        if self.health is not None and self.health.values.device != self.weight.device:
            self.health = self.health.to(self.weight.device)
        return out

    def _bind_gemm_backend(self) -> None:
        """``gemm_backend`` for the weight's device type (``gemm_backend.select_gemm_backend``: the
        process's pinned choice, or the per-machine race; on meta, what a plan assumes)."""
        kind = self.weight.device.type
        if not self.fp8 or kind == self._backend_device:
            return
        self.gemm_backend = select_gemm_backend(kind)
        self._backend_device = kind
        # The row/block cast unit: one read writes both orientations on CUDA where triton
        # imports (triton_cast.bind); elsewhere blockwise.quantize_operand, as before.
        self.cast_kernels = self.scaling.granularity != "tensor" and bind_cast_kernels(kind)
        if self.gemm_backend == "scaled_mm" and self.scaling.granularity != "tensor":
            # Known before any GEMM asks, compiled or not: the CPU's row-wise support, CUDA's
            # block-scaled kernel (probed once; a compiled GEMM never probes).
            prepare_scaled_gemm(self.weight.device, self.scaling.granularity)

    def weight_fp8(self, health: HealthRecord | None = None) -> Float8Tensor:
        """The weight as the forward GEMM reads it: FP8 E4M3 with its scale (per tensor).

        O3 stores it so. Otherwise it is cast (delayed scaling, role ``weight``), and in
        training the cast is kept: with ``reuse_weight_cast`` set, as for every micro-batch
        of a step but the first (the weight changes only at the optimizer step), the kept
        cast is read again, so the weight is cast once per step (Transformer Engine's
        ``is_first_microbatch``); ``release_weight_cast`` drops it after the step. A compiled
        layer casts again with the scale of the first cast: the same bytes.

        With ``keep_weight_cast`` (later micro-batches will read it) and the cuBLASLt backend,
        the cast also writes Wᵀ, the input-gradient GEMM's operand (``data_t``), kept with
        it: one transpose per step, not one per micro-batch. At O3, of the stored weight."""
        scale_inv = getattr(self, "weight_scale_inv", None)
        compiling = torch.compiler.is_compiling()
        reuse = self.training and self.reuse_weight_cast
        keep = self.training and self.keep_weight_cast and not compiling
        transpose = keep and self.gemm_backend == "scaled_mm"
        cached = self._weight_cast if reuse else None
        if self.weight.dtype == E4M3.dtype:
            if cached is None and transpose:
                with torch.no_grad():
                    cached = (self.weight, scale_inv, self.weight.t().contiguous())
                self._weight_cast = cached
            return Float8Tensor(self.weight, scale_inv, E4M3, None if cached is None else cached[2])
        if cached is not None and health is None:
            return Float8Tensor(*cached[:2], E4M3, cached[2])
        with torch.no_grad():  # fp32 (te) or tensor-scaled fp16 (O1/O2)
            w = self.weight if scale_inv is None else self.weight.float() * scale_inv
            if reuse:
                # Compiled, where a graph keeps no Python state, or a logging step measuring
                # the cast's health: the first micro-batch's cast again, with the scale it
                # used (the state's latest), recording nothing in the scaling state.
                scale = self.fp8_weight.scale
                if compiling:
                    scale = torch.ops.fp8train.forward_scale(scale)
                return _quantize(w, self.fp8_weight, False, health, "weight", scale=scale)
            w8 = _forward_quantize(
                w, self.fp8_weight, self.training, health, "weight", transpose=transpose
            )
        if self.training and not compiling:
            self._weight_cast = (w8.data, w8.scale_inv, w8.data_t)
        return w8

    def release_weight_cast(self) -> None:
        """Drop the kept weight cast (its memory) and stop reusing it."""
        self._weight_cast = None
        self.reuse_weight_cast = self.keep_weight_cast = False

    def _wgrad_sink(self) -> torch.Tensor | None:
        """The sink of the weight's FP8 gradient slot (O1-O3), where backward hands the FP32
        weight gradient (``Fp8GradSlot.sink``); None where autograd fills ``weight.grad``."""
        slot = fp8_grad_slot(self.weight) if self.lowered else None
        return None if slot is None else slot.sink

    def reset_parameters(self) -> None:
        # Same calls in the same order as nn.Linear, so a seed gives the same weights.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)
        self.reset_fp8_state()

    def reset_fp8_state(self) -> None:
        """Fresh scaling state (call after ``to_empty`` when building on the meta device)."""
        for state in self.fp8_states().values():
            state.reset()

    def fp8_states(self) -> dict[str, ScalingState]:
        """Role -> scaling state; empty without FP8."""
        if not self.fp8:
            return {}
        return dict(zip(ROLES, (self.fp8_input, self.fp8_weight, self.fp8_grad_output)))

    def forward(self, x: torch.Tensor, input_comm=None) -> torch.Tensor:
        """``input_comm``: see ``Fp8LinearFunction`` (FP8 all-gather of sequence shards)."""
        if not self.fp8:
            if input_comm is not None:
                raise ValueError("input_comm needs an FP8 recipe")
            return F.linear(x, self.weight, self.bias)
        if self.scaling.granularity != "tensor":
            return self._blockwise_forward(x, input_comm)
        lead = x.shape[:-1] if input_comm is None else input_comm.gathered_lead(x.shape[:-1])
        health = self.health if self.track_health else None
        w8 = self.weight_fp8(health)
        y = Fp8LinearFunction.apply(
            x.reshape(-1, self.in_features),
            self.weight,
            self.bias,
            self._wgrad_sink(),
            None if w8.data is self.weight else w8.data,
            w8.scale_inv,
            w8.data_t,
            self.fp8_input,
            self.fp8_weight,
            self.fp8_grad_output,
            self.training,
            health,
            input_comm,
            self.gemm_backend,
            self.scaling.fast_accum,
        )
        return y.reshape(*lead, self.out_features)

    def _blockwise_forward(self, x: torch.Tensor, input_comm) -> torch.Tensor:
        if self.weight.dtype == E4M3.dtype and not hasattr(self, "weight_block"):
            raise ValueError(
                f"fp8 granularity {self.scaling.granularity!r}: this FP8 weight was stored with "
                "one scale per tensor (lower_weight_precision ran at granularity 'tensor')"
            )
        lead = x.shape[:-1] if input_comm is None else input_comm.gathered_lead(x.shape[:-1])
        health = self.health if self.track_health else None
        y = BlockFp8LinearFunction.apply(
            x.reshape(-1, self.in_features),
            self.weight,
            self.bias,
            self._wgrad_sink(),
            self.scaling,
            health,
            getattr(self, "weight_scale_inv", None),
            input_comm,
            self.gemm_backend,
            self.cast_kernels,
            self._block_weight_cast(x.device, health),
        )
        return y.reshape(*lead, self.out_features)

    def _block_weight_cast(self, device: torch.device, health) -> tuple | None:
        """Row/block: the weight's GEMM operands (``block_linear.weight_operands``) shared by
        a step's micro-batches, as ``weight_fp8`` shares the per-tensor cast. With
        ``keep_weight_cast`` (later micro-batches will read it) the first micro-batch casts
        here and keeps ``(w8, wt8)``; with ``reuse_weight_cast`` the others read them: one
        cast and one Wᵀ copy per step instead of one per micro-batch (O3 at block: the copy
        alone). Every scale is the weight's current one, so a fresh cast would be the same
        bytes: a micro-batch that measures the cast's health casts again, and a compiled
        layer (no Python state in a graph) or a step of one micro-batch keep nothing (None:
        the GEMM function casts)."""
        if not (self.training and self.keep_weight_cast) or torch.compiler.is_compiling():
            return None
        if self.reuse_weight_cast and self._weight_cast is not None:
            return None if health is not None else (None, *self._weight_cast)
        with torch.no_grad():
            w, w8, wt8 = weight_operands(
                self.weight,
                getattr(self, "weight_scale_inv", None),
                self.scaling,
                uses_layouts(device, self.gemm_backend),
                self.cast_kernels,
            )
        self._weight_cast = (w8, wt8)
        return w, w8, wt8

    @torch.no_grad()
    def fp8_stats(self) -> dict[str, float]:
        """Latest amax and scale of each role, e.g. {"input_amax": ..., "input_scale": ...},
        plus ``<role>_underflow`` / ``<role>_saturated`` after a pass with ``track_health``.
        At row/block granularity the amax and scale come from the last tracked pass, with
        ``<role>_scale_spread`` (``block_linear.block_health``).

        For logging only: one device-to-host copy for all the numbers.
        """
        states = self.fp8_states()
        if not states:
            return {}
        if self.scaling.granularity != "tensor":
            # Row/block scales are per step and per block: no state to report. The tracked
            # pass records each role's amax, smallest scale and spread instead (block_health).
            states = {}
        tensors = [t for s in states.values() for t in (s.amax_history[0], s.scale)]
        keys = [f"{role}_{what}" for role in states for what in ("amax", "scale")]
        flat = self.health.flat()  # what the tracked passes recorded
        host = torch.cat([torch.stack(tensors), flat] if tensors else [flat]).tolist()
        return {**dict(zip(keys, host)), **self.health.pick(host[len(tensors) :])}

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, "
        s += f"bias={self.bias is not None}"
        if self.fp8:
            r = self.scaling
            grad = r.grad_format.upper()
            if r.granularity == "tensor":
                s += f", fp8=E4M3/{grad} {r.mode}(history={r.amax_history_len}, margin={r.margin})"
            else:
                s += f", fp8=E4M3/{grad} {r.granularity}-wise current(margin={r.margin})"
        return s

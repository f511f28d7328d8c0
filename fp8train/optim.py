"""AdamW whose moments and master weights may live in low precision (MS-AMP O1-O3).

The update itself is computed in FP32: every state is read back to FP32, the arithmetic is
torch.optim.AdamW's, op for op (decoupled weight decay ``p *= 1 - lr*wd``, ``m.lerp_(g, 1-b1)``,
``v = b2*v + (1-b2)*g*g``, ``p += (-lr/bc1 * m) / (sqrt(v)/sqrt(bc2) + eps)``), and the results
are stored again, each low-precision tensor with a fresh per-tensor scale (see optim_states).
With FP32 states on FP32 parameters the result is bit-identical to torch.optim.AdamW on CPU.

Three kinds of parameters (set up by the model layer):

- plain (embeddings, norms, biases, or any FP32 model): ``p.grad``; FP32 moments, because
  high-precision roles stay high at every level. A param group may still set
  ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` to override that for all of its parameters.
- scaled FP16 weight (O1/O2): ``p`` is FP16 with an fp32 0-d per-tensor scale
  (``param_state.scale_inv_of(p)``); it *is* the master weight. Gradient: an ``Fp8GradSlot``
  as its gradient slot (``param_state.fp8_grad_slot(p)``). Written back in place with a
  power-of-two scale (the scale is the module's buffer, so it is updated in place too).
- FP8 weight (O3): ``p`` is FP8 E4M3 with its scale (one, or one per 128x128 block at
  ``fp8_granularity=block``: ``param_state.scale_block_of``); the optimizer owns a
  tensor-scaled FP16 master (state "master"), made on first use from the FP16 rounding of the
  weight's initial value that ``Linear.lower_weight_precision`` left on it
  (``param_state.take_initial_master``), or from the FP8 weight where there is none (a weight
  loaded in FP8). The new FP8 weight is re-cast from the stored master, so
  ``weight == E4M3(master)`` holds exactly after each step (and from the lowering on).

Moment dtypes from the constructor apply to the scaled weights (kinds 2 and 3). A parameter
without a gradient this step (no FP8 slot data, ``grad`` None) is skipped and its state
left untouched, as in torch.

No host synchronisation in ``step()``: bias corrections are computed on the device from the
step tensors, amaxes and scales stay tensors, and the only host flags read are
``Fp8GradSlot.has_data`` and the group's Python hyperparameters. Work is batched with
``torch._foreach_*`` per param group and device. The bias corrections use float64 (not
supported on MPS); CPU and CUDA are the targets.

A step is skipped on the device too: ``step(found_inf=...)`` takes a 0-d tensor (bool or
0/1, what torch's fused optimizers read from ``optimizer.found_inf``), and where it is set the
step leaves every parameter, moment, scale, master and step counter with the bits it had, with
no host read (a CUDA graph of the step needs none). The fused step selects each store's old
bits on the device (fused_adam.py); the reference keeps a copy of the bytes it will write, one
chunk at a time, and selects them back (``_keep_where``). Where ``found_inf`` is clear, both
write exactly what a step without it writes. The states a first step creates are created
either way (zero moments, step 0), as torch's fused AdamW creates its own.

Two backends, chosen once at construction (``fused``): the ``_foreach_*`` step above, the
reference (the CPU's default), and a compiled step per tensor (fused_adam.py, the default for
CUDA parameters) that reads and writes each tensor's stored bytes in a few kernels, with the
same arithmetic (on a CPU with vector units the same bits but for the square root's last
place: fused_adam.py). Block-scaled FP8 weights always take the reference.
"""

from __future__ import annotations

import warnings
from itertools import chain

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from . import device as devices
from . import fused_adam
from .blockwise import quantize_blocks
from .formats import E4M3
from .low_precision import FP16_MAX
from .optim_states import (
    EXP_AVG_DTYPES,
    EXP_AVG_SQ_DTYPES,
    dequantize,
    grad_of,
    has_grad,
    init_state,
    param_kind,
    quantize_into_,
    weight_value,
)
from .param_state import fp8_grad_slot, scale_block_of, scale_inv_of

__all__ = ["LowBitAdamW"]


def _check_dtypes(m_dtype: torch.dtype, v_dtype: torch.dtype) -> None:
    if m_dtype not in EXP_AVG_DTYPES:
        raise ValueError(f"exp_avg_dtype={m_dtype}: choose one of {EXP_AVG_DTYPES}")
    if v_dtype not in EXP_AVG_SQ_DTYPES:
        raise ValueError(f"exp_avg_sq_dtype={v_dtype}: choose one of {EXP_AVG_SQ_DTYPES}")


def _bias_corrections(steps: list[torch.Tensor], lr, beta1: float, beta2: float):
    """``-lr / (1 - b1**t)`` (a float64 vector) and ``sqrt(1 - b2**t)`` (an fp32 vector).

    torch's AdamW computes these in Python doubles from ``step.item()`` (a sync); float64 on
    the device gives the same doubles, and both are rounded to fp32 where the kernels use them.
    """
    t = torch.stack(steps).double()
    neg_step_size = -(lr / (1 - beta1**t))
    bc2_sqrt = (1 - beta2**t).sqrt().float()
    return neg_step_size, bc2_sqrt


def _default_fused(params) -> bool:
    """The fused step where it pays: every parameter on a CUDA device. The CPU keeps the
    reference (compiling costs seconds there and it is the path the tests hold exact), and so
    do a plan's meta or fake tensors."""
    devs = {p.device.type for group in params for p in group["params"]}
    return devs == {"cuda"}


def _add_update_(weights, exp_avgs, denom, neg_step_size: torch.Tensor, packed: bool) -> None:
    """``w += (-step_size * m) / denom``: torch's ``addcdiv_(m, denom, value=-step_size)``.

    ``packed``: the overload that reads a vector of step sizes from host memory, one fused pass;
    only for CPU tensors (on an accelerator that read would be a sync). Otherwise the products
    are formed first, which rounds identically.
    """
    if packed:
        torch._foreach_addcdiv_(weights, exp_avgs, denom, neg_step_size)
    else:
        update = torch._foreach_mul(exp_avgs, list(neg_step_size.float().unbind()))
        torch._foreach_addcdiv_(weights, update, denom)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its width: selecting these keeps every bit (NaN payloads,
    -0.0) on any device, whatever the float dtype."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.itemsize])


def _written(items: list) -> list[torch.Tensor]:
    """Every tensor the reference step writes for ``items``: weights, their scales, and each
    parameter's state (moments, scales, master, step counter)."""
    out: dict[int, torch.Tensor] = {}
    for p, _, _, state in items:
        scale_inv = scale_inv_of(p)
        for t in (p, scale_inv, *state.values()):
            if torch.is_tensor(t):
                out.setdefault(id(t), t.detach())
    return list(out.values())


def _keep_where(skip: torch.Tensor, written: list[torch.Tensor], saved: list) -> None:
    """Put back ``saved`` (the bits of ``written`` before the step) where ``skip`` is set."""
    for t, old in zip(written, saved):
        bits = _bits(t)
        bits.copy_(torch.where(skip, old, bits))


def _chunks(items: list, limit: int):
    """``items`` (each led by its parameter) in runs of at most ``limit`` elements (a larger
    tensor alone). The update makes FP32 working copies of each run's gradients, weights and
    moments (about 6 x 4 bytes per element, beyond the stored state): by runs, that transient
    memory stays bounded instead of growing with the model, which at O2/O3 would undo the
    savings of low-bit storage. Every op is per tensor, so the result is the same bits."""
    run, size = [], 0
    for item in items:
        n = item[0].numel()
        if run and size + n > limit:
            yield run
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        yield run


class LowBitAdamW(torch.optim.Optimizer):
    """AdamW with FP32 or low-bit moments (m: FP32 | FP8 E4M3, v: FP32 | FP16) and FP16 masters.

    Param groups work as in torch.optim.AdamW (per-group lr, betas, eps, weight_decay; extra
    keys such as "wd_mult" are kept). ``chunk_elements``: parameters are updated in runs of
    about this many elements, bounding the FP32 working copies (``_chunks``). The optimizer
    zeroes ``Fp8GradSlot`` gradients in ``zero_grad`` as well as ``.grad``.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        *,
        exp_avg_dtype: torch.dtype = torch.float32,
        exp_avg_sq_dtype: torch.dtype = torch.float32,
        chunk_elements: int = 1 << 26,
        fused: bool | None = None,
    ):
        if not 0.0 <= eps:
            raise ValueError(f"eps={eps}: must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas={betas}: each must be in [0, 1)")
        _check_dtypes(exp_avg_dtype, exp_avg_sq_dtype)
        self.exp_avg_dtype = exp_avg_dtype
        self.exp_avg_sq_dtype = exp_avg_sq_dtype
        if chunk_elements < 1:
            raise ValueError(f"chunk_elements={chunk_elements}: must be >= 1")
        self.chunk_elements = chunk_elements
        # The packed update of ``_add_update_`` (None: where the tensors allow it, in host
        # memory). False takes an accelerator's path on CPU too: the same bits, more memory
        # (what a plan of a GPU run is checked against: measure_rank in
        # training/planning/rank_plan.py).
        self.packed_update: bool | None = None
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.fused = _default_fused(self.param_groups) if fused is None else bool(fused)

    def add_param_group(self, param_group: dict) -> None:
        _check_dtypes(
            param_group.get("exp_avg_dtype", torch.float32),
            param_group.get("exp_avg_sq_dtype", torch.float32),
        )
        super().add_param_group(param_group)

    def _state_dtypes(self, group: dict, kind: str) -> tuple[torch.dtype, torch.dtype]:
        low = kind != "plain"
        m = self.exp_avg_dtype if low else torch.float32
        v = self.exp_avg_sq_dtype if low else torch.float32
        return group.get("exp_avg_dtype", m), group.get("exp_avg_sq_dtype", v)

    @torch.no_grad()
    def step(self, closure=None, *, found_inf: torch.Tensor | None = None):
        """One AdamW step of every parameter with a gradient. ``found_inf``: a 0-d tensor
        (bool or 0/1) on the device; where it is set nothing changes (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Compiled code does not run under a dispatch mode (an accounting of the step, as in
        # training/planning/step_account.py, or a plan's fake tensors): such a step takes the
        # reference.
        fused = self.fused and not is_in_torch_dispatch_mode(include_infra_modes=False)
        for group in self.param_groups:
            by_device: dict[torch.device, list] = {}
            for p in group["params"]:
                if not has_grad(p):
                    continue
                kind = param_kind(p)
                state = self.state[p]
                if not state:
                    state.update(init_state(p, kind, *self._state_dtypes(group, kind)))
                by_device.setdefault(p.device, []).append((p, kind, state))
            for device, items in by_device.items():
                skip = None
                if found_inf is not None:
                    skip = found_inf.to(device=device, dtype=torch.bool, non_blocking=True)
                if fused and self.fused:  # (a compile failure turns self.fused off)
                    items = self._fused_update(group, items, skip)  # returns those it left
                for chunk in _chunks(items, self.chunk_elements):
                    # FP32 gradients chunk by chunk too: an FP8 slot's is a new tensor.
                    self._update(group, [(p, k, grad_of(p), s) for p, k, s in chunk], skip)
        return loss

    def _fused_update(self, group: dict, items: list, skip: torch.Tensor | None) -> list:
        """The compiled step for each tensor that allows it (fused_adam.fusable); returns the
        items left to the reference path. The step counters and bias corrections are formed
        for the group at once, exactly as ``_update`` forms them; a skipped step (``skip``)
        takes the counters back after the stores kept their bits (as torch's fused AdamW)."""
        fused = [item for item in items if fused_adam.fusable(item[0], item[2])]
        if not fused:
            return items
        found = skip
        if found is None:  # one compiled graph for both: the mask is always a tensor
            found = torch.zeros((), dtype=torch.bool, device=fused[0][0].device)
        lr, (beta1, beta2) = group["lr"], group["betas"]
        steps = [s["step"] for _, _, s in fused]
        torch._foreach_add_(steps, 1)
        neg_step_size, bc2_sqrt = _bias_corrections(steps, lr, beta1, beta2)
        rows = fused_adam.coefficients(group, neg_step_size, bc2_sqrt)
        for i, ((p, kind, state), row) in enumerate(zip(fused, rows)):
            try:
                fused_adam.fused_update_(p, kind, state, row, found)
            except torch.OutOfMemoryError:
                raise
            except Exception as err:  # noqa: BLE001  (a compiler failure: fall back, loudly)
                self.fused = False
                warnings.warn(
                    f"LowBitAdamW: fused step disabled ({type(err).__name__}: "
                    f"{str(err)[:200]}); using the reference step",
                    RuntimeWarning,
                    stacklevel=3,
                )
                # A compile error comes before any write: these have not stepped yet.
                torch._foreach_sub_(steps[i:], 1)
                fused = fused[:i]
                break
        if skip is not None and fused:
            torch._foreach_sub_(steps[: len(fused)], [skip.float()] * len(fused))
        done = {id(p) for p, _, _ in fused}
        return [item for item in items if id(item[0]) not in done]

    def _update(self, group: dict, items: list, skip: torch.Tensor | None = None) -> None:
        # A skippable step keeps the bytes it writes, to select them back (``_keep_where``).
        written = _written(items) if skip is not None else []
        saved = [_bits(t).clone() for t in written]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        grads = [g for _, _, g, _ in items]
        states = [s for _, _, _, s in items]
        weights = [self._weight_fp32(p, kind, s) for p, kind, _, s in items]
        exp_avgs = self._moment_fp32(states, "exp_avg")
        exp_avg_sqs = self._moment_fp32(states, "exp_avg_sq")
        steps = [s["step"] for s in states]

        # torch.optim.AdamW's arithmetic, op for op, on FP32 tensors.
        torch._foreach_add_(steps, 1)
        if wd != 0:
            torch._foreach_mul_(weights, 1 - lr * wd)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
        neg_step_size, bc2_sqrt = _bias_corrections(steps, lr, beta1, beta2)
        bc2_sqrt = list(bc2_sqrt.unbind())
        denom = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denom, bc2_sqrt)
        torch._foreach_add_(denom, eps)
        packed = self.packed_update
        if packed is None:
            packed = devices.in_host_memory(neg_step_size)
        _add_update_(weights, exp_avgs, denom, neg_step_size, packed)

        # Store. The moments used above were the FP32 values; only storage rounds them.
        self._store_moments(states, exp_avgs, "exp_avg", E4M3.max, pow2=False)
        self._store_moments(states, exp_avg_sqs, "exp_avg_sq", FP16_MAX, pow2=True)
        self._store_weights(items, weights)
        if skip is not None:
            _keep_where(skip, written, saved)

    @staticmethod
    def _weight_fp32(p: torch.Tensor, kind: str, state: dict) -> torch.Tensor:
        if kind == "fp8":
            return dequantize([state["master"]], [state["master_scale_inv"]])[0]
        if kind == "fp16":
            return weight_value(p)
        return p if p.dtype == torch.float32 else p.float()  # an FP32 param is updated in place

    @staticmethod
    def _moment_fp32(states: list[dict], key: str) -> list[torch.Tensor]:
        scale_key = f"{key}_scale_inv"
        low = [s for s in states if scale_key in s]
        values = iter(dequantize([s[key] for s in low], [s[scale_key] for s in low]))
        return [next(values) if scale_key in s else s[key] for s in states]

    @staticmethod
    def _store_moments(states, values, key: str, max_value: float, pow2: bool) -> None:
        scale_key = f"{key}_scale_inv"
        low = [(v, s) for v, s in zip(values, states) if scale_key in s]
        quantize_into_(
            [v for v, _ in low],
            [s[key] for _, s in low],
            [s[scale_key] for _, s in low],
            max_value,
            pow2,
        )

    @staticmethod
    def _store_weights(items: list, weights: list[torch.Tensor]) -> None:
        fp16_vals, fp16_datas, fp16_scales = [], [], []  # O1/O2 weights and O3 masters
        fp8_params = []
        for (p, kind, _, state), w in zip(items, weights):
            if kind == "fp16":
                data, scale_inv = p, scale_inv_of(p)
            elif kind == "fp8":
                data, scale_inv = state["master"], state["master_scale_inv"]
                fp8_params.append((p, state))
            else:
                if p.dtype != torch.float32:
                    p.copy_(w)
                continue
            fp16_vals.append(w)
            fp16_datas.append(data)
            fp16_scales.append(scale_inv)
        quantize_into_(fp16_vals, fp16_datas, fp16_scales, FP16_MAX, pow2=True)
        # O3: the FP8 weight is the E4M3 rounding of the stored master (power-of-two scale, as
        # fp8train.Linear quantises its weight), so a checkpointed master reproduces it.
        # Block-scaled weights take one power-of-two scale per block, by the same rule.
        for p, state in [(p, s) for p, s in fp8_params if scale_block_of(p) is not None]:
            master = dequantize([state["master"]], [state["master_scale_inv"]])[0]
            stored = quantize_blocks(master, E4M3, scale_block_of(p), power_of_two=True)
            p.copy_(stored.data)
            scale_inv_of(p).copy_(stored.scale_inv)
        fp8_params = [(p, s) for p, s in fp8_params if scale_block_of(p) is None]
        for dtype in {p.dtype for p, _ in fp8_params}:
            same = [(p, s) for p, s in fp8_params if p.dtype == dtype]
            quantize_into_(
                dequantize(
                    [s["master"] for _, s in same], [s["master_scale_inv"] for _, s in same]
                ),
                [p for p, _ in same],
                [scale_inv_of(p) for p, _ in same],
                torch.finfo(dtype).max,
                pow2=True,
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                slot = fp8_grad_slot(p)
                if slot is not None:
                    slot.zero_()

    def load_state_dict(self, state_dict: dict) -> None:
        """As torch, but states keep their saved dtypes (torch would cast them to the param's:
        an FP8 moment of an FP32 parameter would become FP32, a scale of an FP16 one FP16)."""
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(pid)
            if saved is not None:
                self.state[p] = {
                    k: v.to(device=p.device, copy=True) if torch.is_tensor(v) else v
                    for k, v in saved.items()
                }

    def bytes_by_role(self) -> dict[str, int]:
        """Bytes of optimizer state actually held: {"master": ..., "optimizer": ...}.

        "master": O3's FP16 masters and their scales. "optimizer": moments, their scales and
        the step counters (12 bytes per tensor beyond the moments themselves).
        """
        out = {"master": 0, "optimizer": 0}
        for state in self.state.values():
            for key, t in state.items():
                if torch.is_tensor(t):
                    role = "master" if key.startswith("master") else "optimizer"
                    out[role] += t.numel() * t.element_size()
        return out

"""AdamW for every implemented level: plain (fp32, fp16, te), with FP32 masters (bf16), or
LowBitAdamW (O1-O3), optionally sharded over data-parallel ranks (ZeRO-1); gradient clipping.

A step with non-finite gradients is skipped on the device (``TrainOptimizer.found_inf``):
LowBitAdamW masks its own writes, and torch's fused AdamW (the one built for CUDA parameters)
reads ``found_inf`` itself, so neither makes a host read. torch's foreach AdamW, the CPU's
(its results are the ones the project's CPU figures and tests were made with; the fused CPU
kernel rounds a few elements differently), has no device ``found_inf``: there the decision is
one read of a value in host memory, which waits for nothing.

The bf16 level keeps BF16 parameters for forward/backward, accumulates weight gradients into an
FP32 ``main_grad`` (the gradient buffers' hooks add each micro-batch's BF16 grad into FP32, so
accumulation never rounds to BF16) and steps FP32 master copies, then copies them back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from data.indexed import import_megatron
from fp8train.linear import Linear
from fp8train.low_precision import Fp8GradSlot
from fp8train.optim import LowBitAdamW
from fp8train.param_state import drop_initial_master, fp8_grad_slot, grad_slot
from fp8train.precision import PrecisionRecipe
from models.base import ParallelModel
from parallel.distributed_optimizer import ParamGather, assign_owners
from parallel.grad_buffer import GradBuffers, default_bucket_size
from parallel.tensor_parallel.layers import is_parallel_layer

if TYPE_CHECKING:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = [
    "TrainOptimizer",
    "build_optimizer",
    "build_scheduler",
    "clip_grad_norm",
    "device_values",
    "grad_squares",
    "parameter_owners",
    "trainable_parameters",
]


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Megatron: biases and norm scales are not decayed; matrices and embeddings are.
    return param.ndim < 2 or name.endswith(".bias")


class TrainOptimizer:
    """One object the loop talks to: grads in, a step out, whatever the level keeps inside.

    Gradients live in ``GradBuffers`` (parallel/grad_buffer.py): every high-precision
    parameter's ``main_grad`` is an FP32 view into one flat buffer (BF16 gradients accumulate
    there in FP32: Megatron's trick), every O1-O3 weight's FP8 slot a view into the FP8 one,
    and the buffers reduce themselves over ``group`` bucket by bucket during backward.

    ``distributed`` (ZeRO-1, ``optimizer.distributed``): each data-parallel rank owns whole
    tensors (``parallel/distributed_optimizer.py``), keeps master weights and Adam states for
    those alone, receives only their reduced gradients, steps them and all-gathers the updated
    weights to the other ranks. ``grads()``, ``grad_slots()`` and the flags then cover the
    owned parameters only, and norms add them up over ``norm_group``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        recipe: PrecisionRecipe,
        opt_cfg,
        *,
        group=None,
        distributed: bool = False,
        bucket_size: int | None = None,
        overlap: bool = True,
        held=(),
        meter=None,
    ):
        self.recipe = recipe
        self.model_params = trainable_parameters(model)
        world = 1 if group is None else torch.distributed.get_world_size(group)
        rank = 0 if group is None else torch.distributed.get_rank(group)
        # Tensor-parallel shards (their squared norms are summed over the group; replicated
        # parameters count once) and a pipeline stage's copies of another stage's parameters
        # (not counted in norms, so the pipeline-wide sum sees them once). Read after
        # lowering: lowered weights are new Parameters.
        sharded, copies, names = _model_facts(model)
        self.sharded = [id(p) in sharded for p in self.model_params]
        self.counted = [id(p) not in copies for p in self.model_params]

        self.distributed = distributed and world > 1
        owners = None
        if self.distributed:
            owners = parameter_owners(model, self.model_params, world)
        self.owned = [owners is None or o == rank for o in (owners or [0] * len(self.model_params))]
        self.norm_group = group if self.distributed else None
        self.buffers = GradBuffers(
            self.model_params,
            group,
            bucket_size=bucket_size or default_bucket_size(world),
            owners=owners,
            overlap=overlap,
            held={id(p) for p in held},
            meter=meter,
        )
        self.gather = ParamGather(self.model_params, owners, group, meter) if owners else None

        self.step_params = [p for p, own in zip(self.model_params, self.owned) if own]
        self._drop_others_initial_masters()
        # FP32 masters of the BF16 parameters this rank steps: every parameter at bf16; at an
        # FP8 level with param_dtype=bf16 all but the low-bit linear weights (LowBitAdamW
        # keeps theirs). The optimizer steps the master in place of its parameter.
        self.masters = {
            id(p): p.detach().float().clone() for p in self.step_params if p.dtype == torch.bfloat16
        }
        opt_params = [self.masters.get(id(p), p) for p in self.step_params]
        decay, no_decay = [], []
        for model_p, opt_p in zip(self.step_params, opt_params):
            (no_decay if _no_weight_decay(names[id(model_p)], model_p) else decay).append(opt_p)
        groups = [
            {"params": decay, "wd_mult": 1.0},
            {"params": no_decay, "wd_mult": 0.0},
        ]
        # Keep empty groups: a rank may own no decayed (or no undecayed) tensor, and the
        # scheduler sets lr on every group by position.
        self.low_bit = recipe.weight_grad == "fp8"
        fused = _fused_adamw(self.model_params)
        self.optimizer = _adamw(groups, recipe, opt_cfg, fused)
        # Whether ``step`` skips on the device (LowBitAdamW, torch's fused AdamW) or reads
        # ``found_inf`` on the host (torch's foreach AdamW, in host memory).
        self.skips_on_device = self.low_bit or fused
        self.has_states = False  # the optimizer has stepped once: its states exist
        # Set by the caller before ``step``, for that step only (torch's convention, as
        # torch.amp.GradScaler sets a fused optimizer's): a 0-d device tensor, true (or 1)
        # when the gradients are not finite. None: the step is taken.
        self.found_inf: torch.Tensor | None = None
        self._state_index = {
            i: k for k, i in enumerate(j for j, own in enumerate(self.owned) if own)
        }
        # Checkpoints key optimizer state by parameter name (checkpoint/format.py).
        self._names = {id(opt_p): names[id(p)] for p, opt_p in zip(self.step_params, opt_params)}
        self.param_names = {names[id(p)]: p for p in self.model_params}

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @staticmethod
    def _is_slot(p) -> bool:
        return fp8_grad_slot(p) is not None

    def grads(self) -> list[torch.Tensor]:
        """FP32 gradients the step will use (the owned ones under the distributed optimizer)."""
        return [grad_slot(p) for p in self.step_params if not self._is_slot(p)]

    def grad_slots(self) -> list[Fp8GradSlot]:
        """FP8 weight gradients (O1-O3) that hold data this step (owned ones when sharded)."""
        slots = (fp8_grad_slot(p) for p in self.step_params)
        return [s for s in slots if s is not None and s.has_data]

    def sharded_flags(self) -> tuple[list[bool], list[bool]]:
        """Which of ``grads()`` and of ``grad_slots()`` are tensor-parallel shards."""
        return self._flags(self.sharded)

    def counted_flags(self) -> tuple[list[bool], list[bool]]:
        """Which of ``grads()`` and of ``grad_slots()`` count in the norm (not a copy)."""
        return self._flags(self.counted)

    def _flags(self, per_param: list[bool]) -> tuple[list[bool], list[bool]]:
        grad_flags, slot_flags = [], []
        for p, flag, own in zip(self.model_params, per_param, self.owned):
            if not own:
                continue
            if not self._is_slot(p):
                grad_flags.append(flag)
            elif fp8_grad_slot(p).has_data:
                slot_flags.append(flag)
        return grad_flags, slot_flags

    def grad_positions(self) -> list[int]:
        """Each of ``grads()`` then ``grad_slots()``: its parameter's index in
        ``step_params`` (whose names ``stepped_names`` gives, in the same order)."""
        plain, slots = [], []
        for i, p in enumerate(self.step_params):
            if not self._is_slot(p):
                plain.append(i)
            elif fp8_grad_slot(p).has_data:
                slots.append(i)
        return plain + slots

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The FP32 gradient (its ``main_grad`` buffer view) of a high-precision ``param``."""
        return grad_slot(param)

    def grad_elements(self) -> tuple[int, int]:
        """(FP8 gradient elements, all gradient elements) of this replica, owned or not."""
        fp8 = sum(p.numel() for p in self.model_params if self._is_slot(p))
        return fp8, sum(p.numel() for p in self.model_params)

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        self.buffers.zero_()

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The FP32 masters, in the order of the parameters they belong to."""
        return list(self.masters.values())

    @staticmethod
    def _split_state(state: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(masters, the rest) among one parameter's optimizer-state tensors: LowBitAdamW
        keeps O3's FP16 master (and its scale) in the state under ``master*`` keys."""
        masters, rest = [], []
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                (masters if "master" in key else rest).append(value)
        return masters, rest

    def param_state_bytes(self, index: int) -> tuple[int, int]:
        """(master bytes, optimizer-state bytes) held on this rank for model parameter
        ``index`` (0 for parameters another rank owns)."""
        k = self._state_index.get(index)
        if k is None:
            return 0, 0
        param = self.step_params[k]
        master = self.masters.get(id(param))
        state = self.optimizer.state.get(master if master is not None else param, {})
        masters, rest = self._split_state(state)
        master_bytes = master.nbytes if master is not None else 0
        return master_bytes + sum(t.nbytes for t in masters), sum(t.nbytes for t in rest)

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(master weights, optimizer states) this rank holds: the FP32 masters and every
        state tensor, split as ``param_state_bytes`` counts them."""
        masters, rest = list(self.masters.values()), []
        for state in self.optimizer.state.values():
            m, r = self._split_state(state)
            masters += m
            rest += r
        return masters, rest

    def step(self) -> None:
        """One optimizer step (and the weights' all-gather under the distributed optimizer).

        Where ``found_inf`` is set (and true) the step leaves every weight, master, moment and
        step counter as it was: decided on the device where ``skips_on_device``, otherwise
        (torch's foreach AdamW on the CPU) by one read of it, a value in host memory.
        """
        found_inf, self.found_inf = self.found_inf, None
        if found_inf is not None and not self.skips_on_device:
            # A plan's meta step answers a host read with True: it takes the update path.
            if not bool(torch.logical_not(found_inf)):
                return
            found_inf = None
        # AdamW reads .grad: the FP32 main_grad (a view, no copy) on the master where there is
        # one, else on the parameter; FP8 gradient slots are read by LowBitAdamW itself.
        hp = [p for p in self.step_params if not self._is_slot(p)]
        for p in hp:
            self.masters.get(id(p), p).grad = grad_slot(p)
        if found_inf is None:
            self.optimizer.step()
        elif self.low_bit:
            self.optimizer.step(found_inf=found_inf)
        else:  # torch's fused AdamW reads it there (as torch.amp.GradScaler sets it)
            self.optimizer.found_inf = found_inf.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        self.has_states = True
        with torch.no_grad():
            for p in hp:
                master = self.masters.get(id(p))
                if master is not None:
                    p.copy_(master)
                self.masters.get(id(p), p).grad = None
        if self.gather is not None:
            self.gather.gather()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """``{parameter name}:{state}`` -> tensor of everything this rank's optimizer holds
        (``:master`` is the FP32 master at bf16), for safetensors."""
        out: dict[str, torch.Tensor] = {}
        for param, slots in self.optimizer.state.items():
            name = self._names[id(param)]
            for key, value in slots.items():
                out[f"{name}:{key}"] = torch.as_tensor(value).clone()
        for master in self.master_params:
            out[f"{self._names[id(master)]}:master"] = master.detach()
        return out

    @torch.no_grad()
    def reset_masters(self) -> None:
        """FP32 masters from the current weights (after the weights were replaced, e.g. by a
        fine-tune's load); lazily made state (O3's FP16 masters, from the initial masters a
        load leaves on the weights this rank steps) needs nothing."""
        for p in self.step_params:
            if id(p) in self.masters:
                self.masters[id(p)].copy_(p.detach().float())
        self._drop_others_initial_masters()

    def _drop_others_initial_masters(self) -> None:
        # O3: the owner's optimizer makes a weight's master; the other ranks only receive the
        # weight, so they keep no FP16 copy of its initial value (fp8train.param_state).
        for p, own in zip(self.model_params, self.owned):
            if not own:
                drop_initial_master(p)

    def stepped_names(self) -> list[str]:
        """Names of the parameters this rank's optimizer steps (all of its slice's, or with
        the distributed optimizer the ones it owns): whose state it keeps."""
        return list(self._names.values())

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Inverse of ``state_tensors`` (same layout); an unknown name raises naming it."""
        state_dict = self.optimizer.state_dict()
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        index = {self._names[id(p)]: i for i, p in enumerate(params)}
        masters = {self._names[id(m)]: m for m in self.master_params}
        restored: dict[int, dict[str, torch.Tensor]] = {}
        for full_name, value in tensors.items():
            name, _, key = full_name.partition(":")
            if key == "master" and name in masters:
                with torch.no_grad():
                    masters[name].copy_(value)
            elif name in index:
                restored.setdefault(index[name], {})[key] = value
            else:
                raise KeyError(f"optimizer state for {full_name!r}: no such parameter here")
        state_dict["state"] = restored
        self.optimizer.load_state_dict(state_dict)


def parameter_owners(model: torch.nn.Module, params: list, world: int) -> list[int]:
    """The distributed optimizer's owner (data-parallel rank) of each of ``params``: linear
    (GEMM) weights apart from the rest, as training/memory.py reports them, each class spread
    evenly, so every rank holds ~1/W of the table-governed states. Depends only on shapes:
    a model built on the meta device gets the owners a run of it would."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, Linear)}
    return assign_owners(
        [p.numel() for p in params], world, classes=[id(p) in linear for p in params]
    )


def trainable_parameters(model: torch.nn.Module) -> list:
    """The parameters an optimizer steps, in the order ownership is assigned."""
    return [p for p in model.parameters() if p.requires_grad]


def _fused_adamw(params: list) -> bool:
    """torch's fused AdamW for CUDA parameters: one kernel over every tensor, and a skipped
    step decided on the device from its ``found_inf``. Elsewhere its foreach AdamW, which
    the CPU results were made with (the fused CPU kernel rounds a few elements differently;
    a plan's meta tensors take the CPU's path, as LowBitAdamW's reference)."""
    return bool(params) and all(p.device.type == "cuda" for p in params)


def _adamw(
    groups: list[dict], recipe: PrecisionRecipe, opt_cfg, fused: bool = False
) -> torch.optim.Optimizer:
    """torch's AdamW (``fused``, else foreach), or at O1-O3 (scaled FP16 / FP8 weights with
    FP8 gradient slots) LowBitAdamW with the moments' dtypes of the precision table."""
    hyper = dict(
        lr=opt_cfg.lr,
        betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
        eps=opt_cfg.adam_eps,
        weight_decay=opt_cfg.weight_decay,
    )
    if recipe.weight_grad == "fp8":
        return LowBitAdamW(
            groups, exp_avg_dtype=recipe.adam_dtypes[0], exp_avg_sq_dtype=recipe.adam_dtypes[1],
            **hyper,
        )  # fmt: skip
    if fused:
        return torch.optim.AdamW(groups, fused=True, **hyper)
    return torch.optim.AdamW(groups, foreach=True, **hyper)


def _model_facts(model: torch.nn.Module) -> tuple[set[int], set[int], dict[int, str]]:
    """(ids of TP shards, ids of pipeline copies, id -> single-process name). A
    ``ParallelModel`` says so itself (required methods); any other module is taken as one
    whole single-process model, and one holding parallel layers is refused: its norms and
    checkpoint names would silently be wrong."""
    if isinstance(model, ParallelModel):
        names = model.canonical_parameter_names()
        return model.tensor_parallel_sharded(), model.pipeline_duplicates(), names
    for name, module in model.named_modules():
        if is_parallel_layer(module):
            raise TypeError(
                f"{type(model).__name__}.{name} is a tensor-parallel layer: build the model as "
                "a models.base.ParallelModel so its shards are known"
            )
    return set(), set(), {id(p): n for n, p in model.named_parameters()}


def build_optimizer(model, recipe: PrecisionRecipe, opt_cfg, **buffers) -> TrainOptimizer:
    """``buffers``: TrainOptimizer's keyword arguments (group, distributed, bucket_size, ...)."""
    if opt_cfg.type != "adamw":
        raise ValueError(f"optimizer.type={opt_cfg.type!r}: only 'adamw' is implemented")
    return TrainOptimizer(model, recipe, opt_cfg, **buffers)


def build_scheduler(
    optimizer: TrainOptimizer, opt_cfg, decay_iters: int, warmup_iters: int | None = None
) -> OptimizerParamScheduler:
    """Warmup + decay via megatron-core's scheduler, stepped once per iteration.
    ``warmup_iters``: default ``opt_cfg.lr_warmup_iters`` (the config's resolved value)."""
    if warmup_iters is None:
        warmup_iters = opt_cfg.lr_warmup_iters or 0
    scheduler_module = import_megatron("megatron.core.optimizer_param_scheduler")
    return scheduler_module.OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=opt_cfg.lr_decay_style,
        start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay,
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
    )


def device_values(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (from the host) as a tensor on ``device``, without waiting for it. A tensor
    made there directly (``torch.tensor(values, device=...)``) is a blocking copy, which on
    CUDA synchronises the stream: the host waits for every kernel queued before it. A
    non-blocking copy from pageable host memory is staged by the driver at once and waits for
    nothing."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def grad_squares(
    grads: list[torch.Tensor], slots: list[Fp8GradSlot] = (), device: torch.device | None = None
) -> torch.Tensor:
    """The squared L2 norm of each of ``grads`` then ``slots``, a vector on the device (empty,
    on ``device``, without any): not finite for a gradient that is not, and for an FP8 slot
    whose amax overflowed."""
    squares = []
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        squares += [n.square() for n in norms]
    for slot in slots:
        # 0 * amax is 0 for a finite amax and NaN for inf/NaN: the overflow shows in the norm.
        squares.append(
            torch.linalg.vector_norm(slot.dequantize()).square() + 0.0 * slot.amax.amax()
        )
    return torch.stack(squares) if squares else torch.zeros(0, device=device)


def clip_grad_norm(
    grads: list[torch.Tensor],
    max_norm: float,
    slots: list[Fp8GradSlot] = (),
    *,
    tp_group=None,
    sharded: tuple[list[bool], list[bool]] | None = None,
    pp_group=None,
    counted: tuple[list[bool], list[bool]] | None = None,
    dp_group=None,
    device: torch.device | None = None,
    squares: torch.Tensor | None = None,
) -> torch.Tensor:
    """Global L2 norm of ``grads`` and FP8 ``slots``, clipping all of them when above ``max_norm``.

    ``device``: where a rank without gradients makes its zero (the run's device).
    ``squares``: their ``grad_squares``, when the caller has them already.
    Returns the norm before clipping as a tensor; an overflowed FP8 slot (non-finite amax)
    makes it non-finite so the caller skips the step. Every gradient is clipped, FP8 ones
    included (MS-AMP skips them): for a slot that is a change of its scale only. Under tensor
    parallelism ``sharded`` flags the shards (as ``TrainOptimizer.sharded_flags``): their
    squares are summed over ``tp_group``, replicated gradients are counted once.
    """
    if squares is None:
        squares = grad_squares(grads, slots, device)
    # A rank holding no gradients still joins the reductions, on the run's device (nccl
    # reduces no CPU tensors).
    if not squares.numel() and pp_group is None and dp_group is None:
        return torch.zeros((), device=device)
    if counted is not None:
        keep = device_values(counted[0] + counted[1], torch.bool, squares.device)
        squares = torch.where(keep, squares, torch.zeros_like(squares))
    if tp_group is not None and tp_group.size() > 1:
        # Positions from the host's flags, not a boolean mask: the same elements in the same
        # order, with shapes known before the values (a plan on fake tensors has no values).
        flags = sharded[0] + sharded[1]
        picked = [
            device_values([i for i, f in enumerate(flags) if f == want], torch.long, squares.device)
            for want in (True, False)
        ]
        parts = torch.stack([squares[p].sum() for p in picked])
        shard_sum = parts[0:1].clone()
        torch.distributed.all_reduce(shard_sum, group=tp_group)
        total_sq = shard_sum[0] + parts[1]
    else:
        total_sq = squares.sum()
    for group in (dp_group, pp_group):  # disjoint parameters: plain sums
        if group is not None:
            total_sq = total_sq.reshape(1).clone()
            torch.distributed.all_reduce(total_sq, group=group)
            total_sq = total_sq[0]
    total = total_sq.sqrt()
    if max_norm > 0:
        # Decided on the device (no host read): a non-finite norm multiplies by exactly 1,
        # which leaves every gradient as it was (the caller skips the step); a finite one by
        # the same coefficient as always (x * 1 is x when the norm is below max_norm).
        coef = torch.where(
            torch.isfinite(total), torch.clamp(max_norm / (total + 1e-6), max=1.0), 1.0
        )
        if grads:
            torch._foreach_mul_(grads, coef)
        for slot in slots:
            slot.mul_(coef)
    return total

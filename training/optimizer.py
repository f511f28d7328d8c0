"""AdamW for every implemented level: plain (fp32, fp16, te) or with FP32 masters (bf16).

The bf16 level keeps BF16 parameters for forward/backward, accumulates weight gradients into an
FP32 ``main_grad`` (Megatron's trick: a backward hook adds each micro-batch's BF16 grad into FP32,
so accumulation never rounds to BF16) and steps FP32 master copies, then copies them back.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from fp8train.low_precision import Fp8GradSlot
from fp8train.optim import LowBitAdamW
from fp8train.precision import PrecisionRecipe

__all__ = ["TrainOptimizer", "build_optimizer", "build_scheduler", "clip_grad_norm"]


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    # Megatron: biases and norm scales are not decayed; matrices and embeddings are.
    return param.ndim < 2 or name.endswith(".bias")


class TrainOptimizer:
    """One object the loop talks to: grads in, a step out, whatever the level keeps inside."""

    def __init__(self, model: torch.nn.Module, recipe: PrecisionRecipe, opt_cfg):
        self.recipe = recipe
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        # Tensor-parallel shards (their squared norms are summed over the group; replicated
        # parameters count once). Read after lowering: lowered weights are new Parameters.
        sharded = getattr(model, "tensor_parallel_sharded", set)()
        self.sharded = [id(p) in sharded for p in self.model_params]
        # A pipeline stage's copy of another stage's parameter (tied embedding): not counted
        # in norms, so the pipeline-wide sum sees it once.
        copies = getattr(model, "pipeline_duplicates", set)()
        self.counted = [id(p) not in copies for p in self.model_params]
        names = {id(p): n for n, p in model.named_parameters()}
        self.use_master = recipe.has_fp32_master
        if self.use_master:
            # FP32 masters; BF16 grads are accumulated into FP32 main_grad by hooks.
            self.master_params = [p.detach().float().clone() for p in self.model_params]
            for p in self.model_params:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                p.register_post_accumulate_grad_hook(_accumulate_main_grad)
            step_params = self.master_params
        else:
            step_params = self.model_params
        decay, no_decay = [], []
        for model_p, step_p in zip(self.model_params, step_params):
            (no_decay if _no_weight_decay(names[id(model_p)], model_p) else decay).append(step_p)
        groups = [
            {"params": decay, "wd_mult": 1.0},
            {"params": no_decay, "wd_mult": 0.0},
        ]
        hyper = dict(
            lr=opt_cfg.lr,
            betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
            eps=opt_cfg.adam_eps,
            weight_decay=opt_cfg.weight_decay,
        )
        groups = [g for g in groups if g["params"]]
        self.low_bit = recipe.weight_grad == "fp8"
        if self.low_bit:
            # O1-O3: scaled FP16 / FP8 weights with FP8 gradient slots; moments per the table.
            self.optimizer = LowBitAdamW(
                groups,
                exp_avg_dtype=recipe.adam_dtypes[0],
                exp_avg_sq_dtype=recipe.adam_dtypes[1],
                **hyper,
            )
        else:
            self.optimizer = torch.optim.AdamW(groups, foreach=True, **hyper)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def grads(self) -> list[torch.Tensor]:
        """High-precision gradients the step will use (FP32 main grads at bf16, else ``.grad``)."""
        if self.use_master:
            return [p.main_grad for p in self.model_params]
        return [p.grad for p in self.model_params if p.grad is not None]

    def grad_slots(self) -> list[Fp8GradSlot]:
        """FP8 weight gradients (O1-O3) that hold data this step."""
        slots = (getattr(p, "main_grad", None) for p in self.model_params)
        return [s for s in slots if isinstance(s, Fp8GradSlot) and s.has_data]

    def sharded_flags(self) -> tuple[list[bool], list[bool]]:
        """Which of ``grads()`` and of ``grad_slots()`` are tensor-parallel shards."""
        return self._flags(self.sharded)

    def counted_flags(self) -> tuple[list[bool], list[bool]]:
        """Which of ``grads()`` and of ``grad_slots()`` count in the norm (not a copy)."""
        return self._flags(self.counted)

    def _flags(self, per_param: list[bool]) -> tuple[list[bool], list[bool]]:
        if self.use_master:
            grad_flags = list(per_param)
        else:
            grad_flags = [f for p, f in zip(self.model_params, per_param) if p.grad is not None]
        slot_flags = []
        for p, flag in zip(self.model_params, per_param):
            slot = getattr(p, "main_grad", None)
            if isinstance(slot, Fp8GradSlot) and slot.has_data:
                slot_flags.append(flag)
        return grad_flags, slot_flags

    def grad_of(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The high-precision gradient the step will use for ``param`` (not for FP8 slots)."""
        return param.main_grad if self.use_master else param.grad

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            main_grad = getattr(p, "main_grad", None)
            if main_grad is not None:
                main_grad.zero_()

    def param_state_bytes(self, index: int) -> tuple[int, int]:
        """(master bytes, optimizer-state bytes) held for model parameter ``index``."""
        param = self.model_params[index]
        master = self.master_params[index] if self.use_master else None
        state = self.optimizer.state.get(master if master is not None else param, {})
        master_bytes = master.nbytes if master is not None else 0
        other = 0
        for key, value in state.items():
            if torch.is_tensor(value) and key != "step":
                if "master" in key:
                    master_bytes += value.nbytes
                else:
                    other += value.nbytes
        return master_bytes, other

    def step(self) -> None:
        if self.use_master:
            for master, p in zip(self.master_params, self.model_params):
                master.grad = p.main_grad
            self.optimizer.step()
            with torch.no_grad():
                for master, p in zip(self.master_params, self.model_params):
                    p.copy_(master)
                    master.grad = None
        else:
            self.optimizer.step()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Flat name -> tensor view of everything the optimizer owns, for safetensors."""
        out: dict[str, torch.Tensor] = {}
        state = self.optimizer.state_dict()["state"]
        for index, slots in state.items():
            for key, value in slots.items():
                out[f"state.{index}.{key}"] = torch.as_tensor(value).clone()
        if self.use_master:
            for index, master in enumerate(self.master_params):
                out[f"master.{index}"] = master.detach()
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        state_dict = self.optimizer.state_dict()
        restored: dict[int, dict[str, torch.Tensor]] = {}
        for name, value in tensors.items():
            kind, index, *rest = name.split(".")
            if kind == "state":
                restored.setdefault(int(index), {})[rest[0]] = value
        state_dict["state"] = restored
        self.optimizer.load_state_dict(state_dict)
        if self.use_master:
            with torch.no_grad():
                for index, master in enumerate(self.master_params):
                    master.copy_(tensors[f"master.{index}"])


def _accumulate_main_grad(param: torch.nn.Parameter) -> None:
    param.main_grad.add_(param.grad)
    param.grad = None


def build_optimizer(model, recipe: PrecisionRecipe, opt_cfg) -> TrainOptimizer:
    if opt_cfg.type != "adamw":
        raise ValueError(f"optimizer.type={opt_cfg.type!r}: only 'adamw' is implemented")
    return TrainOptimizer(model, recipe, opt_cfg)


def build_scheduler(
    optimizer: TrainOptimizer, opt_cfg, decay_iters: int
) -> OptimizerParamScheduler:
    """Warmup + decay via megatron-core's scheduler, stepped once per iteration."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=opt_cfg.lr,
        min_lr=opt_cfg.min_lr,
        lr_warmup_steps=opt_cfg.lr_warmup_iters,
        lr_decay_steps=decay_iters,
        lr_decay_style=opt_cfg.lr_decay_style,
        start_wd=opt_cfg.weight_decay,
        end_wd=opt_cfg.weight_decay,
        wd_incr_steps=decay_iters,
        wd_incr_style="constant",
    )


def clip_grad_norm(
    grads: list[torch.Tensor],
    max_norm: float,
    slots: list[Fp8GradSlot] = (),
    *,
    tp_group=None,
    sharded: tuple[list[bool], list[bool]] | None = None,
    pp_group=None,
    counted: tuple[list[bool], list[bool]] | None = None,
) -> torch.Tensor:
    """Global L2 norm of ``grads`` and FP8 ``slots``, clipping all of them when above ``max_norm``.

    Returns the norm before clipping as a tensor; an overflowed FP8 slot (non-finite amax)
    makes it non-finite so the caller skips the step. Every gradient is clipped, FP8 ones
    included (MS-AMP skips them): for a slot that is a change of its scale only. Under tensor
    parallelism ``sharded`` flags the shards (as ``TrainOptimizer.sharded_flags``): their
    squares are summed over ``tp_group``, replicated gradients are counted once.
    """
    squares = []
    if grads:
        norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
        squares += [n.square() for n in norms]
    for slot in slots:
        # 0 * amax is 0 for a finite amax and NaN for inf/NaN: the overflow shows in the norm.
        squares.append(torch.linalg.vector_norm(slot.dequantize()).square() + 0.0 * slot.amax)
    if not squares and pp_group is None:
        return torch.zeros(())
    squares = torch.stack(squares) if squares else torch.zeros(0)
    if counted is not None:
        keep = torch.tensor(counted[0] + counted[1], dtype=torch.bool, device=squares.device)
        squares = torch.where(keep, squares, torch.zeros_like(squares))
    if tp_group is not None and tp_group.size() > 1:
        flags = torch.tensor(sharded[0] + sharded[1], dtype=torch.bool, device=squares.device)
        parts = torch.stack([squares[flags].sum(), squares[~flags].sum()])
        shard_sum = parts[0:1].clone()
        torch.distributed.all_reduce(shard_sum, group=tp_group)
        total_sq = shard_sum[0] + parts[1]
    else:
        total_sq = squares.sum()
    if pp_group is not None:
        total_sq = total_sq.reshape(1).clone()
        torch.distributed.all_reduce(total_sq, group=pp_group)
        total_sq = total_sq[0]
    total = total_sq.sqrt()
    if max_norm > 0 and math.isfinite(float(total)):
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        for slot in slots:
            slot.mul_(coef)
    return total

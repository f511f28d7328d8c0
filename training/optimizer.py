"""AdamW for every implemented level: plain (fp32, fp16, te) or with FP32 masters (bf16).

The bf16 level keeps BF16 parameters for forward/backward, accumulates weight gradients into an
FP32 ``main_grad`` (Megatron's trick: a backward hook adds each micro-batch's BF16 grad into FP32,
so accumulation never rounds to BF16) and steps FP32 master copies, then copies them back.
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]],
            lr=opt_cfg.lr,
            betas=(opt_cfg.adam_beta1, opt_cfg.adam_beta2),
            eps=opt_cfg.adam_eps,
            weight_decay=opt_cfg.weight_decay,
            foreach=True,
        )

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def grads(self) -> list[torch.Tensor]:
        """The gradients the step will use (FP32 main grads at bf16, ``.grad`` otherwise)."""
        if self.use_master:
            return [p.main_grad for p in self.model_params]
        return [p.grad for p in self.model_params if p.grad is not None]

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
            if self.use_master:
                p.main_grad.zero_()

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

    def bytes_by_role(self) -> dict[str, int]:
        """Bytes of master weights and optimizer states actually held, for bytes-per-param."""
        master = (
            sum(m.numel() * m.element_size() for m in self.master_params) if self.use_master else 0
        )
        states = 0
        for slots in self.optimizer.state.values():
            for value in slots.values():
                if torch.is_tensor(value) and value.numel() > 1:
                    states += value.numel() * value.element_size()
        return {"master": master, "optimizer": states}


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


def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm of ``grads`` (FP32), scaling them in place when it exceeds ``max_norm``.

    Returns the norm before clipping as a tensor (inf/NaN propagate so the caller can skip).
    Every gradient is clipped, whatever its dtype.
    """
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in grads])
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if math.isfinite(float(total)):
            torch._foreach_mul_(grads, coef)
    return total

"""Build everything a run needs from a validated Config: groups, data, model, optimizer, state.

Order follows torchtitan's train.py: topology -> data -> model -> precision -> optimizer ->
resume. Every "not implemented yet" and every impossible layout fails here, before any work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from families import ModelFamily, get_family
from fp8train import device as devices
from fp8train import gemm_backend
from fp8train.convert import apply_level_storage
from fp8train.loss_scaler import ConstantLossScaler, DynamicLossScaler
from fp8train.precision import PrecisionRecipe, resolve_param_dtype
from models.base import ParallelModel
from models.context import BuildContext
from parallel.comm_meter import CommMeter
from parallel.pipeline import PipelineEngine, PipelineLayout
from parallel.tensor_parallel.random import model_parallel_seed
from parallel.topology import ProcessGroups, init_distributed
from training.compile import compile_enabled, compile_layers
from training.config import Config, ConfigError
from training.optimizer import TrainOptimizer, build_optimizer, build_scheduler
from training.resume_check import resumed_param_dtype, set_aside
from training.run_plan import ResumePlan, RunPlan, plan_parallel

__all__ = [
    "RunState",
    "build_run",
    "prepare_data",
]


@dataclass
class RunState:
    cfg: Config
    plan: RunPlan  # the split, micro-batches, chunks per stage, resume (training/run_plan.py)
    family: ModelFamily
    metrics: tuple[str, ...]  # the family's run_metrics(cfg): what loss() returns and the log shows
    groups: ProcessGroups
    device: torch.device
    recipe: PrecisionRecipe
    data: Any  # what the family's prepare_data returned (tokenizer, paths, ...)
    model: ParallelModel
    model_config: Any
    optimizer: TrainOptimizer
    scheduler: object
    scaler: object
    train_ds: object
    valid_ds: object
    gemm_backend: str | None
    bytes_per_param: dict | None = None  # measured at the first step, while grads are alive
    meter: CommMeter | None = None  # bytes on the wire per collective, this step
    resumed_counters: dict | None = None
    run_lock: Any = None  # training/run_lock.py: held for the run's lifetime
    fp8_linears: list | None = None  # the model's FP8 Linears, for per-step health switching
    scaling_table: Any = None  # fp8train.scaling_table.ScalingTable, made at the first pass
    engine: PipelineEngine | None = None  # None without pipeline parallelism
    # Why ``recipe.other_params`` is what it is (``_param_dtype``): the start-up line says it.
    param_dtype_source: str = "set"


def _run_metrics(family: ModelFamily, cfg: Config) -> tuple[str, ...]:
    names = tuple(family.run_metrics(cfg))
    declared = family.metric_names
    if not names or names[0] != declared[0] or [n for n in declared if n in names] != list(names):
        raise TypeError(
            f"family {family.name!r}: run_metrics {names} must be {declared} or a subset of it "
            f"in that order, starting with {declared[0]!r}"
        )
    return names


def prepare_data(family: ModelFamily, cfg: Config, rank: int):
    """The family's data preparation: rank 0 first (it builds the caches), then the rest. A
    ``ValueError`` from the family names a config key and becomes a ``ConfigError`` on every
    rank: rank 0's verdict is broadcast, so no rank is left waiting for one that gave up."""
    prepared, error = None, None
    if rank == 0:
        try:
            prepared = family.prepare_data(cfg, rank)
        except ValueError as err:
            error = str(err)
    if dist.is_initialized():  # also the barrier: the others start once rank 0 is done
        box = [error]  # a string between this job's own processes
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is None and rank != 0:
        try:
            prepared = family.prepare_data(cfg, rank)
        except ValueError as err:
            error = str(err)
    if error is not None:
        raise ConfigError(f"config: {error}")
    return prepared


def _param_dtype(cfg: Config, resume: ResumePlan | None, device_type: str) -> tuple[str, str]:
    """``(parameter dtype, why)`` of the run: ``precision.param_dtype`` as set; "auto" as the
    checkpoint it continues trained (``resumed_param_dtype``), else as ``device_type`` wants
    (``resolve_param_dtype``: BF16 on CUDA at the FP8 levels, the level's own elsewhere)."""
    p = cfg.precision
    if p.param_dtype != "auto":
        return p.param_dtype, "set"
    kept = resumed_param_dtype(cfg, resume)
    if kept is not None:
        return kept, "auto: as its checkpoint trained"
    return resolve_param_dtype(p.level, "auto", device_type), f"auto on {device_type}"


def _scaler(cfg: Config, recipe: PrecisionRecipe):
    if not recipe.uses_loss_scaling:
        return ConstantLossScaler()
    p = cfg.precision
    return DynamicLossScaler(
        initial_scale=p.initial_loss_scale,
        min_scale=p.min_loss_scale,
        max_scale=p.max_loss_scale,
        growth_interval=p.loss_scale_window,
        hysteresis=p.hysteresis,
    )


_BACKENDS = ("emulated", "scaled_mm")


def _agree_gemm_backend(choice: str, device: torch.device) -> str:
    """Every rank uses rank 0's pick: replicas must run the same arithmetic to stay
    reproducible. (With "auto" the ranks normally agree already: the pick is raced once per
    machine and stored, ``fp8train.machine_cache``; a cache they cannot share is the case
    the broadcast covers.)"""
    picked = gemm_backend.select_gemm_backend(device, choice)
    if dist.is_initialized():
        code = torch.tensor([_BACKENDS.index(picked)], dtype=torch.int64, device=device)
        dist.broadcast(code, src=0)
        picked = _BACKENDS[int(code.item())]
    return picked


def _keep_padded_vocab(model_config, saved: dict | None, tensor: int):
    """A resumed run keeps its checkpoint's padded vocabulary when this tensor-parallel size
    divides it: the padding depends on the TP size that wrote the checkpoint, and its rows
    take part in the softmax (as in Megatron), so other padding would change the model.
    Otherwise the new padding applies and resharding zero-fills or drops padding rows."""
    padded = (saved or {}).get("padded_vocab_size")
    current = getattr(model_config, "vocab_size", None)
    if padded is None or current is None or padded == current or padded % tensor:
        return model_config
    if padded < (saved.get("vocab_size") or 0):
        return model_config
    return replace(model_config, vocab_size=padded)


def _build_model(
    fam, cfg: Config, model_config, layout, groups, device, recipe, meter, initialize=True
) -> ParallelModel:
    """This rank's slice of the family's model on ``device``, in the level's storage, with
    the dropout streams of its tensor and pipeline position seeded; its tensor-parallel
    collectives count their bytes in ``meter`` (``initialize``: False leaves the values
    undefined, see ``BuildContext``)."""
    topo = groups.topology
    # Same seed on every rank: data-parallel replicas start identical without a broadcast.
    # Under TP the tracker also gets a per-rank stream for dropout on sharded tensors.
    torch.manual_seed(cfg.training.seed)
    if groups.tensor is not None:
        model_parallel_seed(cfg.training.seed, topo.tp_rank, device)
    ctx = BuildContext(
        recipe,
        device=None if initialize else device,  # a plan builds on meta; a run moves below
        tp_group=groups.tensor,
        sequence_parallel=cfg.parallel.sequence_parallel,
        initialize=initialize,
        meter=meter,
    )
    model = fam.build_model(model_config, ctx, layout)
    if not isinstance(model, ParallelModel):
        raise TypeError(f"family {fam.name!r} built a {type(model).__name__}, not a ParallelModel")
    model = devices.move_module(model, device)
    apply_level_storage(model, recipe)  # bf16 params; O1-O3 scaled FP16 / FP8 linear weights
    if topo.pp_rank > 0:
        # Megatron's offset: every stage built the same full model from one seed; from here on
        # the stages' streams (dropout) must differ, or their layers would share masks.
        stage_seed = cfg.training.seed + 100 * topo.pp_rank
        if groups.tensor is not None:
            model_parallel_seed(stage_seed, topo.tp_rank, device)
        else:
            torch.manual_seed(stage_seed)
    return model


def _build_datasets(fam, cfg: Config, data):
    """The run's train and validation datasets: every sample the run and its evaluations
    read (validation: the same ``eval_iters`` batches at every evaluation)."""
    t = cfg.training
    train_samples = t.train_iters * t.global_batch_size
    evals = t.train_iters // t.eval_interval + 1
    valid_samples = max(1, t.eval_iters * t.global_batch_size) * (1 if evals else 0)
    train_ds, valid_ds = fam.build_datasets(cfg, data, train_samples, valid_samples)
    return train_ds, valid_ds


def _set_aside(cfg: Config, plan: RunPlan, rank: int) -> ResumePlan:
    """A fine-tune from the run's own directory, which holds another level's checkpoints:
    rank 0 moves them into their subdirectory once every rank is past its pre-flight (which
    read them where they were), and every rank loads from there
    (training/resume_check.py ``set_aside``). One line says so."""
    resume = plan.resume
    if dist.is_initialized():
        dist.barrier()
    moved_to = Path(cfg.resolved_checkpoint_dir()) / resume.set_aside
    if rank == 0:
        set_aside(cfg.resolved_checkpoint_dir(), resume.set_aside, resume.path.name)
    if dist.is_initialized():
        dist.barrier()
    if rank == plan.logging_rank:
        level = resume.metadata["config"]["precision"]["level"]
        print(
            f"> checkpoint.finetune: checkpoint.dir held {level} checkpoints; moved them to "
            f"{moved_to} (checkpoint.load reads it) to fine-tune at {cfg.precision.level} from "
            f"its {resume.path.name}",
            flush=True,
        )
    return replace(resume, path=moved_to / resume.path.name, set_aside=None)


def build_run(cfg: Config, plan: RunPlan | None = None, *, planning: bool = False) -> RunState:
    """Everything but loading the checkpoint, for the model family of ``cfg`` (its ``model``
    section's), as ``plan`` (the pre-flight's) says; without one, the layout is checked here
    and nothing is resumed. A plan that resumes keeps its checkpoint's FP8 GEMM backend (the
    loss sequence stays bit-identical) and padded vocabulary (``_keep_padded_vocab``).

    ``planning``: the build of the planner (training/planning/), on the meta device: no data
    prepared and no datasets (the model config from ``ModelFamily.planned_model_config``), no values
    initialised, and the FP8 GEMM backend a GPU would take when the config says "auto"
    (``scaled_mm``) rather than a race of fake kernels. ``precision.param_dtype=auto`` is
    resolved for the device this process runs on (``_param_dtype``), a plan's too: a plan
    made on a CPU is of a CPU run, as tests/test_planner.py checks it (set
    ``precision.param_dtype=bf16`` there to plan what "auto" is on CUDA at te and O1-O3)."""
    fam = get_family(cfg.family)
    groups, device = init_distributed(
        cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend
    )
    runs_on = device.type
    if planning:  # shapes, dtypes and storage sizes only: nothing allocated or computed
        device = torch.device("meta")
    topo = groups.topology
    if plan is None:
        plan = plan_parallel(cfg, topo.world_size)
    elif plan.world_size != topo.world_size:
        raise ConfigError(
            f"config: planned for {plan.world_size} ranks, but WORLD_SIZE={topo.world_size}"
        )
    if plan.resume is not None and plan.resume.set_aside and not planning:
        plan = replace(plan, resume=_set_aside(cfg, plan, topo.rank))
    resume = plan.resume
    param_dtype, param_dtype_source = _param_dtype(cfg, resume, runs_on)
    recipe = cfg.precision.recipe(param_dtype)  # with its FP8 scaling
    layout = PipelineLayout(cfg.model.num_layers, topo.pipeline, plan.virtual_stages, topo.pp_rank)

    if planning:
        data, model_config = None, fam.planned_model_config(cfg, topo.tensor)
    else:
        data = prepare_data(fam, cfg, topo.rank)
        model_config = fam.model_config(cfg, data, topo.tensor)
    saved_structure = resume.saved_structure if resume else None
    model_config = _keep_padded_vocab(model_config, saved_structure, topo.tensor)

    # Before the model: each FP8 linear binds the backend when its weight lands on a device.
    chosen = None
    if recipe.fp8_gemm:
        choice = (resume.gemm_backend if resume else None) or cfg.precision.fp8_gemm_backend
        if planning and choice == "auto":
            choice = "scaled_mm"
        chosen = _agree_gemm_backend(choice, device)
        gemm_backend.set_gemm_backend(chosen)

    meter = CommMeter()
    model = _build_model(
        fam, cfg, model_config, layout, groups, device, recipe, meter, initialize=not planning
    )
    if not planning and compile_enabled(cfg.training.compile, device):
        compile_layers(model, tensor_parallel=groups.tensor is not None)
    engine = None
    if layout.is_split:
        engine = PipelineEngine(
            layout,
            groups.pipeline,
            shape=model.stage_activation_shape(cfg.training.micro_batch_size),
            dtype=recipe.param_dtype,  # the residual stream's dtype at every level
            device=device,
            meter=meter,
        )

    optimizer = build_optimizer(
        model,
        recipe,
        cfg.optimizer,
        group=groups.data,
        distributed=cfg.optimizer.distributed,
        bucket_size=cfg.parallel.ddp_bucket_size,
        overlap=cfg.parallel.overlap_grad_reduce,
        held=model.shared_parameters(),
        meter=meter,
    )
    scheduler = build_scheduler(
        optimizer, cfg.optimizer, cfg.resolved_lr_decay_iters(), cfg.resolved_lr_warmup_iters()
    )

    train_ds, valid_ds = (None, None) if planning else _build_datasets(fam, cfg, data)
    return RunState(
        cfg=cfg,
        plan=plan,
        family=fam,
        metrics=_run_metrics(fam, cfg),
        groups=groups,
        device=device,
        recipe=recipe,
        data=data,
        model=model,
        model_config=model_config,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=_scaler(cfg, recipe),
        train_ds=train_ds,
        valid_ds=valid_ds,
        gemm_backend=chosen,
        meter=meter,
        engine=engine,
        param_dtype_source=param_dtype_source,
    )

"""Build everything a run needs from a validated Config: groups, data, model, optimizer, state.

Order follows torchtitan's train.py: topology -> data -> model -> precision -> optimizer ->
resume. Every "not implemented yet" and every impossible layout fails here, before any work.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from data.gpt_data import build_gpt_datasets
from data.prepare import prepare_data_from_prefix, prepare_default_data
from data.tokenizer import SentencePieceTokenizer
from fp8train import gemm
from fp8train.convert import apply_level_storage
from fp8train.loss_scaler import ConstantLossScaler, DynamicLossScaler
from fp8train.precision import PrecisionRecipe, get_recipe
from fp8train.scaling import ScalingRecipe
from models.gpt import GPTConfig, GPTModel
from parallel.comm_meter import CommMeter
from parallel.pipeline import PipelineEngine, PipelineLayout
from parallel.tensor_parallel.random import model_parallel_seed
from parallel.topology import ProcessGroups, init_distributed
from training.config import Config, ConfigError
from training.layout import check_layout, num_microbatches
from training.optimizer import TrainOptimizer, build_optimizer, build_scheduler

__all__ = ["RunState", "build_run", "prepare_data", "num_microbatches", "check_layout"]


@dataclass
class RunState:
    cfg: Config
    groups: ProcessGroups
    device: torch.device
    recipe: PrecisionRecipe
    tokenizer: SentencePieceTokenizer
    model: GPTModel
    model_config: GPTConfig
    optimizer: TrainOptimizer
    scheduler: object
    scaler: object
    train_ds: object
    valid_ds: object
    gemm_backend: str | None
    bytes_per_param: dict | None = None  # measured at the first step, while grads are alive
    meter: CommMeter | None = None  # bytes on the wire per collective, this step
    resumed_counters: dict | None = None
    fp8_linears: list | None = None  # the model's FP8 Linears, for per-step health switching
    engine: PipelineEngine | None = None  # None without pipeline parallelism


def prepare_data(cfg: Config, rank: int):
    """(tokenizer model path, data prefix). Rank 0 builds the default corpus; the rest wait."""
    d = cfg.data
    if d.corpus == "stdlib":
        if rank == 0:
            prepared = prepare_default_data(d.cache_dir, d.vocab_size, seed=cfg.training.seed)
        if dist.is_initialized():
            dist.barrier()
        if rank != 0:
            prepared = prepare_default_data(d.cache_dir, d.vocab_size, seed=cfg.training.seed)
        if rank == 0:
            print(
                f"> data: default corpus {prepared.data_prefix} ({prepared.num_documents} "
                f"documents, {prepared.num_tokens} tokens, vocab {prepared.vocab_size})",
                flush=True,
            )
        return prepared.tokenizer_model, prepared.data_prefix
    try:
        prepared = prepare_data_from_prefix(d.data_prefix, d.tokenizer_model)
    except (FileNotFoundError, ValueError) as err:
        key = "data.tokenizer_model" if "tokenizer" in str(err) else "data.data_prefix"
        raise ConfigError(f"config: {key}: {err}") from None
    return prepared.tokenizer_model, prepared.data_prefix


def _scaling(cfg: Config) -> ScalingRecipe:
    p = cfg.precision
    return ScalingRecipe(
        mode=p.fp8_recipe,
        amax_history_len=p.amax_history_len,
        margin=p.fp8_margin,
        power_of_two=p.fp8_power_of_two,
    )


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
    """Rank 0 picks (measuring when "auto") and every rank uses its pick: timings differ per
    process, and replicas must run the same arithmetic to stay reproducible."""
    picked = gemm.select_gemm_backend(device, choice)
    if dist.is_initialized():
        code = torch.tensor([_BACKENDS.index(picked)], dtype=torch.int64, device=device)
        dist.broadcast(code, src=0)
        picked = _BACKENDS[int(code.item())]
    return picked


def build_run(cfg: Config, gemm_backend: str | None = None) -> RunState:
    """Everything but resume. ``gemm_backend`` forces the FP8 GEMM backend (a resumed run
    reuses the one its checkpoint used, so the loss sequence stays bit-identical)."""
    recipe = get_recipe(cfg.precision.level).require_implemented()
    groups, device = init_distributed(
        cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend
    )
    topo = groups.topology
    check_layout(cfg, topo.world_size)
    layout = PipelineLayout(
        cfg.model.num_layers, topo.pipeline, cfg.parallel.virtual_pipeline or 1, topo.pp_rank
    )

    tokenizer_model, data_prefix = prepare_data(cfg, topo.rank)
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    vocab = cfg.model.padded_vocab_size(tokenizer.vocab_size, topo.tensor)
    model_config = GPTConfig.from_model_section(cfg.model, vocab)

    # Same seed on every rank: data-parallel replicas start identical without a broadcast.
    # Under TP the tracker also gets a per-rank stream for dropout on sharded tensors.
    torch.manual_seed(cfg.training.seed)
    if groups.tensor is not None:
        model_parallel_seed(cfg.training.seed, topo.tp_rank, device)
    model = GPTModel(
        model_config,
        recipe,
        _scaling(cfg),
        tp_group=groups.tensor,
        sequence_parallel=cfg.parallel.sequence_parallel,
        pipeline=layout,
    ).to(device)
    apply_level_storage(model, recipe)  # bf16 params; O1-O3 scaled FP16 / FP8 linear weights
    if topo.pp_rank > 0:
        # Megatron's offset: every stage built the same full model from one seed; from here on
        # the stages' streams (dropout) must differ, or their layers would share masks.
        stage_seed = cfg.training.seed + 100 * topo.pp_rank
        if groups.tensor is not None:
            model_parallel_seed(stage_seed, topo.tp_rank, device)
        else:
            torch.manual_seed(stage_seed)
    meter = CommMeter()
    engine = None
    if layout.is_split:
        seq = cfg.model.seq_length // (topo.tensor if cfg.parallel.sequence_parallel else 1)
        engine = PipelineEngine(
            layout,
            groups.pipeline,
            shape=(cfg.training.micro_batch_size, seq, cfg.model.hidden_size),
            dtype=recipe.param_dtype,  # the residual stream's dtype at every level
            device=device,
            meter=meter,
        )

    chosen = None
    if recipe.fp8_gemm:
        chosen = _agree_gemm_backend(gemm_backend or cfg.precision.fp8_gemm_backend, device)
        gemm.set_gemm_backend(chosen)

    shared = model.shared_embedding()
    optimizer = build_optimizer(
        model,
        recipe,
        cfg.optimizer,
        group=groups.data,
        distributed=cfg.optimizer.distributed,
        bucket_size=cfg.parallel.ddp_bucket_size,
        overlap=cfg.parallel.overlap_grad_reduce,
        held=[shared] if shared is not None else [],
        meter=meter,
    )
    scheduler = build_scheduler(optimizer, cfg.optimizer, cfg.resolved_lr_decay_iters())

    t = cfg.training
    train_samples = t.train_iters * t.global_batch_size
    evals = t.train_iters // t.eval_interval + 1
    valid_samples = max(1, t.eval_iters * t.global_batch_size) * (1 if evals else 0)
    train_ds, valid_ds = build_gpt_datasets(
        data_prefix,
        tokenizer,
        seq_length=cfg.model.seq_length,
        seed=t.seed,
        split=cfg.data.split,
        train_samples=train_samples,
        valid_samples=valid_samples,
        cache_dir=os.path.join(cfg.data.cache_dir, "indices"),
    )
    return RunState(
        cfg=cfg,
        groups=groups,
        device=device,
        recipe=recipe,
        tokenizer=tokenizer,
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
    )

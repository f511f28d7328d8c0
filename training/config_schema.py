"""The configuration schema: one frozen dataclass per YAML section, validated on construction.

Every field carries its default and its documentation (``metadata["doc"]``); docs/CONFIG.md is
generated from these, so the code is the only place a key is described. Range limits live in
the metadata too (``ge``/``gt``/``le``/``lt``) so the generated reference can state them.

Validation runs in ``__post_init__``: a ``Config`` that exists is a valid one, whether it came
from YAML, from ``dataclasses.replace`` or from a test building ``ModelConfig(...)`` directly.
Checks here need only the config; anything that needs the world size (data-parallel divisibility
of the batch, GPU count) is checked where the topology is known.

Loading, overrides and the generated reference live in ``training/config.py``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from families import DEFAULT_FAMILY, get_family
from families.config_fields import ConfigError, Section, field_spec, show_value
from families.config_fields import Section as _Section
from families.config_fields import doc_field as _f
from families.data_sections import TextDataSection

# The text data section (GPT, RoBERTa) under its historical name.
DataConfig = TextDataSection

__all__ = [
    "ConfigError",
    "DataConfig",
    "TrainingConfig",
    "OptimizerConfig",
    "PrecisionConfig",
    "ParallelConfig",
    "LoggingConfig",
    "CheckpointConfig",
    "Config",
    "SECTIONS",
    "sections_for",
    "PRECISION_LEVELS",
    "field_spec",
    "show_value",
]

PrecisionLevel = Literal["fp32", "bf16", "fp16", "te", "O1", "O2", "O3"]
PRECISION_LEVELS: tuple[str, ...] = typing.get_args(PrecisionLevel)


@dataclass(frozen=True)
class TrainingConfig(_Section):
    SECTION: ClassVar[str] = "training"

    train_iters: int = _f(300, "Optimizer steps to train for.", ge=1)
    micro_batch_size: int = _f(4, "Samples per forward/backward on one data-parallel rank.", ge=1)
    global_batch_size: int = _f(
        8,
        "Samples per optimizer step over all data-parallel ranks (sets grad accumulation).",
        ge=1,
    )
    seed: int = _f(1234, "Random seed for init, data order and dropout.", ge=0)
    eval_interval: int = _f(100, "Evaluate on the validation split every N steps.", ge=1)
    eval_iters: int = _f(4, "Validation batches per evaluation; 0 disables evaluation.", ge=0)
    clip_grad: float = _f(1.0, "Clip the global gradient norm to this; 0 disables.", ge=0)
    exit_interval: int | None = _f(
        None, "Stop (after saving) once the step count is a multiple of this.", ge=1
    )
    time_limit_minutes: float | None = _f(
        None, "Stop (after saving) once this much wall time has passed.", gt=0
    )
    compile: bool | None = _f(
        None,
        "Compile each transformer layer with torch.compile (fullgraph=True without tensor "
        'parallelism; see docs/ARCHITECTURE.md, "Compiled step"): null = on for CUDA, off '
        "on the CPU, whose eager step is the exact reference and where compiling costs "
        "tens of seconds.",
    )
    max_consecutive_skips: int = _f(
        100,
        "Stop with an error after this many consecutive skipped steps (non-finite gradients); "
        "0 = never. 100 leaves room for a dynamic loss scale to fall from 65536 to 1. Counted "
        "on the device, checked when the loop logs or saves.",
        ge=0,
    )

    def _check(self) -> None:
        if self.global_batch_size % self.micro_batch_size:
            raise self._err(
                f"training.global_batch_size ({self.global_batch_size}) must be divisible by "
                f"training.micro_batch_size ({self.micro_batch_size})"
            )


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    SECTION: ClassVar[str] = "optimizer"

    type: Literal["adamw"] = _f("adamw", "Optimizer (AdamW with decoupled weight decay).")
    lr: float = _f(1e-3, "Peak learning rate.", ge=0)
    min_lr: float = _f(1e-4, "Learning rate at the end of the decay.", ge=0)
    weight_decay: float = _f(0.1, "Decoupled weight decay (not applied to biases and norms).", ge=0)
    adam_beta1: float = _f(0.9, "Adam beta1.", ge=0, lt=1)
    adam_beta2: float = _f(0.95, "Adam beta2.", ge=0, lt=1)
    adam_eps: float = _f(1e-8, "Adam epsilon.", gt=0)
    lr_warmup_iters: int | None = _f(
        None,
        "Linear warm-up steps from 0 to optimizer.lr; null = optimizer.lr_warmup_fraction of "
        "the decay length.",
        ge=0,
    )
    lr_warmup_fraction: float = _f(
        0.0667,
        "Warm-up as a fraction of the decay length (Megatron's --lr-warmup-fraction; rounded "
        "down), used when optimizer.lr_warmup_iters is null: a shortened run keeps a warm-up "
        "that fits.",
        ge=0,
        lt=1,
    )
    lr_decay_iters: int | None = _f(
        None, "Step at which the decay reaches min_lr; null = training.train_iters.", ge=1
    )
    lr_decay_style: Literal["cosine", "linear", "constant"] = _f(
        "cosine", "Shape of the decay after warm-up."
    )
    distributed: bool = _f(
        False, "Shard optimizer state over data-parallel ranks (ZeRO-1; O3 builds on it)."
    )

    def _check(self) -> None:
        if self.min_lr > self.lr:
            raise self._err(
                f"optimizer.lr ({self.lr:g}) must be >= optimizer.min_lr ({self.min_lr:g})"
            )
        # Only an explicit decay length is checked: shortening train_iters for a smoke run
        # must not trip over the warm-up of the shipped config.
        warmup = self.lr_warmup_iters
        if self.lr_decay_iters is not None and warmup is not None and warmup > self.lr_decay_iters:
            raise self._err(
                f"optimizer.lr_warmup_iters ({self.lr_warmup_iters}) must be <= "
                f"optimizer.lr_decay_iters ({self.lr_decay_iters})"
            )


@dataclass(frozen=True)
class PrecisionConfig(_Section):
    SECTION: ClassVar[str] = "precision"

    level: PrecisionLevel = _f(
        "te",
        "Row of the precision table: fp32; bf16 (mixed, FP32 master); fp16 (AMP); te (FP8 "
        "GEMMs only); O1 (+FP8 weight grads and comm, FP16 weights); O2 (+FP8/FP16 Adam "
        "moments); O3 (+FP8 weights, FP16 master sharded by the distributed optimizer).",
    )
    param_dtype: Literal["auto", "fp32", "bf16"] = _f(
        "auto",
        "Parameters the level keeps in higher precision (embeddings, norms, biases; te's "
        "linear weights), and so the activations between the GEMMs. bf16 at te and O1-O3 = "
        "BF16 with FP32 masters, as Transformer Engine and FP8-LM run FP8 (BF16 attention and "
        "elementwise work: faster on GPUs); fp32 = the table's FP32 (not at level bf16). "
        "auto = bf16 on CUDA at te and O1-O3, else the level's own (FP32 on the CPU, the "
        "exact reference; BF16 at level bf16); a resumed run keeps what its checkpoint "
        "recorded. The start-up line says which was chosen.",
    )
    fp8_recipe: Literal["delayed", "current"] = _f(
        "delayed", "FP8 scaling: delayed (amax history) or current (per-tensor amax now)."
    )
    amax_history_len: int = _f(16, "Steps of amax history for delayed scaling.", ge=1)
    fp8_margin: int = _f(0, "Scale down by 2**margin for headroom below the FP8 maximum.", ge=0)
    fp8_power_of_two: bool = _f(False, "Round FP8 scales to powers of two.")
    fp8_granularity: Literal["tensor", "row", "block"] = _f(
        "tensor",
        "FP8 scales per tensor; per row of each GEMM operand along its reduction dimension "
        "(row, torchao's row-wise); or per 1x128 tile of activations and gradients and "
        "128x128 block of weights (block, DeepSeek-V3). row and block need "
        "precision.fp8_recipe=current; row is not built for precision.level O3, whose FP8 "
        "weights are stored in the same 128x128 blocks at block.",
    )
    fp8_grad_format: Literal["e5m2", "e4m3"] | None = _f(
        None,
        "FP8 format of the output gradient: e5m2 (the hybrid recipe) or e4m3; null = e4m3 at "
        "fp8_granularity=block (the block-scaled GEMM takes E4M3 operands only; e5m2 is "
        "refused there), e5m2 otherwise.",
    )
    fp8_fast_accum: bool = _f(
        True,
        "The forward FP8 GEMM uses cuBLASLt's fast accumulation (Transformer Engine's and "
        "torchao's default; the backward GEMMs never do). CUDA only.",
    )
    fp8_gemm_backend: Literal["auto", "scaled_mm", "emulated"] = _f(
        "auto", "auto = torch._scaled_mm where it works, else emulated (cast, then GEMM)."
    )
    keep_weight_transposes: bool = _f(
        True,
        "In a step of several micro-batches, keep each FP8 weight's transpose (the operand of "
        "the input-gradient GEMM on torch._scaled_mm) from the first micro-batch to the step's "
        "end: one transpose per step instead of one copy per micro-batch's backward, for 1 "
        "byte per GEMM weight element held all step (5.44 GB on a GPT-175B stage at TP 8). "
        "false = copy it per backward (the same bytes: no numerics change). The weight's FP8 "
        "cast is kept either way per tensor; at row/block granularity the cast and its "
        "transpose are kept together or, with false, made per micro-batch (the same bytes). "
        "Eager only: a compiled layer never keeps them.",
    )
    initial_loss_scale: float = _f(
        65536.0, "Starting dynamic loss scale (fp16, O1, O2; every other level runs at 1.0).", gt=0
    )
    loss_scale_window: int = _f(1000, "Steps without overflow before the scale doubles.", ge=1)
    hysteresis: int = _f(2, "Overflows tolerated before the scale is halved.", ge=1)
    min_loss_scale: float = _f(1.0, "Lower bound of the loss scale.", gt=0)
    max_loss_scale: float = _f(16777216.0, "Upper bound of the loss scale (2**24).", gt=0)

    def _check(self) -> None:
        for high, low in (("max", "initial"), ("initial", "min")):
            hi, lo = getattr(self, f"{high}_loss_scale"), getattr(self, f"{low}_loss_scale")
            if hi < lo:
                raise self._err(
                    f"precision.{high}_loss_scale ({hi!r}) must be >= "
                    f"precision.{low}_loss_scale ({lo!r})"
                )
        # Granularity first: its message names the config keys, ScalingRecipe's would not.
        self._check_granularity()
        try:  # the combination rules live with the recipes
            self.recipe()
        except ValueError as err:
            raise self._err(str(err)) from None

    def _check_granularity(self) -> None:
        if self.fp8_granularity == "tensor":
            return
        key = f"precision.fp8_granularity={self.fp8_granularity}"
        if self.fp8_recipe != "current":
            raise self._err(
                f"{key} scales from each row's or block's current amax: set "
                "precision.fp8_recipe=current (delayed scaling keeps one history per tensor)"
            )
        if self.fp8_granularity == "block" and self.fp8_grad_format == "e5m2":
            raise self._err(
                f"{key} takes E4M3 gradients (cuBLASLt's block-scaled GEMM reads E4M3 operands "
                "only): set precision.fp8_grad_format=e4m3, or leave it null"
            )
        if self.level == "O3" and self.fp8_granularity == "row":
            raise self._err(
                f"{key} is not built for precision.level O3: its FP8 weights are stored per "
                "tensor or in 128x128 blocks (fp8_granularity=block), whose transpose serves "
                "the input gradient"
            )

    def recipe(self, param_dtype: str | None = None):
        """This section's row of the precision table (``fp8train.precision``) with its FP8
        scaling (the ``fp8_*`` keys); ``param_dtype`` in place of this section's (a run's
        resolved "auto")."""
        from fp8train.precision import get_recipe
        from fp8train.scaling import ScalingRecipe

        values = {f: getattr(self, key) for f, key in _SCALING_KEYS.items()}
        if values["grad_format"] is None:  # null: E4M3 at block, the hybrid E5M2 elsewhere
            values["grad_format"] = "e4m3" if self.fp8_granularity == "block" else "e5m2"
        return get_recipe(self.level, param_dtype or self.param_dtype, ScalingRecipe(**values))


# ScalingRecipe field -> the precision key that sets it (the config keeps its public names).
_SCALING_KEYS = {
    "mode": "fp8_recipe",
    "amax_history_len": "amax_history_len",
    "margin": "fp8_margin",
    "power_of_two": "fp8_power_of_two",
    "granularity": "fp8_granularity",
    "grad_format": "fp8_grad_format",
    "fast_accum": "fp8_fast_accum",
}


@dataclass(frozen=True)
class ParallelConfig(_Section):
    SECTION: ClassVar[str] = "parallel"

    tensor: int = _f(1, "Tensor-parallel size.", ge=1)
    pipeline: int = _f(1, "Pipeline-parallel stages.", ge=1)
    virtual_pipeline: int | None = _f(
        None, "Model chunks per pipeline stage (interleaved 1F1B); null = not interleaved.", ge=2
    )
    pipeline_schedule: Literal["1f1b", "all_forward_all_backward"] = _f(
        "1f1b",
        "Pipeline schedule: 1f1b (interleaved when virtual_pipeline is set) or "
        "all_forward_all_backward (GPipe).",
    )
    sequence_parallel: bool = _f(False, "Shard norms/dropout over the sequence (needs tensor > 1).")
    overlap_grad_reduce: bool = _f(
        True, "Start each gradient bucket's data-parallel reduction as soon as backward fills it."
    )
    ddp_bucket_size: int | None = _f(
        None, "Elements per gradient bucket; null = max(40M, 1M x data-parallel size).", ge=1
    )
    backend: Literal["auto", "gloo", "nccl"] = _f(
        "auto", "Process-group backend; auto = nccl on CUDA, gloo on CPU."
    )

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline stage: ``virtual_pipeline``, 1 when it is null."""
        return self.virtual_pipeline or 1

    def _check(self) -> None:
        if self.sequence_parallel and self.tensor == 1:
            raise self._err("parallel.sequence_parallel requires parallel.tensor > 1")
        if self.virtual_pipeline is not None and self.pipeline == 1:
            raise self._err("parallel.virtual_pipeline requires parallel.pipeline > 1")


@dataclass(frozen=True)
class LoggingConfig(_Section):
    SECTION: ClassVar[str] = "logging"

    dir: str = _f("runs/gpt_tiny", "Run directory (TensorBoard events, logs, checkpoints).")
    interval: int = _f(10, "Log training metrics every N steps.", ge=1)
    tensorboard: bool = _f(True, "Write TensorBoard events to logging.dir.")
    peak_tflops: float | None = _f(
        None, "Peak TFLOP/s for MFU; null = the GPU's known dense peak (measured on CPU).", gt=0
    )
    log_fp8_stats: bool = _f(True, "Log FP8 amax/scale and overflow/underflow statistics.")
    fp8_stats_interval: int | None = _f(
        None,
        "Iterations between per-layer FP8 health logs (amax, scale, underflow and saturation "
        "fractions); null = logging.interval.",
        ge=1,
    )


@dataclass(frozen=True)
class CheckpointConfig(_Section):
    SECTION: ClassVar[str] = "checkpoint"

    dir: str | None = _f(None, "Where checkpoints go; null = {logging.dir}/checkpoints.")
    save_interval: int = _f(100, "Save every N steps; 0 disables periodic saves.", ge=0)
    save_on_signal: bool = _f(
        True,
        "On SIGTERM or SIGINT finish the step, save a checkpoint and exit 0; a second signal "
        "stops at once.",
    )
    resume: bool = _f(True, "Resume from the latest checkpoint in checkpoint.dir if one exists.")
    load: str | None = _f(
        None,
        "Checkpoint (or checkpoints directory: its latest) to start from when checkpoint.dir "
        "has none of its own yet; any parallel layout (resharded on load).",
    )
    finetune: bool = _f(
        False,
        "Take only the model weights from checkpoint.load (any level: dequantized, then stored "
        "at this run's): fresh optimizer, scheduler, loss scale and FP8 scaling, iteration 0. "
        "As from_pretrained does, the model keys left unset come from that checkpoint (keys set "
        "that build another model are refused, all named in one line), and so does the "
        "tokenizer of a converted Hugging Face model (configs/gpt_finetune_hf.yaml). "
        "Switches the level of a run in place too: when checkpoint.dir's own latest is another "
        "level's (or parameter dtype's), the run fine-tunes from it, after moving that "
        "directory's checkpoints into checkpoint.dir/<their level>.",
    )
    keep_last: int = _f(2, "Checkpoints kept in checkpoint.dir; 0 keeps all.", ge=0)
    async_save: bool = _f(
        False,
        "Write periodic checkpoints in the background: the step waits only for a copy of the "
        "state in host memory (held until written), latest moves once every rank's files are "
        "on disk, a few steps later; the last save of a run is published before it ends.",
    )


@dataclass(frozen=True)
class Config:
    """The whole run configuration; sections mirror the YAML file."""

    model: Section = field(default_factory=lambda: _model_section(None)())
    data: Section | None = None  # None: the family's data section with its defaults
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        sections = sections_for(self.family)
        if self.data is None:
            object.__setattr__(self, "data", sections["data"]())  # frozen: set once, here
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), sections[f.name]):
                raise ConfigError(f"config: {f.name} must be a {sections[f.name].__name__}")
        self.model.check_parallel(self.parallel)  # the family's split rules
        self.data.check_config(self)
        if self.precision.fp8_granularity == "block":
            from fp8train.blockwise import BLOCK

            self.model.check_fp8_blocks(self.parallel, BLOCK)

        # megatron-core's scheduler asserts this; say it in the config's own words instead.
        decay = self.resolved_lr_decay_iters()
        if self.optimizer.lr_warmup_iters is not None and self.optimizer.lr_warmup_iters >= decay:
            raise ConfigError(
                f"config: optimizer.lr_warmup_iters ({self.optimizer.lr_warmup_iters}) must be "
                f"less than the decay length {decay} (optimizer.lr_decay_iters, else "
                "training.train_iters)"
            )

    @property
    def family(self) -> str:
        """The model family this config trains: its ``model`` section's."""
        return self.model.FAMILY

    def resolved_checkpoint_dir(self) -> str:
        return self.checkpoint.dir or os.path.join(self.logging.dir, "checkpoints")

    def resolved_lr_decay_iters(self) -> int:
        return self.optimizer.lr_decay_iters or self.training.train_iters

    def resolved_lr_warmup_iters(self) -> int:
        """Explicit warm-up steps, else the warm-up fraction of the decay length (rounded
        down, so always shorter than the decay)."""
        o = self.optimizer
        if o.lr_warmup_iters is not None:
            return o.lr_warmup_iters
        return math.floor(o.lr_warmup_fraction * self.resolved_lr_decay_iters())


def _family(family: str | None):
    try:
        return get_family(family or DEFAULT_FAMILY)
    except ValueError as err:  # an unknown family name
        raise ConfigError(f"config: {err}") from None


def _model_section(family: str | None) -> type:
    return _family(family).model_section


def sections_for(family: str | None = None) -> dict[str, type]:
    """Section name -> class for a run of model ``family`` (default: the default family):
    the ``model`` and ``data`` sections are the family's own."""
    fam = _family(family)
    return {"model": fam.model_section, "data": fam.data_section, **SECTIONS}


# The sections every family shares (``sections_for`` adds the family's ``model`` and ``data``).
SECTIONS: dict[str, type] = {
    "training": TrainingConfig,
    "optimizer": OptimizerConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
}

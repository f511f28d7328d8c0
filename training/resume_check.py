"""Which checkpoint a run starts from, and whether it can: shared by the pre-flight (before any
worker starts, training/preflight.py) and the loop (when it loads, training/loop.py).

A run resumes from its own ``checkpoint.dir`` first (a restarted fine-tune continues itself),
else from ``checkpoint.load``. The checkpoint must hold this family's model (compared as built
configs, so keys left at their defaults match explicit ones) and, unless only its weights are
taken (``checkpoint.finetune``), this run's precision level and parameter dtype
(``precision.param_dtype=auto`` resumes as the checkpoint trained, whatever the device). The
parallel layout may differ: loading reshards (checkpoint/reshard.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from checkpoint.store import (
    CheckpointError,
    check_format,
    latest_checkpoint,
    read_metadata,
    resolve_checkpoint,
)
from fp8train.precision import get_recipe
from training.config import Config, ConfigError, config_to_dict
from training.plan import ResumePlan

__all__ = [
    "find_resume",
    "read_resume_metadata",
    "resume_plan",
    "check_compatible",
    "resumed_param_dtype",
    "saved_param_dtype",
    "FREE_MODEL_FIELDS",
]

# Model fields that shape no tensor: a resumed or fine-tuned run may change them.
FREE_MODEL_FIELDS = frozenset(
    {"vocab_size", "hidden_dropout", "attention_dropout", "recompute", "init_method_std",
     "seq_length"}
)  # fmt: skip


def find_resume(cfg: Config) -> tuple[Path | None, bool]:
    """``(checkpoint or None, weights only?)``: the run's own latest checkpoint first, else
    ``checkpoint.load`` (a checkpoint, or a checkpoints directory: its latest)."""
    try:
        own = latest_checkpoint(cfg.resolved_checkpoint_dir()) if cfg.checkpoint.resume else None
    except CheckpointError as err:
        raise CheckpointError(f"checkpoint.dir: {err}") from None
    if own is not None:
        return own, False
    if cfg.checkpoint.load:
        try:
            return resolve_checkpoint(cfg.checkpoint.load), cfg.checkpoint.finetune
        except CheckpointError as err:
            raise CheckpointError(f"checkpoint.load: {err}") from None
    return None, False


def read_resume_metadata(path: Path, family: str) -> dict:
    """The metadata of checkpoint ``path``, refused (one line) when its format version is
    not this one's or it holds another family's model."""
    saved = read_metadata(path)
    check_format(path, saved)
    if saved.get("family") != family:
        raise ConfigError(
            f"config: checkpoint {path} holds a {saved.get('family')!r} model; this run trains "
            f"{family!r}"
        )
    return saved


def resume_plan(cfg: Config) -> ResumePlan | None:
    """The checkpoint the run starts from (``find_resume``), its metadata read and checked
    once (``read_resume_metadata``); None for a fresh start."""
    path, weights_only = find_resume(cfg)
    if path is None:
        return None
    return ResumePlan(path, weights_only, read_resume_metadata(path, cfg.family))


def check_compatible(
    family, cfg: Config, model_config: Any, saved: dict, path, weights_only: bool
) -> None:
    """A checkpoint must hold this run's model and, unless ``weights_only``, its precision
    level and parameter dtype; the first differing key is named. ``model_config``: this run's
    built model config (``family.model_config``); None when it is not known yet (the
    pre-flight before the default corpus is built): the model is then compared when the run
    loads."""
    if saved.get("weights_only") and not weights_only:
        raise ConfigError(
            f"config: checkpoint {path} holds model weights only ({saved['weights_only']}): "
            "start from it with checkpoint.finetune=true"
        )
    try:
        old = family.config_from_checkpoint(saved)
    except NotImplementedError:  # a family without it: compare the YAML sections
        old, now = saved["config"]["model"], config_to_dict(cfg)["model"]
        pairs = ((k, v, old.get(k)) for k, v in now.items())
    else:
        pairs = (
            (f.name, getattr(model_config, f.name), getattr(old, f.name))
            for f in dataclasses.fields(old)
            if f.name not in FREE_MODEL_FIELDS and model_config is not None
        )
    for key, value, before in pairs:
        if value != before:
            raise ConfigError(f"config: model.{key}={value!r} but checkpoint {path} has {before!r}")
    if weights_only:
        return
    saved_precision = saved["config"]["precision"]
    old_level = saved_precision["level"]
    if old_level != cfg.precision.level:
        raise ConfigError(
            f"config: precision.level={cfg.precision.level} but checkpoint {path} has "
            f"{old_level}; take only its weights with checkpoint.finetune=true (the optimizer "
            "state of one level does not convert to another's)"
        )
    # "auto" resumes as the checkpoint trained (``resumed_param_dtype``); a value set must be
    # the one it trained with.
    asked = cfg.precision.param_dtype
    if asked == "auto":
        return
    trained = saved_param_dtype(saved)
    if get_recipe(old_level, trained) != get_recipe(old_level, asked):
        raise ConfigError(
            f"config: precision.param_dtype={asked} but checkpoint {path} was trained with "
            f"{trained} parameters: set precision.param_dtype={trained} (or auto, which resumes "
            "as the checkpoint trained), or take only its weights with checkpoint.finetune=true "
            "(FP32 masters exist for BF16 parameters only)"
        )


def saved_param_dtype(saved: dict) -> str:
    """The parameter dtype ("fp32" or "bf16") checkpoint metadata ``saved`` was trained with:
    its config's ``precision.param_dtype``, which a run records resolved
    (training/checkpointer.py); "auto" or none (older checkpoints, written before "auto"
    depended on the device) was the level's own on every device."""
    precision = saved["config"]["precision"]
    return get_recipe(precision["level"], precision.get("param_dtype", "auto")).other_params


def resumed_param_dtype(cfg: Config, resume: ResumePlan | None) -> str | None:
    """The parameter dtype that ``resume`` fixes for ``cfg``: its checkpoint's, when the run
    continues it (not a fine-tune) at the same level with ``precision.param_dtype=auto``, so
    that a checkpoint resumes on a device whose "auto" differs (a CUDA run's BF16 on the CPU,
    an older or CPU run's FP32 on CUDA); None otherwise (another level fails on load, naming
    ``precision.level``)."""
    if cfg.precision.param_dtype != "auto" or resume is None or resume.weights_only:
        return None
    if resume.metadata["config"]["precision"]["level"] != cfg.precision.level:
        return None
    return saved_param_dtype(resume.metadata)

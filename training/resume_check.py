"""Which checkpoint a run starts from, and whether it can: shared by the pre-flight (before any
worker starts, training/preflight.py) and the loop (when it loads, training/loop.py).

A run resumes from its own ``checkpoint.dir`` first (a restarted fine-tune continues itself),
else from ``checkpoint.load``. The checkpoint must hold this family's model (compared as built
configs, so keys left at their defaults match explicit ones) and, unless only its weights are
taken (``checkpoint.finetune``), this run's precision level and parameter dtype
(``precision.param_dtype=auto`` resumes as the checkpoint trained, whatever the device). The
parallel layout may differ: loading reshards (checkpoint/reshard.py).

Switching levels in place: when ``checkpoint.dir``'s own latest checkpoint cannot be resumed
at this run's level or parameter dtype (or holds weights only) and ``checkpoint.finetune`` is
set, the run fine-tunes from it: the same command that was refused works with
``checkpoint.finetune=true`` added, as the refusal says. Before loading, the build moves the
directory's checkpoints (``iter_*`` and ``latest``) into a subdirectory named after their
level (``checkpoint.dir/te``, a checkpoints directory of its own that ``checkpoint.load``
reads), so the fine-tune's own checkpoints, which count from iteration 0, neither overwrite
nor prune them; ``checkpoint.dir/finetuned_from`` names the one fine-tuned from, and a
restart before the fine-tune's first save starts from it again (``set_aside``).
"""

from __future__ import annotations

import dataclasses
import os
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
from training.finetune_defaults import FREE_MODEL_FIELDS
from training.run_plan import ResumePlan

__all__ = [
    "FINETUNED_FROM",
    "find_resume",
    "set_aside",
    "read_resume_metadata",
    "resume_plan",
    "check_compatible",
    "resumed_param_dtype",
    "saved_param_dtype",
    "FREE_MODEL_FIELDS",
]


# In checkpoint.dir: "<subdirectory>/<iter_*>", the checkpoint of another level a fine-tune
# started from after moving it there (``set_aside``).
FINETUNED_FROM = "finetuned_from"


def _set_aside_source(directory: Path) -> tuple[str, Path] | None:
    """``(subdirectory, checkpoint)`` that ``FINETUNED_FROM`` names, where the checkpoint is
    now: in the subdirectory, or still in ``directory`` (a move that was interrupted)."""
    try:
        archive, _, name = (directory / FINETUNED_FROM).read_text().strip().partition("/")
    except OSError:
        return None
    for path in (directory / archive / name, directory / name):
        if archive and name.startswith("iter_") and (path / "metadata.json").exists():
            return archive, path
    return None


def _own_checkpoint(directory: Path) -> Path | None:
    """The latest checkpoint of ``directory``; without one (a fine-tune of another level
    that has not saved yet, ``set_aside``), the checkpoint it started from."""
    latest = latest_checkpoint(directory)
    if latest is not None:
        return latest
    source = _set_aside_source(directory)
    return source[1] if source else None


def find_resume(cfg: Config) -> tuple[Path | None, bool]:
    """``(checkpoint or None, weights only?)``: the run's own latest checkpoint first, else
    ``checkpoint.load`` (a checkpoint, or a checkpoints directory: its latest)."""
    own_dir = Path(cfg.resolved_checkpoint_dir())
    try:
        own = _own_checkpoint(own_dir) if cfg.checkpoint.resume else None
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
    saved = read_resume_metadata(path, cfg.family)
    if weights_only or not cfg.checkpoint.finetune or _level_problem(cfg, saved, path) is None:
        return ResumePlan(path, weights_only, saved)
    # The run's own checkpoint, of another level or parameter dtype (or weights only), and
    # checkpoint.finetune set: fine-tune from it, its directory's checkpoints moved aside.
    own_dir = Path(cfg.resolved_checkpoint_dir())
    archive = _archive_name(own_dir, saved, path) if path.parent == own_dir else None
    return ResumePlan(path, True, saved, set_aside=archive)


def _archive_name(directory: Path, saved: dict, path: Path) -> str:
    """Where ``set_aside`` moves ``directory``'s checkpoints: a subdirectory named after
    their level (``te``, else ``te_2``, ...), or the one an interrupted move was filling."""
    level = saved.get("config", {}).get("precision", {}).get("level", "previous")
    source = _set_aside_source(directory)
    if source is not None and source[1] == path and source[0].split("_")[0] == level:
        return source[0]
    name, n = level, 1
    while (directory / name).exists():
        n += 1
        name = f"{level}_{n}"
    return name


def _replace_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def set_aside(directory: str | os.PathLike, archive: str, name: str) -> Path:
    """Move the checkpoints of checkpoints directory ``directory`` (``iter_*`` and
    ``latest``, which names ``name``) into its subdirectory ``archive``, a checkpoints
    directory of its own; returns where checkpoint ``name`` now is. ``FINETUNED_FROM`` names
    it first, and ``latest`` goes before ``name`` moves, so a run restarted at any moment
    finds it (``_own_checkpoint``). Rank 0, before any rank loads (training/setup.py)."""
    root = Path(directory)
    target = root / archive
    target.mkdir(exist_ok=True)
    _replace_text(root / FINETUNED_FROM, f"{archive}/{name}\n")
    for path in sorted(root.glob("iter_*")):
        if path.name != name and not (target / path.name).exists():
            os.replace(path, target / path.name)
    _replace_text(target / "latest", f"{name}\n")
    (root / "latest").unlink(missing_ok=True)
    if (root / name).exists():
        os.replace(root / name, target / name)
    return target / name


def check_compatible(
    family, cfg: Config, model_config: Any, saved: dict, path, weights_only: bool
) -> None:
    """A checkpoint must hold this run's model and, unless ``weights_only``, its precision
    level and parameter dtype; the first differing key is named. ``model_config``: this run's
    built model config (``family.model_config``); None when it is not known yet (the
    pre-flight before the default corpus is built): the model is then compared when the run
    loads."""
    if saved.get("weights_only") and not weights_only:
        raise ConfigError(_level_problem(cfg, saved, path))
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
    problem = _level_problem(cfg, saved, path)
    if problem:
        raise ConfigError(problem)


def _level_problem(cfg: Config, saved: dict, path) -> str | None:
    """Why checkpoint ``path`` (metadata ``saved``) cannot be continued by ``cfg`` with its
    optimizer state, in one line ending with what to set (``checkpoint.finetune=true``
    works as printed, from ``checkpoint.load`` or the run's own directory); None if it can."""
    if saved.get("weights_only"):
        return (
            f"config: checkpoint {path} holds model weights only ({saved['weights_only']}): "
            "start from it with checkpoint.finetune=true"
        )
    old_level = saved["config"]["precision"]["level"]
    if old_level != cfg.precision.level:
        return (
            f"config: precision.level={cfg.precision.level} but checkpoint {path} has "
            f"{old_level}; take only its weights with checkpoint.finetune=true (the optimizer "
            "state of one level does not convert to another's)"
        )
    # "auto" resumes as the checkpoint trained (``resumed_param_dtype``); a value set must be
    # the one it trained with.
    asked = cfg.precision.param_dtype
    if asked == "auto":
        return None
    trained = saved_param_dtype(saved)
    if get_recipe(old_level, trained) != get_recipe(old_level, asked):
        return (
            f"config: precision.param_dtype={asked} but checkpoint {path} was trained with "
            f"{trained} parameters: set precision.param_dtype={trained} (or auto, which resumes "
            "as the checkpoint trained), or take only its weights with checkpoint.finetune=true "
            "(FP32 masters exist for BF16 parameters only)"
        )
    return None


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

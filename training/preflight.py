"""Pre-flight: everything a run's config and its world size let us check before any worker
starts or any process group exists, each problem one line naming the key or file.

- the parallel layout and the batch split for the world size (training/run_plan.py), and a
  ``parallel.backend`` this machine has (nccl needs CUDA);
- ``logging.dir`` and ``checkpoint.dir`` can be created and written (nothing is created),
  and no running job holds ``checkpoint.dir`` (training/run_lock.py);
- the family's data: files present and in their format, the tokenizer loads, caches can be
  written (``ModelFamily.preflight``; the default corpus still to be built is no error);
- a checkpoint to resume (``checkpoint.dir``'s latest, else ``checkpoint.load``): present,
  of this format version and family, the same model and precision level (unless
  ``checkpoint.finetune``), every model and optimizer file there with a readable header, so
  that it can be resharded to this layout.

It runs twice, both times before any worker touches a process group: in the launcher
(``python -m training.launcher``, what ``make train`` runs) before torchrun starts a worker,
and at the start of every worker (training/entry_point.py), so plain ``torchrun`` fails fast too.
Reads only: headers, ``stat``s, the tokenizer; never the data or a tensor.
"""

from __future__ import annotations

import os
from dataclasses import replace

from checkpoint.store import CheckpointError
from data.paths import check_directory
from families import get_family
from fp8train import device as devices
from parallel.topology import TopologyError
from training.config import Config, ConfigError, load_config
from training.resume_check import check_compatible, resume_plan
from training.run_lock import run_lock_problem
from training.run_plan import ResumePlan, RunPlan, plan_parallel

__all__ = ["PREFLIGHT_ERRORS", "preflight", "check_run"]

# What a failed pre-flight raises; each message is one line.
PREFLIGHT_ERRORS = (ConfigError, TopologyError, CheckpointError)


def _check_directories(cfg: Config) -> None:
    checkpoint_key = (
        "checkpoint.dir" if cfg.checkpoint.dir else "checkpoint.dir (logging.dir/checkpoints)"
    )
    for key, path in (
        ("logging.dir", cfg.logging.dir),
        (checkpoint_key, cfg.resolved_checkpoint_dir()),
    ):
        try:
            check_directory(key, path)
        except ValueError as err:
            raise ConfigError(f"config: {err}") from None
    # A live job on the directory: say so before reading its checkpoints (it may be
    # pruning the one its latest named a moment ago).
    held = run_lock_problem(cfg.resolved_checkpoint_dir())
    if held:
        raise CheckpointError(held)


def _check_backend(cfg: Config) -> None:
    # A worker finds out only once torchrun has started every rank, and the agent then ends
    # the others with SIGTERM: exit 1 and "exited with code -15" instead of one line.
    if cfg.parallel.backend == "nccl" and not devices.is_cuda():
        raise ConfigError(
            "config: parallel.backend=nccl needs CUDA, and this machine has none: set "
            "parallel.backend=gloo (or auto: nccl on CUDA, gloo on the CPU)"
        )


def _check_checkpoint(
    cfg: Config, family, model_config, resume: ResumePlan | None
) -> ResumePlan | None:
    if resume is None:
        return None
    from checkpoint.reshard import SourceCheckpoint  # reads file headers only

    path = resume.path
    try:
        check_compatible(family, cfg, model_config, resume.metadata, path, resume.weights_only)
    except (KeyError, TypeError) as err:  # a metadata.json without the keys a save writes
        raise CheckpointError(f"{path / 'metadata.json'}: incomplete ({err!r} missing)") from None
    # Every model and optimizer file of its layout present, each header readable: what
    # resharding to any other layout reads.
    SourceCheckpoint(path)
    return resume


def preflight(cfg: Config, world_size: int | None) -> RunPlan | None:
    """Every check above for ``cfg`` on ``world_size`` ranks (None: not known yet, e.g. an
    elastic node range; the layout is then checked by each worker). Returns the run's plan
    (None without a world size), which the build takes as it is. Raises one of
    ``PREFLIGHT_ERRORS`` with a one-line message; writes nothing."""
    plan = plan_parallel(cfg, world_size) if world_size is not None else None
    _check_backend(cfg)
    _check_directories(cfg)
    family = get_family(cfg.family)
    # Found (and its metadata read) before the data: a fine-tune's tokenizer may come from
    # it, so a checkpoint.load that cannot be read is the problem to name first.
    resume = resume_plan(cfg)
    try:
        model_config = family.preflight(cfg)
    except ValueError as err:  # the family's messages start with the config key
        raise ConfigError(f"config: {err}") from None
    except OSError as err:  # e.g. a data file it may not read: the message names the file
        raise ConfigError(f"config: data: {err}") from None
    resume = _check_checkpoint(cfg, family, model_config, resume)
    return None if plan is None else replace(plan, resume=resume)


def check_run(
    config: str | os.PathLike, overrides: list[str], family: str, world_size: int | None
) -> tuple[Config, RunPlan | None]:
    """Load the config of a ``family`` run and pre-flight it: ``(config, plan)``."""
    cfg = load_config(os.fspath(config), overrides, family)
    return cfg, preflight(cfg, world_size)

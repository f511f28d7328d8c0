"""The run's checkpointer: what this rank saves (``checkpoint_files``), its saver, and restore
on resume, resharding on load when another layout wrote the checkpoint; the saved run config
of a checkpoint (``checkpoint_config``).

The format, naming, atomic publication, background writing and resharding themselves live in
the ``checkpoint`` package, which knows no model, family or config: this module is where they
meet a run (``training.setup.RunState``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from checkpoint.async_writer import CheckpointSaver
from checkpoint.format import (
    CheckpointError,
    JsonObject,
    is_fp8_scaling_state,
    optimizer_layouts,
)
from checkpoint.reshard import (
    SourceCheckpoint,
    Target,
    describe,
    layout_of,
    optimizer_targets,
    reshard,
)
from checkpoint.store import (
    fp8_replica_file,
    load_checkpoint,
    model_file,
    optimizer_file,
    restore_rng,
)
from families.base import checkpoint_family
from training.config import ConfigError, config_from_dict, config_to_dict
from training.resume_check import check_compatible
from training.run_plan import ResumePlan
from training.setup import RunState

__all__ = [
    "checkpoint_config",
    "checkpoint_files",
    "make_saver",
    "restore",
]


def checkpoint_config(metadata: JsonObject, sections: tuple[str, ...] | None = None):
    """The run config (``training.config.Config``) a checkpoint was saved with: its
    metadata's ``config`` of its ``family``, complete in its ``model`` section (a model key
    left to its default would build another model than the tensors') and checked as a run's
    config is; ``sections``: only those (the others at their defaults), e.g. ``("model",)``
    for a reader that only builds the model. A problem is one ``CheckpointError`` naming
    metadata.json and the key."""
    family = checkpoint_family(metadata)
    saved = metadata["config"]
    for field in dataclasses.fields(family.model_section):
        saved["model"].need(field.name, object, why="the model is built from it")
    try:
        return config_from_dict(
            saved if sections is None else {name: saved[name] for name in sections}, family.name
        )
    except ConfigError as err:
        raise CheckpointError(f"{metadata.file}: {err}") from None


def _layout_now(state: RunState) -> dict:
    plan = state.plan
    return {
        "tensor": plan.tensor,
        "pipeline": plan.pipeline,
        "virtual_pipeline": plan.virtual_stages,
        "data": plan.data,
        "distributed": state.optimizer.distributed,
    }


def restore(state: RunState, resume: ResumePlan, *, log: Callable[[str], None]) -> tuple[int, int]:
    """Load the checkpoint the run resumes from (its metadata read and checked by the plan)
    into ``state``: every tensor this rank holds, cut from another layout's files when another
    layout wrote it (``log`` says so), or only the weights (``resume.weights_only``: a
    fine-tune). Returns ``(iteration, consumed samples)``: ``(0, 0)`` for a fine-tune."""
    topo, path, metadata = state.groups.topology, resume.path, resume.metadata
    # The plan compared the model before it was built (maybe not at all: the default corpus
    # was not built yet); the built model config is compared here.
    weights_only = resume.weights_only
    check_compatible(state.family, state.cfg, state.model_config, metadata, path, weights_only)
    if weights_only:
        _load_weights(state, path)
        return 0, 0
    saved, now = layout_of(metadata), _layout_now(state)
    if saved != now:
        _restore_resharded(state, path)
        log(f"resharded {path} from {describe(saved)} to {describe(now)}")
    else:
        replica = _replica_state_file(state)
        names = (model_file(topo), optimizer_file(topo, state.optimizer.distributed))
        ckpt = load_checkpoint(path, topo.rank, names + ((replica,) if replica else ()))
        model_state = ckpt.files[names[0]]
        if replica:  # this replica's own FP8 scaling state over the replicated one
            model_state = {**model_state, **ckpt.files[replica]}
        state.model.load_canonical_state_dict(model_state)
        state.optimizer.load_state_tensors(ckpt.files[names[1]])
        if ckpt.rng:
            restore_rng(ckpt.rng, state.device)
    state.scheduler.load_state_dict(metadata["scheduler"])
    state.scaler.load_state_dict(metadata["loss_scaler"])
    state.resumed_counters = metadata.get("counters", {})
    return metadata["iteration"], metadata["consumed_samples"]


def _load_weights(state: RunState, path) -> None:
    """The checkpoint's parameters only, in this run's layout and storage (scaled FP16/FP8
    weights re-quantised from their FP32 values when the level differs); FP8 scaling state,
    optimizer, scheduler and loss scaler stay fresh."""
    source = SourceCheckpoint(path)
    model = state.model
    layouts = model.tensor_layouts()
    names = model.canonical_parameter_names()
    params = set(names.values())
    local = model.canonical_state_dict()
    targets = {name: Target(layouts[name], tuple(local[name].shape), local[name].dtype)
               for name in params}  # fmt: skip
    # O3's FP8 weights come as FP32 values (a finer checkpoint's, unrounded) and are stored by
    # their linear, which keeps the FP16 rounding for the master to start from: a master made
    # from the FP8 weight would hold it still for the first steps (fp8train.param_state).
    fp8 = {names[id(m.weight)]: m for _, m in model.linear_modules()
           if m.lowered and m.recipe.weight == "fp8"}  # fmt: skip
    for name in fp8:
        layout = {k: v for k, v in layouts[name].items() if k not in ("scale_inv", "scale_block")}
        targets[name] = Target(layout, tuple(local[name].shape), torch.float32)
    loaded = reshard(source, "model", targets)
    values = {name: loaded.pop(name) for name in fp8}
    model.load_canonical_state_dict(loaded, partial=True)
    for name, linear in fp8.items():
        linear.assign_weight(values[name])
    # Masters and O3's FP16 masters start from the loaded weights.
    state.optimizer.reset_masters()


def _restore_resharded(state: RunState, path) -> None:
    """Another layout wrote ``path``: cut this rank's tensors out of it. The RNG streams
    (dropout) restart from the seed: they belong to the ranks that wrote them. Every
    replica takes the model file's FP8 scaling state (data-parallel rank 0's)."""
    source = SourceCheckpoint(path)
    model = state.model
    layouts = model.tensor_layouts()
    targets = {
        name: Target(layouts[name], tuple(v.shape), v.dtype)
        for name, v in model.canonical_state_dict().items()
    }
    model.load_canonical_state_dict(reshard(source, "model", targets))
    opt = state.optimizer
    wanted = optimizer_targets(source, opt.stepped_names(), targets)
    opt.load_state_tensors(reshard(source, "optimizer", wanted))


def checkpoint_files(state: RunState, consumed: int, counters: dict) -> tuple[dict, dict]:
    """``(files, metadata)`` of a checkpoint now: the files THIS rank writes (file name ->
    (tensors, layouts); the live tensors, not copies) and the metadata."""
    topo, model, opt = state.groups.topology, state.model, state.optimizer
    config = config_to_dict(state.cfg)
    # What the run resolved, never "auto" (whose meaning depends on the device): a resume, a
    # conversion and every other reader of the saved config build what was trained.
    config["precision"]["param_dtype"] = state.recipe.other_params
    meta = {
        "config": config,
        "family": state.family.name,
        "model_structure": state.family.checkpoint_structure(state.model_config, state.data),
        "consumed_samples": consumed,
        "scheduler": state.scheduler.state_dict(),
        "loss_scaler": state.scaler.state_dict(),
        "fp8_gemm_backend": state.gemm_backend,
        "world_size": topo.world_size,
        "counters": counters,
    }
    # Canonical names and layouts (checkpoint/format.py); one writer per file.
    model_state, layouts = model.canonical_state_dict(), model.tensor_layouts()
    files = {}
    if topo.dp_rank == 0:
        files[model_file(topo)] = (model_state, layouts)
    if opt.distributed or topo.dp_rank == 0:
        tensors = opt.state_tensors()
        shapes = {name: tuple(p.shape) for name, p in opt.param_names.items()}
        files[optimizer_file(topo, opt.distributed)] = (
            tensors,
            optimizer_layouts(tensors, layouts, shapes),
        )
    replica = _replica_state_file(state)
    if replica:
        scaling = {k: v for k, v in model_state.items() if is_fp8_scaling_state(k)}
        files[replica] = (scaling, layouts)
    return files, meta


def make_saver(state: RunState, log: Callable[[str], None]) -> CheckpointSaver:
    """The run's saver (synchronous or in the background, ``checkpoint.async_save``)."""
    ckpt = state.cfg.checkpoint
    return CheckpointSaver(
        state.cfg.resolved_checkpoint_dir(),
        device=state.device,
        rank=state.groups.topology.rank,
        keep_last=ckpt.keep_last,
        asynchronous=ckpt.async_save,
        log=log,
    )


def _replica_state_file(state: RunState) -> str | None:
    """Per data-parallel rank: its FP8 scaling state (amax histories, scales). Replicas see
    different data, so their delayed-scaling histories differ; the model file holds rank 0's."""
    topo = state.groups.topology
    if topo.data == 1 or not state.recipe.fp8_gemm:
        return None
    return fp8_replica_file(topo)

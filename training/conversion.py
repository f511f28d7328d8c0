"""Checkpoint conversion: native -> native in any layout, Hugging Face -> native, native ->
Hugging Face (tools/convert_checkpoint.py is the command line).

Native -> native writes, for every model slice of the target layout, exactly the files a run
of that layout saves, cut out of the source by ``checkpoint/reshard.py`` (the code a resumed
run uses). What each slice holds is read off the slice itself, built on the meta device with
a ``PlannedGroup`` standing in for its tensor-parallel group: no process is started and no
weight is allocated. Each file is written one tensor at a time
(``write_tensors_streaming``), so memory holds a few tensors, not the model.

Hugging Face -> native goes through the family's adapter (``ModelFamily.import_hf``) to a
one-slice, weights-only FP32 checkpoint, then through the same conversion to the target
layout. Such a checkpoint starts a run with ``checkpoint.finetune=true`` at any level.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint.format import (
    FORMAT_VERSION,
    is_fp8_scaling_state,
    slice_suffix,
    write_tensors,
    write_tensors_streaming,
)
from checkpoint.reshard import SourceCheckpoint, Target, optimizer_targets, reshard_iter
from checkpoint.store import (
    CheckpointError,
    SaveTarget,
    publish_written,
    read_metadata,
    resolve_checkpoint,
)
from data.paths import output_folder
from families.base import ModelFamily, checkpoint_family, family_for_hf_directory
from fp8train.convert import apply_level_storage
from models.context import BuildContext
from models.gpt import pad_vocab_size
from parallel.pipeline.layout import PipelineLayout
from parallel.tensor_parallel.mappings import PlannedGroup
from training.checkpointer import checkpoint_config
from training.config import config_from_dict, config_to_dict
from training.optimizer import parameter_owners, trainable_parameters
from training.tokenizer_files import FOLDER as TOKENIZER_FOLDER
from training.tokenizer_files import copy_tokenizer_files, export_tokenizer

__all__ = [
    "Layout",
    "detect_kind",
    "convert_native",
    "import_hf",
    "export_hf",
    "plan_slice",
    "slice_targets",
]

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Layout:
    """A parallel layout to write: sizes, and whether optimizer state is sharded over the
    data-parallel ranks (the distributed optimizer)."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int = 1
    data: int = 1
    distributed: bool = False

    def __post_init__(self):
        for key in ("tensor", "pipeline", "virtual_pipeline", "data"):
            if getattr(self, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} must be at least 1")


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def detect_kind(path: str | Path) -> str:
    """ "hf" (config.json and safetensors), "native" (a checkpoint or checkpoints directory);
    anything else raises naming the path."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such directory")
    if (path / "config.json").exists():
        if not any(path.glob("*.safetensors")):
            raise CheckpointError(f"{path}: config.json but no *.safetensors weights")
        return "hf"
    resolve_checkpoint(path)  # raises naming the path when it is neither
    return "native"


def plan_slice(
    family: ModelFamily, model_config, cfg, layout: Layout, tp_rank: int, pp_rank: int
) -> torch.nn.Module:
    """Model slice (``tp_rank``, ``pp_rank``) of ``layout`` for ``cfg``'s level, on the meta
    device: its names, shapes, dtypes and layouts, no storage."""
    recipe = cfg.precision.recipe()
    group = PlannedGroup(layout.tensor, tp_rank) if layout.tensor > 1 else None
    ctx = BuildContext(
        recipe,
        device="meta",
        tp_group=group,
        sequence_parallel=cfg.parallel.sequence_parallel and layout.tensor > 1,
        materialize=False,
    )
    pipeline = PipelineLayout(
        model_config.num_layers, layout.pipeline, layout.virtual_pipeline, pp_rank
    )
    model = family.build_model(model_config, ctx, pipeline)
    return apply_level_storage(model, recipe)


def slice_targets(model) -> dict[str, Target]:
    layouts = model.tensor_layouts()
    return {
        name: Target(layouts[name], tuple(v.shape), v.dtype)
        for name, v in model.canonical_state_dict().items()
    }


def _target_metadata(meta: dict, family: ModelFamily, layout: Layout) -> tuple[dict, object]:
    """The converted checkpoint's metadata and validated config: the source's with the new
    layout (checked like a run's config: heads, groups and layers must split evenly)."""
    cfg_dict = copy.deepcopy(meta["config"])
    parallel = cfg_dict["parallel"]
    parallel.update(
        tensor=layout.tensor,
        pipeline=layout.pipeline,
        virtual_pipeline=layout.virtual_pipeline if layout.virtual_pipeline > 1 else None,
    )
    parallel["sequence_parallel"] = bool(parallel.get("sequence_parallel")) and layout.tensor > 1
    cfg_dict["optimizer"]["distributed"] = layout.distributed
    cfg = config_from_dict(cfg_dict, family.name)
    out = copy.deepcopy(meta)
    out["config"] = config_to_dict(cfg)
    out["world_size"] = layout.tensor * layout.pipeline * layout.data
    structure = out.get("model_structure", {})
    padded, vocab = structure.get("padded_vocab_size"), structure.get("vocab_size")
    if padded is not None and padded % layout.tensor:  # re-pad (reshard zero-fills/drops rows)
        divisible = cfg_dict["model"].get("make_vocab_size_divisible_by", 128)
        structure["padded_vocab_size"] = pad_vocab_size(vocab, divisible, layout.tensor)
    return out, cfg


def _counted(items: Iterator, file: str, total: int, progress: Progress) -> Iterator:
    for i, (name, tensor) in enumerate(items, 1):
        progress(f"  {file} [{i}/{total}] {name} {tuple(tensor.shape)} {_short(tensor.dtype)}")
        yield name, tensor


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _write(path: Path, targets: dict[str, Target], stream: Iterator, progress: Progress) -> None:
    specs = {name: (t.shape, t.dtype) for name, t in targets.items()}
    layouts = {name: t.layout for name, t in targets.items()}
    write_tensors_streaming(path, specs, layouts, _counted(stream, path.name, len(specs), progress))


def convert_native(
    source_path: str | Path, output: str | Path, layout: Layout, progress: Progress = _stderr
) -> Path:
    """Write checkpoint ``source_path`` (any layout) as ``layout`` into checkpoints directory
    ``output`` (``iter_*`` + ``latest``, as a run writes them). Returns the checkpoint path.
    Every source file's header is checked before ``output`` is made (``SourceCheckpoint``);
    a failure after that leaves ``output`` as it was (absent or empty)."""
    source = SourceCheckpoint(resolve_checkpoint(source_path))
    meta = source.metadata
    family = checkpoint_family(meta)
    checkpoint_config(meta)  # the saved config: a damaged one is named before the new layout's
    new_meta, cfg = _target_metadata(meta, family, layout)
    model_config = family.config_from_checkpoint(new_meta)
    weights_only = bool(meta.get("weights_only"))
    recipe = cfg.precision.recipe()
    with output_folder(output, owned=True) as root:
        target = SaveTarget.of(root, meta["iteration"])  # a run's naming and publication
        tmp = target.tmp
        tmp.mkdir()
        for pp_rank in range(layout.pipeline):
            for tp_rank in range(layout.tensor):
                model = plan_slice(family, model_config, cfg, layout, tp_rank, pp_rank)
                suffix = slice_suffix(tp_rank, layout.tensor, pp_rank, layout.pipeline)
                targets = slice_targets(model)
                if weights_only:  # no FP8 scaling state to carry: the loader keeps it fresh
                    params = set(model.canonical_parameter_names().values())
                    scales = {t.layout["scale_inv"] for n, t in targets.items() if n in params
                              and t.layout.get("scale_inv")}  # fmt: skip
                    targets = {n: t for n, t in targets.items() if n in params | scales}
                model_path = tmp / f"model{suffix}.safetensors"
                _write(model_path, targets, reshard_iter(source, "model", targets), progress)
                if weights_only:
                    continue
                _write_optimizer(source, model, targets, tmp, suffix, layout, progress)
                if layout.data > 1 and recipe.fp8_gemm:
                    scaling = {n: t for n, t in targets.items() if is_fp8_scaling_state(n)}
                    for d in range(layout.data):  # every replica starts from the same state
                        path = tmp / f"fp8_scaling{suffix}_dp{d}.safetensors"
                        _write(path, scaling, reshard_iter(source, "model", scaling), progress)
        copy_tokenizer_files(source.path / TOKENIZER_FOLDER, tmp / TOKENIZER_FOLDER)
        (tmp / "metadata.json").write_text(json.dumps(new_meta, indent=2, sort_keys=True))
        publish_written(target)
    return target.final


def _write_optimizer(source, model, targets, directory: Path, suffix, layout, progress) -> None:
    params = trainable_parameters(model)
    names = model.canonical_parameter_names()
    param_names = [names[id(p)] for p in params]
    if layout.distributed and layout.data > 1:
        owners = parameter_owners(model, params, layout.data)
        groups = {f"_dp{d}": [n for n, o in zip(param_names, owners) if o == d]
                  for d in range(layout.data)}  # fmt: skip
    else:
        groups = {"": param_names}
    for dp_suffix, owned in groups.items():
        wanted = optimizer_targets(source, owned, targets)
        path = directory / f"optimizer{suffix}{dp_suffix}.safetensors"
        _write(path, wanted, reshard_iter(source, "optimizer", wanted), progress)


def import_hf(
    directory: str | Path,
    output: str | Path,
    layout: Layout,
    divisible_by: int = 128,
    progress: Progress = _stderr,
) -> Path:
    """A Hugging Face model directory as a weights-only native checkpoint in ``layout``."""
    directory = Path(directory)
    family = family_for_hf_directory(directory)
    imported = family.import_hf(directory, divisible_by)
    cfg = config_from_dict(
        {"model": imported.model_section, "precision": {"level": "fp32"}}, family.name
    )
    meta = {
        "config": config_to_dict(cfg),
        "family": family.name,
        "model_structure": imported.structure,
        "iteration": 0,
        "consumed_samples": 0,
        "world_size": 1,
        "counters": {},
        "format_version": FORMAT_VERSION,
        "weights_only": f"imported from Hugging Face {directory.resolve()}",
    }
    with tempfile.TemporaryDirectory(prefix="fp8train_import_") as tmp:
        # The model's tokenizer (or image processor) travels with it.
        copy_tokenizer_files(directory, Path(tmp) / TOKENIZER_FOLDER)
        write_tensors(Path(tmp) / "model.safetensors", imported.tensors, {})
        (Path(tmp) / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        return convert_native(tmp, output, layout, progress)


def export_hf(source_path: str | Path, output: str | Path, progress: Progress = _stderr) -> Path:
    """A native checkpoint (any layout, any level) as a Hugging Face model directory, with
    the run's tokenizer beside it where one is found (training/tokenizer_files.py), or the
    family's own input files (ViT: ``preprocessor_config.json``, ``HFAdapter.write_inputs``). The
    metadata and every model file's header are checked before ``output`` is made; a failure
    after that leaves ``output`` as it was (absent or empty)."""
    checkpoint = resolve_checkpoint(source_path)
    meta = read_metadata(checkpoint)
    SourceCheckpoint(checkpoint, kinds=("model",))  # what the export reads: refused here
    checkpoint_config(meta, ("model",))
    family = checkpoint_family(meta)
    adapter = family.hf_adapter
    with output_folder(output, owned=True) as root:
        out = family.export_hf(checkpoint, root)
        carried = export_tokenizer(checkpoint, meta, out, family.control_symbols, adapter.inputs)
        # A family's own input files (ViT: its image processor) where none were carried.
        progress(adapter.write_inputs(meta, out) or carried)
    return out

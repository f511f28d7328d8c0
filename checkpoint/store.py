"""Checkpoints: safetensors tensors + JSON metadata, written to a temporary directory and renamed.

The tensors are in the canonical format of ``checkpoint/format.py`` (single-process
names whatever the layout, per-tensor layouts in each file's header, optimizer state keyed by
parameter name). Layout of ``checkpoint.dir``::

    latest                    one line: the name of the newest complete checkpoint
    iter_0000100/
        model{slice}.safetensors      model state (FP8 scaling buffers included), one per
                                      model slice, written by data-parallel rank 0
        optimizer{slice}.safetensors  optimizer states and masters, likewise; with the
                                      distributed optimizer every data-parallel rank writes
                                      optimizer{slice}_dp{d}.safetensors (what it owns)
        fp8_scaling{slice}_dp{d}.safetensors  each data-parallel replica's FP8 scaling state
                                      (amax histories differ between replicas: different data)
        rng_rank{r}.safetensors       each rank's RNG states (dropout streams differ per rank)
        metadata.json                 config, iteration, consumed samples, scheduler, loss
                                      scaler, model structure, format version

``{slice}`` names a rank's model slice (``slice_name``): empty for one process, ``_tp1``,
``_pp0``, ``_tp1_pp0``. Nothing is ever unpickled: tensors come back through safetensors, the
rest through JSON. Files are flushed to disk before a checkpoint is published, and ``latest``
names a complete checkpoint at every moment (``save_checkpoint``): a crash mid-save leaves
the previous checkpoint current and a ``.tmp_*`` directory that the next save replaces.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.format import (
    FORMAT_VERSION,
    CheckpointError,
    JsonObject,
    load_safetensors,
    read_json,
    save_safetensors,
    slice_suffix,
    write_tensors,
)

__all__ = [
    "CheckpointError",
    "slice_name",
    "model_file",
    "optimizer_file",
    "fp8_replica_file",
    "save_checkpoint",
    "SaveTarget",
    "RankFiles",
    "begin_save",
    "rank_files",
    "snapshot_tensors",
    "write_rank_files",
    "publish_save",
    "publish_written",
    "load_checkpoint",
    "latest_checkpoint",
    "read_metadata",
    "resolve_checkpoint",
    "check_format",
]


@dataclass
class LoadedCheckpoint:
    path: Path
    metadata: dict
    files: dict[str, dict[str, torch.Tensor]]  # the requested files' tensors, by file name
    rng: dict[str, torch.Tensor]


def slice_name(topo) -> str:
    """A rank's model slice in file names: ``""``, ``_tp1``, ``_pp0``, ``_tp1_pp0``."""
    return slice_suffix(topo.tp_rank, topo.tensor, topo.pp_rank, topo.pipeline)


def model_file(topo) -> str:
    return f"model{slice_name(topo)}.safetensors"


def optimizer_file(topo, distributed: bool) -> str:
    """The replicated optimizer file of a slice, or a data-parallel rank's own shard."""
    suffix = f"_dp{topo.dp_rank}" if distributed else ""
    return f"optimizer{slice_name(topo)}{suffix}.safetensors"


def fp8_replica_file(topo) -> str:
    return f"fp8_scaling{slice_name(topo)}_dp{topo.dp_rank}.safetensors"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _own_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings): store private copies.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def rng_state_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    # Imported here: reading or checking checkpoint files must not pull in model code.
    from fp8train import device as devices
    from parallel.tensor_parallel.random import get_tracker

    out = {"torch_cpu": torch.get_rng_state()}
    accel = devices.rng_state(device)
    if accel is not None:
        out["torch_device"] = accel
    # The tensor-parallel dropout streams (empty without TP).
    out.update({f"tracker.{k}": v for k, v in get_tracker().get_states().items()})
    return out


def restore_rng(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    from fp8train import device as devices
    from parallel.tensor_parallel.random import get_tracker

    torch.set_rng_state(tensors["torch_cpu"])
    if "torch_device" in tensors:
        devices.set_rng_state(tensors["torch_device"], device)
    tracked = {k[len("tracker.") :]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracked:
        get_tracker().set_states(tracked)


def save_checkpoint(
    directory: str | os.PathLike,
    iteration: int,
    *,
    files: dict[str, tuple[dict[str, torch.Tensor], dict]],
    metadata: dict,
    device: torch.device,
    rank: int,
    keep_last: int = 2,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    ``files``: file name -> (tensors, their layouts) that THIS rank writes (the caller picks:
    one writer per file, see the module doc); each rank also writes its RNG states.

    Crash safety: every file is flushed to disk (fsync) before the directory is published,
    and ``latest`` names a complete checkpoint at every moment, a re-save of the iteration it
    names included (``_publish``); a kill at any point leaves the previous or the new one.
    The three phases (``begin_save``, ``write_rank_files``, ``publish_save``) are also what
    ``checkpoint/async_writer.py`` runs, with the writing on a background thread.
    """
    target = begin_save(directory, iteration, rank)
    write_rank_files(rank_files(target, files, metadata, device, rank, copy=False))
    _barrier()  # every rank's files are on disk
    publish_save(target, rank, keep_last)
    return target.final


@dataclass(frozen=True)
class SaveTarget:
    """Where one checkpoint is written (``tmp``) and published (``final``) under ``root``."""

    root: Path
    tmp: Path
    final: Path

    @property
    def iteration(self) -> int:
        return int(self.final.name.removeprefix("iter_"))

    @classmethod
    def of(cls, directory: str | os.PathLike, iteration: int) -> SaveTarget:
        """The naming: ``iter_{iteration:07d}``, written as ``.tmp_iter_...`` beside it."""
        root = Path(directory)
        name = f"iter_{iteration:07d}"
        return cls(root, root / f".tmp_{name}", root / name)


@dataclass
class RankFiles:
    """What one rank writes into one checkpoint: its tensor files, its RNG states and (rank 0)
    the metadata as JSON text, all fixed at the save's iteration."""

    target: SaveTarget
    files: dict[str, tuple[dict[str, torch.Tensor], dict]]
    rng: dict[str, torch.Tensor]
    rank: int
    metadata_json: str | None


def begin_save(directory: str | os.PathLike, iteration: int, rank: int) -> SaveTarget:
    """Collective, first phase of a save: rank 0 finishes or clears what killed saves left
    (``_recover``) and makes a fresh temporary directory, which every rank then writes into.
    No save may be in flight: ``_recover`` removes every ``.tmp_*`` directory."""
    target = SaveTarget.of(directory, iteration)
    root = target.root
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        shutil.rmtree(target.tmp, ignore_errors=True)
        target.tmp.mkdir()
    _barrier()
    return target


def rank_files(
    target: SaveTarget,
    files: dict[str, tuple[dict[str, torch.Tensor], dict]],
    metadata: dict,
    device: torch.device,
    rank: int,
    *,
    copy: bool,
) -> RankFiles:
    """This rank's part of the checkpoint, taken now: the RNG states and the metadata (as
    JSON text: the caller may change its dicts afterwards). ``copy``: the tensors as private
    host copies (``snapshot_tensors``) that training may not touch while a background thread
    writes them; without it they are written from the live tensors before anything else runs."""
    meta = dict(metadata, iteration=target.iteration, format_version=FORMAT_VERSION)
    if copy:
        files = {name: (snapshot_tensors(t, device), lay) for name, (t, lay) in files.items()}
    return RankFiles(
        target=target,
        files=files,
        rng=_own_tensors(rng_state_tensors(device)),
        rank=rank,
        metadata_json=json.dumps(meta, indent=2, sort_keys=True) if rank == 0 else None,
    )


def snapshot_tensors(
    tensors: dict[str, torch.Tensor], device: torch.device
) -> dict[str, torch.Tensor]:
    """Private, contiguous host copies of ``tensors`` (never views: the optimizer step after
    the save must not change what is written; tied tensors get one copy each, as safetensors
    wants). From an accelerator the copies go into pinned memory without blocking, then one
    device synchronisation makes them all valid."""
    accelerator = device.type != "cpu"
    out = {}
    for name, value in tensors.items():
        value = value.detach()
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=accelerator)
        out[name] = host.copy_(value, non_blocking=accelerator)
    if accelerator:
        from fp8train import device as devices

        devices.synchronize(device)
    return out


def write_rank_files(part: RankFiles) -> None:
    """Second phase of a save, no collectives (it may run on a background thread): write this
    rank's files into the temporary directory and flush each to disk."""
    tmp = part.target.tmp
    written = []
    for file_name, (tensors, layouts) in part.files.items():
        write_tensors(tmp / file_name, tensors, layouts)
        written.append(tmp / file_name)
    rng_file = tmp / f"rng_rank{part.rank}.safetensors"
    save_safetensors(part.rng, rng_file)
    written.append(rng_file)
    if part.metadata_json is not None:
        (tmp / "metadata.json").write_text(part.metadata_json)
        written.append(tmp / "metadata.json")
    for path in written:
        _fsync(path)


def publish_save(target: SaveTarget, rank: int, keep_last: int) -> None:
    """Collective, last phase of a save, once every rank's files are on disk (the caller has
    agreed on that): rank 0 renames the directory into place, moves ``latest`` and prunes."""
    if rank == 0:
        _fsync(target.tmp)
        _publish(target.root, target.tmp, target.final)
        _prune(target.root, keep_last)
    _barrier()


def publish_written(target: SaveTarget) -> None:
    """One process's publication of a checkpoint written whole into ``target.tmp`` (a tool's
    output, e.g. a converted checkpoint): every file flushed to disk, then the rename and the
    ``latest`` move of a run's save (``publish_save``), so a crash leaves no pointer to a
    partial checkpoint."""
    for path in sorted(target.tmp.rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync(target.tmp)
    _publish(target.root, target.tmp, target.final)


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_pointer(root: Path, name: str) -> None:
    pointer = root / ".latest.tmp"
    pointer.write_text(name + "\n")
    _fsync(pointer)
    os.replace(pointer, root / "latest")
    _fsync(root)


def _publish(root: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` into place and point ``latest`` at it.

    A first save of an iteration: rename, then move the pointer (a kill in between leaves the
    pointer on the previous checkpoint). A re-save of an existing iteration (a run restarted
    from scratch into the same directory): the pointer first names ``tmp`` itself, then the old
    directory moves aside and ``tmp`` takes its name; ``latest_checkpoint`` follows a pointer
    to ``.tmp_NAME`` that no longer exists to ``NAME``, which it was renamed to, so the pointer
    names a complete checkpoint throughout.
    """
    if not final.exists():
        os.replace(tmp, final)
        _fsync(root)
        _write_pointer(root, final.name)
        return
    _write_pointer(root, tmp.name)
    old = root / f".old_{final.name}"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    os.replace(tmp, final)
    _fsync(root)
    _write_pointer(root, final.name)
    shutil.rmtree(old, ignore_errors=True)


def _recover(root: Path) -> None:
    """Finish a publication a kill interrupted (the pointer names a ``.tmp_`` directory), then
    drop the debris of killed saves; rank 0, before a new save writes anything."""
    pointer = root / "latest"
    name = pointer.read_text().strip() if pointer.exists() else ""
    if name.startswith(".tmp_"):
        tmp, final = root / name, root / name.removeprefix(".tmp_")
        if tmp.exists():
            _publish(root, tmp, final)
        elif final.exists():
            _write_pointer(root, final.name)
    # What is left is debris of killed saves: no pointer names it any more.
    for debris in [*root.glob(".old_iter_*"), *root.glob(".tmp_iter_*")]:
        shutil.rmtree(debris, ignore_errors=True)


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("iter_*") if (p / "metadata.json").exists())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or None when there is none yet. A pointer
    to ``.tmp_NAME`` (a re-save interrupted mid-publication, see ``_publish``) names that
    directory while it exists and ``NAME`` once it has been renamed."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {pointer}: {exc}") from None
    # One directory name in one line (a garbled pointer must not name the root, or print as
    # several lines).
    if not name.isprintable() or "/" in name or name in ("", ".", ".."):
        raise CheckpointError(f"{pointer} names no checkpoint directory ({name!r})")
    path = root / name
    if not path.exists() and name.startswith(".tmp_"):
        path = root / name.removeprefix(".tmp_")
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {path.name}, which does not exist")
    if not (path / "metadata.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which has no metadata.json")
    return path


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory itself, or the newest one a checkpoints directory's ``latest``
    names; anything else raises naming the path."""
    path = Path(path)
    if (path / "metadata.json").exists():
        return path
    found = latest_checkpoint(path) if path.is_dir() else None
    if found is None:
        raise CheckpointError(
            f"{path}: not a checkpoint (no metadata.json) nor a checkpoints directory (no latest)"
        )
    return found


# The kinds of metadata.json's values that readers use (``JsonObject.check``), checked where
# present: a key that is absent is named where it is needed. ``config``: what the tools read
# before (or without) checking the saved config (``training.checkpointer.checkpoint_config``):
# the layout and the tokenizer; ``model_structure``: what any family writes there
# (``checkpoint_structure``).
_METADATA_KINDS = {
    "family": str,
    "iteration": int,
    "consumed_samples": int,
    "world_size": int,
    "weights_only": str,
    "counters": dict,
    "scheduler": dict,
    "loss_scaler": dict,
    "config": {
        "parallel": {"tensor": int, "pipeline": int, "virtual_pipeline": (int, None)},
        "optimizer": {"distributed": bool},
        "model": dict,
        "data": {"corpus": str, "cache_dir": str, "vocab_size": int,
                 "tokenizer_model": (str, None), "tokenizer_type": str},
        "training": {"seed": int},
    },
    "model_structure": {
        "family": str, "fused": dict, "vocab_size": (int, None), "padded_vocab_size": int,
        "vocab_tensors": list, "token_ids": (dict, None), "padding_idx": int,
        "norm_position": str, "image_size": int, "patch_size": int, "num_channels": int,
        "num_classes": int, "classes": (list, None), "mean": (list, None), "std": (list, None),
    },
}  # fmt: skip


def read_metadata(path: str | os.PathLike) -> JsonObject:
    """The checkpoint's metadata.json. A missing or corrupt file raises naming it, as does a
    value of the wrong kind (``_METADATA_KINDS``), naming the key too; a key a reader needs
    and the file lacks raises where it is read (``JsonObject``). Whether a model family of
    that ``family`` exists is for the code that looks it up (``families.checkpoint_family``):
    this package knows no model."""
    metadata = read_json(Path(path) / "metadata.json")
    metadata.check(_METADATA_KINDS)
    return metadata


def check_format(path: str | os.PathLike, metadata: dict) -> None:
    """A checkpoint of another format version is refused in one line naming both versions."""
    found = metadata.get("format_version")
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"{Path(path) / 'metadata.json'}: checkpoint format version {found}; this version "
            f"of fp8train reads format {FORMAT_VERSION} (canonical tensor names) only"
        )


def load_checkpoint(path: str | os.PathLike, rank: int, files: tuple[str, ...]) -> LoadedCheckpoint:
    """Read this rank's ``files`` of one checkpoint, and its RNG states. Missing or corrupt
    files raise naming the file."""
    path = Path(path)

    metadata = read_metadata(path)
    check_format(path, metadata)
    rng_file = path / f"rng_rank{rank}.safetensors"
    return LoadedCheckpoint(
        path=path,
        metadata=metadata,
        files={name: load_safetensors(path / name) for name in files},
        rng=load_safetensors(rng_file) if rng_file.exists() else {},
    )

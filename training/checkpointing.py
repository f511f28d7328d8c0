"""Checkpoints: safetensors tensors + JSON metadata, written to a temporary directory and renamed.

Layout of ``checkpoint.dir``::

    latest                    one line: the name of the newest complete checkpoint
    iter_0000100/
        model.safetensors     model state (FP8 scaling buffers included); data-parallel rank 0
        optimizer.safetensors optimizer states and masters; data-parallel rank 0
                              (one pair per model slice under tensor / pipeline
                              parallelism: model_tp{t}_pp{p}.safetensors, ...;
                              with the distributed optimizer every data-parallel rank
                              writes its own optimizer{...}_dp{d}.safetensors)
        fp8_scaling{...}_dp{d}.safetensors  each data-parallel replica's FP8 scaling state
                              (amax histories differ between replicas: different data)
        rng_rank{r}.safetensors  each rank's RNG states (dropout streams differ per rank later)
        metadata.json         config, iteration, consumed samples, scheduler, loss scaler, ...

Nothing is ever unpickled: tensors come back through safetensors, the rest through JSON. A crash
mid-save leaves only a ``.tmp_*`` directory, which the next save replaces and loading ignores.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from fp8train import device as devices
from parallel.tensor_parallel.random import get_tracker

__all__ = [
    "CheckpointError",
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "read_metadata",
]

FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


@dataclass
class LoadedCheckpoint:
    path: Path
    metadata: dict
    model: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    rng: dict[str, torch.Tensor]
    extra: dict[str, dict[str, torch.Tensor]]  # this rank's own extra files, by file name


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _own_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses tensors that share storage (tied embeddings): store private copies.
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}


def rng_state_tensors(device: torch.device) -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    accel = devices.rng_state(device)
    if accel is not None:
        out["torch_device"] = accel
    # The tensor-parallel dropout streams (empty without TP).
    out.update({f"tracker.{k}": v for k, v in get_tracker().get_states().items()})
    return out


def restore_rng(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
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
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, torch.Tensor],
    metadata: dict,
    device: torch.device,
    rank: int,
    writes_replicated: bool,
    keep_last: int = 2,
    shard: str = "",
    optimizer_file: str | None = None,
    extra_files: dict[str, dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    ``shard`` names this rank's model slice in the file names (``model_tp1_pp0.safetensors``
    under tensor and pipeline parallelism); data-parallel replicas write nothing
    (``writes_replicated``). ``optimizer_file``: this rank's own optimizer file, written by
    every rank (the distributed optimizer's shards) instead of the replicated one.
    ``extra_files``: file name -> tensors that this rank writes whatever its replica (state
    that differs between data-parallel replicas, e.g. FP8 scaling histories).
    """
    root = Path(directory)
    name = f"iter_{iteration:07d}"
    tmp = root / f".tmp_{name}"
    final = root / name
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    if writes_replicated:
        save_file(_own_tensors(model_state), str(tmp / f"model{shard}.safetensors"))
    if optimizer_file is not None:
        save_file(_own_tensors(optimizer_state), str(tmp / optimizer_file))
    elif writes_replicated:
        save_file(_own_tensors(optimizer_state), str(tmp / f"optimizer{shard}.safetensors"))
    for file_name, tensors in (extra_files or {}).items():
        save_file(_own_tensors(tensors), str(tmp / file_name))
    save_file(_own_tensors(rng_state_tensors(device)), str(tmp / f"rng_rank{rank}.safetensors"))
    if rank == 0:
        meta = dict(metadata, iteration=iteration, format_version=FORMAT_VERSION)
        (tmp / "metadata.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    _barrier()
    if rank == 0:
        if final.exists():  # re-saving the same iteration (e.g. after a resume): replace
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = root / ".latest.tmp"
        pointer.write_text(name + "\n")
        os.replace(pointer, root / "latest")
        _prune(root, keep_last)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    complete = sorted(p for p in root.glob("iter_*") if (p / "metadata.json").exists())
    for old in complete[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The checkpoint the ``latest`` pointer names, or None when there is none yet."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    path = root / pointer.read_text().strip()
    if not (path / "metadata.json").exists():
        raise CheckpointError(f"{pointer} names {path.name}, which has no metadata.json")
    return path


def read_metadata(path: str | os.PathLike) -> dict:
    """The checkpoint's metadata.json; a missing or corrupt file raises naming it."""
    meta_file = Path(path) / "metadata.json"
    try:
        return json.loads(meta_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {meta_file}") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"cannot parse {meta_file}: {exc}") from None


def load_checkpoint(
    path: str | os.PathLike,
    rank: int,
    shard: str = "",
    optimizer_file: str | None = None,
    extra_files: tuple[str, ...] = (),
) -> LoadedCheckpoint:
    """Read one checkpoint (any rank). Missing or corrupt files raise naming the file."""
    path = Path(path)

    def read(file: Path) -> dict[str, torch.Tensor]:
        if not file.exists():
            raise CheckpointError(f"checkpoint file missing: {file}")
        try:
            return load_file(str(file))
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from None

    meta_file = path / "metadata.json"
    metadata = read_metadata(path)
    if metadata.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_file}: format_version {metadata.get('format_version')} is not {FORMAT_VERSION}"
        )
    rng_file = path / f"rng_rank{rank}.safetensors"
    return LoadedCheckpoint(
        path=path,
        metadata=metadata,
        model=read(path / f"model{shard}.safetensors"),
        optimizer=read(path / (optimizer_file or f"optimizer{shard}.safetensors")),
        rng=read(rng_file) if rng_file.exists() else {},
        extra={name: read(path / name) for name in extra_files},
    )

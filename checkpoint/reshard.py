"""Resharding: one rank's tensors for any layout, read from a checkpoint of any other layout.

A checkpoint stores every tensor under its single-process name with a layout entry saying how
the stored piece relates to the full tensor (checkpoint/format.py). A target rank
describes what it needs the same way (``Target``: its layout, local shape and dtype), and
``reshard`` cuts each needed piece out of the stored ones, reading only the tensors and the
tensor-parallel shards it needs (memory: a few tensors, never the whole model). Resuming with
another layout (training/checkpointer.py) and tools/convert_checkpoint.py run this same code.

Rules, per tensor:

- Split tensors (``partition_dim``; ``blocks`` equal blocks each split across the ranks):
  when the target's tensor-parallel size T is a multiple of the source's S, a target shard
  lies inside one source shard and is a slice of it; when S is a multiple of T, it joins
  S/T source shards; otherwise it is cut from the joined full tensor.
- Scaled FP16/FP8 tensors (``scale_inv``): a target shard inside one source shard keeps its
  bytes and scale, bit-exact. A shard joined from several source shards is re-quantised once
  with the rule that made it (``requantize``): power-of-two scales for weights, FP16 masters
  and second moments, so joining is exact except for values that become subnormal in the
  joint scale (absolute error at most half the format's smallest subnormal times the new
  ``scale_inv``); the full-range scale of the FP8 first moment, so one more E4M3 rounding
  (relative error at most 2**-4 for normals). Block-scaled FP8 weights (``scale_block``):
  a shard inside one source shard takes its bytes and its rows or columns of the scale grid
  (shards hold whole blocks); a joined one is re-quantised block by block with power-of-two
  scales, so every value comes back exactly (a block's amax is unchanged by the join).
- Per-shard state (``per_shard``: FP8 scaling histories and scales each shard keeps): a target
  shard inside one source shard takes its state; a joined one merges the states as one
  process would have kept them: amax histories and counters take the maximum (the amax of a
  joined tensor is the max of its pieces' amaxes), scales the minimum, flags any.
- Vocabulary tensors (the model structure's ``vocab_tensors``) whose padded size differs
  keep their first ``vocab_size`` rows and get zero rows as new padding.
- Everything else is whole and copied. A pipeline stage's copy of another stage's tensor (a
  tied head's embedding) is read from the stage that counts it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from checkpoint.format import (
    DTYPES_BY_NAME,
    DTYPES_BY_SAFETENSORS_NAME,
    LAYOUT_KEY,
    CheckpointError,
    dequantize_stored,
    expected_files,
    open_safetensors,
    read_layouts,
)
from checkpoint.store import check_format, read_metadata
from fp8train.blockwise import quantize_blocks
from fp8train.formats import E4M3, FORMATS
from fp8train.optim_states import quantize_into_

__all__ = [
    "Target",
    "SourceCheckpoint",
    "reshard",
    "reshard_iter",
    "optimizer_targets",
    "requantize",
    "merge_per_shard",
    "layout_of",
    "describe",
]


@dataclass(frozen=True)
class Target:
    """What one rank holds of a tensor: its layout entry (as ``tensor_layouts`` gives it),
    the local shape and the stored dtype."""

    layout: dict
    shape: tuple[int, ...]
    dtype: torch.dtype


class SourceCheckpoint:
    """The stored pieces of a checkpoint directory, indexed by name from the file headers
    (no tensor is read until asked for). ``kind``: "model" or "optimizer" files; ``kinds``:
    those to index (every file's header is read and checked here: a missing, truncated or
    garbled file raises ``CheckpointError`` naming it before anything else happens)."""

    def __init__(self, path: str | Path, kinds: tuple[str, ...] = ("model", "optimizer")):
        self.path = Path(path)
        self.metadata = read_metadata(self.path)
        check_format(self.path, self.metadata)
        self.structure = self.metadata.get("model_structure", {})
        self.index: dict[str, dict[str, dict[int, tuple[dict, Path]]]] = {}
        for kind in kinds:
            names = expected_files(self.metadata, kind)
            missing = [n for n in names if not (self.path / n).exists()]
            if missing:
                raise CheckpointError(f"checkpoint file missing: {self.path / missing[0]}")
            pieces: dict[str, dict[int, tuple[dict, Path]]] = {}
            for name in names:
                file = self.path / name
                layouts = read_layouts(file)
                if not layouts:
                    raise CheckpointError(f"{file}: no '{LAYOUT_KEY}' header")
                for tensor, layout in layouts.items():
                    shards = pieces.setdefault(tensor, {})
                    held = shards.get(layout["tp_rank"])
                    # Keep the counted copy of a tensor two pipeline stages hold.
                    if held is None or (
                        held[0].get("pipeline_copy") and not layout.get("pipeline_copy")
                    ):
                        shards[layout["tp_rank"]] = (layout, file)
            self.index[kind] = pieces

    @property
    def parallel(self) -> dict:
        return self.metadata["config"]["parallel"]

    def names(self, kind: str) -> list[str]:
        return sorted(self.index[kind])

    def shards(self, kind: str, name: str) -> dict[int, tuple[dict, Path]]:
        try:
            shards = self.index[kind][name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path} has no {kind} tensor {name!r}") from None
        layout = next(iter(shards.values()))[0]
        split = layout["partition_dim"] is not None or layout["per_shard"]
        if split and len(shards) != layout["tp_size"]:
            raise CheckpointError(
                f"checkpoint {self.path}: {len(shards)} of {layout['tp_size']} "
                f"tensor-parallel shards of {name!r} present"
            )
        return shards

    def stored(self, kind: str, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(shape, dtype) of one stored piece of ``name``, from the file header alone."""
        _, file = next(iter(self.shards(kind, name).values()))
        with open_safetensors(file) as f:
            piece = f.get_slice(name)
            return tuple(piece.get_shape()), DTYPES_BY_SAFETENSORS_NAME[piece.get_dtype()]

    def read(self, kind: str, name: str, tp_rank: int) -> torch.Tensor:
        layout, file = self.shards(kind, name)[tp_rank]
        with open_safetensors(file) as f:
            return f.get_tensor(name)


def _format_of(dtype: torch.dtype):
    return next(f for f in FORMATS.values() if f.dtype == dtype)


def requantize(value: torch.Tensor, dtype: torch.dtype, name: str, block=None):
    """``(data, scale_inv)`` of FP32 ``value`` stored as ``dtype`` by the rule that made it:
    the full-range E4M3 scale for a first moment (``…:exp_avg``), power-of-two otherwise; with
    ``block`` (an O3 weight at block granularity) a power-of-two scale per block."""
    if block is not None:
        stored = quantize_blocks(value.float(), _format_of(dtype), tuple(block), 0, True)
        return stored.data, stored.scale_inv
    data = torch.empty(value.shape, dtype=dtype)
    scale_inv = torch.ones((), dtype=torch.float32)
    full_range = name.endswith(":exp_avg")
    max_value = E4M3.max if full_range else torch.finfo(dtype).max
    quantize_into_([value.float().clone()], [data], [scale_inv], max_value, pow2=not full_range)
    return data, scale_inv


def merge_per_shard(name: str, values: list[torch.Tensor]) -> torch.Tensor:
    """One shard's state from several shards' (see the module doc): min for scales, max
    (any, for flags) for the rest."""
    stacked = torch.stack(values)
    if name.endswith(".scale"):
        return stacked.min(0).values
    if stacked.dtype == torch.bool:
        return stacked.any(0)
    return stacked.max(0).values


def _blocks_of(x: torch.Tensor, dim: int, blocks: int) -> tuple[torch.Tensor, ...]:
    return x.chunk(blocks, dim) if blocks > 1 else (x,)


def _sub_shard(x: torch.Tensor, dim: int, blocks: int, parts: int, index: int) -> torch.Tensor:
    """Piece ``index`` of ``parts`` of a (shard of a) split tensor: the same piece of each block."""
    pieces = [b.chunk(parts, dim)[index] for b in _blocks_of(x, dim, blocks)]
    return torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]


def _join(values: list[torch.Tensor], dim: int, blocks: int) -> torch.Tensor:
    """Inverse of ``_sub_shard`` over all parts: block-major concatenation."""
    if len(values) == 1:
        return values[0]
    split = [_blocks_of(v, dim, blocks) for v in values]
    return torch.cat([split[r][b] for b in range(blocks) for r in range(len(values))], dim)


def _source_group(source_tp: int, target_tp: int, target_rank: int) -> tuple[list[int], int, int]:
    """(source shards a target shard needs, parts to cut their join into, which part)."""
    if target_tp % source_tp == 0:  # inside one source shard
        per = target_tp // source_tp
        return [target_rank // per], per, target_rank % per
    if source_tp % target_tp == 0:  # several whole source shards
        per = source_tp // target_tp
        return list(range(target_rank * per, (target_rank + 1) * per)), 1, 0
    return list(range(source_tp)), target_tp, target_rank  # cut from the full tensor


class _Resharder:
    def __init__(self, source: SourceCheckpoint, kind: str):
        self.source, self.kind = source, kind
        structure = source.structure
        self.vocab_tensors = set(structure.get("vocab_tensors", ()))
        self.vocab_size = structure.get("vocab_size")

    def _values(self, name: str, ranks: Iterable[int]) -> tuple[list[torch.Tensor], bool]:
        """The source shards' values, dequantized to FP32 when scaled; and whether scaled."""
        shards = self.source.shards(self.kind, name)
        out, scaled = [], False
        for r in ranks:
            layout, _ = shards[r]
            data = self.source.read(self.kind, name, r)
            if layout.get("scale_inv"):
                scale = self.source.read(self.kind, layout["scale_inv"], r)
                data, scaled = dequantize_stored(layout, data, scale), True
            out.append(data)
        return out, scaled

    def split_tensor(self, name: str, target: Target) -> dict[str, torch.Tensor]:
        shards = self.source.shards(self.kind, name)
        src = next(iter(shards.values()))[0]
        tl = target.layout
        dim = tl["partition_dim"] if tl["partition_dim"] is not None else src["partition_dim"]
        blocks = tl["blocks"] if tl["partition_dim"] is not None else src["blocks"]
        s_tp = src["tp_size"] if src["partition_dim"] is not None else 1
        t_tp = tl["tp_size"] if tl["partition_dim"] is not None else 1
        t_rank = tl["tp_rank"] if t_tp > 1 else 0
        source_full = self.source.stored(self.kind, name)[0][dim] * s_tp
        target_full = target.shape[dim] * t_tp
        ranks, parts, index = _source_group(s_tp, t_tp, t_rank)
        if source_full != target_full:  # the vocabulary's padding differs: via the full tensor
            ranks, parts, index = list(range(s_tp)), t_tp, t_rank
        scale_name = tl.get("scale_inv")
        exact = _same_storage(src, tl, self._dtype(name, src), target.dtype)
        if len(ranks) == 1 and exact and source_full == target_full:
            # Inside one source shard: its bytes and scale, exact. A block grid is cut with its
            # blocks (shards hold whole blocks: the config refuses a split inside one).
            data = self.source.read(self.kind, name, ranks[0])
            scale = self.source.read(self.kind, src["scale_inv"], ranks[0])
            out = {name: _sub_shard(data, dim, blocks, parts, index).contiguous()}
            if src.get("scale_block") and parts > 1:
                scale = _sub_shard(scale, dim, blocks, parts, index).contiguous()
            out[scale_name] = scale
            return out
        values, scaled = self._values(name, ranks)
        joined = _join(values, dim, blocks)
        if source_full != target_full:
            joined = self._repad(name, joined, dim, target_full)
        return _store(name, _sub_shard(joined, dim, blocks, parts, index).contiguous(), target)

    def _dtype(self, name: str, layout: dict) -> torch.dtype:
        return DTYPES_BY_NAME[layout["dtype"]]

    def _repad(self, name: str, full: torch.Tensor, dim: int, size: int) -> torch.Tensor:
        if name.split(":")[0] not in self.vocab_tensors or self.vocab_size is None or dim != 0:
            raise CheckpointError(
                f"checkpoint {self.source.path}: {name!r} has {full.shape[dim]} rows along "
                f"dimension {dim}, this model has {size}; only the vocabulary's padding may differ"
            )
        if size < self.vocab_size:
            raise CheckpointError(
                f"{name!r}: {size} rows cannot hold a vocabulary of {self.vocab_size}"
            )
        out = full.new_zeros((size, *full.shape[1:]))
        out[: self.vocab_size] = full[: self.vocab_size]
        return out

    def per_shard(self, name: str, target: Target) -> torch.Tensor:
        shards = self.source.shards(self.kind, name)
        src = next(iter(shards.values()))[0]
        tl = target.layout
        s_tp = src["tp_size"] if src["per_shard"] else 1
        t_tp = tl["tp_size"] if tl["per_shard"] else 1
        ranks, _, _ = _source_group(s_tp, t_tp, tl["tp_rank"] if t_tp > 1 else 0)
        values = [self.source.read(self.kind, name, r) for r in ranks]
        value = values[0] if len(values) == 1 else merge_per_shard(name, values)
        return value.to(target.dtype)

    def whole(self, name: str, target: Target) -> dict[str, torch.Tensor]:
        shards = self.source.shards(self.kind, name)
        rank = next(iter(shards))
        src = shards[rank][0]
        scale_name = target.layout.get("scale_inv")
        if _same_storage(src, target.layout, self._dtype(name, src), target.dtype):
            # Same storage: bytes and scale as they are.
            data = self.source.read(self.kind, name, rank)
            return {name: data, scale_name: self.source.read(self.kind, src["scale_inv"], rank)}
        values, _ = self._values(name, [rank])
        return _store(name, values[0], target)


def _same_storage(src: dict, target: dict, src_dtype, target_dtype) -> bool:
    """Whether a scaled source piece can be copied as it is: the target is scaled the same way
    (dtype, and one scale or the same blocks)."""
    return bool(
        src.get("scale_inv")
        and target.get("scale_inv")
        and src_dtype == target_dtype
        and src.get("scale_block") == target.get("scale_block")
    )


def _store(name: str, value: torch.Tensor, target: Target) -> dict[str, torch.Tensor]:
    """``value`` (FP32 when it came from scaled storage) in the target's storage: re-quantised
    with a fresh scale (or block scales) when the target is scaled, else cast."""
    scale_name = target.layout.get("scale_inv")
    if scale_name:
        data, scale = requantize(value, target.dtype, name, target.layout.get("scale_block"))
        return {name: data, scale_name: scale}
    return {name: value.to(target.dtype)}


def reshard(
    source: SourceCheckpoint, kind: str, targets: dict[str, Target]
) -> dict[str, torch.Tensor]:
    """This rank's tensors ``targets`` (name -> ``Target``) from ``source``'s ``kind`` files.

    Scales named by a target's ``scale_inv`` come with their tensor; asking for a name the
    checkpoint lacks raises ``CheckpointError`` naming it.
    """
    return dict(reshard_iter(source, kind, targets))


def reshard_iter(source: SourceCheckpoint, kind: str, targets: dict[str, Target]):
    """``reshard`` as a stream of ``(name, tensor)``: one tensor (and its scale) at a time."""
    worker = _Resharder(source, kind)
    scales = {t.layout["scale_inv"] for t in targets.values() if t.layout.get("scale_inv")}
    produced = set()
    for name, target in targets.items():
        if name in scales:
            continue  # produced with its tensor
        src = next(iter(source.shards(kind, name).values()))[0]
        tl = target.layout
        if tl["partition_dim"] is not None or src["partition_dim"] is not None:
            out = worker.split_tensor(name, target)
        elif tl["per_shard"] or src["per_shard"]:
            out = {name: worker.per_shard(name, target)}
        else:
            out = worker.whole(name, target)
        produced.update(out)
        yield from out.items()
    missing = sorted(scales - produced)
    if missing:
        raise CheckpointError(f"checkpoint {source.path}: no scale for {missing[0]!r}")


def optimizer_targets(
    source: SourceCheckpoint, params: Iterable[str], param_targets: dict[str, Target]
) -> dict[str, Target]:
    """The optimizer tensors of parameters ``params`` (the ones this rank steps), as the
    checkpoint stores them (``{parameter}:{state}``), laid out for this rank: a state of the
    parameter's shape is split like the parameter, the scale of a split or per-shard one is
    per shard, anything else (a step count) whole (``optimizer_layouts``' rule)."""
    by_param: dict[str, list[str]] = {}
    for name in source.names("optimizer"):
        by_param.setdefault(name.partition(":")[0], []).append(name)
    out = {}
    for param in params:
        base = param_targets[param]
        split = base.layout["partition_dim"] is not None or base.layout["per_shard"]
        names = by_param.get(param, [])
        for name in names:
            layout = next(iter(source.shards("optimizer", name).values()))[0]
            shape, dtype = source.stored("optimizer", name)
            # a state of the parameter's shape (stored unsplit: compare with the parameter)
            param_shaped = shape != () and source.stored("model", param)[0] == shape
            if layout["partition_dim"] is not None or param_shaped:
                entry = {**base.layout, "per_shard": False}
                entry.pop("scale_inv", None)
                entry.pop("scale_block", None)  # optimizer states keep one scale
                if f"{name}_scale_inv" in names:
                    entry["scale_inv"] = f"{name}_scale_inv"
                out[name] = Target(entry, base.shape, dtype)
            else:
                per_shard = split and name.endswith("_scale_inv")
                entry = {**base.layout, "partition_dim": None, "blocks": 1, "per_shard": per_shard}
                entry.pop("scale_inv", None)
                entry.pop("scale_block", None)  # optimizer states keep one scale
                out[name] = Target(entry, shape, dtype)
    return out


def layout_of(metadata: dict) -> dict:
    """``{tensor, pipeline, virtual_pipeline, data, distributed}`` a checkpoint was saved with."""
    parallel = metadata["config"]["parallel"]
    tp, pp = parallel["tensor"], parallel["pipeline"]
    return {
        "tensor": tp,
        "pipeline": pp,
        "virtual_pipeline": parallel.get("virtual_pipeline") or 1,
        "data": metadata.get("world_size", tp * pp) // (tp * pp),
        "distributed": bool(metadata["config"]["optimizer"].get("distributed")),
    }


def describe(layout: dict) -> str:
    text = f"TP={layout['tensor']} PP={layout['pipeline']}"
    if layout["virtual_pipeline"] > 1:
        text += f" (virtual {layout['virtual_pipeline']})"
    text += f" DP={layout['data']}"
    return text + (" distributed optimizer" if layout["distributed"] else "")

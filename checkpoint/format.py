"""The canonical checkpoint format (version 2), and a reader that needs no model code.

Every rank writes only what it holds, under the single-process tensor names whatever the
layout. Each safetensors file carries, in its header metadata under ``fp8train.layouts``, one
JSON entry per tensor saying how it relates to the full single-process tensor:

    partition_dim  null (whole) or the dimension split across tensor-parallel ranks
    blocks         the split dimension is this many concatenated equal blocks, each split
                   across the ranks (SwiGLU's [gate | up]); 1 otherwise
    tp_rank, tp_size  which shard this is
    per_shard      state every tensor-parallel shard keeps for itself (FP8 scaling histories,
                   the per-shard scale of a scaled weight): the reader stacks the shards along
                   a new first dimension (one row per rank; the tensor itself at TP=1)
    scale_inv      name of the FP32 scale of a scaled FP16/FP8 tensor in the same file: its
                   value is ``data * scale_inv`` (shard by shard)
    scale_block    with ``scale_inv``: ``[rows, columns]`` of the blocks of a block-scaled FP8
                   weight (O3 at ``fp8_granularity=block``: [128, 128]); ``scale_inv`` is then
                   the grid, one scale per block, the last block of a dimension partial.
                   Tensor-parallel shards are cut on block boundaries, so a shard's grid is the
                   same rows or columns of the full grid. Absent: one scale
    pipeline_copy  another pipeline stage stores the counted copy (a tied head's embedding)
    dtype          the stored dtype (safetensors says it too; kept for readers of the JSON)

Optimizer tensors are named ``{parameter}:{state}`` (``layers.0.mlp.fc1.weight:exp_avg``), so
state is keyed by parameter name, not by an index that depends on grouping or ownership;
a state with the parameter's shape is split like the parameter. ``metadata.json`` holds the
run's config, counters and ``model_structure`` (fused tensors, the unpadded vocabulary size);
``weights_only`` (a string saying where the weights came from) marks a checkpoint without
optimizer state, e.g. one imported from Hugging Face.

The reader below imports only torch, safetensors and json: it is the reference for tools that
reshard or convert checkpoints. Every file it reads goes through ``read_json`` or
``open_safetensors``, which refuse a missing, truncated or garbled file with one
``CheckpointError`` line naming it (the pre-flight, the loader and the tools all read this way).
A JSON object comes back as a ``JsonObject``: a key it lacks, or a value of the wrong type
(``JsonObject.need``), is one such line too, naming the file and the key.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

__all__ = [
    "CheckpointError",
    "MissingKeyError",
    "JsonObject",
    "read_json",
    "open_safetensors",
    "load_safetensors",
    "FORMAT_VERSION",
    "LAYOUT_KEY",
    "slice_suffix",
    "expected_files",
    "save_safetensors",
    "write_tensors",
    "write_tensors_streaming",
    "SAFETENSORS_DTYPES",
    "DTYPES_BY_SAFETENSORS_NAME",
    "DTYPES_BY_NAME",
    "read_layouts",
    "optimizer_layouts",
    "reassemble",
    "reassemble_tensor",
    "dequantize_stored",
    "is_fp8_scaling_state",
    "is_model_parameter",
]

FORMAT_VERSION = 2
LAYOUT_KEY = "fp8train.layouts"


def is_fp8_scaling_state(name: str) -> bool:
    """Whether canonical name ``name`` is FP8 scaling state (amax histories, scales: a
    component starting ``fp8_``), which follows the run, not the model: a replica keeps its
    own, and exports and inference readers leave it out."""
    return ".fp8_" in f".{name}"


def is_model_parameter(name: str) -> bool:
    """Whether canonical name ``name`` is a model parameter: neither FP8 scaling state nor
    the ``*_scale_inv`` of a scaled FP16/FP8 weight (a reader of the format gets that weight
    dequantised already)."""
    return not is_fp8_scaling_state(name) and not name.endswith("scale_inv")


class CheckpointError(RuntimeError):
    """A checkpoint (or a Hugging Face model directory) that cannot be used; the message is one
    line naming the file."""


class MissingKeyError(CheckpointError, KeyError):
    """A key a JSON file lacks: a ``CheckpointError`` naming the file and the key, and a
    ``KeyError`` as from a plain dict."""

    def __str__(self) -> str:  # KeyError's would quote the message
        return str(self.args[0])


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


_REQUIRED = object()
_KIND_WORDS = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
               dict: "an object", list: "a list", type(None): "null"}  # fmt: skip


class JsonObject(dict):
    """A JSON object of file ``file`` (``read_json``), at ``where`` in it (the dotted keys
    leading there, "" at the top); the objects inside are ``JsonObject`` too. A key it lacks
    (``obj[key]``) raises ``MissingKeyError`` naming the file and the key: 'no key
    'config.parallel.tensor'' rather than a bare ``KeyError: 'tensor'``; ``need`` checks the
    value's type as well. ``.get`` and ``in`` behave as for any dict."""

    def __init__(self, items: dict, file: str | Path, where: str = ""):
        super().__init__()
        self.file, self.where = file, where
        for key, value in items.items():
            self[key] = (
                JsonObject(value, file, self._name(key)) if isinstance(value, dict) else value
            )

    @classmethod
    def wrap(cls, value: dict, file: str | Path, where: str = "") -> JsonObject:
        """``value`` itself when it is a ``JsonObject``, else a ``JsonObject`` of it (a dict
        made in memory, e.g. a ``transformers`` config's ``to_dict()``) named ``file``."""
        return value if isinstance(value, JsonObject) else cls(value, file, where)

    def _name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else str(key)

    def __missing__(self, key: str):
        raise self._missing(key)

    def _missing(self, key: str, why: str = "") -> MissingKeyError:
        return MissingKeyError(
            f"{self.file}: no key '{self._name(key)}'" + (f" ({why})" if why else "")
        )

    def need(self, key: str, kind: type | tuple, default=_REQUIRED, *, why: str = ""):
        """The value at ``key``, of ``kind``: a type or a tuple of them, ``None`` in it
        allowing null; a float may be written as an integer (returned as a float), an
        integer never as true/false. A missing key gives ``default`` when one is given, else
        raises ``MissingKeyError`` (``why``: who needs it, for the message); a value of
        another kind raises ``CheckpointError`` naming the file and the key."""
        if key not in self:
            if default is not _REQUIRED:
                return default
            raise self._missing(key, why)
        value = self[key]
        kinds = tuple(
            type(None) if k is None else k for k in (kind if isinstance(kind, tuple) else (kind,))
        )
        if float in kinds and type(value) is int:
            value = float(value)
        bool_for_int = isinstance(value, bool) and int in kinds and bool not in kinds
        if bool_for_int or not isinstance(value, kinds):
            shown = json.dumps(value, default=str)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            words = " or ".join(_KIND_WORDS[k] for k in kinds)
            raise CheckpointError(f"{self.file}: '{self._name(key)}' must be {words}, not {shown}")
        return (
            JsonObject.wrap(value, self.file, self._name(key)) if isinstance(value, dict) else value
        )

    def check(self, kinds: dict) -> None:
        """Check the keys present against ``kinds``: key -> a kind as for ``need``, or a dict
        of them for an object whose own keys are checked the same way. An absent key is named
        where it is needed (``obj[key]``, ``need``), not here."""
        for key, kind in kinds.items():
            if key in self:
                if isinstance(kind, dict):
                    self.need(key, dict).check(kind)
                else:
                    self.need(key, kind)


def read_json(path: str | Path) -> JsonObject:
    """The JSON object in file ``path`` (metadata.json, a Hugging Face config or index). A
    missing or unreadable file, bytes that are not UTF-8, text that does not parse (the
    message gives the line) or a value that is not an object raise ``CheckpointError``; the
    object comes back as a ``JsonObject`` naming ``path`` for a key it lacks."""
    path = Path(path)
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file missing: {path}") from None
    except OSError as exc:  # a directory, no permission: strerror says which
        raise CheckpointError(f"cannot read {path}: {exc.strerror or _one_line(exc)}") from None
    except UnicodeDecodeError as exc:
        bad = exc.object[exc.start]
        raise CheckpointError(
            f"cannot parse {path}: not UTF-8 (byte 0x{bad:02x} at offset {exc.start})"
        ) from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"cannot parse {path}: {_one_line(exc)}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"cannot parse {path}: a JSON {type(value).__name__}, not an object")
    return JsonObject(value, path)


@contextmanager
def open_safetensors(path: str | Path) -> Iterator:
    """``safe_open(path)`` for reading tensors. Opening parses the header and checks that its
    tensors exactly cover the file, so a truncated or garbled file fails here, before any
    output is written; that failure, a missing file, and a failed read inside the block raise
    ``CheckpointError`` naming the file (safetensors' own error names none)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint file missing: {path}")
    try:
        handle = safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises several types for a damaged header
        raise CheckpointError(f"cannot read checkpoint file {path}: {_one_line(exc)}") from None
    with handle as f:
        try:
            yield f
        except SafetensorError as exc:
            raise CheckpointError(f"cannot read checkpoint file {path}: {_one_line(exc)}") from None


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (``safetensors.torch.load_file``, through
    ``open_safetensors``: a damaged file raises ``CheckpointError`` naming it)."""
    with open_safetensors(path) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a mapping)


def slice_suffix(tp_rank: int, tp: int, pp_rank: int, pp: int) -> str:
    """A model slice in file names: ``""`` (one slice), ``_tp1``, ``_pp0``, ``_tp1_pp0``."""
    name = f"_tp{tp_rank}" if tp > 1 else ""
    return name + (f"_pp{pp_rank}" if pp > 1 else "")


def expected_files(metadata: dict, kind: str) -> list[str]:
    """The ``model``/``optimizer`` files a complete checkpoint of this metadata holds: one
    per model slice, or per slice and data-parallel rank for the distributed optimizer. A
    weights-only checkpoint (``weights_only`` in its metadata: an imported model) has no
    optimizer files."""
    if kind == "optimizer" and metadata.get("weights_only"):
        return []
    parallel = metadata["config"]["parallel"]
    tp, pp = parallel["tensor"], parallel["pipeline"]
    dp = metadata.get("world_size", tp * pp) // (tp * pp)
    sharded = kind == "optimizer" and metadata["config"]["optimizer"]["distributed"] and dp > 1
    names = []
    for p in range(pp):
        for t in range(tp):
            base = f"{kind}{slice_suffix(t, tp, p, pp)}"
            names += (
                [f"{base}_dp{d}.safetensors" for d in range(dp)]
                if sharded
                else [f"{base}.safetensors"]
            )
    return names


def _umask() -> int:
    """The process's umask, read without changing it where Linux says it (``os.umask`` sets
    it to read it: another thread creating a file in between would get the wrong mode)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None
) -> None:
    """``safetensors.torch.save_file``, with the mode any other new file gets (``0o666``
    less the umask): safetensors writes through a private temporary file and renames it, so
    its files come out 0600, unreadable by the other users and jobs of a shared file system
    that the checkpoint's other files (and resharded ones) are readable by."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def write_tensors(path: str | Path, tensors: dict[str, torch.Tensor], layouts: dict) -> None:
    """Save ``tensors`` (CPU copies are made) with their layouts in the file's header."""
    own = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    entries = {}
    for name, value in own.items():
        entry = dict(layouts.get(name, _WHOLE))
        entry["dtype"] = str(value.dtype).removeprefix("torch.")
        entries[name] = entry
    save_safetensors(own, path, metadata={LAYOUT_KEY: json.dumps(entries, sort_keys=True)})


# safetensors' dtype names (its header's "dtype"), for the dtypes a checkpoint holds.
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
# The inverse maps: a header's safetensors name, and a layout entry's "dtype" (torch's name).
DTYPES_BY_SAFETENSORS_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}
DTYPES_BY_NAME = {str(dtype).removeprefix("torch."): dtype for dtype in SAFETENSORS_DTYPES}


def write_tensors_streaming(
    path: str | Path,
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    layouts: dict,
    tensors,
) -> None:
    """``write_tensors`` one tensor at a time: ``specs`` (name -> (shape, dtype)) fixes the
    header up front, then ``tensors`` yields ``(name, tensor)`` in any order and each is
    written and dropped, so memory holds one tensor, not the file. The result is an ordinary
    safetensors file (offsets in name order, as safetensors itself writes). Written to
    ``path`` + ".tmp" and renamed: an interrupted write leaves no file under ``path``."""
    names = sorted(specs)
    header, offset = {}, 0
    sizes = {}
    for name in names:
        shape, dtype = specs[name]
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        sizes[name], offset = size, offset + size
    entries = {}
    for name in names:
        entry = dict(layouts.get(name, _WHOLE))
        entry["dtype"] = str(specs[name][1]).removeprefix("torch.")
        entries[name] = entry
    header["__metadata__"] = {LAYOUT_KEY: json.dumps(entries, sort_keys=True)}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    tmp = Path(f"{path}.tmp")
    start = 8 + len(blob)
    seen = set()
    with open(tmp, "wb") as fh:
        fh.write(len(blob).to_bytes(8, "little"))
        fh.write(blob)
        fh.truncate(start + offset)
        for name, value in tensors:
            shape, dtype = specs[name]
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise ValueError(
                    f"{name}: got {tuple(value.shape)} {value.dtype}, header says {shape} {dtype}"
                )
            fh.seek(start + header[name]["data_offsets"][0])
            data = value.detach().to("cpu").contiguous().reshape(-1)
            fh.write(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
            seen.add(name)
    if seen != set(names):
        tmp.unlink()
        raise ValueError(f"{path}: no data for {sorted(set(names) - seen)[:3]}")
    tmp.replace(path)


_WHOLE = {
    "partition_dim": None,
    "blocks": 1,
    "tp_rank": 0,
    "tp_size": 1,
    "per_shard": False,
    "pipeline_copy": False,
}


def read_layouts(path: str | Path) -> dict[str, dict]:
    """The per-tensor layouts of one file (empty for a file without them); a damaged file or
    layout header raises ``CheckpointError`` naming the file."""
    with open_safetensors(path) as f:
        meta = f.metadata() or {}
    try:
        layouts = json.loads(meta.get(LAYOUT_KEY, "{}"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: '{LAYOUT_KEY}' header: {_one_line(exc)}") from None
    if not isinstance(layouts, dict):
        raise CheckpointError(f"{path}: '{LAYOUT_KEY}' header is not a JSON object")
    return layouts


def optimizer_layouts(
    tensors: dict[str, torch.Tensor], param_layouts: dict[str, dict], param_shapes: dict
) -> dict[str, dict]:
    """Layouts of ``{parameter}:{state}`` tensors from their parameters' layouts: a state of
    the parameter's (local) shape is split like it; a ``*_scale_inv`` of a split or per-shard
    parameter is per shard (each shard scales its own moments); anything else (a step count)
    is whole, the same on every shard."""
    out = {}
    for name, value in tensors.items():
        param, _, key = name.partition(":")
        base = param_layouts.get(param, _WHOLE)
        if tuple(value.shape) == tuple(param_shapes.get(param, ())):
            entry = {**base, "per_shard": False}
            entry.pop("scale_inv", None)
            entry.pop("scale_block", None)  # optimizer states keep one scale
            if f"{name}_scale_inv" in tensors:
                entry["scale_inv"] = f"{name}_scale_inv"
        else:
            split = base["partition_dim"] is not None or base["per_shard"]
            split = split and key.endswith("_scale_inv")
            entry = {**base, "partition_dim": None, "blocks": 1, "per_shard": split}
            entry.pop("scale_inv", None)
            entry.pop("scale_block", None)  # optimizer states keep one scale
        out[name] = entry
    return out


def dequantize_stored(layout: dict, data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """FP32 value of one stored piece of a scaled tensor: ``data * scale_inv``, each block by
    its own scale when the layout has a ``scale_block`` (spread here rather than by
    fp8train.blockwise: this reader imports no project code)."""
    block = layout.get("scale_block")
    if block is None:
        return data.float() * scale_inv.float()
    rows, cols = data.shape
    spread = scale_inv.float().repeat_interleave(block[0], 0)[:rows]
    return data.float() * spread.repeat_interleave(block[1], 1)[:, :cols]


def reassemble_tensor(shards: list[tuple[dict, torch.Tensor, torch.Tensor | None]]) -> torch.Tensor:
    """The full tensor from its stored pieces: ``(layout, data, scale_inv or None)`` each."""
    counted = [s for s in shards if not s[0].get("pipeline_copy")] or shards
    by_rank: dict[int, tuple[dict, torch.Tensor, torch.Tensor | None]] = {}
    for piece in counted:  # data-parallel or pipeline copies of one shard: keep one
        by_rank.setdefault(piece[0]["tp_rank"], piece)
    pieces = [by_rank[r] for r in sorted(by_rank)]
    values = [d if s is None else dequantize_stored(lay, d, s) for lay, d, s in pieces]
    layout = pieces[0][0]
    split = layout["partition_dim"] is not None or layout["per_shard"]
    if split and len(values) != layout["tp_size"]:
        raise ValueError(f"{len(values)} of {layout['tp_size']} tensor-parallel shards present")
    if layout["partition_dim"] is None:
        if layout["per_shard"] and layout["tp_size"] > 1:
            return torch.stack(values)
        return values[0]
    dim, blocks = layout["partition_dim"], layout["blocks"]
    if blocks == 1:
        return torch.cat(values, dim)
    # Each shard is [block_0 piece | block_1 piece | ...]: regroup block-major.
    split = [v.chunk(blocks, dim) for v in values]
    return torch.cat([split[r][b] for b in range(blocks) for r in range(len(values))], dim)


def reassemble(path: str | Path, kind: str = "model") -> dict[str, torch.Tensor]:
    """Every full tensor of checkpoint directory ``path``: ``kind`` "model" reads the
    ``model*.safetensors`` files, "optimizer" the ``optimizer*.safetensors`` ones. Scaled
    tensors come back dequantized to FP32; their scales as stored (per shard)."""
    files = sorted(Path(path).glob(f"{kind}*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no {kind}*.safetensors in {path}")
    meta_file = Path(path) / "metadata.json"
    if meta_file.exists():  # a whole checkpoint: every slice's file must be there
        missing = [
            name
            for name in expected_files(read_json(meta_file), kind)
            if not (Path(path) / name).exists()
        ]
        if missing:
            raise FileNotFoundError(f"checkpoint {path} is incomplete: {missing[0]} is missing")
    pieces: dict[str, list] = defaultdict(list)
    for file in files:
        layouts = read_layouts(file)
        if not layouts:
            raise ValueError(f"{file}: no '{LAYOUT_KEY}' header (not a format-2 checkpoint)")
        with open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                layout = layouts[name]
                scale_name = layout.get("scale_inv")
                scale = f.get_tensor(scale_name) if scale_name else None
                pieces[name].append((layout, f.get_tensor(name), scale))
    return {name: reassemble_tensor(parts) for name, parts in sorted(pieces.items())}

"""Megatron indexed datasets (``.bin`` tokens + ``.idx`` index) through megatron-core.

Writing goes through ``IndexedDatasetBuilder`` and reading through ``IndexedDataset`` so the
files are exactly what Megatron-LM's own ``preprocess_data.py`` would produce and consume.
One document is stored as one sequence (ids followed by the EOD token when appended).
"""

from __future__ import annotations

import importlib
import os
import struct
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "IndexStats",
    "token_dtype",
    "dataset_prefix",
    "missing_files",
    "check_prefix",
    "write_indexed_dataset",
    "read_indexed_dataset",
    "read_index_stats",
    "check_index_header",
    "import_megatron",
]

_IDX_MAGIC = b"MMIDIDX\x00\x00"
# megatron.core.datasets.indexed_dataset.DType, duplicated so reading counts needs no import.
_DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}


def _dtype_from_code(idx_path: str, code: int) -> np.dtype:
    if code not in _DTYPE_CODES:
        raise ValueError(f"{idx_path!r}: unknown token dtype code {code}")
    return np.dtype(_DTYPE_CODES[code])


def import_megatron(name: str):
    """Import a megatron.core module without its import-time warnings and fusion compiles.

    Importing anything under megatron.core loads the whole package, which warns that
    Transformer Engine and Apex are absent; they are never needed here. Kept lazy so that
    ``import data`` and a data-cache hit stay fast.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        if "megatron.core" not in sys.modules:
            _import_core_uncompiled()
        return importlib.import_module(name)


def _leave_uncompiled(model=None, **_options):
    """``torch.compile``'s signature, compiling nothing (bare decorator or with options)."""
    return model if model is not None else (lambda fn: fn)


def _import_core_uncompiled() -> None:
    """megatron.core's ``__init__`` imports its fusion modules, whose ``@jit_fuser`` is
    ``torch.compile``: merely decorating loads torch._dynamo and torch._inductor, about 2.5 s
    per process on a 2-core CPU plus 1.5 s more at exit, in every rank of every run. We use
    its datasets and LR scheduler, none of those fusions, so for this one import
    ``torch.compile`` leaves functions as they are (megatron's ``jit_fuser`` keeps that
    identity in this process; ``torch.compile`` itself is restored)."""
    import torch

    compile_fn = torch.compile
    torch.compile = _leave_uncompiled
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_fn


@dataclass(frozen=True)
class IndexStats:
    """Counts read from (or written to) one ``.idx`` file."""

    num_documents: int
    num_tokens: int
    dtype: np.dtype


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest safe token dtype; megatron's ``DType.optimal_dtype`` rule (uint16 below 65500)."""
    return np.dtype(np.uint16) if int(vocab_size) < 65500 else np.dtype(np.int32)


def dataset_prefix(output_prefix: str | os.PathLike[str], key: str = "text") -> str:
    """``{output_prefix}_{key}_document``: the path prefix Megatron's GPTDataset takes."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def missing_files(prefix: str | os.PathLike[str]) -> list[str]:
    """The ``.bin``/``.idx`` paths of ``prefix`` that do not exist (empty when complete)."""
    base = os.fspath(prefix)
    return [p for p in (base + ".bin", base + ".idx") if not os.path.isfile(p)]


def check_prefix(prefix: str | os.PathLike[str]) -> str:
    """Return ``prefix`` as a str, or raise FileNotFoundError naming the first missing file."""
    base = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if base.endswith(suffix):
            raise ValueError(f"data prefix {base!r} must not include the {suffix} suffix")
    missing = missing_files(base)
    if missing:
        raise FileNotFoundError(f"indexed dataset file not found: {missing[0]!r}")
    return base


def write_indexed_dataset(
    prefix: str | os.PathLike[str],
    documents: Iterable[Sequence[int] | np.ndarray],
    vocab_size: int,
) -> IndexStats:
    """Write ``{prefix}.bin`` and ``{prefix}.idx`` with one sequence per document.

    Ids are range-checked against ``vocab_size`` because a silent uint16 wrap-around would
    corrupt training data without any error.
    """
    builder_cls = import_megatron("megatron.core.datasets.indexed_dataset").IndexedDatasetBuilder
    base = os.fspath(prefix)
    Path(base).parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    builder = builder_cls(base + ".bin", dtype=dtype.type)
    num_documents = 0
    num_tokens = 0
    try:
        for doc in documents:
            ids = np.asarray(doc, dtype=np.int64)
            if ids.ndim != 1:
                raise ValueError(f"document {num_documents} is not a 1-D id sequence")
            if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                raise ValueError(
                    f"document {num_documents} has token ids outside [0, {vocab_size})"
                )
            builder.add_document(ids.astype(dtype), [int(ids.size)])
            num_documents += 1
            num_tokens += int(ids.size)
    except BaseException:
        # No .idx for a partial .bin: a half-written dataset must not look loadable.
        builder.data_file.close()
        Path(base + ".bin").unlink(missing_ok=True)
        raise
    builder.finalize(base + ".idx")
    return IndexStats(num_documents=num_documents, num_tokens=num_tokens, dtype=dtype)


def read_indexed_dataset(prefix: str | os.PathLike[str]):
    """Open ``prefix`` as a megatron-core ``IndexedDataset`` (memory-mapped)."""
    indexed = import_megatron("megatron.core.datasets.indexed_dataset")
    return indexed.IndexedDataset(check_prefix(prefix), multimodal=False, mmap=True)


def read_index_stats(prefix: str | os.PathLike[str]) -> IndexStats:
    """Document/token counts and dtype from the ``.idx`` alone (never touches ``.bin``)."""
    idx_path = check_prefix(prefix) + ".idx"
    with open(idx_path, "rb") as f:
        head = f.read(34)
        if len(head) < 34 or head[:9] != _IDX_MAGIC:
            raise ValueError(f"{idx_path!r} is not a Megatron MMIDIDX index file")
        (version,) = struct.unpack("<Q", head[9:17])
        if version != 1:
            raise ValueError(f"{idx_path!r}: unsupported index version {version}")
        code, seq_count, doc_count = struct.unpack("<BQQ", head[17:34])
        lengths = np.fromfile(f, dtype=np.int32, count=seq_count)
    if lengths.size != seq_count:
        raise ValueError(f"{idx_path!r} is truncated")
    return IndexStats(
        num_documents=int(doc_count) - 1,  # document_indices start with a leading 0
        num_tokens=int(lengths.sum(dtype=np.int64)),
        dtype=_dtype_from_code(idx_path, code),
    )


_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents: 34 bytes


def check_index_header(prefix: str | os.PathLike[str]) -> IndexStats:
    """Check that ``prefix`` is a readable Megatron indexed dataset without reading it: the
    ``.idx`` header (magic, version, dtype), the ``.idx`` size its counts imply, and the
    ``.bin`` size the last sequence's pointer and length imply (two values read by seek).
    Raises FileNotFoundError / ValueError naming the file; returns the counts (tokens from
    the ``.bin`` size)."""
    base = check_prefix(prefix)
    idx_path, bin_path = base + ".idx", base + ".bin"
    try:
        with open(idx_path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size or head[:9] != _IDX_MAGIC:
                raise ValueError(f"{idx_path!r} is not a Megatron MMIDIDX index file")
            _, version, code, sequences, documents = _HEADER.unpack(head)
            if version != 1:
                raise ValueError(f"{idx_path!r}: unsupported index version {version}")
            dtype = _dtype_from_code(idx_path, code)
            # lengths int32[sequences], pointers int64[sequences], document indices int64[documents]
            expected = _HEADER.size + 12 * sequences + 8 * documents
            actual = os.fstat(f.fileno()).st_size
            if actual != expected or documents < 1:
                raise ValueError(
                    f"{idx_path!r} holds {actual} bytes, its header describes {expected} "
                    f"({sequences} sequences, {documents} document indices): truncated or damaged"
                )
            last_end = 0
            if sequences:
                f.seek(_HEADER.size + 4 * (sequences - 1))
                (length,) = struct.unpack("<i", f.read(4))
                f.seek(_HEADER.size + 4 * sequences + 8 * (sequences - 1))
                (pointer,) = struct.unpack("<q", f.read(8))
                last_end = pointer + length * dtype.itemsize
        with open(bin_path, "rb") as f:
            bin_size = os.fstat(f.fileno()).st_size
    except OSError as err:
        raise ValueError(f"cannot read {err.filename!r}: {err.strerror}") from None
    if bin_size != last_end:
        raise ValueError(
            f"{bin_path!r} holds {bin_size} bytes, its index describes {last_end}: truncated "
            "or not the index's data file"
        )
    return IndexStats(
        num_documents=int(documents) - 1,  # document indices start with a leading 0
        num_tokens=bin_size // dtype.itemsize,
        dtype=dtype,
    )

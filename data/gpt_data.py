"""Train/valid GPT datasets from a Megatron indexed dataset, built by megatron-core.

``BlendedMegatronDatasetBuilder`` + ``GPTDatasetConfig`` + ``GPTDataset`` do the work: split
documents by ratio, shuffle documents and samples with a numpy RandomState seeded from
``seed``, and cache the three index arrays (document/sample/shuffle) as ``.npy`` files.

What megatron-core needs and how it is met here:

- a tokenizer with ``vocab_size``, ``eod``, ``pad`` and ``unique_identifiers`` (a dict that
  keys its index cache): :class:`data.tokenizer.SentencePieceTokenizer` has them;
- its compiled ``helpers_cpp`` extension for ``build_sample_idx``. The megatron-core wheel
  ships it prebuilt; when it is missing (source installs, exotic platforms) we register an
  exact numpy re-implementation instead of needing pybind11 and a compiler
  (:func:`ensure_helpers`);
- torch.distributed is optional. When it is initialised, ``build_gpt_datasets`` must be
  called on every rank: rank 0 builds the index cache, the others wait at megatron's barrier
  and then load it.
"""

from __future__ import annotations

import hashlib
import os
import sys
import types
from math import ceil
from pathlib import Path
from typing import Any

import numpy as np

from data.indexed import check_prefix, import_megatron, read_index_stats

__all__ = [
    "ensure_helpers",
    "build_sample_idx_numpy",
    "split_document_ranges",
    "build_gpt_datasets",
]

_HELPERS = "megatron.core.datasets.helpers_cpp"


def build_sample_idx_numpy(
    sizes: np.ndarray,
    document_indices: np.ndarray,
    sequence_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token_to_sequence: int = 1,
    dtype: type = np.int64,
) -> np.ndarray:
    """Same output as megatron's ``helpers.cpp::build_sample_idx`` (vectorised).

    Sample ``i`` starts at flat token position ``i * sequence_length`` of the documents laid
    out in ``document_indices`` order; row ``i`` stores (position in document_indices, offset).
    The C++ walk lands on the *next* document at a boundary when an extra token is drawn and
    stays at the end of the current one otherwise; the searchsorted sides reproduce that.
    """
    extra = int(add_extra_token_to_sequence)
    total = num_epochs * tokens_per_epoch - extra
    if drop_last_partial_sequence:
        num_samples = total // sequence_length
    else:
        num_samples = ceil(float(total) / sequence_length)
    doc_lengths = np.asarray(sizes, dtype=np.int64)[np.asarray(document_indices)]
    ends = np.cumsum(doc_lengths)
    starts = ends - doc_lengths
    positions = np.arange(num_samples + 1, dtype=np.int64) * sequence_length
    last = len(doc_lengths) - 1
    # Running out of documents pins the final row to (last document, its length - extra).
    overflow = positions > ends[-1] - extra
    positions = np.minimum(positions, ends[-1] - extra)
    if extra:
        rows = np.searchsorted(starts, positions, side="right") - 1
    else:
        rows = np.searchsorted(ends, positions, side="left")
    rows = np.clip(rows, 0, last)
    offsets = positions - starts[rows]
    rows[overflow] = last
    offsets[overflow] = doc_lengths[last] - extra
    rows[0], offsets[0] = 0, 0
    return np.stack([rows, offsets], axis=1).astype(dtype)


def ensure_helpers() -> bool:
    """Make ``megatron.core.datasets.helpers`` importable; True if the compiled one is used."""
    try:
        import_megatron(_HELPERS)
        return not getattr(sys.modules[_HELPERS], "__fp8train_fallback__", False)
    except ImportError:
        pass
    fallback = types.ModuleType(_HELPERS)
    fallback.__fp8train_fallback__ = True  # type: ignore[attr-defined]

    def _int32(*args: Any) -> np.ndarray:
        return build_sample_idx_numpy(*args, dtype=np.int32)

    def _int64(*args: Any) -> np.ndarray:
        return build_sample_idx_numpy(*args, dtype=np.int64)

    fallback.build_sample_idx_int32 = _int32  # type: ignore[attr-defined]
    fallback.build_sample_idx_int64 = _int64  # type: ignore[attr-defined]
    sys.modules[_HELPERS] = fallback
    return False


def split_document_ranges(split: str, num_documents: int) -> list[tuple[int, int] | None]:
    """Document ranges [begin, end) per train/valid/test exactly as megatron-core cuts them."""
    cfg = import_megatron("megatron.core.datasets.blended_megatron_dataset_config")
    matrix = cfg.convert_split_vector_to_split_matrix(cfg.parse_and_normalize_split(split))
    ranges: list[tuple[int, int] | None] = []
    for bookend in matrix:
        if bookend is None:
            ranges.append(None)
        else:
            ranges.append(
                (
                    int(round(bookend[0] * float(num_documents))),
                    int(round(bookend[1] * float(num_documents))),
                )
            )
    return ranges


def _index_fingerprint(prefix: str) -> str:
    # Megatron keys its index cache by path, not content; a rebuilt dataset at the same path
    # must not reuse stale shuffles, so the cache lives under a hash of the .idx bytes.
    digest = hashlib.sha256()
    with open(prefix + ".idx", "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def build_gpt_datasets(
    data_prefix: str | os.PathLike[str],
    tokenizer: Any,
    seq_length: int,
    seed: int,
    split: str,
    train_samples: int,
    valid_samples: int,
    cache_dir: str | os.PathLike[str],
    *,
    eod_mask_loss: bool = False,
    create_attention_mask: bool = False,
) -> tuple[Any, Any]:
    """Build ``(train_ds, valid_ds)`` megatron-core ``GPTDataset`` objects.

    ``split`` is Megatron's ratio string, e.g. ``"98,2,0"`` (documents, in file order). Each
    dataset has at least the requested number of samples (more epochs are drawn as needed) and
    ``ds[i]`` is a dict of 1-D tensors of length ``seq_length``: ``tokens`` int64, ``labels``
    int64 (tokens shifted by one), ``loss_mask`` float32, ``position_ids`` int64 (plus
    ``attention_mask`` if ``create_attention_mask``). ``valid_ds`` is None when the split has
    no validation part. Call on every rank when torch.distributed is initialised.
    """
    prefix = check_prefix(data_prefix)
    if seq_length < 2:
        raise ValueError(f"seq_length must be >= 2, got {seq_length}")
    ensure_helpers()
    gpt = import_megatron("megatron.core.datasets.gpt_dataset")
    builder_mod = import_megatron("megatron.core.datasets.blended_megatron_dataset_builder")
    num_documents = read_index_stats(prefix).num_documents
    ranges = split_document_ranges(split, num_documents)
    for name, rng, wanted in (
        ("train", ranges[0], train_samples),
        ("valid", ranges[1], valid_samples),
        ("test", ranges[2], 0),
    ):
        # megatron-core fails obscurely on a split part that exists but holds no document.
        if (rng is None and wanted) or (rng is not None and rng[1] <= rng[0]):
            raise ValueError(
                f"split {split!r} gives the {name} set no documents "
                f"(the dataset has {num_documents})"
            )

    path_to_cache = Path(cache_dir) / _index_fingerprint(prefix)
    config = gpt.GPTDatasetConfig(
        random_seed=int(seed),
        sequence_length=int(seq_length),
        blend=([prefix], None),
        split=split,
        path_to_cache=str(path_to_cache),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask,
        mmap_bin_files=True,
    )
    sizes = [int(train_samples), int(valid_samples), 0]
    builder = builder_mod.BlendedMegatronDatasetBuilder(gpt.GPTDataset, sizes, lambda: True, config)
    train_ds, valid_ds, _ = builder.build()
    if ranges[1] is None:
        valid_ds = None
    return train_ds, valid_ds

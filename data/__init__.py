"""Data layer: default corpus, SentencePiece and Hugging Face tokenizers, Megatron indexed
datasets, GPT datasets built by megatron-core, image-classification sources and datasets,
and resumable micro-batch sampling.

Names are resolved lazily (PEP 562) so ``import data.corpus`` does not pull in torch, and
megatron.core (about 1 s to import, its fusions left uncompiled: ``indexed.import_megatron``) is
loaded only when a dataset is written or read.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "stdlib_documents": "data.corpus",
    "iter_texts": "data.corpus",
    "corpus_fingerprint": "data.corpus",
    "train_sentencepiece": "data.tokenizer",
    "SentencePieceTokenizer": "data.tokenizer",
    "HFTokenizer": "data.tokenizer",
    "load_tokenizer": "data.tokenizer",
    "dataset_prefix": "data.indexed",
    "write_indexed_dataset": "data.indexed",
    "read_indexed_dataset": "data.indexed",
    "PreparedData": "data.prepare",
    "prepare_corpus_data": "data.prepare",
    "prepare_default_data": "data.prepare",
    "prepare_data_from_prefix": "data.prepare",
    "build_gpt_datasets": "data.gpt_data",
    "ImageSource": "data.image_data",
    "digits_source": "data.image_data",
    "folder_source": "data.image_data",
    "packed_source": "data.image_data",
    "write_packed": "data.image_data",
    "split_indices": "data.image_data",
    "channel_mean_std": "data.image_data",
    "ImageDataset": "data.image_data",
    "build_image_datasets": "data.image_data",
    "MicroBatchSampler": "data.sampler",
    "micro_batches": "data.sampler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(__all__)

"""The ``data`` sections of the model families.

A family names its data section (``ModelFamily.data_section``) as it names its model section,
so each kind of data has its own keys: text (a corpus, a tokenizer, Megatron indexed files)
here, images with the ViT family. The run's other sections are the same for every family
(training/config_schema.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from data.split import PART_NAMES, split_problem
from families.config_fields import Section, doc_field, show_value

__all__ = ["ImageDataSection", "TextDataSection"]


@dataclass(frozen=True)
class TextDataSection(Section):
    """The ``data`` section of the text families (GPT, RoBERTa): a corpus and its tokenizer."""

    SECTION: ClassVar[str] = "data"

    corpus: Literal["stdlib", "prefix"] = doc_field(
        "stdlib",
        "stdlib = build the default corpus (Python standard library sources) and train a "
        "tokenizer on it; prefix = read Megatron .bin/.idx files at data.data_prefix.",
    )
    data_prefix: str | None = doc_field(
        None, "Megatron dataset path without .bin/.idx (e.g. data/owt_text_document); for prefix."
    )
    tokenizer_model: str | None = doc_field(
        None,
        "Tokenizer of the prefix data, required for prefix: a SentencePiece .model file, or "
        "for huggingface a tokenizer.json or the directory holding it (with its "
        "tokenizer_config.json). A fine-tune (checkpoint.finetune with checkpoint.load) of a "
        "checkpoint that carries its tokenizer (a converted Hugging Face model) defaults to it.",
    )
    tokenizer_type: Literal["sentencepiece", "huggingface"] = doc_field(
        "sentencepiece",
        "How to read data.tokenizer_model: sentencepiece, or huggingface (a converted model's "
        "own vocabulary; needs data.corpus prefix, the stdlib corpus trains SentencePiece).",
    )
    vocab_size: int = doc_field(
        4096, "Vocabulary of the tokenizer trained on the stdlib corpus.", ge=2
    )
    cache_dir: str = doc_field(
        ".cache/data", "Where the default corpus and its tokenizer are cached."
    )
    split: str = doc_field(
        "98,2,0",
        "train,valid,test weights: three non-negative numbers, not all 0, cutting the documents "
        "in file order. Each set the run reads needs at least one document: checked before "
        "the run starts, and the message proposes a split that fits (e.g. 19,1,0 for 20).",
    )

    def _check(self) -> None:
        self.split_weights()  # raises on a malformed split
        if self.corpus == "prefix":
            if self.data_prefix is None:
                raise self._err("data.data_prefix is required when data.corpus is 'prefix'")
        elif self.tokenizer_type != "sentencepiece":
            # The stdlib corpus is tokenised by the SentencePiece model trained on it.
            raise self._err(
                f"data.tokenizer_type {self.tokenizer_type!r} needs data.corpus 'prefix' (the "
                "stdlib corpus trains its own SentencePiece tokenizer)"
            )

    def check_config(self, cfg) -> None:
        # A fine-tune's tokenizer defaults to its checkpoint's (training/finetune_defaults.py,
        # which has filled it in when the checkpoint has one; the pre-flight names a missing one).
        finetune = cfg.checkpoint.finetune and cfg.checkpoint.load
        if self.corpus == "prefix" and self.tokenizer_model is None and not finetune:
            raise self._err(
                "data.tokenizer_model is required when data.corpus is 'prefix' (a fine-tune, "
                "checkpoint.finetune=true, takes checkpoint.load's tokenizer when it has one)"
            )

    def check_split(
        self,
        num_documents: int,
        required: tuple[str, ...] = ("train", "valid"),
        checked: tuple[str, ...] = PART_NAMES,
    ) -> None:
        """Raise ``ValueError`` naming ``data.split``, with a split that fits, when it leaves
        a set the dataset build needs without documents (``data.split.split_problem``:
        ``required`` sets are read whatever their weight, ``checked`` ones when weighted)."""
        problem = split_problem(self.split, self.split_weights(), num_documents, required, checked)
        if problem:
            raise ValueError(problem)

    def split_weights(self) -> tuple[float, float, float]:
        """The split as normalised fractions (train, valid, test)."""
        bad = self._err(
            f"data.split must be three comma-separated non-negative numbers, not all zero, "
            f"got {show_value(self.split)}"
        )
        try:
            parts = tuple(float(p) for p in self.split.split(","))
        except ValueError:
            raise bad from None
        if len(parts) != 3 or not all(math.isfinite(p) and p >= 0 for p in parts):
            raise bad
        total = sum(parts)
        if total == 0:
            raise bad
        return (parts[0] / total, parts[1] / total, parts[2] / total)


@dataclass(frozen=True)
class ImageDataSection(Section):
    """The ``data`` section of image classification (ViT): where the images come from, the
    split and the augmentation (data/image_data.py)."""

    SECTION: ClassVar[str] = "data"

    dataset: Literal["digits", "folder", "packed"] = doc_field(
        "digits",
        "digits = scikit-learn's bundled handwritten digits (1,797 8x8 grayscale images, 10 "
        "classes; nothing downloaded); folder = an image-folder tree at data.path (one "
        "sub-folder per class); packed = a set written by tools/preprocess_images.py at "
        "data.path (a prefix).",
    )
    path: str | None = doc_field(None, "Image folder or packed prefix; for folder and packed.")
    valid_path: str | None = doc_field(
        None,
        "A separate validation set of the same kind (e.g. ImageNet's val/); it replaces the "
        "split's valid part.",
    )
    channels: int = doc_field(3, "Channels decoded from a folder: 3 (RGB) or 1 (grayscale).")
    split: str = doc_field(
        "90,10,0", "train,valid,test weights, cut per class: three non-negative numbers."
    )
    mean: str | None = doc_field(
        None,
        "Per-channel normalisation mean of pixels/255, comma-separated (one value for all "
        "channels is fine); null = measured on the training images.",
    )
    std: str | None = doc_field(
        None, "Per-channel normalisation std, as data.mean; null = measured."
    )
    crop_scale_min: float = doc_field(
        0.8, "Training RandomResizedCrop: the smallest image area fraction kept.", gt=0, le=1
    )
    hflip: bool = doc_field(False, "Training: flip horizontally with probability 0.5.")
    crop_ratio: float = doc_field(
        0.875,
        "Validation: resize the shorter side to image_size / crop_ratio, centre-crop "
        "image_size (1.0 = no margin).",
        gt=0,
        le=1,
    )
    num_workers: int = doc_field(
        0, "DataLoader worker processes decoding images (0 = in the training process).", ge=0
    )

    def _check(self) -> None:
        if self.dataset != "digits" and self.path is None:
            raise self._err(f"data.path is required when data.dataset is {self.dataset!r}")
        if self.channels not in (1, 3):
            raise self._err(f"data.channels must be 1 or 3, got {show_value(self.channels)}")
        for key in ("mean", "std"):
            self.channel_values(key)  # raises on a malformed list

    def channel_values(self, key: str) -> tuple[float, ...] | None:
        """``data.mean`` / ``data.std`` as floats (None when null)."""
        text = getattr(self, key)
        if text is None:
            return None
        try:
            values = tuple(float(v) for v in str(text).split(","))
        except ValueError:
            values = ()
        if (
            not values
            or not all(math.isfinite(v) for v in values)
            or (key == "std" and min(values) <= 0)
        ):
            raise self._err(
                f"data.{key} must be comma-separated numbers{' > 0' if key == 'std' else ''}, "
                f"got {show_value(text)}"
            )
        return values

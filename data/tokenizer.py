"""SentencePiece tokenizer for code: trained locally, deterministic, lossless on decode.

Training settings that matter for source code (all in :data:`TRAINER_OPTIONS`):

- ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False`` and
  ``add_dummy_prefix=False``: nothing is folded or stripped, so indentation, runs of spaces and
  a file's first character survive ``decode(encode(text))`` byte for byte.
- ``user_defined_symbols=["\\n"]``: SentencePiece trains on lines and would otherwise never see
  a newline; as a user symbol it is one token everywhere.
- ``allow_whitespace_only_pieces=True``: indentation runs ("▁▁▁▁", "▁▁▁▁▁▁▁▁") become single
  pieces instead of one token per space.
- ``byte_fallback=True``: any text encodes (tabs, rare unicode) without ``<unk>``.
- ``num_threads=1``, explicit seed, no internal shuffling: the same input gives the same model.
  When the input has more lines than ``max_sentences`` we subsample them ourselves with a seeded
  reservoir so the choice does not depend on SentencePiece internals.

Special ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2 (the end-of-document token, ``eod``),
``<pad>``=3, ``"\\n"``=4; byte pieces follow.
"""

from __future__ import annotations

import hashlib
import io
import os
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

__all__ = [
    "TRAINER_OPTIONS",
    "DEFAULT_MAX_SENTENCES",
    "train_sentencepiece",
    "SentencePieceTokenizer",
]

# Part of the data cache key (data/prepare.py): change any value and caches rebuild.
TRAINER_OPTIONS: dict[str, object] = {
    "model_type": "bpe",
    "character_coverage": 0.9995,
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": True,
    "max_sentencepiece_length": 16,
    "max_sentence_length": 8192,
    "user_defined_symbols": ["\n"],
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": 3,
    "num_threads": 1,
    "input_sentence_size": 0,
    "shuffle_input_sentence": False,
    "minloglevel": 2,
}

# BPE on 300k lines of code with vocab 8192 trains in a few seconds on one core; the full
# stdlib has about 280k non-blank lines, so it is used whole.
DEFAULT_MAX_SENTENCES = 300_000


def _iter_lines(paths_or_texts: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    for item in paths_or_texts:
        text = Path(item).read_text(encoding="utf-8") if isinstance(item, os.PathLike) else item
        for line in text.split("\n"):
            if line.strip():
                yield line


def _sample_lines(lines: Iterable[str], max_sentences: int, seed: int) -> list[str]:
    """Seeded reservoir sample (algorithm R) kept in input order; all lines if there are fewer."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        if i < max_sentences:
            reservoir.append((i, line))
        else:
            j = rng.randrange(i + 1)
            if j < max_sentences:
                reservoir[j] = (i, line)
    reservoir.sort(key=lambda item: item[0])
    return [line for _, line in reservoir]


def trainer_options(control_symbols: Sequence[str] = ()) -> dict[str, object]:
    """``TRAINER_OPTIONS``, plus ``control_symbols`` (e.g. ``["<mask>"]`` for masked-LM
    models: ids right after ``<pad>``, never produced by encoding text, so a literal
    ``<mask>`` in the corpus stays ordinary text)."""
    if not control_symbols:
        return dict(TRAINER_OPTIONS)
    return {**TRAINER_OPTIONS, "control_symbols": list(control_symbols)}


def train_sentencepiece(
    paths_or_texts: Iterable[str | os.PathLike[str]],
    model_prefix: str | os.PathLike[str],
    vocab_size: int,
    seed: int = 1234,
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    control_symbols: Sequence[str] = (),
) -> Path:
    """Train a BPE SentencePiece model and write ``{model_prefix}.model``; returns that path.

    ``paths_or_texts``: ``pathlib.Path`` (or any ``os.PathLike``) items are read as UTF-8 files;
    plain ``str`` items are the text itself. Blank lines are not used for training.
    ``control_symbols``: extra special pieces (see ``trainer_options``).
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte fallback alone needs 261")
    sentences = _sample_lines(_iter_lines(paths_or_texts), max_sentences, seed)
    if not sentences:
        raise ValueError("no non-blank text to train the tokenizer on")
    model_path = Path(f"{os.fspath(model_prefix)}.model")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    proto = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=proto,
            vocab_size=vocab_size,
            **trainer_options(control_symbols),
        )
    except RuntimeError as err:  # e.g. vocab smaller than the characters the text needs
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"sentencepiece training failed (vocab_size={vocab_size}): {first}"
        ) from err
    model_path.write_bytes(proto.getvalue())
    return model_path


class SentencePieceTokenizer:
    """A SentencePiece model with the attributes megatron-core's GPTDataset reads.

    megatron.core reads ``vocab_size``, ``eod``, ``pad`` and (for its index-cache key)
    ``unique_identifiers``; ``tokenize``/``detokenize`` mirror its legacy tokenizer API.
    """

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        path = Path(model_path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {str(path)!r}")
        blob = path.read_bytes()
        self.model_path = path
        self._sp = spm.SentencePieceProcessor(model_proto=blob)
        if self._sp.eos_id() < 0:
            raise ValueError(f"tokenizer model {str(path)!r} has no </s> piece to use as EOD")
        # Keys megatron's sample-index cache. The content hash, not the path: every rank must
        # compute the same key even where the file is mounted at different paths.
        self.unique_identifiers: OrderedDict[str, object] = OrderedDict(
            [("class", type(self).__name__), ("sha256", hashlib.sha256(blob).hexdigest())]
        )

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad(self) -> int:
        # -1 (megatron's "no pad") for models trained without a pad piece.
        return int(self._sp.pad_id())

    @property
    def unk(self) -> int:
        return int(self._sp.unk_id())

    @property
    def mask(self) -> int:
        """The ``<mask>`` control symbol's id, or -1 when the model has none."""
        i = int(self._sp.piece_to_id("<mask>"))
        return i if self._sp.id_to_piece(i) == "<mask>" and self._sp.is_control(i) else -1

    @property
    def newline(self) -> int:
        """The id of the ``"\\n"`` piece (a user symbol in tokenizers trained here), or -1 when
        the model has no piece that is exactly a newline."""
        i = int(self._sp.piece_to_id("\n"))
        return i if self._sp.id_to_piece(i) == "\n" else -1

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (SentencePiece runs the batch in C++ threads)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int] | np.ndarray) -> str:
        return self.decode(ids)

    # Picklable (e.g. for DataLoader worker processes): rebuild the processor from the bytes.
    def __getstate__(self) -> dict[str, object]:
        return {
            "model_path": self.model_path,
            "blob": self._sp.serialized_model_proto(),
            "unique_identifiers": self.unique_identifiers,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        self.model_path = state["model_path"]
        self._sp = spm.SentencePieceProcessor(model_proto=state["blob"])
        self.unique_identifiers = state["unique_identifiers"]

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"

"""Masked-LM (RoBERTa) train/valid datasets read from a Megatron indexed dataset.

Packing ("full sentences" across document boundaries, RoBERTa style):

- The split part's documents (``split_document_ranges``, the same document ranges
  megatron-core gives GPT) are laid out in a document order drawn per epoch from a numpy
  Generator seeded by ``(seed, part, epoch)``, each document followed by ``</s>`` (the
  separator across document boundaries). A document stored with a trailing ``</s>`` (what
  ``data/prepare.py`` and ``tools/preprocess_data.py`` write: the EOD is ``</s>``) keeps
  exactly one separator; documents with nothing else are skipped. Every epoch has the same
  stream length and a fresh document order.
- Sample ``k`` of an epoch is the window of ``W = seq_length - 2`` stream tokens starting at
  ``k * W``, wrapped as ``<s> window </s>``; the last, partial window of an epoch is padded
  with ``<pad>`` (``attention_mask`` 0 there). Windows cut through documents and sentences
  (fairseq's ``--sample-break-mode none`` cut, with RoBERTa's cross-document packing): no
  token is dropped and item ``i`` is found by a binary search, with no sample index to build,
  cache or share between ranks. Item ``i`` is window ``i % samples_per_epoch`` of epoch
  ``i // samples_per_epoch``; ``len(dataset)`` is the requested number of samples.

Dynamic masking, resume-exact: item ``i`` is masked by a numpy Generator seeded by
``(seed, part, i)`` alone, so the same ``i`` always gives the same sample (whatever was read
before, in whatever process), and a window seen again in a later epoch (a different ``i``)
gets a fresh mask. Train and valid use different ``part`` values, so their masks are
independent. Candidates are the real tokens of the window other than ``<s>``, ``</s>``,
``<pad>``, ``<mask>`` and ``never_mask`` (the separators are never predicted). Exactly
``max(1, floor(mask_prob * n + 0.5))`` of the ``n`` candidates are chosen without
replacement (none when ``n == 0``). Each chosen token then independently becomes a random
id with probability ``random_prob``, stays itself with probability ``keep_prob`` and becomes
``<mask>`` otherwise (per-token draws, as BERT and Hugging Face do: exact 80/10/10 in
expectation for any window; exact counts by rounding would never produce a random or kept
token when fewer than 5 tokens are chosen). Random ids are uniform over the non-special
vocabulary ``[0, vocab_size)`` minus the special ids and ``never_mask``; they may equal the
original token, as in BERT.

Item (torch tensors of length ``seq_length``): ``tokens`` int64 (after masking), ``labels``
int64 (original token at chosen positions, -100 elsewhere), ``loss_mask`` float32 (1 at
chosen positions), ``attention_mask`` int64 (1 real, 0 pad) and ``token_types`` int64 zeros,
what ``models.roberta.RobertaModel.forward_chunk`` reads. No torch.distributed, no global RNG,
no cache files: every rank builds the same dataset independently.

Reading: megatron-core's ``IndexedDataset`` supplies the index (sequence lengths and pointers,
document boundaries; a document may hold several sequences, concatenated); tokens are
gathered vectorised from a numpy memmap of the ``.bin`` (opened lazily, so the dataset
pickles for DataLoader workers).

Why not megatron-core's ``BERTMaskedWordPieceDataset`` / ``MaskedWordPieceDataset`` (0.16.1,
checked here on a small dataset):

- it needs an initialised process group: building its sample index calls
  ``torch.distributed.get_rank()`` unconditionally (masked_dataset.py:184, "Default process
  group has not been initialized");
- its padding mask is ``ones`` with ``mask_pads[tokens == pad] = pad`` (bert_dataset.py:148),
  which is only right for pad id 0: with RoBERTa's pad id 1 every pad is marked attendable
  (measured: ``padding_mask`` all ones on a padded sample), and pads are rewritten to id 0;
- its mask is ``RandomState(seed + idx)`` (bert_dataset.py:86): fixed per sample index, so
  masking is only as dynamic as the sample index (megatron's per-epoch copies of a window do
  get other indices, hence other masks), and ``seed + idx`` makes seeds ``s`` and ``s + 1``
  share masks shifted by one index;
- it packs sentences within one document only (``helpers.build_mapping``), truncating from
  both ends at random beyond ``seq_length - 3``: with one sequence per document, as this
  project writes, a sample is one truncated document and the rest of the document is lost
  (measured: 49-59 token documents, 32-token samples, one per document per epoch);
- it expects a WordPiece tokenizer (``cls``/``sep``/``inv_vocab`` with ``##`` continuations)
  and draws its random replacements from the whole vocabulary, specials included.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from data.gpt_data import split_document_ranges
from data.indexed import check_prefix, read_index_stats, read_indexed_dataset

__all__ = ["MLMSpecialTokens", "MLMDataset", "build_mlm_datasets"]

IGNORE_INDEX = -100
_ORDER, _MASK = 0, 1  # RNG stream tags
_PART_NAMES = ("train", "valid", "test")


@dataclass(frozen=True)
class MLMSpecialTokens:
    """Token ids the masked-LM data needs; ``vocab_size`` is the tokenizer's (unpadded) size.

    ``never_mask``: further ids (e.g. ``<unk>``) that are never chosen for prediction and
    never drawn as random replacements.
    """

    bos: int
    eos: int
    pad: int
    mask: int
    vocab_size: int
    never_mask: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "never_mask", frozenset(int(t) for t in self.never_mask))
        for name in ("bos", "eos", "pad", "mask"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} id {value} is outside [0, vocab_size={self.vocab_size})")
        if len({self.bos, self.eos, self.pad, self.mask}) != 4:
            raise ValueError(
                f"bos/eos/pad/mask ids must differ: {self.bos}/{self.eos}/{self.pad}/{self.mask}"
            )
        bad = sorted(t for t in self.never_mask if not 0 <= t < self.vocab_size)
        if bad:
            raise ValueError(f"never_mask ids {bad} are outside [0, vocab_size)")
        if len(self.excluded_ids) >= self.vocab_size:
            raise ValueError("no non-special token id left to draw random replacements from")

    @property
    def excluded_ids(self) -> frozenset[int]:
        """Ids never predicted and never drawn as random replacements."""
        return frozenset({self.bos, self.eos, self.pad, self.mask}) | self.never_mask


def _rng(seed: int, part: int, tag: int, index: int) -> np.random.Generator:
    # Fixed-length 32-bit words: SeedSequence treats trailing zero words and multi-word ints
    # ambiguously, a fixed layout keeps every (seed, part, tag, index) its own stream.
    words = np.array(
        [seed, part, tag, index >> 32, index & 0xFFFFFFFF],
        dtype=np.uint32,
    )
    return np.random.default_rng(np.random.SeedSequence(words))


class MLMDataset:
    """Map-style masked-LM dataset over documents ``[begin, end)`` of an indexed dataset.

    Use :func:`build_mlm_datasets`; ``part`` (0 train, 1 valid, 2 test) separates the RNG
    streams of the split parts.
    """

    def __init__(
        self,
        data_prefix: str | os.PathLike[str],
        document_range: tuple[int, int],
        num_samples: int,
        *,
        seq_length: int,
        seed: int,
        part: int,
        special: MLMSpecialTokens,
        mask_prob: float = 0.15,
        random_prob: float = 0.1,
        keep_prob: float = 0.1,
    ) -> None:
        if seq_length < 3:
            raise ValueError(f"seq_length must be >= 3 (<s>, a token, </s>), got {seq_length}")
        if not 0 <= seed < 2**32 or not 0 <= part < 2**32:
            raise ValueError(f"seed ({seed}) and part ({part}) must be in [0, 2**32)")
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if not 0.0 < mask_prob <= 1.0:
            raise ValueError(f"mask_prob must be in (0, 1], got {mask_prob}")
        if random_prob < 0 or keep_prob < 0 or random_prob + keep_prob > 1.0:
            raise ValueError(
                f"random_prob ({random_prob}) and keep_prob ({keep_prob}) must be >= 0 "
                "and sum to at most 1"
            )
        self.prefix = check_prefix(data_prefix)
        self.seq_length = int(seq_length)
        self.window = self.seq_length - 2
        self.seed = int(seed)
        self.part = int(part)
        self.special = special
        self.mask_prob = float(mask_prob)
        self.random_prob = float(random_prob)
        self.keep_prob = float(keep_prob)
        self.num_samples = int(num_samples)

        begin, end = (int(x) for x in document_range)
        indexed = read_indexed_dataset(self.prefix)
        num_documents = indexed.document_indices.shape[0] - 1
        if not 0 <= begin < end <= num_documents:
            raise ValueError(
                f"document range [{begin}, {end}) is empty or outside [0, {num_documents})"
            )
        # Copies: megatron's _IndexReader.__del__ closes the .idx mmap, and a numpy view of
        # it read after that is a segfault, not an error.
        lengths = np.array(indexed.index.sequence_lengths, dtype=np.int64)
        pointers = np.array(indexed.index.sequence_pointers, dtype=np.int64)
        doc_idx = np.array(indexed.index.document_indices, dtype=np.int64)
        self._dtype = np.dtype(indexed.index.dtype)
        del indexed
        itemsize = self._dtype.itemsize
        # IndexedDatasetBuilder writes sequences back to back; a document's tokens are then
        # one slice of the .bin, which is what the vectorised gather relies on.
        expected = np.concatenate(([0], np.cumsum(lengths)[:-1])) * itemsize
        if lengths.size and not np.array_equal(pointers, expected):
            raise ValueError(f"{self.prefix}.bin: sequences are not stored contiguously")
        seq_starts = np.concatenate(([0], np.cumsum(lengths)))  # token offsets, n + 1 of them
        starts = seq_starts[doc_idx[begin:end]]
        counts = seq_starts[doc_idx[begin + 1 : end + 1]] - starts
        nonempty = counts > 0
        if not nonempty.any():  # also keeps np.memmap off an empty .bin
            raise ValueError(f"documents [{begin}, {end}) of {self.prefix!r} hold no tokens")
        tokens = self._tokens()
        last = np.zeros_like(counts)
        last[nonempty] = tokens[starts[nonempty] + counts[nonempty] - 1]
        # One stored trailing </s> (the EOD) is the document's separator: not doubled.
        content = counts - (nonempty & (last == special.eos))
        keep = content > 0
        if not keep.any():
            raise ValueError(f"documents [{begin}, {end}) of {self.prefix!r} hold no tokens")
        self.documents = np.arange(begin, end, dtype=np.int64)[keep]
        self._starts = starts[keep]  # first token of each kept document in the .bin
        self._content = content[keep]  # its tokens, trailing </s> excluded
        self.tokens_per_epoch = int(self._content.sum() + self._content.size)  # + separators
        self.samples_per_epoch = -(-self.tokens_per_epoch // self.window)
        self._epochs: OrderedDict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = OrderedDict()

        excluded = np.zeros(special.vocab_size, dtype=bool)
        excluded[sorted(special.excluded_ids)] = True
        self._excluded = excluded
        self._replacements = np.flatnonzero(~excluded)

    # -- reading -------------------------------------------------------------------------------

    def _tokens(self) -> np.ndarray:
        mm = self.__dict__.get("_mm")
        if mm is None:
            mm = np.memmap(self.prefix + ".bin", dtype=self._dtype, mode="r")
            self._mm = mm
        return mm

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_mm", None)
        state["_epochs"] = OrderedDict()
        return state

    def document_order(self, epoch: int) -> np.ndarray:
        """Document ids (indices into the indexed dataset) in the stream order of ``epoch``."""
        return self.documents[self._epoch(epoch)[0]]

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cached = self._epochs.get(epoch)
        if cached is None:
            order = _rng(self.seed, self.part, _ORDER, epoch).permutation(self.documents.size)
            units = self._content[order] + 1
            cached = (order, np.cumsum(units), units)
            self._epochs[epoch] = cached
            while len(self._epochs) > 2:  # an epoch boundary touches two; sequential reads one
                self._epochs.popitem(last=False)
        return cached

    def stream_window(self, index: int) -> np.ndarray:
        """The unmasked stream tokens of item ``index`` (``<= seq_length - 2`` of them)."""
        epoch, k = divmod(int(index), self.samples_per_epoch)
        order, ends, units = self._epoch(epoch)
        a = k * self.window
        b = min(a + self.window, self.tokens_per_epoch)
        pos = np.arange(a, b, dtype=np.int64)
        j = np.searchsorted(ends, pos, side="right")  # which document of the order
        off = pos - (ends[j] - units[j])
        content = self._content[order[j]]
        gather = self._starts[order[j]] + np.minimum(off, content - 1)
        out = self._tokens()[gather].astype(np.int64)
        out[off == content] = self.special.eos
        return out

    # -- items ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        sp = self.special
        window = self.stream_window(i)
        n = window.size
        if n and int(window.max()) >= sp.vocab_size:
            raise ValueError(
                f"{self.prefix}.bin holds token id {int(window.max())} >= vocab_size "
                f"{sp.vocab_size}"
            )
        seq = np.full(self.seq_length, sp.pad, dtype=np.int64)
        seq[0] = sp.bos
        seq[1 : n + 1] = window
        seq[n + 1] = sp.eos
        attention = np.zeros(self.seq_length, dtype=np.int64)
        attention[: n + 2] = 1

        tokens = seq.copy()
        labels = np.full(self.seq_length, IGNORE_INDEX, dtype=np.int64)
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        candidates = 1 + np.flatnonzero(~self._excluded[window])
        if candidates.size:
            rng = _rng(self.seed, self.part, _MASK, i)
            count = max(1, int(np.floor(self.mask_prob * candidates.size + 0.5)))
            chosen = rng.choice(candidates, size=count, replace=False)
            u = rng.random(count)
            to_random = chosen[u < self.random_prob]
            to_mask = chosen[u >= self.random_prob + self.keep_prob]
            labels[chosen] = seq[chosen]
            loss_mask[chosen] = 1.0
            tokens[to_mask] = sp.mask
            pool = self._replacements
            tokens[to_random] = pool[rng.integers(0, pool.size, size=to_random.size)]
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "attention_mask": torch.from_numpy(attention),
            "token_types": torch.zeros(self.seq_length, dtype=torch.int64),
        }


def build_mlm_datasets(
    data_prefix: str | os.PathLike[str],
    *,
    seq_length: int,
    seed: int,
    split: str,
    train_samples: int,
    valid_samples: int,
    special: MLMSpecialTokens,
    mask_prob: float = 0.15,
    random_prob: float = 0.1,
    keep_prob: float = 0.1,
) -> tuple[MLMDataset, MLMDataset | None]:
    """``(train, valid)`` masked-LM datasets of ``train_samples``/``valid_samples`` items.

    ``split`` is Megatron's ratio string (documents in file order, cut exactly as for GPT).
    ``valid`` is None when the split has no validation part (``valid_samples`` is then not
    used). A split part that exists but holds no document raises ValueError.
    """
    prefix = check_prefix(data_prefix)
    num_documents = read_index_stats(prefix).num_documents
    ranges = split_document_ranges(split, num_documents)
    out: list[MLMDataset | None] = []
    for part, wanted in ((0, train_samples), (1, valid_samples)):
        rng = ranges[part]
        if rng is None:
            if part == 0:
                raise ValueError(f"split {split!r} has no train part")
            out.append(None)
            continue
        if rng[1] <= rng[0]:
            raise ValueError(
                f"split {split!r} gives the {_PART_NAMES[part]} set no documents "
                f"(the dataset has {num_documents})"
            )
        out.append(
            MLMDataset(
                prefix,
                rng,
                int(wanted),
                seq_length=seq_length,
                seed=seed,
                part=part,
                special=special,
                mask_prob=mask_prob,
                random_prob=random_prob,
                keep_prob=keep_prob,
            )
        )
    return out[0], out[1]

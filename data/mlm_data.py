"""Masked-LM (RoBERTa) train/valid datasets read from a Megatron indexed dataset.

Stream. The split part's documents (``split_document_ranges``, the same document ranges
megatron-core gives GPT) are laid out in a document order drawn per epoch from a numpy
Generator seeded by ``(seed, part, epoch)``, each document followed by ``</s>`` (the separator
across document boundaries). A document stored with a trailing ``</s>`` (what
``data/prepare.py`` and ``tools/preprocess_data.py`` write: the EOD is ``</s>``) keeps exactly
one separator; documents with nothing else are skipped. Every epoch has the same stream length
(``tokens_per_epoch``) and a fresh document order.

Packing: RoBERTa's FULL-SENTENCES (fairseq ``--sample-break-mode complete``: "full sentences
sampled contiguously from one or more documents, such that the total length is at most 512
tokens").

- A sentence ends after any id in ``special.sentence_ends`` (the RoBERTa family passes the
  ``"\\n"`` piece: lines of code are sentences) and after each document separator. Other ids
  stored inside a document are data, a ``</s>`` among them included.
- Window ``k`` of an epoch starts where window ``k - 1`` ended (stream position 0 for the
  first) and extends, across document boundaries, to the last sentence end that keeps it at
  most ``W = seq_length - 2`` tokens. A sentence longer than ``W`` is cut into ``W``-token
  pieces and its remainder packs on with the following sentences. The windows of an epoch
  tile its stream: no token is dropped or repeated. Without ``sentence_ends`` this is a cut at
  every document end plus ``W``-pieces of longer documents.
- A sample is ``<s> window </s>`` padded with ``<pad>`` to ``seq_length`` (``attention_mask``
  0 there).

Cost. Sentence ends are found once, by a chunked vectorised scan of the part's tokens, and
kept as within-document offsets. Per epoch they are mapped to stream positions through the
epoch's document order (one gather); one vectorised ``searchsorted`` gives, for every sentence
end, the farthest end a window starting there may reach; a Python loop then follows that
pointer once per window, never once per sentence: O(E log E) vectorised work for E sentence
ends plus O(windows) interpreter steps. The window bounds of the two most recently used epochs
are cached. The number of windows depends on the epoch's document order, so item ``i`` is
found in a cumulative list of per-epoch window counts, extended in epoch order on demand: the
first item of epoch ``e`` a process reads packs epochs ``0..e`` once (later lookups are a
bisect). No sample index is written, cached on disk or shared between ranks;
``len(dataset)`` is the requested number of samples.

Sentence-order pairs (``binary_head=True``; ALBERT's sentence-order prediction, Megatron-BERT's
binary head):

- The separator is not a stream token and each document end is a hard break: a window never
  crosses a document, so both segments of a pair come from one document. ``W = seq_length - 4``.
- A window is split at one of its interior sentence boundaries drawn uniformly; with none, at
  its token midpoint (the first segment gets ``ceil(n / 2)`` tokens). A one-token window (a
  one-token document, or the tail of a cut sentence at a document end) gives the first segment
  that token and the second none: packing cannot avoid it without dropping a token or
  crossing a document, and it is rare.
- With probability 0.5 the segments swap. A sample is ``<s> A </s> </s> B </s>`` (``sop_label``
  0) or ``<s> B </s> </s> A </s>`` (``sop_label`` 1), then pads. ``token_types`` is 0 on
  ``<s>``, the first segment and its ``</s>``, 1 on the second ``</s>``, the second segment and
  the final ``</s>``, 0 on pads.
- Split and swap come from their own per-item stream (tag ``_PAIR``), so the masking draws
  below are the same streams in both modes and the default mode is untouched by this one.

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
chosen positions), ``attention_mask`` int64 (1 real, 0 pad) and ``token_types`` int64 (zeros
unless ``binary_head``), what ``models.roberta.RobertaModel.forward_chunk`` reads; with
``binary_head`` also ``sop_label``, an int64 scalar tensor. No torch.distributed, no global
RNG, no cache files: every rank builds the same dataset independently.

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

import bisect
import os
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from data.gpt_data import split_document_ranges
from data.indexed import check_prefix, read_index_stats, read_indexed_dataset
from data.seeded import keyed_rng

__all__ = ["MLMSpecialTokens", "MLMDataset", "build_mlm_datasets"]

IGNORE_INDEX = -100
_ORDER, _MASK, _PAIR, _SHUFFLE = 0, 1, 2, 3  # RNG stream tags
_PART_NAMES = ("train", "valid", "test")
_SCAN_CHUNK = 1 << 24  # tokens per step of the sentence-end scan: bounded memory on any corpus


@dataclass(frozen=True)
class MLMSpecialTokens:
    """Token ids the masked-LM data needs; ``vocab_size`` is the tokenizer's (unpadded) size.

    ``never_mask``: further ids (e.g. ``<unk>``) that are never chosen for prediction and
    never drawn as random replacements. ``sentence_ends``: ids after which a sentence ends
    (packing boundaries, e.g. the ``"\\n"`` piece); empty means documents are the sentences.
    """

    bos: int
    eos: int
    pad: int
    mask: int
    vocab_size: int
    never_mask: frozenset[int] = field(default_factory=frozenset)
    sentence_ends: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        for name in ("never_mask", "sentence_ends"):
            ids = frozenset(int(t) for t in getattr(self, name))
            object.__setattr__(self, name, ids)
            bad = sorted(t for t in ids if not 0 <= t < self.vocab_size)
            if bad:
                raise ValueError(f"{name} ids {bad} are outside [0, vocab_size)")
        for name in ("bos", "eos", "pad", "mask"):
            value = getattr(self, name)
            if not 0 <= value < self.vocab_size:
                raise ValueError(f"{name} id {value} is outside [0, vocab_size={self.vocab_size})")
        if len({self.bos, self.eos, self.pad, self.mask}) != 4:
            raise ValueError(
                f"bos/eos/pad/mask ids must differ: {self.bos}/{self.eos}/{self.pad}/{self.mask}"
            )
        if len(self.excluded_ids) >= self.vocab_size:
            raise ValueError("no non-special token id left to draw random replacements from")

    @property
    def excluded_ids(self) -> frozenset[int]:
        """Ids never predicted and never drawn as random replacements."""
        return frozenset({self.bos, self.eos, self.pad, self.mask}) | self.never_mask


# -- packing (module functions: pure numpy, no dataset state) ------------------------------------


def _scan_for_ids(tokens: np.ndarray, lo: int, hi: int, ids: Sequence[int]) -> np.ndarray:
    """Ascending positions in ``[lo, hi)`` of ``tokens`` that hold one of ``ids``."""
    found = [np.empty(0, dtype=np.int64)]
    for a in range(lo, hi, _SCAN_CHUNK):
        chunk = np.asarray(tokens[a : min(a + _SCAN_CHUNK, hi)])
        hit = chunk == ids[0]
        for t in ids[1:]:  # a handful of ids: cheaper than np.isin's sort per chunk
            hit |= chunk == t
        found.append(a + np.flatnonzero(hit))
    return np.concatenate(found)


def _within_document_ends(
    positions: np.ndarray, starts: np.ndarray, last: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Sentence ends as offsets inside their documents, in CSR form ``(offsets, pointers)``.

    ``positions``: ascending .bin positions of sentence-end tokens; ``starts``: ascending first
    .bin position of each kept document; ``last``: the largest end offset a document keeps
    (ends past it fall on the stored EOD, in a skipped document or on the document's own end).
    Document ``d``'s ends are ``offsets[pointers[d]:pointers[d + 1]]``: exclusive, ascending.
    """
    doc = np.searchsorted(starts, positions, side="right") - 1
    safe = np.maximum(doc, 0)
    offsets = positions - starts[safe] + 1
    keep = (doc >= 0) & (offsets <= last[safe])
    doc, offsets = doc[keep], offsets[keep]
    pointers = np.searchsorted(doc, np.arange(starts.size + 1))  # doc is ascending
    # Documents are far shorter than 2**31 tokens in practice: half the memory per sentence.
    small = last.size == 0 or int(last.max()) < 2**31
    return offsets.astype(np.int32 if small else np.int64), pointers


def _stream_ends(
    offsets: np.ndarray, pointers: np.ndarray, order: np.ndarray, units: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``(sentence_ends, document_ends)``: ascending stream positions of one epoch.

    ``order``: kept documents in stream order; ``units``: stream tokens of each document (its
    separator included when there is one). Sentence ends include the document ends.
    """
    sizes = units[order]
    doc_ends = np.cumsum(sizes)
    counts = (pointers[1:] - pointers[:-1])[order]
    n_inner = int(counts.sum())
    if n_inner == 0:
        return doc_ends, doc_ends
    first = np.cumsum(counts) - counts  # where each document's ends go in the gathered array
    gather = np.repeat(pointers[:-1][order] - first, counts) + np.arange(n_inner)
    inner = offsets[gather] + np.repeat(doc_ends - sizes, counts)
    # Document k's end follows the inner ends of documents 0..k and the ends of 0..k-1.
    slots = np.cumsum(counts) + np.arange(order.size)
    ends = np.empty(n_inner + order.size, dtype=np.int64)
    is_doc = np.zeros(ends.size, dtype=bool)
    is_doc[slots] = True
    ends[slots] = doc_ends
    ends[~is_doc] = inner
    return ends, doc_ends


def _window_limit(starts: Any, budget: int, hard_ends: np.ndarray | None) -> Any:
    """Farthest end of a window starting at ``starts``: ``budget`` tokens, no hard end crossed."""
    limit = starts + budget
    if hard_ends is None:
        return limit
    nxt = np.minimum(np.searchsorted(hard_ends, starts, side="right"), hard_ends.size - 1)
    return np.minimum(limit, hard_ends[nxt])


def _pack_windows(ends: np.ndarray, budget: int, hard_ends: np.ndarray | None) -> np.ndarray:
    """Bounds ``[0, b_1, ..., total]`` of the greedy full-sentence windows of one epoch.

    ``ends``: ascending stream positions where sentences end, the last one the stream length;
    ``hard_ends``: ascending positions no window may cross (a subset of ``ends``), or None.
    Window ``k`` is ``[bounds[k], bounds[k + 1])``.
    """
    total = int(ends[-1])
    points = np.concatenate(([0], ends))  # where a window may start: stream start, sentence ends
    # reach[j]: index of the last point a window starting at points[j] may end at.
    reach = np.searchsorted(points, _window_limit(points, budget, hard_ends), side="right") - 1
    bounds = [0]
    start, j = 0, 0  # j: index of start in points; -1 inside a sentence (after a cut)
    while start < total:
        if j >= 0:
            k = int(reach[j])
        else:
            limit = _window_limit(start, budget, hard_ends)
            k = int(np.searchsorted(points, limit, side="right")) - 1
        if points[k] > start:
            start, j = int(points[k]), k
            bounds.append(start)
        else:
            # The sentence at start is longer than the budget: all its cuts at once (long
            # documents without sentence ends would otherwise cost a search per window).
            # They stop once its end (the next point, never past a hard end) is in reach.
            cuts = -(-(int(points[k + 1]) - start) // budget) - 1
            bounds.extend(range(start + budget, start + cuts * budget + 1, budget))
            start, j = start + cuts * budget, -1
    out = np.array(bounds, dtype=np.int64)
    out.flags.writeable = False  # cached and handed out: nobody may edit it in place
    return out


class _Epoch(NamedTuple):
    order: np.ndarray  # kept-document indices in stream order
    doc_ends: np.ndarray  # stream position just past each of them
    bounds: np.ndarray  # window k is the stream slice [bounds[k], bounds[k + 1])
    windows: np.ndarray  # the epoch's j-th item reads window windows[j] (a permutation)


class MLMDataset:
    """Map-style masked-LM dataset over documents ``[begin, end)`` of an indexed dataset.

    Use :func:`build_mlm_datasets`; ``part`` (0 train, 1 valid, 2 test) separates the RNG
    streams of the split parts. ``binary_head`` builds sentence-order pairs (module docstring).
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
        binary_head: bool = False,
    ) -> None:
        n_special = 4 if binary_head else 2  # <s> A </s> </s> B </s> or <s> window </s>
        if seq_length < n_special + 1:
            raise ValueError(
                f"seq_length must be >= {n_special + 1} ({n_special} specials and a token), "
                f"got {seq_length}"
            )
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
        self.binary_head = bool(binary_head)
        self.window = self.seq_length - n_special  # stream tokens per sample, at most
        self.seed = int(seed)
        self.part = int(part)
        self.special = special
        self.mask_prob = float(mask_prob)
        self.random_prob = float(random_prob)
        self.keep_prob = float(keep_prob)
        self.num_samples = int(num_samples)
        self._read_documents(*(int(x) for x in document_range))
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()
        # Windows per epoch vary with the document order: _cum_windows[e] counts the windows of
        # epochs 0..e-1 (extended in epoch order by locate()).
        self._cum_windows: list[int] = [0]

        vocab = special.vocab_size
        excluded = np.zeros(vocab, dtype=bool)
        excluded[sorted(special.excluded_ids)] = True
        self._excluded = excluded
        self._replacements = np.flatnonzero(~excluded)
        self._is_sentence_end = np.zeros(vocab, dtype=bool)
        self._is_sentence_end[sorted(special.sentence_ends)] = True

    def _read_documents(self, begin: int, end: int) -> None:
        """Kept documents, their .bin slices and their sentence ends (done once)."""
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
        content = counts - (nonempty & (last == self.special.eos))
        keep = content > 0
        if not keep.any():
            raise ValueError(f"documents [{begin}, {end}) of {self.prefix!r} hold no tokens")
        self.documents = np.arange(begin, end, dtype=np.int64)[keep]
        self._starts = starts[keep]  # first token of each kept document in the .bin
        self._content = content[keep]  # its tokens, trailing </s> excluded
        # Stream tokens per document: the separator is one more, except in pair mode.
        self._units = self._content + (0 if self.binary_head else 1)
        self.tokens_per_epoch = int(self._units.sum())

        ids = sorted(self.special.sentence_ends)
        lo, hi = int(seq_starts[doc_idx[begin]]), int(seq_starts[doc_idx[end]])
        found = _scan_for_ids(tokens, lo, hi, ids) if ids else np.empty(0, dtype=np.int64)
        # An end on a document's last token coincides with the document end in pair mode.
        last_kept = self._content - (1 if self.binary_head else 0)
        self._end_offsets, self._end_pointers = _within_document_ends(
            found, self._starts, last_kept
        )

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
        state["_cum_windows"] = list(self._cum_windows)  # cheap ints: workers skip recounting
        return state

    def _order(self, epoch: int) -> np.ndarray:
        return keyed_rng(self.seed, self.part, _ORDER, epoch).permutation(self.documents.size)

    def document_order(self, epoch: int) -> np.ndarray:
        """Document ids (indices into the indexed dataset) in the stream order of ``epoch``."""
        return self.documents[self._order(epoch)]

    def _epoch(self, epoch: int) -> _Epoch:
        cached = self._epochs.get(epoch)
        if cached is None:
            order = self._order(epoch)
            ends, doc_ends = _stream_ends(self._end_offsets, self._end_pointers, order, self._units)
            hard = doc_ends if self.binary_head else None
            bounds = _pack_windows(ends, self.window, hard)
            # Items visit the windows in a shuffled order: in stream order a batch would hold
            # consecutive windows of one or two files, and the model chases per-file token
            # statistics (measured: roberta_tiny stayed on the unigram plateau for 1500 steps).
            windows = keyed_rng(self.seed, self.part, _SHUFFLE, epoch).permutation(bounds.size - 1)
            cached = _Epoch(order, doc_ends, bounds, windows)
            self._epochs[epoch] = cached
            while len(self._epochs) > 2:  # an epoch boundary touches two; sequential reads one
                self._epochs.popitem(last=False)
        else:
            self._epochs.move_to_end(epoch)
        return cached

    def window_bounds(self, epoch: int) -> np.ndarray:
        """Read-only stream positions ``[0, ..., tokens_per_epoch]``: window ``k`` of ``epoch``
        is ``[bounds[k], bounds[k + 1])``."""
        return self._epoch(epoch).bounds

    def windows_in_epoch(self, epoch: int) -> int:
        """Number of windows (samples) in ``epoch``; it depends on the epoch's document order."""
        return self._epoch(epoch).bounds.size - 1

    def locate(self, index: int) -> tuple[int, int]:
        """``(epoch, window)`` of item ``index``: items run through the epochs in order and
        through each epoch's windows in the epoch's shuffled order."""
        i = int(index)
        if i < 0:
            raise IndexError(f"sample {index} is negative")
        cum = self._cum_windows
        while cum[-1] <= i:
            cum.append(cum[-1] + self.windows_in_epoch(len(cum) - 1))
        epoch = bisect.bisect_right(cum, i) - 1
        return epoch, int(self._epoch(epoch).windows[i - cum[epoch]])

    def stream_window(self, index: int) -> np.ndarray:
        """The unmasked stream tokens of item ``index`` (at most ``self.window`` of them)."""
        epoch, k = self.locate(index)
        ep = self._epoch(epoch)
        pos = np.arange(ep.bounds[k], ep.bounds[k + 1], dtype=np.int64)
        j = np.searchsorted(ep.doc_ends, pos, side="right")  # which document of the order
        doc = ep.order[j]
        off = pos - (ep.doc_ends[j] - self._units[doc])
        content = self._content[doc]
        gather = self._starts[doc] + np.minimum(off, content - 1)
        out = self._tokens()[gather].astype(np.int64)
        out[off == content] = self.special.eos  # the separator (never reached in pair mode)
        return out

    # -- items ---------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def _single(self, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``<s> window </s>`` then pads, and its (all zero) token types."""
        sp, n = self.special, window.size
        seq = np.full(self.seq_length, sp.pad, dtype=np.int64)
        seq[0] = sp.bos
        seq[1 : n + 1] = window
        seq[n + 1] = sp.eos
        return seq, np.zeros(self.seq_length, dtype=np.int64)

    def _split_point(self, rng: np.random.Generator, window: np.ndarray) -> int:
        """Length of segment A: an interior sentence boundary drawn uniformly, else the midpoint."""
        inner = 1 + np.flatnonzero(self._is_sentence_end[window[:-1]])
        if inner.size:
            return int(inner[rng.integers(inner.size)])
        return (window.size + 1) // 2  # a one-token window gives A the token, B nothing

    def _pair(self, i: int, window: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """``<s> A </s> </s> B </s>`` (label 0) or with A and B swapped (label 1), then pads."""
        sp = self.special
        rng = keyed_rng(self.seed, self.part, _PAIR, i)
        cut = self._split_point(rng, window)
        swap = bool(rng.random() < 0.5)
        a, b = window[:cut], window[cut:]
        first, second = (b, a) if swap else (a, b)
        p, q = first.size, second.size
        seq = np.full(self.seq_length, sp.pad, dtype=np.int64)
        seq[0] = sp.bos
        seq[1 : p + 1] = first
        seq[p + 1 : p + 3] = sp.eos
        seq[p + 3 : p + 3 + q] = second
        seq[p + 3 + q] = sp.eos
        types = np.zeros(self.seq_length, dtype=np.int64)
        types[p + 2 : p + 4 + q] = 1  # the second </s>, B and the final </s>
        return seq, types, int(swap)

    def _mask(self, i: int, seq: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(tokens, labels, loss_mask)``: the item's dynamic mask over ``seq``."""
        tokens = seq.copy()
        labels = np.full(self.seq_length, IGNORE_INDEX, dtype=np.int64)
        loss_mask = np.zeros(self.seq_length, dtype=np.float32)
        candidates = np.flatnonzero(~self._excluded[seq])  # specials and pads never chosen
        if candidates.size:
            rng = keyed_rng(self.seed, self.part, _MASK, i)
            count = max(1, int(np.floor(self.mask_prob * candidates.size + 0.5)))
            chosen = rng.choice(candidates, size=count, replace=False)
            u = rng.random(count)
            to_random = chosen[u < self.random_prob]
            to_mask = chosen[u >= self.random_prob + self.keep_prob]
            labels[chosen] = seq[chosen]
            loss_mask[chosen] = 1.0
            tokens[to_mask] = self.special.mask
            pool = self._replacements
            tokens[to_random] = pool[rng.integers(0, pool.size, size=to_random.size)]
        return tokens, labels, loss_mask

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        i = int(index)
        if not 0 <= i < self.num_samples:
            raise IndexError(f"sample {index} is outside [0, {self.num_samples})")
        window = self.stream_window(i)
        if window.size and int(window.max()) >= self.special.vocab_size:
            raise ValueError(
                f"{self.prefix}.bin holds token id {int(window.max())} >= vocab_size "
                f"{self.special.vocab_size}"
            )
        label = None
        if self.binary_head:
            seq, types, label = self._pair(i, window)
        else:
            seq, types = self._single(window)
        attention = np.zeros(self.seq_length, dtype=np.int64)
        attention[: window.size + self.seq_length - self.window] = 1  # window + its specials
        tokens, labels, loss_mask = self._mask(i, seq)
        item = {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "loss_mask": torch.from_numpy(loss_mask),
            "attention_mask": torch.from_numpy(attention),
            "token_types": torch.from_numpy(types),
        }
        if label is not None:
            item["sop_label"] = torch.tensor(label, dtype=torch.int64)
        return item


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
    binary_head: bool = False,
) -> tuple[MLMDataset, MLMDataset | None]:
    """``(train, valid)`` masked-LM datasets of ``train_samples``/``valid_samples`` items.

    ``split`` is Megatron's ratio string (documents in file order, cut exactly as for GPT).
    ``valid`` is None when the split has no validation part (``valid_samples`` is then not
    used). A split part that exists but holds no document raises ValueError. ``binary_head``
    makes sentence-order pairs with a ``sop_label`` (see the module docstring).
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
                binary_head=binary_head,
            )
        )
    return out[0], out[1]

"""Masked-LM datasets: full-sentence packing against a plain-Python packer, sentence-order
pairs, resume-exact dynamic masking, masking statistics, split disjointness and reading
through the micro-batch sampler."""

from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest
import torch

from data.gpt_data import split_document_ranges
from data.indexed import dataset_prefix, import_megatron, write_indexed_dataset
from data.mlm_data import MLMDataset, MLMSpecialTokens, build_mlm_datasets
from data.sampler import micro_batches

UNK, BOS, EOS, PAD, MASK, NL = 0, 1, 2, 3, 4, 5  # NL: the sentence-end id ("\n")
VOCAB = 5000
SPECIAL = MLMSpecialTokens(
    bos=BOS,
    eos=EOS,
    pad=PAD,
    mask=MASK,
    vocab_size=VOCAB,
    never_mask=frozenset({UNK}),
    sentence_ends=frozenset({NL}),
)
NO_SENTENCES = MLMSpecialTokens(
    bos=BOS, eos=EOS, pad=PAD, mask=MASK, vocab_size=VOCAB, never_mask=frozenset({UNK})
)
EXCLUDED = {UNK, BOS, EOS, PAD, MASK}
SEQ = 32
SEED = 1234
SPLIT = "75,25,0"  # 16 documents -> train [0, 12), valid [12, 16)
ITEM_KEYS = {"tokens", "labels", "loss_mask", "attention_mask", "token_types"}


def _documents() -> list[list[int]]:
    """16 documents; document d draws its ids from [100 + 300 d, 400 + 300 d), so every id
    names its document, with NL ending lines of ~8 tokens. Most end with the stored EOD
    (</s>), like data/prepare.py writes."""
    rng = np.random.default_rng(7)
    docs = []
    for d in range(16):
        n = 200 if d == 0 else int(rng.integers(1, 90))
        ids = rng.integers(100 + 300 * d, 400 + 300 * d, size=n)
        ids[rng.random(n) < 0.12] = NL
        ids = ids.tolist()
        docs.append(ids if d in (3, 7, 14) else ids + [EOS])
    docs[0][40:110] = range(150, 220)  # a sentence longer than two windows (W = 30, or 28)
    docs[4][-1:-1] = [NL]  # a line end just before the EOD: </s> alone is a sentence
    docs[11] = [3500, EOS]  # one token: a one-token window in pair mode
    docs[5] = []  # empty: skipped
    docs[9] = [EOS]  # nothing but the EOD: skipped
    docs[2][3:3] = [UNK, BOS, EOS, MASK, UNK]  # specials inside a document stay and are kept
    return docs


def _content(doc: list[int]) -> list[int]:
    """A document's tokens without one trailing stored </s>."""
    return doc[:-1] if doc and doc[-1] == EOS else list(doc)


def _ref_stream(docs, order) -> list[int]:
    out: list[int] = []
    for d in order:
        if _content(docs[d]):
            out += _content(docs[d]) + [EOS]
    return out


def _ref_sentences(tokens: list[int], ends: set[int], closing: list[int]) -> list[list[int]]:
    """A document's sentences: a sentence ends after an id in ``ends`` and after ``closing``
    (its separator), which ends the document's last sentence."""
    out, current = [], []
    for t in tokens:
        current.append(t)
        if t in ends:
            out.append(current)
            current = []
    current += closing
    if current:
        out.append(current)
    return out


def _ref_windows(docs, order, ends: set[int], budget: int, pairs: bool = False):
    """Greedy full-sentence packing, sentence by sentence: add a sentence while it fits;
    a sentence longer than ``budget`` is emitted in ``budget``-pieces, its rest packs on.
    ``pairs``: no separator and no window across a document end."""
    out: list[list[int]] = []
    current: list[int] = []
    for d in order:
        content = _content(docs[d])
        if not content:
            continue
        for sentence in _ref_sentences(content, ends, [] if pairs else [EOS]):
            rest = sentence
            while rest:
                if len(current) + len(rest) <= budget:
                    current, rest = current + rest, []
                elif current:
                    out.append(current)
                    current = []
                else:
                    out.append(rest[:budget])
                    rest = rest[budget:]
        if pairs and current:
            out.append(current)
            current = []
    if current:
        out.append(current)
    return out


def _ref_sample(window: list[int], seq: int) -> tuple[list[int], list[int]]:
    """(tokens, attention_mask) of ``<s> window </s>`` padded to ``seq``."""
    tokens = [BOS] + window + [EOS]
    pad = seq - len(tokens)
    return tokens + [PAD] * pad, [1] * len(tokens) + [0] * pad


def _unmasked(item) -> torch.Tensor:
    return torch.where(item["loss_mask"].bool(), item["labels"], item["tokens"])


def _doc_of(ids) -> set[int]:
    """Documents the ids come from (ids >= 100 name their document)."""
    ids = np.asarray(ids)
    return set(((ids[ids >= 100] - 100) // 300).tolist())


def _epoch_items(ds: MLMDataset, epoch: int) -> list[int]:
    """The item indices of ``epoch`` in window order (items visit an epoch's windows in a
    shuffled order); checks that they map one to one onto the epoch's windows."""
    first, n = sum(ds.windows_in_epoch(e) for e in range(epoch)), ds.windows_in_epoch(epoch)
    by_window = {}
    for i in range(first, first + n):
        e, k = ds.locate(i)
        assert e == epoch
        by_window[k] = i
    assert sorted(by_window) == list(range(n))  # every window once
    return [by_window[k] for k in range(n)]


def test_items_visit_each_epoch_in_a_shuffled_reproducible_order(corpus):
    train, _ = _build(corpus)
    again, _ = _build(corpus)
    walks = []
    for epoch in range(3):
        items = _epoch_items(train, epoch)
        assert items != sorted(items)  # not the stream order: batches mix documents
        assert items == _epoch_items(again, epoch)  # the seed alone decides (resume-exact)
        walks.append([train.locate(i)[1] for i in sorted(items)])
    assert walks[0] != walks[1] != walks[2]
    other, _ = _build(corpus, seed=SEED + 1)
    assert _epoch_items(other, 0) != _epoch_items(train, 0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    docs = _documents()
    prefix = dataset_prefix(root / "synthetic")
    write_indexed_dataset(prefix, docs, VOCAB)
    return {"root": root, "prefix": prefix, "docs": docs}


def _build(corpus, seed=SEED, split=SPLIT, train=400, valid=40, seq=SEQ, **kw):
    kw.setdefault("special", SPECIAL)
    return build_mlm_datasets(
        corpus["prefix"],
        seq_length=seq,
        seed=seed,
        split=split,
        train_samples=train,
        valid_samples=valid,
        **kw,
    )


def test_the_corpus_exercises_every_packing_case(corpus):
    docs, w = corpus["docs"], SEQ - 2
    sentences = [s for d in docs for s in _ref_sentences(_content(d), {NL}, [EOS])]
    assert max(map(len, sentences)) > 2 * w  # cut into pieces
    assert [EOS] in sentences  # a separator alone, after a line end
    assert sum(len(s) == 1 for s in sentences) > 1 and np.mean(list(map(len, sentences))) < 10


@pytest.mark.parametrize("special", [SPECIAL, NO_SENTENCES], ids=["lines", "documents"])
def test_packing_matches_plain_python_packer(corpus, special):
    docs = corpus["docs"]
    ends = set(special.sentence_ends)
    train, valid = _build(corpus, special=special)
    assert len(train) == 400 and len(valid) == 40
    for ds, (begin, end) in ((train, (0, 12)), (valid, (12, 16))):
        kept = [d for d in range(begin, end) if _content(docs[d])]
        assert ds.tokens_per_epoch == sum(len(_content(docs[d])) + 1 for d in kept)
        orders = []
        for epoch in range(4):
            order = ds.document_order(epoch).tolist()
            assert sorted(order) == kept  # every non-empty document once per epoch
            orders.append(order)
            ref = _ref_windows(docs, order, ends, SEQ - 2)
            assert ds.windows_in_epoch(epoch) == len(ref)
            items = _epoch_items(ds, epoch)
            for k, (i, window) in enumerate(zip(items, ref)):
                assert ds.locate(i) == (epoch, k)
                assert ds.stream_window(i).tolist() == window, (epoch, k)
                if i < len(ds):
                    tokens, attn = _ref_sample(window, SEQ)
                    item = ds[i]
                    assert set(item) == ITEM_KEYS
                    assert _unmasked(item).tolist() == tokens, (epoch, k)
                    assert item["attention_mask"].tolist() == attn
        assert orders[0] != sorted(orders[0])  # shuffled
        assert orders[0] != orders[1] != orders[2]  # a fresh order every epoch
    # Other orders, other packings: the window count is the epoch's own.
    counts = {train.windows_in_epoch(e) for e in range(12)}
    if special.sentence_ends:
        assert len(counts) > 1
    # The last window of an epoch ends with the stream's final separator, then </s>, pads.
    last = train[_epoch_items(train, 0)[-1]]
    n_real = int(last["attention_mask"].sum())
    tokens = _unmasked(last).tolist()
    assert tokens[n_real - 2 : n_real] == [EOS, EOS] and tokens[n_real:] == [PAD] * (SEQ - n_real)


def test_every_epoch_covers_the_stream_exactly(corpus):
    docs = corpus["docs"]
    train, _ = _build(corpus)
    for epoch in range(6):
        items = _epoch_items(train, epoch)
        windows = [train.stream_window(i) for i in items]
        assert all(1 <= w.size <= SEQ - 2 for w in windows)
        stream = np.concatenate(windows)
        assert stream.tolist() == _ref_stream(docs, train.document_order(epoch).tolist())
        bounds = train.window_bounds(epoch)
        assert bounds[0] == 0 and bounds[-1] == train.tokens_per_epoch == stream.size
        assert np.array_equal(np.diff(bounds), [w.size for w in windows])
    # Specials stored inside a document are data: only a trailing </s> is the separator.
    run = np.array([UNK, BOS, EOS, MASK, UNK])
    assert any(np.array_equal(stream[j : j + 5], run) for j in range(stream.size - 4))


def test_multi_sequence_documents_are_concatenated(tmp_path):
    builder_cls = import_megatron("megatron.core.datasets.indexed_dataset").IndexedDatasetBuilder
    prefix = str(tmp_path / "multi")
    builder = builder_cls(prefix + ".bin", dtype=np.uint16)
    docs = [[[10, NL, 12], [13, 14, EOS]], [[20, 21], [NL]], [[30], [EOS]]]
    for seqs in docs:
        builder.add_document(np.array(sum(seqs, []), dtype=np.uint16), [len(s) for s in seqs])
    builder.finalize(prefix + ".idx")
    flat = [sum(seqs, []) for seqs in docs]
    for seq in (5, 8):
        ds = MLMDataset(prefix, (0, 3), 4, seq_length=seq, seed=3, part=0, special=SPECIAL)
        order = ds.document_order(0).tolist()
        windows = [ds.stream_window(i).tolist() for i in _epoch_items(ds, 0)]
        assert windows == _ref_windows(flat, order, {NL}, seq - 2)


def test_same_index_same_sample_any_object_any_order(corpus):
    for pairs in (False, True):
        a, va = _build(corpus, binary_head=pairs)
        b, vb = _build(corpus, binary_head=pairs)  # a new object
        idx = list(range(0, len(a), 7))
        first = [a[i] for i in idx]
        # Another object read backwards: its first read is deep in a later epoch.
        again = [b[i] for i in reversed(idx)][::-1]
        clone = pickle.loads(pickle.dumps(a))  # what a DataLoader worker gets
        fresh_clone = pickle.loads(pickle.dumps(_build(corpus, binary_head=pairs)[0]))
        for i, x, y in zip(idx, first, again):
            z, w, f = clone[i], a[i], fresh_clone[i]
            assert set(x) == ITEM_KEYS | ({"sop_label"} if pairs else set())
            for name in x:
                for other in (y, z, w, f):
                    assert torch.equal(x[name], other[name]), (pairs, i, name)
        assert all(torch.equal(va[i]["tokens"], vb[i]["tokens"]) for i in range(len(va)))
    c, _ = _build(corpus, seed=SEED + 1)
    assert c.document_order(0).tolist() != a.document_order(0).tolist()
    assert not torch.equal(
        torch.stack([c[i]["loss_mask"] for i in range(40)]),
        torch.stack([a[i]["loss_mask"] for i in range(40)]),
    )
    with pytest.raises(IndexError):
        a[len(a)]
    with pytest.raises(IndexError):
        a[-1]


def test_same_window_gets_a_new_mask_every_epoch(corpus):
    # One document in the part: the stream, hence every window, is identical each epoch.
    ds = MLMDataset(
        corpus["prefix"], (0, 1), 60, seq_length=SEQ, seed=SEED, part=0, special=SPECIAL
    )
    spe = ds.windows_in_epoch(0)
    assert all(ds.windows_in_epoch(e) == spe for e in range(4))
    differing = 0
    by_epoch = [_epoch_items(ds, epoch) for epoch in range(4)]  # window order
    for k in range(spe):
        masks = []
        for epoch in range(4):
            item = ds[by_epoch[epoch][k]]
            assert torch.equal(_unmasked(item), _unmasked(ds[by_epoch[0][k]]))  # same window
            masks.append(item["loss_mask"])
        differing += sum(not torch.equal(masks[0], m) for m in masks[1:])
    # Every window holds >= 17 candidates, 3 or more chosen: P(two epochs draw the same
    # positions) <= 1 / C(17, 3) = 1 / 680 per pair (and the seed is fixed).
    assert differing == 3 * spe


def test_masking_rules_and_statistics(corpus):
    train, _ = _build(corpus, train=3000, seq=64)
    items = [train[i] for i in range(len(train))]
    tokens, labels, loss, attn, types = (
        torch.stack([it[name] for it in items])
        for name in ("tokens", "labels", "loss_mask", "attention_mask", "token_types")
    )
    original = torch.where(loss.bool(), labels, tokens)
    chosen = loss.bool()
    # labels and loss_mask agree; nothing outside the chosen positions changes.
    assert loss.dtype == torch.float32 and torch.equal(chosen, labels.ne(-100))
    assert torch.equal(tokens[~chosen], original[~chosen])
    assert not chosen[attn == 0].any() and torch.all(tokens[attn == 0] == PAD)
    assert torch.all(types == 0)
    # Specials (and never_mask) are never chosen; the count is the documented rounding.
    is_candidate = attn.bool() & ~torch.isin(original, torch.tensor(sorted(EXCLUDED)))
    assert not (chosen & ~is_candidate).any()
    n = is_candidate.sum(1).numpy()
    want = np.where(n > 0, np.maximum(1, np.floor(0.15 * n + 0.5)), 0)
    assert np.array_equal(chosen.sum(1).numpy(), want)
    assert torch.all(tokens[:, 0] == BOS)  # a special, so never masked
    chosen_total, candidates_total = int(chosen.sum()), int(n.sum())
    got, lab = tokens[chosen], labels[chosen]
    n_mask = int((got == MASK).sum())
    n_keep = int((got == lab).sum())
    changed = (got != MASK) & (got != lab)
    n_random = int(changed.sum())
    frac = chosen_total / candidates_total
    # Rounding moves a window's fraction by < 0.5 / n; windows hold ~52 candidates here.
    assert abs(frac - 0.15) < 0.5 / 40
    # ~23k chosen tokens: the binomial sd of the 80% share is 0.0026, of a 10% share 0.002;
    # tolerances are > 5 sd (the seed is fixed, so the outcome is deterministic anyway).
    # A random draw equal to the original counts as kept: + 0.1 / 4995, negligible.
    assert abs(n_mask / chosen_total - 0.8) < 0.015
    assert abs(n_keep / chosen_total - 0.1) < 0.011
    assert abs(n_random / chosen_total - 0.1) < 0.011
    rand = got[changed].numpy()
    assert not np.isin(rand, sorted(EXCLUDED)).any() and rand.max() < VOCAB
    # Uniform over the non-special vocabulary, not over the window: 5 equal-width bins of ids
    # (5 of the 1000 ids of the first bin are excluded) each hold ~20% (sd ~0.8% here).
    counts = np.histogram(rand, bins=5, range=(0, VOCAB))[0] / rand.size
    assert np.all(np.abs(counts - 0.2) < 0.06), counts
    print(
        f"\nchosen {frac:.4f} of {candidates_total} candidates; of {chosen_total} chosen: "
        f"mask {n_mask / chosen_total:.4f} random {n_random / chosen_total:.4f} "
        f"kept {n_keep / chosen_total:.4f}; random-id bins {np.round(counts, 3).tolist()}"
    )


def test_custom_probabilities(corpus):
    train, _ = _build(corpus, train=200, mask_prob=0.5, random_prob=0.0, keep_prob=0.0)
    items = [train[i] for i in range(200)]
    chosen = sum(int(it["loss_mask"].sum()) for it in items)
    masked = sum(int((it["tokens"][it["loss_mask"].bool()] == MASK).sum()) for it in items)
    real = sum(int(it["attention_mask"].sum()) - 2 for it in items)
    assert chosen == masked > 0.45 * real


def _parse_pair(item) -> tuple[list[int], list[int]]:
    """The (first, second) segments of ``<s> first </s> </s> second </s> pads``, checking the
    layout, token types and attention mask exactly."""
    tokens = _unmasked(item).tolist()
    types = item["token_types"].tolist()
    n_real = int(item["attention_mask"].sum())
    p = types.index(1) - 2  # the second segment's types start at the second </s>
    q = n_real - p - 4
    assert q >= 0 and tokens[0] == BOS and tokens[n_real:] == [PAD] * (SEQ - n_real)
    assert tokens[p + 1 : p + 3] == [EOS, EOS] and tokens[n_real - 1] == EOS
    assert types == [0] * (p + 2) + [1] * (q + 2) + [0] * (SEQ - n_real)
    assert item["attention_mask"].tolist() == [1] * n_real + [0] * (SEQ - n_real)
    return tokens[1 : p + 1], tokens[p + 3 : p + 3 + q]


def _check_pairs(ds: MLMDataset, docs, ends: set[int], epochs: int) -> tuple[list[int], int]:
    """Check every item of ``epochs`` epochs against the reference pair packing; return the
    sop labels and how many windows were split at the midpoint."""
    labels, midpoints = [], 0
    for epoch in range(epochs):
        ref = _ref_windows(docs, ds.document_order(epoch).tolist(), ends, SEQ - 4, pairs=True)
        assert ds.windows_in_epoch(epoch) == len(ref)
        for i, window in zip(_epoch_items(ds, epoch), ref):
            item = ds[i]
            assert set(item) == ITEM_KEYS | {"sop_label"}
            label = item["sop_label"]
            assert label.dtype == torch.int64 and label.shape == () and int(label) in (0, 1)
            first, second = _parse_pair(item)
            a, b = (second, first) if int(label) else (first, second)
            assert a + b == window  # label 1 exactly when the segments come swapped
            assert len(_doc_of(window)) <= 1  # one document per pair
            boundaries = [j + 1 for j, t in enumerate(window[:-1]) if t in ends]
            if boundaries:
                assert len(a) in boundaries
            else:
                assert len(a) == (len(window) + 1) // 2
                midpoints += 1
            labels.append(int(label))
    return labels, midpoints


def test_sentence_order_pairs_match_the_reference(corpus):
    docs = corpus["docs"]
    train, valid = _build(corpus, train=3000, binary_head=True)
    assert train.tokens_per_epoch == sum(len(_content(docs[d])) for d in train.documents)
    labels, midpoints = _check_pairs(train, docs, {NL}, epochs=4)
    assert 0 < midpoints < len(labels)  # cut pieces and one-line windows have no boundary
    _check_pairs(valid, docs, {NL}, epochs=2)
    # The swap is a fair coin: ~3000 draws, sd 0.009; the seed is fixed, so no flake.
    swaps = [int(train[i]["sop_label"]) for i in range(len(train))]
    assert abs(np.mean(swaps) - 0.5) < 0.04
    # Masking in pair mode: specials never chosen, token types untouched by masking.
    item = train[5]
    chosen = item["loss_mask"].bool()
    assert not torch.isin(item["labels"][chosen], torch.tensor(sorted(EXCLUDED))).any()


def test_pairs_without_sentence_ends_split_at_the_midpoint(corpus):
    docs = corpus["docs"]
    train, _ = _build(corpus, train=200, binary_head=True, special=NO_SENTENCES)
    labels, midpoints = _check_pairs(train, docs, set(), epochs=3)
    assert midpoints == len(labels) and 0 < sum(labels) < len(labels)
    # The one-token document: its token is segment A, segment B is empty.
    one = [
        i
        for i in _epoch_items(train, 0)
        if train.stream_window(i).tolist() == [_content(docs[11])[0]]
    ]
    assert len(one) == 1
    item = train[one[0]]
    want = [[3500], []][:: -1 if int(item["sop_label"]) else 1]
    assert list(_parse_pair(item)) == want


def test_split_parts_are_disjoint_and_follow_megatron_ranges(corpus):
    docs = corpus["docs"]
    assert split_document_ranges(SPLIT, 16)[:2] == [(0, 12), (12, 16)]
    train, valid = _build(corpus)
    assert set(train.documents.tolist()) == {d for d in range(12) if _content(docs[d])}
    assert set(valid.documents.tolist()) == {d for d in range(12, 16) if _content(docs[d])}
    seen_train = set().union(*(_doc_of(_unmasked(train[i])) for i in range(len(train))))
    seen_valid = set().union(*(_doc_of(_unmasked(valid[i])) for i in range(len(valid))))
    assert seen_train == set(train.documents.tolist())
    assert seen_valid == set(valid.documents.tolist())

    only_train, none = _build(corpus, split="100,0,0", valid=10)
    assert none is None and len(only_train.documents) == 14
    with pytest.raises(ValueError, match="no documents"):
        _build(corpus, split="99,1,0")  # round(0.01 * 16) == 0 validation documents


@pytest.mark.parametrize("pairs", [False, True])
def test_micro_batches_read_it(corpus, pairs):
    train, _ = _build(corpus, binary_head=pairs)
    m, dp = 4, 2
    keys = ITEM_KEYS | ({"sop_label"} if pairs else set())
    for rank in range(dp):
        batches = list(itertools.islice(micro_batches(train, 8, m, rank, dp), 3))
        for j, batch in enumerate(batches):
            assert set(batch) == keys
            assert batch["tokens"].shape == (m, SEQ) and batch["tokens"].dtype == torch.int64
            assert batch["loss_mask"].dtype == torch.float32
            if pairs:
                assert batch["sop_label"].shape == (m,)
            start = 8 + j * m * dp + rank * m
            want = torch.stack([train[i]["tokens"] for i in range(start, start + m)])
            assert torch.equal(batch["tokens"], want)
    assert len(list(micro_batches(train, 0, m, 0, dp))) == len(train) // (m * dp)


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(ValueError, match="must differ"):
        MLMSpecialTokens(bos=1, eos=1, pad=3, mask=4, vocab_size=10)
    with pytest.raises(ValueError, match="outside"):
        MLMSpecialTokens(bos=1, eos=2, pad=3, mask=10, vocab_size=10)
    with pytest.raises(ValueError, match="sentence_ends"):
        MLMSpecialTokens(bos=1, eos=2, pad=3, mask=4, vocab_size=10, sentence_ends={10})
    with pytest.raises(ValueError, match="seq_length"):
        _build(corpus, seq=2)
    with pytest.raises(ValueError, match="seq_length"):
        _build(corpus, seq=4, binary_head=True)
    small = MLMSpecialTokens(bos=1, eos=2, pad=3, mask=4, vocab_size=50)
    ds = MLMDataset(corpus["prefix"], (0, 1), 1, seq_length=SEQ, seed=0, part=0, special=small)
    with pytest.raises(ValueError, match="vocab_size"):
        ds[0]  # ids >= 100 do not fit a 50-token vocabulary
    with pytest.raises(FileNotFoundError):
        MLMDataset(tmp_path / "nope", (0, 1), 1, seq_length=SEQ, seed=0, part=0, special=small)

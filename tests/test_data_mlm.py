"""Masked-LM datasets: packing against a plain-Python stream, resume-exact dynamic masking,
masking statistics, split disjointness and reading through the micro-batch sampler."""

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

UNK, BOS, EOS, PAD, MASK = 0, 1, 2, 3, 4
VOCAB = 5000
SPECIAL = MLMSpecialTokens(
    bos=BOS, eos=EOS, pad=PAD, mask=MASK, vocab_size=VOCAB, never_mask=frozenset({UNK})
)
EXCLUDED = {UNK, BOS, EOS, PAD, MASK}
SEQ = 32
SEED = 1234
SPLIT = "75,25,0"  # 16 documents -> train [0, 12), valid [12, 16)


def _documents() -> list[list[int]]:
    """16 documents; document d draws its ids from [100 + 300 d, 400 + 300 d), so every id
    names its document. Most end with the stored EOD (</s>), like data/prepare.py writes."""
    rng = np.random.default_rng(7)
    docs = []
    for d in range(16):
        n = 200 if d == 0 else int(rng.integers(1, 90))
        ids = rng.integers(100 + 300 * d, 400 + 300 * d, size=n).tolist()
        docs.append(ids if d in (3, 7, 14) else ids + [EOS])
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


def _ref_samples(stream: list[int], seq: int) -> list[tuple[list[int], list[int]]]:
    """(tokens, attention_mask) of every window of one epoch, built position by position."""
    w = seq - 2
    out = []
    for start in range(0, len(stream), w):
        window = stream[start : start + w]
        tokens = [BOS] + window + [EOS]
        attn = [1] * len(tokens)
        while len(tokens) < seq:
            tokens.append(PAD)
            attn.append(0)
        out.append((tokens, attn))
    return out


def _unmasked(item) -> torch.Tensor:
    return torch.where(item["loss_mask"].bool(), item["labels"], item["tokens"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlm")
    docs = _documents()
    prefix = dataset_prefix(root / "synthetic")
    write_indexed_dataset(prefix, docs, VOCAB)
    return {"root": root, "prefix": prefix, "docs": docs}


def _build(corpus, seed=SEED, split=SPLIT, train=400, valid=40, seq=SEQ, **kw):
    return build_mlm_datasets(
        corpus["prefix"],
        seq_length=seq,
        seed=seed,
        split=split,
        train_samples=train,
        valid_samples=valid,
        special=SPECIAL,
        **kw,
    )


def test_packing_matches_plain_python_stream(corpus):
    docs = corpus["docs"]
    train, valid = _build(corpus)
    assert len(train) == 400 and len(valid) == 40
    for ds, (begin, end) in ((train, (0, 12)), (valid, (12, 16))):
        kept = [d for d in range(begin, end) if _content(docs[d])]
        stream_len = sum(len(_content(docs[d])) + 1 for d in kept)
        assert ds.tokens_per_epoch == stream_len
        assert ds.samples_per_epoch == -(-stream_len // (SEQ - 2))
        orders = []
        for epoch in range(3):
            order = ds.document_order(epoch).tolist()
            assert sorted(order) == kept  # every non-empty document once per epoch
            orders.append(order)
            ref = _ref_samples(_ref_stream(docs, order), SEQ)
            assert len(ref) == ds.samples_per_epoch
            for k, (tokens, attn) in enumerate(ref):
                i = epoch * ds.samples_per_epoch + k
                if i >= len(ds):
                    break
                item = ds[i]
                assert _unmasked(item).tolist() == tokens, (epoch, k)
                assert item["attention_mask"].tolist() == attn
        assert orders[0] != sorted(orders[0])  # shuffled
        assert orders[0] != orders[1] != orders[2]  # a fresh order every epoch
    # The last window of an epoch is padded; the stream's final separator precedes </s>.
    last = _unmasked(train[train.samples_per_epoch - 1]).tolist()
    n_real = int(train[train.samples_per_epoch - 1]["attention_mask"].sum())
    assert n_real < SEQ and last[n_real - 2 : n_real] == [EOS, EOS] and last[n_real] == PAD
    # Specials stored inside a document are data: only a trailing </s> is the separator.
    stream = np.concatenate([train.stream_window(k) for k in range(train.samples_per_epoch)])
    run = np.array([UNK, BOS, EOS, MASK, UNK])
    assert any(np.array_equal(stream[j : j + 5], run) for j in range(stream.size - 4))


def test_multi_sequence_documents_are_concatenated(tmp_path):
    builder_cls = import_megatron("megatron.core.datasets.indexed_dataset").IndexedDatasetBuilder
    prefix = str(tmp_path / "multi")
    builder = builder_cls(prefix + ".bin", dtype=np.uint16)
    docs = [[[10, 11, 12], [13, 14, EOS]], [[20, 21], [22]], [[30], [EOS]]]
    for seqs in docs:
        builder.add_document(np.array(sum(seqs, []), dtype=np.uint16), [len(s) for s in seqs])
    builder.finalize(prefix + ".idx")
    ds = MLMDataset(prefix, (0, 3), 4, seq_length=8, seed=3, part=0, special=SPECIAL)
    order = ds.document_order(0).tolist()
    flat = [sum(seqs, []) for seqs in docs]
    stream: list[int] = []
    for i in range(ds.samples_per_epoch):
        stream += ds.stream_window(i).tolist()
    assert stream == _ref_stream(flat, order)


def test_same_index_same_sample_any_object_any_order(corpus):
    a, va = _build(corpus)
    b, vb = _build(corpus)  # a new object
    idx = list(range(0, len(a), 7))
    first = [a[i] for i in idx]
    again = [b[i] for i in reversed(idx)][::-1]  # other object, other reading order
    clone = pickle.loads(pickle.dumps(a))  # what a DataLoader worker gets
    for i, x, y in zip(idx, first, again):
        z, w = clone[i], a[i]
        for name in x:
            assert torch.equal(x[name], y[name]) and torch.equal(x[name], z[name])
            assert torch.equal(x[name], w[name])
    assert all(torch.equal(va[i]["tokens"], vb[i]["tokens"]) for i in range(len(va)))
    c, _ = _build(corpus, seed=SEED + 1)
    assert c.document_order(0).tolist() != a.document_order(0).tolist()
    assert not torch.equal(
        torch.stack([c[i]["loss_mask"] for i in range(40)]),
        torch.stack([a[i]["loss_mask"] for i in range(40)]),
    )
    with pytest.raises(IndexError):
        a[len(a)]


def test_same_window_gets_a_new_mask_every_epoch(corpus):
    # One document in the part: the stream, hence every window, is identical each epoch.
    ds = MLMDataset(
        corpus["prefix"], (0, 1), 60, seq_length=SEQ, seed=SEED, part=0, special=SPECIAL
    )
    spe = ds.samples_per_epoch
    assert spe == 7  # 200 tokens + separator in windows of 30
    differing = 0
    for k in range(spe - 1):  # full windows: 30 candidates, 5 chosen
        masks = []
        for epoch in range(4):
            item = ds[epoch * spe + k]
            assert torch.equal(_unmasked(item), _unmasked(ds[k]))  # same window
            masks.append(item["loss_mask"])
        differing += sum(not torch.equal(masks[0], m) for m in masks[1:])
    # P(two epochs draw the same 5 of 30 positions) = 1 / C(30, 5) ~ 7e-6 per pair.
    assert differing == 3 * (spe - 1)


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
    # Rounding per window of ~62 candidates moves the fraction by < 0.5/62 per item.
    assert abs(frac - 0.15) < 0.5 / 50
    # ~26k chosen tokens: the binomial sd of the 80% share is 0.0025, of a 10% share 0.0019;
    # tolerances are > 5 sd (the seed is fixed, so the outcome is deterministic anyway).
    # A random draw equal to the original counts as kept: + 0.1 / 4995, negligible.
    assert abs(n_mask / chosen_total - 0.8) < 0.015
    assert abs(n_keep / chosen_total - 0.1) < 0.01
    assert abs(n_random / chosen_total - 0.1) < 0.01
    rand = got[changed].numpy()
    assert not np.isin(rand, sorted(EXCLUDED)).any() and rand.max() < VOCAB
    # Uniform over the non-special vocabulary, not over the window: 5 equal-width bins of ids
    # (5 of the 1000 ids of the first bin are excluded) each hold ~20% (sd ~1.1% here).
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
    assert chosen == masked > 0.45 * 200 * (SEQ - 2)


def test_split_parts_are_disjoint_and_follow_megatron_ranges(corpus):
    docs = corpus["docs"]
    assert split_document_ranges(SPLIT, 16)[:2] == [(0, 12), (12, 16)]
    train, valid = _build(corpus)
    assert set(train.documents.tolist()) == {d for d in range(12) if _content(docs[d])}
    assert set(valid.documents.tolist()) == {d for d in range(12, 16) if _content(docs[d])}

    def doc_of(ids):  # ids >= 100 name their document
        ids = np.asarray(ids)
        return set(((ids[ids >= 100] - 100) // 300).tolist())

    seen_train = set().union(*(doc_of(_unmasked(train[i])) for i in range(len(train))))
    seen_valid = set().union(*(doc_of(_unmasked(valid[i])) for i in range(len(valid))))
    assert seen_train == set(train.documents.tolist())
    assert seen_valid == set(valid.documents.tolist())

    only_train, none = _build(corpus, split="100,0,0", valid=10)
    assert none is None and len(only_train.documents) == 14
    with pytest.raises(ValueError, match="no documents"):
        _build(corpus, split="99,1,0")  # round(0.01 * 16) == 0 validation documents


def test_micro_batches_read_it(corpus):
    train, _ = _build(corpus)
    m, dp = 4, 2
    for rank in range(dp):
        batches = list(itertools.islice(micro_batches(train, 8, m, rank, dp), 3))
        for j, batch in enumerate(batches):
            assert set(batch) == {"tokens", "labels", "loss_mask", "attention_mask", "token_types"}
            assert batch["tokens"].shape == (m, SEQ) and batch["tokens"].dtype == torch.int64
            assert batch["loss_mask"].dtype == torch.float32
            start = 8 + j * m * dp + rank * m
            want = torch.stack([train[i]["tokens"] for i in range(start, start + m)])
            assert torch.equal(batch["tokens"], want)
    assert len(list(micro_batches(train, 0, m, 0, dp))) == len(train) // (m * dp)


def test_bad_arguments(corpus, tmp_path):
    with pytest.raises(ValueError, match="must differ"):
        MLMSpecialTokens(bos=1, eos=1, pad=3, mask=4, vocab_size=10)
    with pytest.raises(ValueError, match="outside"):
        MLMSpecialTokens(bos=1, eos=2, pad=3, mask=10, vocab_size=10)
    with pytest.raises(ValueError, match="seq_length"):
        _build(corpus, seq=2)
    small = MLMSpecialTokens(bos=1, eos=2, pad=3, mask=4, vocab_size=50)
    ds = MLMDataset(corpus["prefix"], (0, 1), 1, seq_length=SEQ, seed=0, part=0, special=small)
    with pytest.raises(ValueError, match="vocab_size"):
        ds[0]  # ids >= 100 do not fit a 50-token vocabulary
    with pytest.raises(FileNotFoundError):
        MLMDataset(tmp_path / "nope", (0, 1), 1, seq_length=SEQ, seed=0, part=0, special=small)

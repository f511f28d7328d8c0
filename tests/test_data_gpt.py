"""GPT train/valid datasets from megatron-core, its helpers fallback, and resumable sampling."""

from __future__ import annotations

import multiprocessing as mp
import sys

import numpy as np
import pytest
import torch

from data.corpus import iter_texts, stdlib_documents
from data.gpt_data import (
    build_gpt_datasets,
    build_sample_idx_numpy,
    ensure_helpers,
    split_document_ranges,
)
from data.indexed import dataset_prefix, write_indexed_dataset
from data.sampler import MicroBatchSampler, micro_batches
from data.tokenizer import SentencePieceTokenizer, train_sentencepiece

SEQ = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """40 real stdlib modules, a 1000-piece tokenizer, and their indexed dataset."""
    root = tmp_path_factory.mktemp("gpt")
    docs = stdlib_documents()[100:140]
    model = train_sentencepiece(docs, root / "tok", 1000, seed=1)
    tok = SentencePieceTokenizer(model)
    prefix = dataset_prefix(root / "small")
    encoded = [ids + [tok.eod] for ids in tok.encode_batch(list(iter_texts(docs)))]
    write_indexed_dataset(prefix, encoded, tok.vocab_size)
    return {"root": root, "tok": tok, "prefix": prefix, "docs": encoded}


def _build(corpus, cache, seed=1234, split="90,10,0", train=300, valid=30):
    return build_gpt_datasets(
        corpus["prefix"], corpus["tok"], SEQ, seed, split, train, valid, corpus["root"] / cache
    )


def _tokens(ds, n):
    return torch.stack([ds[i]["tokens"] for i in range(n)])


def test_items_shapes_dtypes_and_labels(corpus):
    train, valid = _build(corpus, "c0")
    assert len(train) >= 300 and len(valid) >= 30
    item = train[0]
    assert set(item) == {"tokens", "labels", "loss_mask", "position_ids"}
    assert item["tokens"].shape == (SEQ,) and item["tokens"].dtype == torch.int64
    assert item["labels"].dtype == torch.int64 and item["loss_mask"].dtype == torch.float32
    assert torch.equal(item["position_ids"], torch.arange(SEQ))
    for ds in (train, valid):
        for i in range(0, 20):
            it = ds[i]
            assert torch.equal(it["tokens"][1:], it["labels"][:-1])  # next-token targets
            assert torch.all(it["loss_mask"] == 1.0)  # EOD masking is off by default
    # Samples are windows of the concatenated documents: EOD tokens appear inside them.
    assert any((train[i]["tokens"] == corpus["tok"].eod).any() for i in range(50))


def test_same_seed_same_samples_other_seed_differs(corpus):
    a, va = _build(corpus, "c1")
    b, vb = _build(corpus, "c2")  # fresh cache: rebuilt from scratch
    c, _ = _build(corpus, "c1")  # cache hit
    assert torch.equal(_tokens(a, 100), _tokens(b, 100))
    assert torch.equal(_tokens(a, 100), _tokens(c, 100))
    assert torch.equal(_tokens(va, 20), _tokens(vb, 20))
    d, _ = _build(corpus, "c1", seed=99)
    assert not torch.equal(_tokens(a, 100), _tokens(d, 100))
    assert list((corpus["root"] / "c1").rglob("*shuffle_index.npy"))


def test_train_and_valid_documents_are_disjoint(corpus):
    train, valid = _build(corpus, "c3")
    n = len(corpus["docs"])
    (tb, te), (vb, ve), test = split_document_ranges("90,10,0", n)
    assert (tb, te, vb, ve, test) == (0, 36, 36, 40, None)
    train_docs, valid_docs = (
        set(np.asarray(train.document_index)),
        set(np.asarray(valid.document_index)),
    )
    assert train_docs == set(range(tb, te)) and valid_docs == set(range(vb, ve))
    # Every sample (shuffle -> sample index -> document rows) stays inside its own split.
    for ds, docs in ((train, train_docs), (valid, valid_docs)):
        rows = np.asarray(ds.sample_index)[np.asarray(ds.shuffle_index)[:50]][:, 0]
        assert set(np.asarray(ds.document_index)[rows]) <= docs


def test_the_preflights_split_arithmetic_is_megatrons():
    """data/split.py cuts documents without importing megatron-core (the pre-flight's cost);
    its ranges are megatron-core's for every split and size, and every split it proposes
    fits."""
    from data.split import document_ranges, fitting_split
    from families.data_sections import TextDataSection

    splits = ["98,2,0", "90,5,5", "1,1,1", "100,0,0", "0,1,0", "949,50,1", "3,0,1", "0.5,0.25,0.25"]
    for split in splits:
        weights = TextDataSection(split=split).split_weights()
        for n in (1, 2, 3, 7, 10, 20, 49, 50, 51, 100, 731, 1000):
            assert document_ranges(weights, n) == split_document_ranges(split, n), (split, n)
            fits = fitting_split(weights, n)
            if fits is not None:
                TextDataSection(split=fits).check_split(n)
                assert sum(int(c) for c in fits.split(",")) == n


def test_split_without_documents_is_rejected(corpus):
    with pytest.raises(ValueError, match="valid set no documents"):
        _build(corpus, "c4", split="100,0,0")
    with pytest.raises(ValueError, match="valid set no documents"):
        _build(corpus, "c4", split="999,1,0")


def test_numpy_sample_index_matches_compiled_helpers():
    from megatron.core.datasets import helpers_cpp

    rng = np.random.default_rng(0)
    checked = 0
    while checked < 200:
        n = int(rng.integers(1, 25))
        sizes = rng.integers(0 if checked % 2 else 1, 40, n).astype(np.int32)
        epochs = int(rng.integers(1, 4))
        doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
        rng.shuffle(doc_idx)
        seq, extra, drop = int(rng.integers(2, 20)), int(rng.integers(0, 2)), bool(checked % 3)
        tpe = int(sizes.sum())
        if tpe < 2 or (epochs * tpe - extra) // seq < 1:
            continue
        args = (sizes, doc_idx, seq, epochs, tpe, drop, extra)
        want = helpers_cpp.build_sample_idx_int64(*args)
        assert np.array_equal(build_sample_idx_numpy(*args), want), args
        checked += 1


def test_fallback_helpers_give_identical_datasets(corpus, monkeypatch):
    import megatron.core.datasets as mcd

    assert ensure_helpers() is True  # the wheel ships the compiled extension
    ref, _ = _build(corpus, "c5")
    # Pretend the extension is missing: importing it must fail, and helpers must re-import.
    monkeypatch.setitem(sys.modules, "megatron.core.datasets.helpers_cpp", None)
    monkeypatch.delitem(sys.modules, "megatron.core.datasets.helpers", raising=False)
    monkeypatch.delattr(mcd, "helpers", raising=False)
    assert ensure_helpers() is False
    alt, _ = _build(corpus, "c6")
    assert np.array_equal(np.asarray(alt.sample_index), np.asarray(ref.sample_index))
    assert torch.equal(_tokens(alt, 50), _tokens(ref, 50))


def test_sampler_partitions_global_batches():
    ranks = [list(MicroBatchSampler(50, 6, 3, r, 2)) for r in range(2)]
    assert ranks[0][:2] == [[6, 7, 8], [12, 13, 14]] and ranks[1][0] == [9, 10, 11]
    assert len(ranks[0]) == len(ranks[1]) == len(MicroBatchSampler(50, 6, 3, 0, 2)) == 7
    flat = sorted(i for r in ranks for b in r for i in b)
    assert flat == list(range(6, 48))  # full global batches only
    assert list(MicroBatchSampler(10, 10, 2, 0, 1)) == []
    with pytest.raises(ValueError, match="consumed_samples"):
        MicroBatchSampler(10, 11, 2, 0, 1)
    with pytest.raises(ValueError, match="dp_rank"):
        MicroBatchSampler(10, 0, 2, 2, 2)


def test_micro_batches_resume_exactly(corpus):
    train, _ = _build(corpus, "c7")
    mbs, dp = 2, 2
    for rank in range(dp):
        full = list(micro_batches(train, 0, mbs, rank, dp, total_samples=80))
        assert len(full) == 20
        b = full[0]
        assert b["tokens"].shape == (mbs, SEQ) and b["tokens"].dtype == torch.int64
        assert b["loss_mask"].dtype == torch.float32 and b["position_ids"].shape == (mbs, SEQ)
        for k_batches in (1, 7):
            consumed = k_batches * mbs * dp
            resumed = list(micro_batches(train, consumed, mbs, rank, dp, total_samples=80))
            assert len(resumed) == len(full) - k_batches
            for x, y in zip(full[k_batches:], resumed):
                assert all(torch.equal(x[key], y[key]) for key in x)
    r0 = next(micro_batches(train, 0, mbs, 0, dp))
    r1 = next(micro_batches(train, 0, mbs, 1, dp))
    assert torch.equal(r0["tokens"], _tokens(train, 2)) and not torch.equal(
        r0["tokens"], r1["tokens"]
    )


def _rank_main(rank, store, prefix, model, cache, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        train, _ = build_gpt_datasets(
            prefix, SentencePieceTokenizer(model), SEQ, 5, "90,10,0", 100, 10, cache
        )
        np.save(out, _tokens(train, 20).numpy())
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_torch_distributed_agree(corpus, tmp_path):
    """Rank 0 builds the index cache, rank 1 waits at megatron's barrier, then loads it.

    Forked children inherit the already-imported megatron (a fresh interpreter pays ~4 s of
    imports per rank, ~20 s when two compete for 2 cores).
    """
    ctx = mp.get_context("fork")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(
                r,
                str(tmp_path / "store"),
                corpus["prefix"],
                str(corpus["tok"].model_path),
                str(tmp_path / "cache"),
                str(tmp_path / f"r{r}.npy"),
            ),
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank process exit code {p.exitcode}"
    a, b = np.load(tmp_path / "r0.npy"), np.load(tmp_path / "r1.npy")
    assert np.array_equal(a, b)
    ref, _ = build_gpt_datasets(
        corpus["prefix"], corpus["tok"], SEQ, 5, "90,10,0", 100, 10, tmp_path / "single"
    )
    assert np.array_equal(a, _tokens(ref, 20).numpy())  # same as without torch.distributed
    assert len(list((tmp_path / "cache").rglob("*-GPTDataset-train-shuffle_index.npy"))) == 1

"""Megatron .bin/.idx files: the header parsed independently, ids round-tripped."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from data.indexed import (
    check_prefix,
    dataset_prefix,
    missing_files,
    read_index_stats,
    read_indexed_dataset,
    token_dtype,
    write_indexed_dataset,
)


def _parse_idx(path):
    """Independent reader of Megatron's MMIDIDX layout (data/indexed.py documents it)."""
    raw = path.read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    (version,) = struct.unpack_from("<Q", raw, 9)
    code, n_seq, n_doc = struct.unpack_from("<BQQ", raw, 17)
    off = 34
    lengths = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=off)
    off += 4 * n_seq
    pointers = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=off)
    off += 8 * n_seq
    doc_idx = np.frombuffer(raw, dtype="<i8", count=n_doc, offset=off)
    off += 8 * n_doc
    assert off == len(raw)  # nothing else (no multimodal modes) in the file
    return version, code, lengths, pointers, doc_idx


def _documents(vocab, n=7, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 50))).tolist() for _ in range(n)]


@pytest.mark.parametrize("vocab, code, itemsize", [(1000, 8, 2), (70000, 4, 4)])
def test_idx_header_and_bin_bytes(tmp_path, vocab, code, itemsize):
    docs = _documents(vocab)
    docs[0][-1] = vocab - 1  # the largest id must survive the narrow dtype
    prefix = dataset_prefix(tmp_path / "out" / "corpus", "text")
    assert prefix.endswith("corpus_text_document")
    stats = write_indexed_dataset(prefix, docs, vocab)
    assert (stats.num_documents, stats.num_tokens) == (len(docs), sum(map(len, docs)))

    version, got_code, lengths, pointers, doc_idx = _parse_idx(
        tmp_path / "out" / "corpus_text_document.idx"
    )
    assert version == 1 and got_code == code
    assert lengths.tolist() == [len(d) for d in docs]
    assert pointers.tolist() == (np.cumsum([0] + [len(d) for d in docs[:-1]]) * itemsize).tolist()
    assert doc_idx.tolist() == list(range(len(docs) + 1))

    dtype = "<u2" if code == 8 else "<i4"
    flat = np.fromfile(prefix + ".bin", dtype=dtype)
    assert flat.tolist() == [t for d in docs for t in d]


def test_round_trip_through_megatron_indexed_dataset(tmp_path):
    docs = _documents(5000, n=20, seed=1)
    prefix = dataset_prefix(tmp_path / "rt")
    write_indexed_dataset(prefix, (np.array(d) for d in docs), 5000)
    ds = read_indexed_dataset(prefix)
    assert len(ds) == len(docs)
    for i, d in enumerate(docs):
        assert ds[i].tolist() == d
        assert ds.get(i, offset=1, length=None).tolist() == d[1:]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    stats = read_index_stats(prefix)
    assert (stats.num_documents, stats.num_tokens, stats.dtype) == (
        20,
        sum(map(len, docs)),
        np.dtype(np.uint16),
    )


def test_token_dtype_follows_megatron_rule():
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (256, 32000, 65499, 65500, 65536, 128256):
        assert token_dtype(vocab) == np.dtype(DType.optimal_dtype(vocab))


def test_out_of_range_ids_fail_and_leave_nothing(tmp_path):
    prefix = dataset_prefix(tmp_path / "bad")
    with pytest.raises(ValueError, match="outside"):
        write_indexed_dataset(prefix, [[1, 2], [3, 1000]], 1000)
    assert missing_files(prefix) == [prefix + ".bin", prefix + ".idx"]


def test_prefix_checks_name_the_missing_file(tmp_path):
    prefix = dataset_prefix(tmp_path / "p")
    with pytest.raises(FileNotFoundError, match=r"p_text_document\.bin"):
        check_prefix(prefix)
    write_indexed_dataset(prefix, [[1, 2, 3]], 100)
    assert check_prefix(prefix) == prefix
    (tmp_path / "p_text_document.idx").unlink()
    with pytest.raises(FileNotFoundError, match=r"p_text_document\.idx"):
        read_indexed_dataset(prefix)
    with pytest.raises(ValueError, match="suffix"):
        check_prefix(prefix + ".bin")

"""Locally trained SentencePiece tokenizer: lossless on code, deterministic, megatron-ready."""

from __future__ import annotations

import json
import pickle

import pytest

from data.corpus import stdlib_documents, stdlib_root
from data.tokenizer import SentencePieceTokenizer, _sample_lines, train_sentencepiece

VOCAB = 1000


def _small_corpus():
    # A fixed handful of real stdlib modules: enough text for a 1000-piece BPE in ~0.2 s.
    wanted = {
        "textwrap.py",
        "json/decoder.py",
        "json/encoder.py",
        "string.py",
        "bisect.py",
        "heapq.py",
        "shlex.py",
        "fnmatch.py",
        "colorsys.py",
        "keyword.py",
    }
    root = stdlib_root()
    docs = [p for p in stdlib_documents() if p.relative_to(root).as_posix() in wanted]
    assert len(docs) == len(wanted)
    return docs


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return train_sentencepiece(_small_corpus(), tmp_path_factory.mktemp("tok") / "m", VOCAB, seed=7)


@pytest.fixture(scope="module")
def tok(model_path):
    return SentencePieceTokenizer(model_path)


CODE = (
    "  # leading spaces survive\n"
    "class Foo(Base):\n"
    '    """Doc  with  double  spaces."""\n'
    "\n"
    "    def bar(self, x: int = 42) -> int:\n"
    "        if x:\n"
    "\t\treturn x  # tab-indented, trailing spaces   \n"
    "\n\n\n"
    "        return {'k': [1, 2, 3]}  # caf\u00e9 \u2603 \U0001f600\n"
    "\r\n"
)


def test_encode_decode_round_trip_keeps_indentation(tok):
    ids = tok.encode(CODE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == CODE
    assert tok.detokenize(tok.tokenize(CODE)) == CODE
    assert tok.unk not in ids  # byte fallback covers tabs, emoji, anything
    for doc in _small_corpus():
        text = doc.read_text(encoding="utf-8")
        assert tok.decode(tok.encode(text)) == text


def test_special_ids_and_code_friendly_pieces(tok):
    assert tok.vocab_size == VOCAB
    assert (tok.unk, tok.bos, tok.eod, tok.pad) == (0, 1, 2, 3)
    assert tok.eos == tok.eod
    assert tok.encode("\n") == [4]  # newline is one user-defined symbol
    assert tok.encode("a\n\nb").count(4) == 2
    # Whitespace-only pieces: eight spaces of indentation are not eight tokens.
    assert len(tok.encode(" " * 8)) <= 2
    assert tok.eod not in tok.encode(CODE)


def test_training_is_deterministic_and_paths_equal_texts(tmp_path, model_path):
    again = train_sentencepiece(_small_corpus(), tmp_path / "again", VOCAB, seed=7)
    assert again.read_bytes() == model_path.read_bytes()
    texts = [p.read_text(encoding="utf-8") for p in _small_corpus()]
    from_texts = train_sentencepiece(texts, tmp_path / "texts", VOCAB, seed=7)
    assert from_texts.read_bytes() == model_path.read_bytes()


def test_sentence_sampling_is_seeded_and_order_preserving():
    lines = [f"line {i}" for i in range(1000)]
    a = _sample_lines(iter(lines), 100, seed=1)
    assert a == _sample_lines(iter(lines), 100, seed=1)
    assert a != _sample_lines(iter(lines), 100, seed=2)
    assert len(a) == 100 and len(set(a)) == 100
    assert a == sorted(a, key=lambda s: int(s.split()[1]))
    assert _sample_lines(iter(lines[:50]), 100, seed=1) == lines[:50]


def test_subsampled_training_is_deterministic(tmp_path):
    m1 = train_sentencepiece(_small_corpus(), tmp_path / "a", 500, seed=3, max_sentences=800)
    m2 = train_sentencepiece(_small_corpus(), tmp_path / "b", 500, seed=3, max_sentences=800)
    assert m1.read_bytes() == m2.read_bytes()


def test_megatron_attributes_and_pickle(tok, model_path):
    ident = json.loads(json.dumps(tok.unique_identifiers))
    assert ident["class"] == "SentencePieceTokenizer" and len(ident["sha256"]) == 64
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(CODE) == tok.encode(CODE)
    assert clone.unique_identifiers == tok.unique_identifiers
    assert "vocab_size=1000" in repr(tok)


def test_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.model"):
        SentencePieceTokenizer(tmp_path / "missing.model")
    with pytest.raises(ValueError, match="too small"):
        train_sentencepiece(["x = 1"], tmp_path / "t", 100)
    with pytest.raises(ValueError, match="no non-blank text"):
        train_sentencepiece(["\n  \n"], tmp_path / "t", 1000)
    with pytest.raises(ValueError, match="sentencepiece training failed"):
        train_sentencepiece(["x = 1\n"], tmp_path / "t", 5000)


def test_mask_control_symbol_for_masked_lm(tmp_path, tok):
    """``control_symbols=("<mask>",)``: ``<mask>`` gets the id after ``<pad>`` and is never
    produced from text (a literal "<mask>" in the corpus stays ordinary pieces); the GPT recipe
    has no mask, and its data cache key is unchanged by the option's existence."""
    from data.prepare import cache_key

    mlm = SentencePieceTokenizer(
        train_sentencepiece(
            _small_corpus(), tmp_path / "mlm", VOCAB, seed=7, control_symbols=("<mask>",)
        )
    )
    assert (mlm.unk, mlm.bos, mlm.eod, mlm.pad, mlm.mask) == (0, 1, 2, 3, 4)
    assert tok.mask == -1
    assert 4 not in mlm.encode("x = '<mask>'  # <mask>")
    assert cache_key("c", 512, 7, "n") != cache_key("c", 512, 7, "n", control_symbols=("<mask>",))

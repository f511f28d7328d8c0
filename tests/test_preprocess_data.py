"""Data preparation: the cached default-corpus build and the preprocess_data.py CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import data.prepare as prepare
from data.corpus import stdlib_documents, stdlib_root
from data.indexed import read_indexed_dataset
from data.prepare import prepare_corpus_data, prepare_data_from_prefix, prepare_default_data
from data.tokenizer import SentencePieceTokenizer
from tools.preprocess_data import main

REPO = Path(__file__).resolve().parents[1]


def _docs(n=12):
    return stdlib_documents()[200 : 200 + n]


def _prep(cache, vocab=600, **kw):
    return prepare_corpus_data(cache, _docs(), vocab, seed=3, root=stdlib_root(), name="mini", **kw)


def test_prepare_builds_decodable_dataset(tmp_path):
    got = _prep(tmp_path / "cache")
    assert Path(got.data_prefix).name == "mini_text_document"
    assert got.key == "text" and got.vocab_size == 600 and got.num_documents == 12
    ds = read_indexed_dataset(got.data_prefix)
    tok = SentencePieceTokenizer(got.tokenizer_model)
    assert sum(len(ds[i]) for i in range(len(ds))) == got.num_tokens
    for i, path in enumerate(_docs()):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod and tok.eod not in ids[:-1]
        assert tok.decode(ids[:-1]) == path.read_text(encoding="utf-8")


def test_cache_hit_does_not_rebuild(tmp_path, monkeypatch):
    first = _prep(tmp_path / "cache")
    files = sorted(Path(first.data_prefix).parent.iterdir())
    mtimes = [f.stat().st_mtime_ns for f in files]

    def boom(*args, **kwargs):
        raise AssertionError("cache hit must not retrain or re-encode")

    monkeypatch.setattr(prepare, "train_sentencepiece", boom)
    monkeypatch.setattr(prepare, "iter_texts", boom)
    t0 = time.perf_counter()
    second = _prep(tmp_path / "cache")
    assert time.perf_counter() - t0 < 1.0
    assert second == first
    assert [f.stat().st_mtime_ns for f in files] == mtimes
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [files[0].parent.name]


def test_cache_key_changes_with_inputs(tmp_path):
    a = _prep(tmp_path / "cache")
    b = _prep(tmp_path / "cache", vocab=700)
    assert Path(a.data_prefix).parent != Path(b.data_prefix).parent
    assert b.vocab_size == 700
    key = prepare.cache_key("fp", 600, 3, "mini")
    assert key != prepare.cache_key("fp", 600, 4, "mini")
    assert key != prepare.cache_key("fp2", 600, 3, "mini")


@pytest.mark.parametrize("error", [KeyboardInterrupt, OSError])
def test_interrupted_build_leaves_no_cache_directory(tmp_path, monkeypatch, error):
    def crash(prefix, documents, vocab_size):
        Path(prefix + ".bin").write_bytes(b"partial")
        raise error("simulated crash while writing")

    monkeypatch.setattr(prepare, "write_indexed_dataset", crash)
    with pytest.raises(error):
        _prep(tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []
    monkeypatch.undo()
    assert _prep(tmp_path / "cache").num_documents == 12  # a later call builds normally


def test_prepare_from_prefix_validates(tmp_path):
    got = _prep(tmp_path / "cache")
    again = prepare_data_from_prefix(got.data_prefix, got.tokenizer_model)
    assert again == got
    with pytest.raises(FileNotFoundError, match="nope.model"):
        prepare_data_from_prefix(got.data_prefix, tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match=r"missing_text_document\.bin"):
        prepare_data_from_prefix(str(tmp_path / "missing_text_document"), got.tokenizer_model)


def _run(*argv):
    return main([str(a) for a in argv])


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_cli_jsonl_trains_tokenizer_and_round_trips(tmp_path, capsys):
    texts = [p.read_text(encoding="utf-8") for p in _docs(6)]
    src = _jsonl(
        tmp_path / "in.jsonl", [{"text": t, "title": f"doc {i}"} for i, t in enumerate(texts)]
    )
    out = tmp_path / "out" / "corpus"
    assert (
        _run(
            "--input",
            src,
            "--json-keys",
            "text",
            "title",
            "--vocab-size",
            500,
            "--output-prefix",
            out,
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "corpus_text_document" in printed and "corpus_title_document" in printed
    tok = SentencePieceTokenizer(f"{out}_tokenizer.model")
    text_ds = read_indexed_dataset(f"{out}_text_document")
    title_ds = read_indexed_dataset(f"{out}_title_document")
    assert [tok.decode(text_ds[i][:-1]) for i in range(len(text_ds))] == texts
    assert tok.decode(title_ds[3][:-1]) == "doc 3" and title_ds[3][-1] == tok.eod
    assert text_ds[0].dtype == np.uint16


def test_cli_directory_with_existing_tokenizer(tmp_path, capsys):
    got = _prep(tmp_path / "cache")
    src = tmp_path / "src"
    for i, path in enumerate(_docs(4)):
        (src / f"d{i}").mkdir(parents=True)
        (src / f"d{i}" / "m.py").write_text(path.read_text(encoding="utf-8"))
    (src / "d0" / "notes.txt").write_text("ignored by --pattern\n")
    (src / "empty.py").write_text("")
    out = tmp_path / "o"
    assert (
        _run(
            "--input",
            src,
            "--pattern",
            "*.py",
            "--tokenizer-model",
            got.tokenizer_model,
            "--output-prefix",
            out,
            "--no-append-eod",
        )
        == 0
    )
    assert "1 empty skipped" in capsys.readouterr().out
    ds = read_indexed_dataset(f"{out}_text_document")
    tok = SentencePieceTokenizer(got.tokenizer_model)
    assert len(ds) == 4
    assert tok.decode(ds[2]) == _docs(4)[2].read_text(encoding="utf-8")  # no EOD appended


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--input", "{tmp}/missing.jsonl", "--vocab-size", "500", "--output-prefix", "{tmp}/o"],
            "does not exist",
        ),
        (
            ["--input", "{tmp}/bad.jsonl", "--vocab-size", "500", "--output-prefix", "{tmp}/o"],
            "bad.jsonl:2: invalid JSON",
        ),
        (
            ["--input", "{tmp}/nokey.jsonl", "--vocab-size", "500", "--output-prefix", "{tmp}/o"],
            "nokey.jsonl:1: no key 'text'",
        ),
        (["--input", "{tmp}/good.jsonl", "--output-prefix", "{tmp}/o"], "--tokenizer-model"),
        (
            [
                "--input",
                "{tmp}/good.jsonl",
                "--tokenizer-model",
                "{tmp}/x.model",
                "--output-prefix",
                "{tmp}/o",
            ],
            "x.model' does not exist",
        ),
        (["--input", "{tmp}/good.jsonl", "--vocab-size", "500"], "--output-prefix is required"),
    ],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, argv, message):
    _jsonl(tmp_path / "good.jsonl", [{"text": "x = 1\n"}])
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    _jsonl(tmp_path / "nokey.jsonl", [{"body": "x"}])
    assert _run(*[a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("preprocess_data.py: error:")
    assert message in err
    assert not list(tmp_path.glob("o_*"))


def test_cli_runs_as_a_script_from_a_fresh_process(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "tools" / "preprocess_data.py"),
            "--input",
            str(tmp_path / "none.jsonl"),
            "--vocab-size",
            "500",
            "--output-prefix",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().endswith("does not exist")


def test_full_default_corpus_build_slow(tmp_path, capsys):
    """SLOW (about 5 s here): the real default corpus, end to end, through the CLI."""
    assert _run("--default-corpus", "--vocab-size", 4096, "--cache-dir", tmp_path) == 0
    printed = capsys.readouterr().out
    got = prepare_default_data(tmp_path, 4096)  # cache hit: same paths as printed
    assert got.data_prefix in printed and got.tokenizer_model in printed
    assert Path(got.data_prefix).name == "stdlib_text_document"
    assert got.num_documents == len(stdlib_documents()) > 300
    assert got.num_tokens > 1_000_000
    tok = SentencePieceTokenizer(got.tokenizer_model)
    ds = read_indexed_dataset(got.data_prefix)
    os_index = stdlib_documents().index(stdlib_root() / "os.py")
    text = (stdlib_root() / "os.py").read_text(encoding="utf-8")
    assert tok.decode(ds[os_index][:-1]) == text

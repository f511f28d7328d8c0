"""The default corpus: which stdlib files are documents, and the cache fingerprint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from data.corpus import (
    EXCLUDED_DIRS,
    corpus_fingerprint,
    iter_documents,
    iter_texts,
    stdlib_documents,
    stdlib_root,
)


def _rel(paths: list[Path], root: Path) -> list[str]:
    return [p.relative_to(root).as_posix() for p in paths]


def test_stdlib_documents_are_sorted_python_sources_without_tests():
    root = stdlib_root()
    docs = stdlib_documents()
    rel = _rel(docs, root)
    assert len(docs) > 300  # about 730 on CPython 3.11
    assert rel == sorted(rel)
    assert all(r.endswith(".py") for r in rel)
    for r in rel:
        assert not EXCLUDED_DIRS & set(r.split("/")[:-1]), r
    assert "os.py" in rel and "json/decoder.py" in rel
    assert not any(r.startswith(("test/", "idlelib/idle_test/", "lib2to3/tests/")) for r in rel)
    assert all(p.stat().st_size > 0 for p in docs)
    assert stdlib_documents() == docs  # deterministic


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_custom_root_pruning_and_utf8_skipping(tmp_path):
    _write(tmp_path / "b.py", b"b = 1\n")
    _write(tmp_path / "a" / "z.py", "s = 'caf\u00e9'\n".encode())
    _write(tmp_path / "a" / "tests" / "test_z.py", b"assert 1\n")
    _write(tmp_path / "test" / "x.py", b"x\n")
    _write(tmp_path / "pkg" / "idle_test" / "y.py", b"y\n")
    _write(tmp_path / "site-packages" / "numpy" / "n.py", b"n\n")
    _write(tmp_path / "empty" / "__init__.py", b"")
    _write(tmp_path / "latin1.py", "s = 'caf\u00e9'\n".encode("latin-1"))
    _write(tmp_path / "notes.txt", b"not python\n")

    docs = stdlib_documents(tmp_path)
    assert _rel(docs, tmp_path) == ["a/z.py", "b.py", "latin1.py"]
    pairs = list(iter_documents(docs))
    assert [p.name for p, _ in pairs] == ["z.py", "b.py"]  # latin-1 file skipped
    assert list(iter_texts(docs)) == ["s = 'caf\u00e9'\n", "b = 1\n"]


def test_texts_keep_line_endings_exactly(tmp_path):
    path = _write(tmp_path / "crlf.py", b"a = 1\r\n\tb = 2\r\n")
    assert list(iter_texts([path])) == ["a = 1\r\n\tb = 2\r\n"]


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a directory"):
        stdlib_documents(tmp_path / "nope")


def test_fingerprint_tracks_paths_sizes_and_python_version(tmp_path, monkeypatch):
    a = _write(tmp_path / "one" / "a.py", b"a = 1\n")
    _write(tmp_path / "one" / "b.py", b"b = 2\n")
    docs = stdlib_documents(tmp_path / "one")
    fp = corpus_fingerprint(docs, tmp_path / "one")
    assert fp == corpus_fingerprint(docs, tmp_path / "one")

    # Relative paths: the same files under another root give the same key.
    _write(tmp_path / "two" / "a.py", b"a = 1\n")
    _write(tmp_path / "two" / "b.py", b"b = 2\n")
    assert corpus_fingerprint(stdlib_documents(tmp_path / "two"), tmp_path / "two") == fp

    a.write_bytes(b"a = 10\n")
    assert corpus_fingerprint(docs, tmp_path / "one") != fp
    a.write_bytes(b"a = 1\n")
    assert corpus_fingerprint(docs[:1], tmp_path / "one") != fp

    monkeypatch.setattr(sys, "version_info", (3, 99, 0, "final", 0))
    assert corpus_fingerprint(docs, tmp_path / "one") != fp

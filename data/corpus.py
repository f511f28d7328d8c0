"""The default corpus: the Python standard library's own source code.

It is present on every machine that runs this project, needs no download, and is real code
(about 730 files / 12 MB for CPython 3.11), which makes it a fair small pre-training corpus.
One document per file; the order is the sorted relative path so every machine sees the same
corpus for the same Python version.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

__all__ = [
    "EXCLUDED_DIRS",
    "stdlib_root",
    "stdlib_documents",
    "iter_documents",
    "iter_texts",
    "corpus_fingerprint",
]

logger = logging.getLogger(__name__)

# Directory names pruned anywhere below the stdlib root. Third-party packages are not the
# standard library, and the test suites are dominated by fixtures and generated data
# (lib2to3/tests, ctypes/test, tkinter/test, unittest/test, idlelib/idle_test, ...).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_documents(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """All non-empty ``*.py`` files below ``root`` (default: the stdlib), sorted by relative path.

    Uses os.walk with pruning so the (often huge) site-packages tree is never listed.
    """
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        raise FileNotFoundError(f"corpus root {str(base)!r} is not a directory")
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            # Empty files (many __init__.py) would contribute a lone EOD token and nothing else.
            if not path.is_file() or path.stat().st_size == 0:
                continue
            found.append((path.relative_to(base).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def iter_documents(paths: Iterable[str | os.PathLike[str]]) -> Iterator[tuple[Path, str]]:
    """Yield ``(path, text)`` for every file that decodes as UTF-8; others are skipped.

    Decoding is strict (no replacement characters) so the tokenizer never learns U+FFFD from
    a mis-encoded file; newlines are kept exactly as written (no universal-newline folding).
    """
    for raw in paths:
        path = Path(raw)
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            logger.warning("skipping %s: not valid UTF-8", path)
            continue
        yield path, text


def iter_texts(paths: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    """Texts of the UTF-8 files among ``paths``, in order (see :func:`iter_documents`)."""
    for _, text in iter_documents(paths):
        yield text


def corpus_fingerprint(
    paths: Sequence[str | os.PathLike[str]], root: str | os.PathLike[str] | None = None
) -> str:
    """Cheap content key: relative path and byte size of every file, plus the Python version.

    Only ``stat`` is called, so a cache hit never reads the corpus. Sizes catch every edit that
    changes a file's length; the Python version (``major.minor.micro``) catches the rest for the
    default corpus, whose files only change with the interpreter.
    """
    base = Path(root) if root is not None else stdlib_root()
    digest = hashlib.sha256()
    digest.update(
        f"python={sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}\n".encode()
    )
    for raw in paths:
        path = Path(raw)
        try:
            rel = path.relative_to(base).as_posix()
        except ValueError:
            rel = path.as_posix()
        digest.update(f"{rel}\t{path.stat().st_size}\n".encode())
    return digest.hexdigest()

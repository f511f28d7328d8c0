"""Tokenizer + indexed dataset for a corpus, built once and cached by content key.

Cache layout (one directory per key, complete or absent)::

    {cache_dir}/{key}/tokenizer.model
    {cache_dir}/{key}/{name}_text_document.bin
    {cache_dir}/{key}/{name}_text_document.idx
    {cache_dir}/{key}/prepared.json          # the PreparedData fields, written last

``key`` hashes the corpus fingerprint (relative paths + sizes + Python version), the vocab
size, the seed, the tokenizer trainer options and :data:`FORMAT_VERSION`. A build happens in
``{cache_dir}/.tmp-{key}-*`` and is renamed into place in one ``os.rename``, so a crash never
leaves a half-written ``{key}`` directory. No torch.distributed here: the caller makes one
rank build and the others wait, then call again (a cache hit).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.corpus import corpus_fingerprint, iter_texts, stdlib_documents, stdlib_root
from data.indexed import check_index_header, dataset_prefix, write_indexed_dataset
from data.paths import check_directory
from data.progress import format_duration, track
from data.tokenizer import (
    DEFAULT_MAX_SENTENCES,
    SentencePieceTokenizer,
    load_tokenizer,
    train_sentencepiece,
    trainer_options,
)

__all__ = [
    "planned_vocabulary",
    "FORMAT_VERSION",
    "PreparedData",
    "cache_key",
    "prepare_corpus_data",
    "prepare_default_data",
    "prepare_data_from_prefix",
    "prepare_text_data",
    "find_default_data",
    "check_text_data",
]

logger = logging.getLogger(__name__)

# Bump when the on-disk layout or the tokenisation pipeline changes meaning.
FORMAT_VERSION = 1
_META = "prepared.json"
_ENCODE_CHUNK = 64  # documents per SentencePiece batch call: bounded memory, threaded encode


@dataclass(frozen=True)
class PreparedData:
    """Everything the training loop needs to open the data."""

    tokenizer_model: str
    data_prefix: str  # e.g. ".../stdlib_text_document" (no .bin/.idx suffix)
    vocab_size: int
    key: str  # the json key / dataset key, "text"
    num_documents: int
    num_tokens: int
    # How to open tokenizer_model (data.tokenizer.load_tokenizer); built caches are SentencePiece.
    tokenizer_type: str = "sentencepiece"

    def tokenizer(self):
        """The tokenizer (``load_tokenizer(tokenizer_type, tokenizer_model)``)."""
        return load_tokenizer(self.tokenizer_type, self.tokenizer_model)


def cache_key(
    fingerprint: str,
    vocab_size: int,
    seed: int,
    name: str,
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    control_symbols: Sequence[str] = (),
) -> str:
    """Hex key of every input that changes the built files."""
    payload = json.dumps(
        {
            "format_version": FORMAT_VERSION,
            "corpus": fingerprint,
            "name": name,
            "vocab_size": int(vocab_size),
            "seed": int(seed),
            "max_sentences": int(max_sentences),
            "trainer_options": trainer_options(control_symbols),
        },
        sort_keys=True,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def _load_cached(final_dir: Path) -> PreparedData | None:
    meta = final_dir / _META
    if not meta.is_file():
        return None
    fields = json.loads(meta.read_text())
    # Paths are stored relative so a cache directory can be moved or shared across mounts.
    fields["tokenizer_model"] = str(final_dir / fields["tokenizer_model"])
    fields["data_prefix"] = str(final_dir / fields["data_prefix"])
    return PreparedData(**fields)


def _fsync_files(directory: Path) -> None:
    # Data reaches the disk before the rename publishes it: after a power cut the key
    # directory is either absent or complete, never present with empty files.
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())


def _build(
    tmp: Path,
    documents: Sequence[Path],
    vocab_size: int,
    seed: int,
    name: str,
    max_sentences: int,
    control_symbols: Sequence[str] = (),
) -> dict[str, object]:
    # Minutes on a small machine, once per cache key: say what is happening (stderr).
    print(
        f"{name}: training a SentencePiece tokenizer (vocab {vocab_size}) on "
        f"{len(documents)} documents",
        file=sys.stderr,
        flush=True,
    )
    start = time.perf_counter()
    model = train_sentencepiece(
        documents, tmp / "tokenizer", vocab_size, seed=seed, max_sentences=max_sentences,
        control_symbols=control_symbols,
    )  # fmt: skip
    print(
        f"{name}: tokenizer trained in {format_duration(time.perf_counter() - start)}",
        file=sys.stderr,
        flush=True,
    )
    tokenizer = SentencePieceTokenizer(model)

    def encoded():
        chunk: list[str] = []
        texts = track(
            iter_texts(documents),
            f"{name}: tokenizing",
            total=len(documents),
            size=lambda text: len(text.encode()),
        )
        for text in texts:
            chunk.append(text)
            if len(chunk) == _ENCODE_CHUNK:
                yield from (ids + [tokenizer.eod] for ids in tokenizer.encode_batch(chunk))
                chunk = []
        if chunk:
            yield from (ids + [tokenizer.eod] for ids in tokenizer.encode_batch(chunk))

    prefix = dataset_prefix(tmp / name, "text")
    stats = write_indexed_dataset(prefix, encoded(), tokenizer.vocab_size)
    return {
        "tokenizer_model": model.name,
        "data_prefix": Path(prefix).name,
        "vocab_size": tokenizer.vocab_size,
        "key": "text",
        "num_documents": stats.num_documents,
        "num_tokens": stats.num_tokens,
    }


def prepare_corpus_data(
    cache_dir: str | os.PathLike[str],
    documents: Sequence[str | os.PathLike[str]],
    vocab_size: int,
    seed: int = 1234,
    *,
    root: str | os.PathLike[str] | None = None,
    name: str = "corpus",
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    control_symbols: Sequence[str] = (),
) -> PreparedData:
    """Train a tokenizer on ``documents`` and write them as ``{name}_text_document``; cached.

    ``root`` only makes the fingerprint use relative paths (so caches survive a moved
    checkout). A cache hit costs one ``stat`` per document and a small JSON read.
    """
    paths = [Path(p) for p in documents]
    if not paths:
        raise ValueError("no documents to prepare")
    key = cache_key(
        corpus_fingerprint(paths, root), vocab_size, seed, name, max_sentences, control_symbols
    )
    base = Path(cache_dir)
    final_dir = base / key
    cached = _load_cached(final_dir)
    if cached is not None:
        return cached

    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=base))
    try:
        fields = _build(tmp, paths, vocab_size, seed, name, max_sentences, control_symbols)
        (tmp / _META).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is meant to be shared
        _fsync_files(tmp)
        try:
            os.rename(tmp, final_dir)
        except OSError:
            # Another process finished the same key first: its result is identical, use it.
            if _load_cached(final_dir) is None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info(
        "prepared %s (%d documents, %d tokens) in %s",
        name,
        fields["num_documents"],
        fields["num_tokens"],
        final_dir,
    )
    result = _load_cached(final_dir)
    assert result is not None
    return result


def prepare_default_data(
    cache_dir: str | os.PathLike[str],
    vocab_size: int,
    seed: int = 1234,
    control_symbols: Sequence[str] = (),
) -> PreparedData:
    """The Python stdlib corpus (data/corpus.py) tokenised with a freshly trained BPE model
    (``control_symbols``: extra special pieces, e.g. ``("<mask>",)``; a separate cache)."""
    root = stdlib_root()
    return prepare_corpus_data(
        cache_dir, stdlib_documents(root), vocab_size, seed, root=root, name="stdlib",
        control_symbols=control_symbols,
    )  # fmt: skip


def prepare_data_from_prefix(
    data_prefix: str | os.PathLike[str],
    tokenizer_model: str | os.PathLike[str],
    tokenizer_type: str = "sentencepiece",
) -> PreparedData:
    """Validate a user-given ``{prefix}.bin/.idx`` + its tokenizer and describe them.

    ``tokenizer_type``: "sentencepiece" (``tokenizer_model`` is a ``.model`` file) or
    "huggingface" (a ``tokenizer.json`` or its directory). Raises FileNotFoundError naming the
    missing file, or ValueError when the tokenizer is unusable (no end-of-document token),
    the token dtype of the index cannot hold the tokenizer's ids, or the files are not a
    complete Megatron indexed dataset (``check_index_header``).
    """
    tokenizer = _usable_tokenizer(tokenizer_type, tokenizer_model)
    return _describe_prefix(data_prefix, tokenizer, tokenizer_model, tokenizer_type)


def _usable_tokenizer(tokenizer_type: str, tokenizer_model):
    tokenizer = load_tokenizer(tokenizer_type, tokenizer_model)
    _ = tokenizer.eod  # documents end with it: a tokenizer without one fails here, not later
    return tokenizer


def _describe_prefix(data_prefix, tokenizer, tokenizer_model, tokenizer_type) -> PreparedData:
    prefix = os.fspath(data_prefix)
    stats = check_index_header(prefix)  # the header and file sizes; the data is not read
    vocab_size = tokenizer.vocab_size
    if stats.dtype.kind in "ui" and vocab_size - 1 > np.iinfo(stats.dtype).max:
        raise ValueError(
            f"{prefix}.idx stores {stats.dtype.name} tokens but the tokenizer has {vocab_size} ids"
        )
    stem = Path(prefix).name
    key = stem.rsplit("_", 2)[-2] if stem.endswith("_document") and stem.count("_") >= 2 else "text"
    return PreparedData(
        tokenizer_model=os.fspath(tokenizer_model),
        data_prefix=prefix,
        vocab_size=vocab_size,
        key=key,
        num_documents=stats.num_documents,
        num_tokens=stats.num_tokens,
        tokenizer_type=tokenizer_type,
    )


def prepare_text_data(data_cfg, seed: int, rank: int, control_symbols: Sequence[str] = ()):
    """The ``data`` section's text corpus for a run: the default stdlib corpus (built and
    cached; ``control_symbols`` extra special pieces, e.g. ``("<mask>",)``) or a user's
    Megatron prefix with its tokenizer. Returns ``PreparedData``; a problem is a
    ``ValueError`` whose message starts with the config key. Rank 0 reports the corpus."""
    if data_cfg.corpus == "stdlib":
        prepared = prepare_default_data(
            data_cfg.cache_dir, data_cfg.vocab_size, seed=seed, control_symbols=control_symbols
        )
        if rank == 0:
            extra = "".join(f", with {piece}" for piece in control_symbols)
            print(
                f"> data: default corpus {prepared.data_prefix} ({prepared.num_documents} "
                f"documents, {prepared.num_tokens} tokens, vocab {prepared.vocab_size}{extra})",
                flush=True,
            )
        return prepared
    return _prefix_data(data_cfg)


def _tokenizer_model(data_cfg):
    """``data.tokenizer_model``; unset only for a fine-tune whose checkpoint brought none
    (training/finetune_defaults.py), which is said here, naming the key."""
    if data_cfg.tokenizer_model is None:
        raise ValueError(
            "data.tokenizer_model: not set, and checkpoint.load carries no tokenizer of its own "
            "(a converted Hugging Face model's tokenizer/ folder): set it"
        )
    return data_cfg.tokenizer_model


def _prefix_data(data_cfg) -> PreparedData:
    """``prepare_data_from_prefix`` of the ``data`` section, each error keyed by its culprit."""
    model, kind = _tokenizer_model(data_cfg), data_cfg.tokenizer_type
    try:
        tokenizer = _usable_tokenizer(kind, model)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"data.tokenizer_model: {err}") from None
    try:
        return _describe_prefix(data_cfg.data_prefix, tokenizer, model, kind)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"data.data_prefix: {err}") from None


def find_default_data(
    cache_dir: str | os.PathLike[str],
    vocab_size: int,
    seed: int = 1234,
    control_symbols: Sequence[str] = (),
) -> PreparedData | None:
    """The default corpus as ``prepare_default_data`` cached it, or None when that would
    build it now. Reads the corpus's ``stat``s and the cache's ``prepared.json``; writes
    nothing."""
    root = stdlib_root()
    fingerprint = corpus_fingerprint(stdlib_documents(root), root)
    key = cache_key(fingerprint, vocab_size, seed, "stdlib", DEFAULT_MAX_SENTENCES, control_symbols)
    return _load_cached(Path(cache_dir) / key)


def planned_vocabulary(data_cfg) -> tuple[int, int]:
    """``(vocabulary size, pad id)`` of the ``data`` section's tokenizer for a run that is only
    planned (training/planning/: nothing prepared, no corpus read): a user's tokenizer is
    loaded (``data.tokenizer_model``); the default corpus's is the SentencePiece model it would
    train, ``data.vocab_size`` pieces with ``<pad>`` at id 3 (``train_sentencepiece``)."""
    if data_cfg.corpus == "stdlib":
        return data_cfg.vocab_size, 3
    model = _tokenizer_model(data_cfg)
    try:
        tokenizer = load_tokenizer(data_cfg.tokenizer_type, model)
    except (OSError, ValueError) as err:
        raise ValueError(f"data.tokenizer_model: {err}") from None
    return tokenizer.vocab_size, tokenizer.pad


def check_text_data(
    data_cfg, seed: int, control_symbols: Sequence[str] = ()
) -> PreparedData | None:
    """Pre-flight of ``prepare_text_data``, building and writing nothing: a user's prefix
    must be a complete Megatron indexed dataset (header and sizes) with a tokenizer that
    loads; the default corpus, when already built, likewise, and when still to be built,
    ``data.cache_dir`` must be creatable. Returns what ``prepare_text_data`` would (None
    while the default corpus is unbuilt); a problem is a ``ValueError`` starting with the
    config key."""
    if data_cfg.corpus != "stdlib":
        return _prefix_data(data_cfg)
    cached = find_default_data(data_cfg.cache_dir, data_cfg.vocab_size, seed, control_symbols)
    if cached is None:
        check_directory("data.cache_dir", data_cfg.cache_dir)
        return None
    try:  # a damaged cache is the cache directory's problem
        cached.tokenizer()
        check_index_header(cached.data_prefix)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"data.cache_dir: {err} (delete that cache entry to rebuild it)") from None
    return cached

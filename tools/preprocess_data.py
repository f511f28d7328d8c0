"""Tokenise text into Megatron indexed datasets (``{prefix}_{key}_document.bin/.idx``).

Like Megatron-LM's ``tools/preprocess_data.py``, with a SentencePiece tokenizer that is either
given (``--tokenizer-model``) or trained here on the same input (``--vocab-size``), or a
Hugging Face tokenizer (``--tokenizer-type huggingface``: a converted model's own vocabulary,
``--tokenizer-model`` naming its ``tokenizer.json`` or the directory holding it)::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --vocab-size 8192 --output-prefix out/corpus
    python tools/preprocess_data.py --input src_dir/ --pattern '*.py' \\
        --tokenizer-model tok.model --output-prefix out/code
    python tools/preprocess_data.py --input corpus.jsonl --tokenizer-type huggingface \\
        --tokenizer-model hf/gpt2 --output-prefix out/gpt2
    python tools/preprocess_data.py --default-corpus --vocab-size 8192 --cache-dir .cache/data

``--input`` is a JSON-lines file (one object per line, the text under each ``--json-keys``
key) or a directory whose files (sorted by relative path) are one document each. An EOD token
is appended to every document unless ``--no-append-eod``. Progress (documents, rate, ETA) goes
to stderr: a line rewritten in place on a terminal, a line every 10 s in a log. Errors print
one line, exit 2. Every JSON line is read (UTF-8, JSON, the keys) before anything is written,
so a damaged one is named as ``file:line``; a failure after that removes what was written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.corpus import iter_texts  # noqa: E402
from data.indexed import dataset_prefix, write_indexed_dataset  # noqa: E402
from data.paths import output_folder  # noqa: E402
from data.progress import track  # noqa: E402
from data.tokenizer import (  # noqa: E402
    TOKENIZER_TYPES,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    train_sentencepiece,
)

__all__ = ["main", "build_parser", "check_input_documents", "iter_input_texts"]

_PROG = "preprocess_data.py"
_BATCH = 64


class UsageError(Exception):
    """A user mistake reported as one line on stderr with exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", help="JSON-lines file, or a directory of text files")
    src.add_argument(
        "--default-corpus",
        action="store_true",
        help="prepare the cached default corpus (Python stdlib) and print its paths",
    )
    p.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="keys to read from each JSON line; one output dataset per key",
    )
    p.add_argument(
        "--pattern",
        default="*",
        help="file name glob for a directory --input (recursive), default '*'",
    )
    tok = p.add_mutually_exclusive_group()
    tok.add_argument(
        "--tokenizer-model",
        help="existing SentencePiece .model file, or for --tokenizer-type huggingface a "
        "tokenizer.json or the directory holding it",
    )
    tok.add_argument(
        "--vocab-size", type=int, help="train a SentencePiece BPE model of this size on the input"
    )
    p.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default="sentencepiece",
        help="how to read --tokenizer-model (default: sentencepiece)",
    )
    p.add_argument("--output-prefix", help="output path prefix ({prefix}_{key}_document.*)")
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the EOD token to each document (default: on)",
    )
    p.add_argument("--seed", type=int, default=1234, help="tokenizer training seed")
    p.add_argument("--cache-dir", default=".cache/data", help="cache for --default-corpus")
    return p


def _directory_files(root: Path, pattern: str) -> list[Path]:
    files = [
        p
        for p in root.rglob(pattern)
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    ]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _jsonl_records(path: Path) -> Iterator[tuple[int, object]]:
    """``(line number, parsed value)`` of every non-blank line; a line that is not UTF-8 or
    not JSON raises naming ``file:line`` (lines end at newline bytes: a line's bytes are
    decoded on their own, so the error can name it)."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UsageError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[err.start]:02x} at column "
                    f"{err.start + 1})"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise UsageError(f"{path}:{lineno}: invalid JSON ({err.msg})") from None


def _text(path: Path, lineno: int, record: object, key: str) -> str:
    if not isinstance(record, dict) or key not in record:
        raise UsageError(f"{path}:{lineno}: no key {key!r} in this JSON line")
    text = record[key]
    if not isinstance(text, str):
        raise UsageError(f"{path}:{lineno}: value of {key!r} is not a string")
    return text


def _iter_jsonl(path: Path, key: str) -> Iterator[str]:
    for lineno, record in _jsonl_records(path):
        yield _text(path, lineno, record, key)


def check_input_documents(input_path: str, keys: list[str], pattern: str = "*") -> int:
    """Documents ``iter_input_texts`` will yield per key (a directory's files, a JSON-lines
    file's non-blank lines). A JSON-lines file is read whole here, as the tokenizing pass
    will read it: a line that is not UTF-8 or not JSON, or lacks a key, raises naming
    ``file:line`` before anything is written. The count gives the progress line its ETA."""
    path = Path(input_path)
    if path.is_dir():
        return len(_directory_files(path, pattern))
    count = 0
    for lineno, record in _jsonl_records(path):
        for key in keys:
            _text(path, lineno, record, key)
        count += 1
    return count


def iter_input_texts(input_path: str, key: str, pattern: str = "*") -> Iterator[str]:
    """Document texts of ``input_path`` for ``key`` (a directory ignores the key)."""
    path = Path(input_path)
    if path.is_dir():
        return iter_texts(_directory_files(path, pattern))
    return _iter_jsonl(path, key)


def _encoded(
    tokenizer: SentencePieceTokenizer | HFTokenizer,
    texts: Iterator[str],
    append_eod: bool,
    skipped: list[int],
) -> Iterator[list[int]]:
    def flush(chunk: list[str]) -> Iterator[list[int]]:
        for ids in tokenizer.encode_batch(chunk):
            if not ids:  # an empty document adds nothing, not a lone EOD
                skipped[0] += 1
                continue
            yield ids + [tokenizer.eod] if append_eod else ids

    chunk: list[str] = []
    for text in texts:
        chunk.append(text)
        if len(chunk) == _BATCH:
            yield from flush(chunk)
            chunk = []
    if chunk:
        yield from flush(chunk)


def _validate(args: argparse.Namespace) -> None:
    if args.tokenizer_type != "sentencepiece" and args.tokenizer_model is None:
        raise UsageError(
            f"--tokenizer-type {args.tokenizer_type} needs --tokenizer-model (only SentencePiece "
            "models are trained here)"
        )
    if args.default_corpus:
        if args.tokenizer_model:
            raise UsageError("--default-corpus trains its own tokenizer; drop --tokenizer-model")
        if args.vocab_size is None:
            args.vocab_size = 8192
        return
    path = Path(args.input)
    if not path.exists():
        raise UsageError(f"--input {args.input!r} does not exist")
    if path.is_dir() and len(args.json_keys) != 1:
        raise UsageError("a directory --input gives one dataset: pass a single --json-keys")
    if path.is_dir() and not _directory_files(path, args.pattern):
        raise UsageError(f"--input directory {args.input!r} has no files matching {args.pattern!r}")
    if args.tokenizer_model is None and args.vocab_size is None:
        raise UsageError("give --tokenizer-model (existing) or --vocab-size (train one)")
    if args.tokenizer_model is not None and not Path(args.tokenizer_model).exists():
        raise UsageError(f"--tokenizer-model {args.tokenizer_model!r} does not exist")
    if not args.output_prefix:
        raise UsageError("--output-prefix is required")


def _run(args: argparse.Namespace) -> None:
    _validate(args)
    if args.default_corpus:
        from data.prepare import prepare_default_data

        prepared = prepare_default_data(args.cache_dir, args.vocab_size, seed=args.seed)
        print(f"tokenizer_model: {prepared.tokenizer_model}")
        print(f"data_prefix: {prepared.data_prefix}")
        print(
            f"documents: {prepared.num_documents} tokens: {prepared.num_tokens} "
            f"vocab_size: {prepared.vocab_size}"
        )
        return

    # Every line read once before anything is written: a damaged one is refused here.
    total = check_input_documents(args.input, args.json_keys, args.pattern)
    if args.tokenizer_model is not None:
        tokenizer = load_tokenizer(args.tokenizer_type, args.tokenizer_model)
        if args.append_eod:
            _ = tokenizer.eod  # a tokenizer without one fails before any file is written
    written: list[Path] = []  # removed again if anything fails: no partial output
    report: list[str] = []  # printed once everything is written
    with output_folder(Path(args.output_prefix).parent):
        try:
            if args.tokenizer_model is None:
                texts = (
                    t
                    for key in args.json_keys
                    for t in iter_input_texts(args.input, key, args.pattern)
                )
                written.append(Path(f"{args.output_prefix}_tokenizer.model"))
                model = train_sentencepiece(
                    texts, f"{args.output_prefix}_tokenizer", args.vocab_size, seed=args.seed
                )
                report.append(f"tokenizer_model: {model}")
                tokenizer = SentencePieceTokenizer(model)
                if args.append_eod:
                    _ = tokenizer.eod
            for key in args.json_keys:
                prefix = dataset_prefix(args.output_prefix, key)
                written += [Path(prefix + ".bin"), Path(prefix + ".idx")]
                report.append(_write_key(args, tokenizer, key, prefix, total))
        except BaseException:
            for path in written:
                path.unlink(missing_ok=True)
            raise
    print("\n".join(report))


def _write_key(args: argparse.Namespace, tokenizer, key: str, prefix: str, total: int) -> str:
    """Tokenize ``key``'s documents into the dataset at ``prefix``; returns the report line."""
    skipped = [0]
    texts = track(
        iter_input_texts(args.input, key, args.pattern),
        f"tokenizing {key}",
        total=total,
        size=lambda text: len(text.encode()),
    )
    docs = _encoded(tokenizer, texts, args.append_eod, skipped)
    stats = write_indexed_dataset(prefix, docs, tokenizer.vocab_size)
    if stats.num_documents == 0:
        raise UsageError(f"no non-empty documents under key {key!r} in {args.input!r}")
    note = f" ({skipped[0]} empty skipped)" if skipped[0] else ""
    return (
        f"data_prefix: {prefix} documents: {stats.num_documents}{note} "
        f"tokens: {stats.num_tokens} dtype: {stats.dtype.name}"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _run(args)
    except (UsageError, OSError, ValueError) as err:
        print(f"{_PROG}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

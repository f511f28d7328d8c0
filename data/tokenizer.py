"""Tokenizers: SentencePiece for code (trained locally, deterministic, lossless on decode) and
Hugging Face ``tokenizer.json`` files (:class:`HFTokenizer`, a converted model's own vocabulary),
both behind one interface; :func:`load_tokenizer` opens either from a path.

Training settings that matter for source code (all in :data:`TRAINER_OPTIONS`):

- ``normalization_rule_name="identity"``, ``remove_extra_whitespaces=False`` and
  ``add_dummy_prefix=False``: nothing is folded or stripped, so indentation, runs of spaces and
  a file's first character survive ``decode(encode(text))`` byte for byte.
- ``user_defined_symbols=["\\n"]``: SentencePiece trains on lines and would otherwise never see
  a newline; as a user symbol it is one token everywhere.
- ``allow_whitespace_only_pieces=True``: indentation runs ("▁▁▁▁", "▁▁▁▁▁▁▁▁") become single
  pieces instead of one token per space.
- ``byte_fallback=True``: any text encodes (tabs, rare unicode) without ``<unk>``.
- ``num_threads=1``, explicit seed, no internal shuffling: the same input gives the same model.
  When the input has more lines than ``max_sentences`` we subsample them ourselves with a seeded
  reservoir so the choice does not depend on SentencePiece internals.

Special ids: ``<unk>``=0, ``<s>``=1, ``</s>``=2 (the end-of-document token, ``eod``),
``<pad>``=3, ``"\\n"``=4; byte pieces follow.

The interface (both classes): ``vocab_size``, ``eod`` (= ``eos``), ``bos``, ``pad``, ``unk``,
``mask``, ``newline`` (-1 for a role the vocabulary lacks, except ``eod``), ``encode``,
``encode_batch``, ``decode``, ``id_to_piece``, ``tokenize``/``detokenize``, pickling, and
``unique_identifiers`` (a content fingerprint keying megatron's index caches).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import sentencepiece as spm

__all__ = [
    "TRAINER_OPTIONS",
    "DEFAULT_MAX_SENTENCES",
    "TOKENIZER_TYPES",
    "train_sentencepiece",
    "SentencePieceTokenizer",
    "HFTokenizer",
    "load_tokenizer",
]

# The ``data.tokenizer_type`` values; ``load_tokenizer`` also takes "auto".
TOKENIZER_TYPES = ("sentencepiece", "huggingface")
HF_TOKENIZER_FILE = "tokenizer.json"

# Part of the data cache key (data/prepare.py): change any value and caches rebuild.
TRAINER_OPTIONS: dict[str, object] = {
    "model_type": "bpe",
    "character_coverage": 0.9995,
    "byte_fallback": True,
    "normalization_rule_name": "identity",
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "allow_whitespace_only_pieces": True,
    "split_digits": True,
    "max_sentencepiece_length": 16,
    "max_sentence_length": 8192,
    "user_defined_symbols": ["\n"],
    "unk_id": 0,
    "bos_id": 1,
    "eos_id": 2,
    "pad_id": 3,
    "num_threads": 1,
    "input_sentence_size": 0,
    "shuffle_input_sentence": False,
    "minloglevel": 2,
}

# BPE on 300k lines of code with vocab 8192 trains in a few seconds on one core; the full
# stdlib has about 280k non-blank lines, so it is used whole.
DEFAULT_MAX_SENTENCES = 300_000


def _iter_lines(paths_or_texts: Iterable[str | os.PathLike[str]]) -> Iterator[str]:
    for item in paths_or_texts:
        text = Path(item).read_text(encoding="utf-8") if isinstance(item, os.PathLike) else item
        for line in text.split("\n"):
            if line.strip():
                yield line


def _sample_lines(lines: Iterable[str], max_sentences: int, seed: int) -> list[str]:
    """Seeded reservoir sample (algorithm R) kept in input order; all lines if there are fewer."""
    rng = random.Random(seed)
    reservoir: list[tuple[int, str]] = []
    for i, line in enumerate(lines):
        if i < max_sentences:
            reservoir.append((i, line))
        else:
            j = rng.randrange(i + 1)
            if j < max_sentences:
                reservoir[j] = (i, line)
    reservoir.sort(key=lambda item: item[0])
    return [line for _, line in reservoir]


def trainer_options(control_symbols: Sequence[str] = ()) -> dict[str, object]:
    """``TRAINER_OPTIONS``, plus ``control_symbols`` (e.g. ``["<mask>"]`` for masked-LM
    models: ids right after ``<pad>``, never produced by encoding text, so a literal
    ``<mask>`` in the corpus stays ordinary text)."""
    if not control_symbols:
        return dict(TRAINER_OPTIONS)
    return {**TRAINER_OPTIONS, "control_symbols": list(control_symbols)}


def train_sentencepiece(
    paths_or_texts: Iterable[str | os.PathLike[str]],
    model_prefix: str | os.PathLike[str],
    vocab_size: int,
    seed: int = 1234,
    max_sentences: int = DEFAULT_MAX_SENTENCES,
    control_symbols: Sequence[str] = (),
) -> Path:
    """Train a BPE SentencePiece model and write ``{model_prefix}.model``; returns that path.

    ``paths_or_texts``: ``pathlib.Path`` (or any ``os.PathLike``) items are read as UTF-8 files;
    plain ``str`` items are the text itself. Blank lines are not used for training.
    ``control_symbols``: extra special pieces (see ``trainer_options``).
    """
    if vocab_size < 300:
        raise ValueError(f"vocab_size={vocab_size} is too small: byte fallback alone needs 261")
    sentences = _sample_lines(_iter_lines(paths_or_texts), max_sentences, seed)
    if not sentences:
        raise ValueError("no non-blank text to train the tokenizer on")
    model_path = Path(f"{os.fspath(model_prefix)}.model")
    model_path.parent.mkdir(parents=True, exist_ok=True)
    proto = io.BytesIO()
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=proto,
            vocab_size=vocab_size,
            **trainer_options(control_symbols),
        )
    except RuntimeError as err:  # e.g. vocab smaller than the characters the text needs
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(
            f"sentencepiece training failed (vocab_size={vocab_size}): {first}"
        ) from err
    model_path.write_bytes(proto.getvalue())
    return model_path


class SentencePieceTokenizer:
    """A SentencePiece model with the attributes megatron-core's GPTDataset reads.

    megatron.core reads ``vocab_size``, ``eod``, ``pad`` and (for its index-cache key)
    ``unique_identifiers``; ``tokenize``/``detokenize`` mirror its legacy tokenizer API.
    """

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        path = Path(model_path)
        if (path / HF_TOKENIZER_FILE).is_file() or (path.is_file() and path.suffix == ".json"):
            # SentencePiece's own parse error is a multi-line C++ assertion; say what to do.
            raise ValueError(
                f"tokenizer model {str(path)!r} is a Hugging Face tokenizer, not a "
                "SentencePiece model: use tokenizer type 'huggingface'"
            )
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {str(path)!r}")
        blob = path.read_bytes()
        self.model_path = path
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=blob)
        except RuntimeError:
            msg = f"tokenizer model {str(path)!r} is not a SentencePiece model"
            raise ValueError(msg) from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"tokenizer model {str(path)!r} has no </s> piece to use as EOD")
        # Keys megatron's sample-index cache. The content hash, not the path: every rank must
        # compute the same key even where the file is mounted at different paths.
        self.unique_identifiers: OrderedDict[str, object] = OrderedDict(
            [("class", type(self).__name__), ("sha256", hashlib.sha256(blob).hexdigest())]
        )

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def eod(self) -> int:
        return int(self._sp.eos_id())

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        return int(self._sp.bos_id())

    @property
    def pad(self) -> int:
        # -1 (megatron's "no pad") for models trained without a pad piece.
        return int(self._sp.pad_id())

    @property
    def unk(self) -> int:
        return int(self._sp.unk_id())

    @property
    def mask(self) -> int:
        """The ``<mask>`` control symbol's id, or -1 when the model has none."""
        i = int(self._sp.piece_to_id("<mask>"))
        return i if self._sp.id_to_piece(i) == "<mask>" and self._sp.is_control(i) else -1

    @property
    def newline(self) -> int:
        """The id of the ``"\\n"`` piece (a user symbol in tokenizers trained here), or -1 when
        the model has no piece that is exactly a newline."""
        i = int(self._sp.piece_to_id("\n"))
        return i if self._sp.id_to_piece(i) == "\n" else -1

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (SentencePiece runs the batch in C++ threads)."""
        return [list(ids) for ids in self._sp.encode(list(texts))]

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, token_id: int) -> str:
        return self._sp.id_to_piece(int(token_id))

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int] | np.ndarray) -> str:
        return self.decode(ids)

    # Picklable (e.g. for DataLoader worker processes): rebuild the processor from the bytes.
    def __getstate__(self) -> dict[str, object]:
        return {
            "model_path": self.model_path,
            "blob": self._sp.serialized_model_proto(),
            "unique_identifiers": self.unique_identifiers,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        self.model_path = state["model_path"]
        self._sp = spm.SentencePieceProcessor(model_proto=state["blob"])
        self.unique_identifiers = state["unique_identifiers"]

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"


# Hugging Face files next to tokenizer.json that say which special token plays which role.
_HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
_ROLES = ("bos", "eos", "pad", "unk", "mask")
# Without config files naming roles, roles are looked up among the tokenizer's special tokens
# by these usual names, first match wins. GPT-2's lone <|endoftext|> is both bos and eos.
_ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "bos": ("<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "<|endoftext|>", "[CLS]"),
    "eos": ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]"),
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "mask": ("<mask>", "[MASK]"),
}
# BERT-style configs name no bos/eos; their cls/sep tokens play those parts in a document.
_ROLE_FALLBACK_KEYS = {"bos": "cls_token", "eos": "sep_token"}


def _hf_files(path: Path) -> tuple[Path, Path]:
    """(tokenizer.json, the directory searched for the config files)."""
    if path.is_dir():
        json_path = path / HF_TOKENIZER_FILE
        if not json_path.is_file():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} has no {HF_TOKENIZER_FILE}")
        return json_path, path
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer not found: {str(path)!r}")
    return path, path.parent


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"tokenizer config {str(path)!r} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(f"tokenizer config {str(path)!r} is not a JSON object")
    return value


def _token_content(value: object) -> str | None:
    # A role is a string, an AddedToken dict ({"content": ..., "__type": "AddedToken"}) or null.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _configured_roles(directory: Path) -> tuple[dict[str, str | None], str | None]:
    """Role -> token string from the config files (None: the config says the role is absent),
    and the file the roles came from (for error messages).

    Precedence as in transformers 5: special_tokens_map.json overrides tokenizer_config.json,
    unless the latter has ``added_tokens_decoder`` (the current layout, where the legacy map is
    ignored)."""
    tok_cfg_path, map_path = (directory / name for name in _HF_CONFIG_FILES)
    merged: dict[str, object] = {}
    source = None
    if tok_cfg_path.is_file():
        merged.update(_read_json(tok_cfg_path))
        source = str(tok_cfg_path)
    if map_path.is_file() and "added_tokens_decoder" not in merged:
        merged.update(_read_json(map_path))
        source = str(map_path) if source is None else f"{source} + {map_path.name}"
    roles: dict[str, str | None] = {}
    for role in _ROLES:
        key = f"{role}_token"
        if key in merged:
            roles[role] = _token_content(merged[key])
        elif role in _ROLE_FALLBACK_KEYS and _ROLE_FALLBACK_KEYS[role] in merged:
            roles[role] = _token_content(merged[_ROLE_FALLBACK_KEYS[role]])
    return roles, source


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (the ``tokenizers`` library) with the interface of
    :class:`SentencePieceTokenizer`, so a converted model trains on its own vocabulary.

    ``path``: a directory holding ``tokenizer.json`` (as ``save_pretrained`` writes it) or the
    file itself. The special tokens' roles come from ``tokenizer_config.json`` /
    ``special_tokens_map.json`` beside it when they name any (``bos_token``, ``eos_token``,
    ``pad_token``, ``unk_token``, ``mask_token``; ``cls_token``/``sep_token`` stand in for a
    missing bos/eos; a role they leave out is absent, as in transformers), otherwise from the
    tokenizer's own special tokens by their usual names (``<s>``, ``</s>``, ``<|endoftext|>``,
    ``<pad>``, ``<unk>``, ``<mask>``, ``[SEP]``, ...).

    Encoding is of plain text: no template (``add_special_tokens=False``; the data pipeline
    appends ``eod`` itself), no truncation or padding even where tokenizer.json configures
    them, and a special token's literal text in a document (say ``<|endoftext|>`` in a source
    file) is encoded as ordinary text, as SentencePiece control symbols are, so documents
    cannot forge document boundaries or masks. ``decode`` keeps special tokens.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer  # not needed by SentencePiece-only runs

        self.path = Path(path)
        json_path, directory = _hf_files(self.path)
        blob = json_path.read_bytes()
        try:
            tok = Tokenizer.from_str(blob.decode("utf-8"))
        except Exception as err:  # the tokenizers library raises a bare Exception
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            if json_path.suffix == ".model":
                first = "a SentencePiece model? use tokenizer type 'sentencepiece'"
            raise ValueError(
                f"tokenizer {str(json_path)!r} is not a Hugging Face tokenizer.json ({first})"
            ) from None
        self._tok = self._configured(tok)
        self.special_tokens = self._resolve_roles(directory)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        # Ids can have holes (removed tokens); the embedding must cover the largest id.
        self._vocab_size = max(len(vocab), max(vocab.values(), default=-1) + 1)
        self.unique_identifiers: OrderedDict[str, object] = OrderedDict(
            [
                ("class", type(self).__name__),
                ("sha256", hashlib.sha256(blob).hexdigest()),
                # Roles from the config files change eod and pad without touching the json.
                ("special_tokens", dict(sorted(self.special_tokens.items()))),
            ]
        )

    @staticmethod
    def _configured(tok):
        # A saved tokenizer.json may carry truncation (e.g. max_length 512) or padding: either
        # would silently cut or pad whole documents during preprocessing.
        tok.no_truncation()
        tok.no_padding()
        tok.encode_special_tokens = True  # runtime-only: to_str() and pickling drop it
        return tok

    def _resolve_roles(self, directory: Path) -> dict[str, str]:
        configured, source = _configured_roles(directory)
        if configured:
            # Config files that name roles are complete, as transformers reads them: a role
            # they leave out (Llama's pad) is absent, not guessed.
            roles: dict[str, str] = {}
            for role, token in configured.items():
                if token is None:
                    continue  # named as null: no such token (GPT-2's pad)
                if self._tok.token_to_id(token) is None:
                    raise ValueError(
                        f"tokenizer config {source}: {role}_token {token!r} is not in the "
                        "tokenizer's vocabulary"
                    )
                roles[role] = token
            return roles
        # A bare tokenizer.json, or a config that names no role (the GPT-2 hub's, whose roles
        # are transformers class defaults): the usual names among the special tokens.
        special = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        roles = {}
        for role in _ROLES:
            found = next((n for n in _ROLE_NAMES[role] if n in special), None)
            if found is None and role == "unk":
                found = getattr(self._tok.model, "unk_token", None)  # BPE/WordPiece models
                found = found if found and self._tok.token_to_id(found) is not None else None
            if found is not None:
                roles[role] = found
        return roles

    def _role_id(self, role: str) -> int:
        token = self.special_tokens.get(role)
        return -1 if token is None else int(self._tok.token_to_id(token))

    @property
    def vocab_size(self) -> int:
        """The full vocabulary, added tokens included (the model's rows before padding)."""
        return self._vocab_size

    @property
    def eod(self) -> int:
        """The end-of-sequence token's id; ValueError when the tokenizer has none."""
        if "eos" not in self.special_tokens:
            raise ValueError(
                f"tokenizer {str(self.path)!r} has no end-of-document (eos) token: name one as "
                f"eos_token in {_HF_CONFIG_FILES[0]}"
            )
        return self._role_id("eos")

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def bos(self) -> int:
        """-1 when the tokenizer has none."""
        return self._role_id("bos")

    @property
    def pad(self) -> int:
        # -1 (megatron's "no pad") when there is none, as SentencePieceTokenizer.
        return self._role_id("pad")

    @property
    def unk(self) -> int:
        """-1 when the tokenizer has none (byte-level BPE needs none)."""
        return self._role_id("unk")

    @property
    def mask(self) -> int:
        """The mask token's id, or -1 when the tokenizer has none."""
        return self._role_id("mask")

    @property
    def newline(self) -> int:
        """The id of the token that is exactly ``"\\n"`` (byte-level ``Ċ``, SentencePiece's
        ``<0x0A>``), or -1 when there is none."""
        ids = self.encode("\n")
        candidates = ids if len(ids) == 1 else []
        candidates += [self._tok.token_to_id(t) for t in ("\n", "\u010a", "<0x0A>")]
        for i in candidates:
            if i is not None and self._tok.decode([i], skip_special_tokens=False) == "\n":
                return int(i)
        return -1

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encode many texts at once (the tokenizers library runs the batch in Rust threads)."""
        return [list(e.ids) for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def id_to_piece(self, token_id: int) -> str:
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise IndexError(f"token id {int(token_id)} is out of range")
        return piece

    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int] | np.ndarray) -> str:
        return self.decode(ids)

    # Picklable (e.g. for DataLoader worker processes): rebuild from the JSON text.
    def __getstate__(self) -> dict[str, object]:
        return {
            "path": self.path,
            "json": self._tok.to_str(),
            "special_tokens": self.special_tokens,
            "vocab_size": self._vocab_size,
            "unique_identifiers": self.unique_identifiers,
        }

    def __setstate__(self, state: dict[str, object]) -> None:
        from tokenizers import Tokenizer

        self.path = state["path"]
        self._tok = self._configured(Tokenizer.from_str(state["json"]))
        self.special_tokens = state["special_tokens"]
        self._vocab_size = state["vocab_size"]
        self.unique_identifiers = state["unique_identifiers"]

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(kind: str, path: str | os.PathLike[str]) -> SentencePieceTokenizer | HFTokenizer:
    """Open the tokenizer at ``path``. ``kind``: "sentencepiece" (a ``.model`` file),
    "huggingface" (a ``tokenizer.json`` or a directory holding one) or "auto" (a directory
    or a ``.json`` file is Hugging Face's, anything else SentencePiece)."""
    if kind == "auto":
        p = Path(path)
        kind = "huggingface" if p.is_dir() or p.suffix == ".json" else "sentencepiece"
    if kind == "sentencepiece":
        return SentencePieceTokenizer(path)
    if kind == "huggingface":
        return HFTokenizer(path)
    raise ValueError(
        f"tokenizer type must be one of {', '.join(TOKENIZER_TYPES)} or auto, got {kind!r}"
    )

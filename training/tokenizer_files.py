"""A checkpoint's tokenizer as files: found from its run, written beside a Hugging Face
export, carried through an import.

- Import (``training/conversion.py import_hf``): the Hugging Face directory's tokenizer and
  processor files are copied into the native checkpoint's ``tokenizer/`` folder, and a
  native-to-native conversion copies that folder on, so ``tools/generate.py`` and an export
  find them without ``--tokenizer``.
- Export: the tokenizer the checkpoint's run trained with is written beside ``config.json``
  so ``AutoTokenizer.from_pretrained`` loads it: the ``tokenizer/`` folder of an imported
  checkpoint, the files of a Hugging Face tokenizer (``data.tokenizer_type=huggingface``),
  or a SentencePiece model (the default corpus's, or ``data.tokenizer_model``) converted to a
  ``LlamaTokenizer`` without a prefix space (this project's SentencePiece models add no
  dummy prefix) and without added BOS/EOS (documents end with EOS in the data, as trained).
  A converted tokenizer is checked before it is kept: it must encode a probe text (code,
  indentation, tabs, digits, non-ASCII) to this project's ids; otherwise nothing is written
  and the description says why.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from data.prepare import find_default_data
from data.tokenizer import SentencePieceTokenizer

__all__ = [
    "FOLDER",
    "HF_TOKENIZER_FILES",
    "copy_tokenizer_files",
    "export_tokenizer",
    "run_cache_dir",
    "run_tokenizer",
]

# What a Hugging Face model directory may hold besides the model: tokenizers of every kind and
# the image processor's config (ViT).
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "sentencepiece.bpe.model",
    "spiece.model",
    "preprocessor_config.json",
)

FOLDER = "tokenizer"  # inside a native checkpoint directory

_PROBE = (
    'def main(argv=None):\n    """Parse the command line."""\n\tvalue = 12345 + 0.5\n'
    "    return {'naïve': 'café', \"π\": 3.14159}  # ünïcödé\n\n\nclass A(B): pass\n"
)


def copy_tokenizer_files(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer/processor files of directory ``source`` (or the single
    ``tokenizer.json`` file ``source``) into ``target``; returns the names copied."""
    source = Path(source)
    files = [source] if source.is_file() else [source / n for n in HF_TOKENIZER_FILES]
    files = [f for f in files if f.is_file()]
    if files:
        target.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, target / f.name)
    return [f.name for f in files]


def run_tokenizer(checkpoint: Path, metadata: dict, control_symbols=()) -> tuple[str, Path] | None:
    """``(kind, path)`` of the tokenizer ``checkpoint``'s run used ("huggingface": a
    ``tokenizer.json`` or a folder of Hugging Face files; "sentencepiece": a ``.model``), or
    None when it names none that exists (an image model; an import without tokenizer files; a
    default-corpus cache since deleted). ``control_symbols``: the family's extra pieces,
    part of the default corpus's cache key."""
    carried = Path(checkpoint) / FOLDER  # an import's files (a ViT's: the image processor's)
    if carried.is_dir() and any(carried.iterdir()):
        return "huggingface", carried
    if metadata.get("weights_only"):
        return None  # an import's run config is a placeholder, not the model's tokenizer
    data = metadata.get("config", {}).get("data") or {}
    if data.get("corpus") == "stdlib" and "vocab_size" in data:
        seed = metadata["config"].get("training", {}).get("seed", 1234)
        cache = run_cache_dir(data["cache_dir"])
        prepared = find_default_data(cache, data["vocab_size"], seed, control_symbols)
        return None if prepared is None else ("sentencepiece", Path(prepared.tokenizer_model))
    path = data.get("tokenizer_model")
    if path and Path(path).exists():
        return data.get("tokenizer_type", "sentencepiece"), Path(path)
    return None


def run_cache_dir(path: str) -> Path:
    """A run's ``data.cache_dir``: relative ones are relative to where the run started, the
    checkout (``make train``) unless that path exists from here."""
    cache = Path(path)
    checkout = Path(__file__).resolve().parents[1] / cache
    if cache.is_absolute() or cache.exists() or not checkout.exists():
        return cache
    return checkout


def export_tokenizer(
    checkpoint: Path, metadata: dict, directory: Path, control_symbols=(), what="tokenizer"
) -> str:
    """Write the run's tokenizer (``run_tokenizer``) into Hugging Face model ``directory``;
    returns a one-line description of what was written, or of why nothing was, starting
    with ``what`` (an image model's carried files: "image processor")."""
    found = run_tokenizer(checkpoint, metadata, control_symbols)
    if found is None:
        return f"{what}: none written (the checkpoint names no {what} file that exists)"
    kind, path = found
    if kind == "huggingface":
        names = copy_tokenizer_files(path, Path(directory))
        return f"{what}: copied {', '.join(names)} from {path}"
    return _sentencepiece_as_llama(path, Path(directory))


def _sentencepiece_as_llama(model: Path, directory: Path) -> str:
    from transformers import AutoTokenizer, LlamaTokenizer

    ours = SentencePieceTokenizer(model)
    specials = {
        role: ours.id_to_piece(token_id)
        for role, token_id in (
            ("unk_token", ours.unk),
            ("bos_token", ours.bos),
            ("eos_token", ours.eos),
            ("pad_token", ours.pad),
            ("mask_token", ours.mask),
        )  # fmt: skip
        if token_id is not None and token_id >= 0
    }
    with tempfile.TemporaryDirectory(prefix="fp8train_tok_") as tmp:
        # LlamaTokenizer finds the model by this name.
        shutil.copyfile(model, Path(tmp) / "tokenizer.model")
        converted = LlamaTokenizer.from_pretrained(
            tmp, add_bos_token=False, add_eos_token=False, add_prefix_space=False, **specials
        )
        staged = Path(tmp) / "staged"
        converted.save_pretrained(staged)
        reloaded = AutoTokenizer.from_pretrained(staged)
        want = ours.encode(_PROBE)
        got = reloaded(_PROBE, add_special_tokens=False)["input_ids"]
        if got != want or reloaded.decode(got) != ours.decode(want):
            return (
                f"tokenizer: none written (the Hugging Face conversion of {model} does not "
                "give this project's ids; pass the .model file with the model)"
            )
        names = copy_tokenizer_files(staged, directory)
    return f"tokenizer: {', '.join(names)} (LlamaTokenizer from the SentencePiece model {model})"

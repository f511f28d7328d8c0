"""What a fine-tune takes from the checkpoint it starts from, as ``from_pretrained`` does.

With ``checkpoint.finetune=true`` and ``checkpoint.load`` set, ``load_config``
(training/config.py) fills the keys that the config file and the overrides leave unset from
that checkpoint's ``metadata.json``, before the config is validated:

- the ``model`` section, every key: the weights fix the architecture. A key set here that
  builds another model than the checkpoint's (compared as built model configs, so a value
  equal to the checkpoint's resolved one is no conflict) is refused, every such key in one
  line. Keys that shape no tensor (``FREE_MODEL_FIELDS``: dropout, the sequence length
  within the position table, ...) may be set to anything valid.
- the tokenizer of ``data``: the checkpoint's ``tokenizer/`` folder (the Hugging Face
  tokenizer an import copied, training/tokenizer_files.py) as ``data.tokenizer_type=
  huggingface``, unless ``data.tokenizer_model`` or ``data.tokenizer_type`` is set. The
  stdlib corpus trains a tokenizer of its own, whose ids would not be the model's: that
  combination is refused, saying how to tokenize one's text with the checkpoint's.

A checkpoint that cannot be read, or that holds another family's model, leaves the config as
written: the pre-flight names the problem (training/resume_check.py).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

from training.config_schema import ConfigError, sections_for

__all__ = ["FREE_MODEL_FIELDS", "finetune_defaults"]

# Model fields that shape no tensor: a resumed or fine-tuned run may change them
# (training/resume_check.py compares the others).
FREE_MODEL_FIELDS = frozenset(
    {"vocab_size", "hidden_dropout", "attention_dropout", "recompute", "init_method_std",
     "seq_length"}
)  # fmt: skip

_TOKENIZER_FOLDER = "tokenizer"  # training/tokenizer_files.py FOLDER (it imports data code)


def _read_checkpoint(load: str) -> tuple[Path, dict] | None:
    from checkpoint.store import CheckpointError, read_metadata, resolve_checkpoint

    try:
        path = resolve_checkpoint(load)
        return path, read_metadata(path)
    except (CheckpointError, OSError, ValueError):
        return None


def _built(family, saved: dict, model: dict) -> Any:
    """The model config checkpoint metadata ``saved`` describes with ``model`` as its model
    section (None when that section is not a valid one)."""
    meta = {**saved, "config": {**saved["config"], "model": model}}
    try:
        return family.config_from_checkpoint(meta)
    except (ConfigError, KeyError, NotImplementedError, TypeError, ValueError):
        return None


def _conflicts(family, saved: dict, explicit: dict) -> list[str]:
    """Every key set in ``explicit`` that builds another model than checkpoint ``saved``'s:
    one that changes a field shaping a tensor (a sequence length does when it sets the
    position table), or one that no model with the checkpoint's other keys takes."""
    theirs = saved["config"]["model"]
    reference = _built(family, saved, theirs)
    out = []
    for key, value in explicit.items():
        if value == theirs.get(key):
            continue
        if reference is None:  # no built config to compare: the section's values
            differs = key not in FREE_MODEL_FIELDS
        else:
            mine = _built(family, saved, {**theirs, key: value})
            if mine is None:  # no model with the checkpoint's other keys (seq_length too long)
                differs = _valid_alone(family.model_section, key, value)
            else:
                differs = any(
                    getattr(mine, f.name) != getattr(reference, f.name)
                    for f in dataclasses.fields(reference)
                    if f.name not in FREE_MODEL_FIELDS
                )
        if differs:
            out.append(key)
    return out


def _valid_alone(section: type, key: str, value: Any) -> bool:
    """Whether ``key=value`` is valid with the other keys at their defaults: if not, it is
    no conflict with the checkpoint but a bad value, which validating the config names."""
    try:
        section(**{key: value})
    except (ConfigError, TypeError):
        return False
    return True


def _yaml(value: Any) -> str:
    """``value`` as an override's YAML."""
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _tokenizer_defaults(path: Path, merged: dict) -> None:
    folder = path / _TOKENIZER_FOLDER
    data = merged.setdefault("data", {})
    if not (folder / "tokenizer.json").is_file():
        return
    if "tokenizer_model" in data or "tokenizer_type" in data:
        return
    if data.get("corpus", "stdlib") == "stdlib":
        raise ConfigError(
            f"config: checkpoint.load {path} brings its own tokenizer ({folder}), and "
            "data.corpus=stdlib trains another: tokenize your text with it (python "
            f"tools/preprocess_data.py --input FILE.jsonl --tokenizer-type huggingface "
            f"--tokenizer-model {folder} --output-prefix PREFIX) and set data.corpus=prefix "
            "data.data_prefix=PREFIX_text_document"
        )
    data["tokenizer_type"] = "huggingface"
    data["tokenizer_model"] = str(folder)


def finetune_defaults(merged: dict[str, dict], family: str | None) -> dict[str, dict]:
    """``merged`` (the keys a config file and its overrides set, by section) with the
    checkpoint's model and tokenizer filled in where unset (module docstring); unchanged
    unless ``checkpoint.finetune`` is true and ``checkpoint.load`` names a readable
    checkpoint of this family. Raises ``ConfigError`` (one line) for conflicting keys."""
    checkpoint = merged.get("checkpoint", {})
    if checkpoint.get("finetune") is not True or not isinstance(checkpoint.get("load"), str):
        return merged
    found = _read_checkpoint(checkpoint["load"])
    if found is None:
        return merged
    fam_section = sections_for(family)["model"]
    path, saved = found
    try:
        theirs = saved["config"]["model"]
    except (KeyError, TypeError):
        return merged
    if saved.get("family") != fam_section.FAMILY or not isinstance(theirs, dict):
        return merged
    from families import get_family

    merged = copy.deepcopy(merged)
    explicit = merged.get("model", {})
    conflicts = _conflicts(get_family(fam_section.FAMILY), saved, explicit)
    if conflicts:
        theirs_now = " ".join(f"model.{k}={_yaml(theirs.get(k))}" for k in conflicts)
        ours = ", ".join(
            f"model.{k}={_yaml(explicit[k])} (checkpoint: {_yaml(theirs.get(k))})"
            for k in conflicts
        )
        raise ConfigError(
            f"config: checkpoint.finetune takes the model from checkpoint {path}, but "
            f"{len(conflicts)} key(s) set here build another model: {ours}; leave them out of the "
            f"config file, or override them with the checkpoint's: {theirs_now}"
        )
    known = {f.name for f in dataclasses.fields(fam_section)}
    merged["model"] = {**{k: v for k, v in theirs.items() if k in known}, **explicit}
    _tokenizer_defaults(path, merged)
    return merged

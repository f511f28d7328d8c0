"""A checkpoint's tokenizer leaves with its Hugging Face export (training/tokenizer_files.py).

The reference is transformers itself: ``AutoTokenizer.from_pretrained`` on the exported
directory must encode real text (stdlib sources: indentation, tabs, digits, non-ASCII) to the
ids this project's SentencePiece tokenizer gives, and decode them back to the same text.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO
from transformers import AutoTokenizer

from data.corpus import iter_texts, stdlib_documents
from data.tokenizer import SentencePieceTokenizer
from training.tokenizer_files import export_tokenizer, run_tokenizer


def _metadata(data_section: dict, **extra) -> dict:
    return {"config": {"data": data_section, "training": {"seed": 1234}}, **extra}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(iter_texts(stdlib_documents()[40:70]))  # not the tokenizer's training files


@pytest.fixture(scope="module")
def default_mask_data(tmp_path_factory):
    """The default (stdlib) corpus as RoBERTa's runs prepare it: a 512-piece SentencePiece
    model with the <mask> control symbol, in a cache of its own (seconds to build)."""
    from data.prepare import prepare_default_data

    cache = tmp_path_factory.mktemp("default_cache")
    return cache, prepare_default_data(cache, 512, seed=1234, control_symbols=("<mask>",))


def _check_same_ids(model_path, exported, texts) -> None:
    ours = SentencePieceTokenizer(model_path)
    theirs = AutoTokenizer.from_pretrained(exported)
    assert theirs.vocab_size == ours.vocab_size
    for text in texts:
        ids = ours.encode(text)
        assert theirs(text, add_special_tokens=False)["input_ids"] == ids
        assert theirs.decode(ids) == ours.decode(ids) == text


def test_a_prefix_runs_sentencepiece_model_exports_with_the_same_ids(tiny_data, tmp_path, texts):
    meta = _metadata({"corpus": "prefix", "tokenizer_type": "sentencepiece",
                      "tokenizer_model": str(tiny_data.tokenizer_model)})  # fmt: skip
    line = export_tokenizer(tmp_path, meta, tmp_path / "hf")
    assert line.startswith("tokenizer: ") and "LlamaTokenizer" in line, line
    _check_same_ids(tiny_data.tokenizer_model, tmp_path / "hf", texts)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = SentencePieceTokenizer(tiny_data.tokenizer_model)
    assert theirs.eos_token_id == ours.eod and theirs.bos_token_id == ours.bos


def test_roberta_runs_on_the_default_corpus_get_the_mask_cache(default_mask_data, tmp_path):
    """The RoBERTa family asks for the default corpus with its <mask> symbol (a cache apart
    from GPT's): its pre-flight finds the cache built with <mask> and its data has one."""
    from families import get_family
    from training.config import load_config

    cache, prepared = default_mask_data
    family = get_family("roberta")
    assert family.control_symbols == ("<mask>",) and get_family("gpt").control_symbols == ()
    cfg = load_config(
        str(REPO / "configs/roberta_tiny.yaml"),
        [f"data.cache_dir={cache}", "data.vocab_size=512", f"logging.dir={tmp_path}"],
        "roberta",
    )
    assert family.preflight(cfg) is not None  # found in the cache: nothing to build
    data = family.prepare_data(cfg, 0)
    assert data.tokenizer.mask >= 0
    assert Path(data.tokenizer.model_path) == Path(prepared.tokenizer_model)


def test_the_default_corpus_is_found_in_its_cache_with_the_family_symbols(
    default_mask_data, tmp_path, texts
):
    from families import get_family

    cache, prepared = default_mask_data
    meta = _metadata({"corpus": "stdlib", "cache_dir": str(cache), "vocab_size": 512})
    found = run_tokenizer(tmp_path, meta, get_family("roberta").control_symbols)
    assert found == ("sentencepiece", Path(prepared.tokenizer_model))
    assert run_tokenizer(tmp_path, meta) is None  # GPT's key (no <mask>): not built here
    line = export_tokenizer(tmp_path, meta, tmp_path / "hf", ("<mask>",))
    assert "LlamaTokenizer" in line, line
    _check_same_ids(prepared.tokenizer_model, tmp_path / "hf", texts)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = SentencePieceTokenizer(prepared.tokenizer_model)
    assert theirs.mask_token_id == ours.mask >= 0 and theirs.pad_token_id == ours.pad >= 0


def test_an_imported_checkpoints_tokenizer_folder_wins_and_is_copied(tmp_path):
    carried = tmp_path / "ckpt" / "tokenizer"
    carried.mkdir(parents=True)
    (carried / "tokenizer.json").write_text('{"version": "1.0"}')
    (carried / "tokenizer_config.json").write_text("{}")
    meta = _metadata({"corpus": "stdlib"}, weights_only="imported from Hugging Face x")
    line = export_tokenizer(tmp_path / "ckpt", meta, tmp_path / "hf")
    assert line == f"tokenizer: copied tokenizer.json, tokenizer_config.json from {carried}"
    assert json.loads((tmp_path / "hf" / "tokenizer.json").read_text()) == {"version": "1.0"}


def test_nothing_found_writes_nothing_and_says_why(tmp_path):
    for meta in (
        _metadata({}, weights_only="imported"),  # an import without tokenizer files
        _metadata({"corpus": "prefix", "tokenizer_model": str(tmp_path / "gone.model")}),
        {"config": {"data": {"dataset": "digits"}}},  # an image model
    ):
        line = export_tokenizer(tmp_path, meta, tmp_path / "hf")
        assert line.startswith("tokenizer: none written"), line
        assert not (tmp_path / "hf").exists()

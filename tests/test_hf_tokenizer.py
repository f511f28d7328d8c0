"""Hugging Face tokenizers (``tokenizer.json``) through preprocessing and training.

Three real tokenizers are built here from 40 standard-library files (a fraction of a second,
nothing downloaded) and saved by transformers' own ``save_pretrained``: byte-level BPE trained
with the ``tokenizers`` library in GPT-2 style (one ``<|endoftext|>`` as bos/eos/unk, no pad)
and RoBERTa style (``<s>``, ``<pad>``, ``</s>``, ``<unk>``, ``<mask>`` and its ``<s> ... </s>``
template), and Llama style (a SentencePiece BPE model with byte fallback, converted by
transformers' ``LlamaTokenizer``). ``AutoTokenizer.from_pretrained`` on the same directory is
the reference for every id.
"""

from __future__ import annotations

import json
import math
import pickle
import shutil
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides

from data.corpus import iter_texts, stdlib_documents
from data.indexed import read_indexed_dataset
from data.prepare import prepare_data_from_prefix, prepare_text_data
from data.tokenizer import (
    TOKENIZER_TYPES,
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    train_sentencepiece,
)
from families.config_fields import field_spec
from families.data_sections import TextDataSection
from models.gpt import pad_vocab_size
from tools.preprocess_data import main as preprocess_main
from training.config import ConfigError, load_config

VOCAB = 700  # padded to 768 by make_vocab_size_divisible_by=128
STYLES = ["gpt2", "roberta", "llama"]
GPT2_SPECIALS = ["<|endoftext|>"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]

CODE = (
    "  # leading spaces survive\n"
    "class Foo(Base):\n"
    '    """Doc  with  double  spaces."""\n'
    "\n"
    "    def bar(self, x: int = 42) -> int:\n"
    "\t\treturn x  # tab-indented, trailing spaces   \n"
    "        return {'k': [1, 2, 3]}  # caf\u00e9 \u2603 \U0001f600\n"
    "\r\n"
)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    # Enough documents for a 98,2,0 split to give the validation set one.
    return list(iter_texts(stdlib_documents()[:40]))


def _train_bpe(texts: list[str], specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_dirs(documents, tmp_path_factory) -> dict[str, Path]:
    """style -> a save_pretrained directory (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import processors
    from transformers import GPT2Tokenizer, LlamaTokenizer, RobertaTokenizer

    root = tmp_path_factory.mktemp("hf_tokenizers")
    gpt2 = _train_bpe(documents, GPT2_SPECIALS)
    GPT2Tokenizer(tokenizer_object=gpt2).save_pretrained(root / "gpt2")
    roberta = _train_bpe(documents, ROBERTA_SPECIALS)
    # RoBERTa's template, so that "no special tokens added by encode" is really tested.
    roberta.post_processor = processors.RobertaProcessing(
        ("</s>", roberta.token_to_id("</s>")), ("<s>", roberta.token_to_id("<s>"))
    )
    RobertaTokenizer(tokenizer_object=roberta).save_pretrained(root / "roberta")
    sp_model = train_sentencepiece(documents, root / "sp" / "tokenizer", VOCAB, seed=1)
    LlamaTokenizer.from_pretrained(sp_model.parent).save_pretrained(root / "llama")
    return {style: root / style for style in STYLES}


@pytest.fixture(scope="module")
def reference(hf_dirs):
    from transformers import AutoTokenizer

    return {style: AutoTokenizer.from_pretrained(path) for style, path in hf_dirs.items()}


def _ids_or_minus_one(value):
    return -1 if value is None else value


@pytest.mark.parametrize("style", STYLES)
def test_special_ids_and_vocab_match_transformers(hf_dirs, reference, style):
    tok = HFTokenizer(hf_dirs[style])
    ref = reference[style]
    assert tok.vocab_size == len(ref) == VOCAB
    assert tok.eod == tok.eos == ref.eos_token_id
    assert tok.bos == _ids_or_minus_one(ref.bos_token_id)
    assert tok.pad == _ids_or_minus_one(ref.pad_token_id)
    assert tok.unk == _ids_or_minus_one(ref.unk_token_id)
    assert tok.mask == _ids_or_minus_one(ref.mask_token_id)
    if style == "gpt2":
        # One token plays every role it can; no pad and no mask.
        endoftext = ref.convert_tokens_to_ids("<|endoftext|>")
        assert tok.bos == tok.eod == tok.unk == endoftext
        assert tok.pad == -1 and tok.mask == -1
    elif style == "roberta":
        assert [tok.bos, tok.pad, tok.eod, tok.unk, tok.mask] == [0, 1, 2, 3, 4]
    else:  # the SentencePiece model's ids; its <pad> piece is no role in Llama's config
        assert [tok.unk, tok.bos, tok.eod, tok.pad, tok.mask] == [0, 1, 2, -1, -1]
    assert tok.decode([tok.newline]) == "\n"


@pytest.mark.parametrize("style", STYLES)
def test_encode_matches_transformers_and_round_trips(hf_dirs, reference, documents, style):
    tok = HFTokenizer(hf_dirs[style])
    ref = reference[style]
    texts = [CODE, *documents[:8]]
    expected = [ref(t, add_special_tokens=False).input_ids for t in texts]
    assert [tok.encode(t) for t in texts] == expected
    assert tok.encode_batch(texts) == expected
    assert tok.tokenize(CODE) == expected[0]
    for text, ids in zip(texts, expected, strict=True):
        assert tok.decode(ids) == tok.detokenize(ids) == ref.decode(ids)
        # Byte-level BPE is lossless; Llama's decoder drops a leading space (its own prefix).
        lossy = style == "llama" and text.startswith(" ")
        assert tok.decode(ids) == (text[1:] if lossy else text)
    if style == "roberta":  # no template: RoBERTa's post-processor would add <s> ... </s>
        assert ref(CODE).input_ids == [tok.bos, *expected[0], tok.eod]
    assert [tok.id_to_piece(i) for i in expected[0]] == ref.convert_ids_to_tokens(expected[0])
    with pytest.raises(IndexError, match="out of range"):
        tok.id_to_piece(tok.vocab_size + 5)


@pytest.mark.parametrize("style", STYLES)
def test_literal_special_token_text_stays_text(hf_dirs, reference, style):
    # A document that contains "<|endoftext|>" or "<mask>" must not forge a boundary or a
    # mask: like SentencePiece control symbols, special tokens only come from the pipeline.
    tok = HFTokenizer(hf_dirs[style])
    text = "x = '<|endoftext|>' + '<mask>' + '</s><s><pad>'\n"
    ids = tok.encode(text)
    assert not {tok.eod, tok.bos, tok.pad, tok.mask} & set(ids)
    assert tok.decode(ids) == text
    split = reference[style](text, add_special_tokens=False, split_special_tokens=True)
    assert ids == split.input_ids


def test_saved_truncation_and_padding_are_ignored(hf_dirs, documents, tmp_path):
    # tokenizer.json files often carry the model's max length: a document must not be cut.
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(hf_dirs["gpt2"] / "tokenizer.json"))
    saved.enable_truncation(8)
    saved.enable_padding(length=16, pad_id=0)
    saved.save(str(tmp_path / "tokenizer.json"))
    tok, full = HFTokenizer(tmp_path / "tokenizer.json"), HFTokenizer(hf_dirs["gpt2"])
    assert len(saved.encode(documents[0]).ids) == 16
    assert tok.encode(documents[0]) == full.encode(documents[0])
    assert tok.encode_batch(["a", documents[0]]) == full.encode_batch(["a", documents[0]])


def test_pickle_keeps_behaviour(hf_dirs):
    tok = HFTokenizer(hf_dirs["roberta"])
    back = pickle.loads(pickle.dumps(tok))
    assert isinstance(back, HFTokenizer) and repr(back) == repr(tok)
    text = CODE + "<mask></s>"
    assert back.encode(text) == tok.encode(text)  # literal specials still text after pickling
    for role in ("vocab_size", "eod", "bos", "pad", "unk", "mask", "newline"):
        assert getattr(back, role) == getattr(tok, role), role
    assert back.unique_identifiers == tok.unique_identifiers


def test_fingerprint_is_content_not_path(hf_dirs, tmp_path):
    tok = HFTokenizer(hf_dirs["roberta"])
    copy = shutil.copytree(hf_dirs["roberta"], tmp_path / "elsewhere")
    assert HFTokenizer(copy).unique_identifiers == tok.unique_identifiers
    assert HFTokenizer(copy / "tokenizer.json").unique_identifiers == tok.unique_identifiers
    assert HFTokenizer(hf_dirs["gpt2"]).unique_identifiers != tok.unique_identifiers
    # A role changed in the config changes the key too (eod and pad shape the samples).
    config_path = copy / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token"] = "<unk>"
    config_path.write_text(json.dumps(config))
    changed = HFTokenizer(copy)
    assert changed.eod == 3 and changed.unique_identifiers != tok.unique_identifiers
    json.dumps(tok.unique_identifiers)  # megatron serialises it into its cache key


@pytest.mark.parametrize("style", STYLES)
def test_tokenizer_json_alone_finds_roles_by_name(hf_dirs, tmp_path, style):
    lone = tmp_path / "tokenizer.json"
    shutil.copy(hf_dirs[style] / "tokenizer.json", lone)
    tok, full = HFTokenizer(lone), HFTokenizer(hf_dirs[style])
    roles = ("bos", "pad", "eos", "unk", "mask")
    expected = {
        "gpt2": {"bos": "<|endoftext|>", "eos": "<|endoftext|>"},
        "roberta": dict(zip(roles, ROBERTA_SPECIALS, strict=True)),
        "llama": {"bos": "<s>", "pad": "<pad>", "eos": "</s>", "unk": "<unk>"},
    }
    assert tok.special_tokens == expected[style]
    assert (tok.eod, tok.bos, tok.mask) == (full.eod, full.bos, full.mask)
    # Found by name where the saved config says otherwise: GPT-2's unk (a transformers class
    # default written into tokenizer_config.json) and the <pad> Llama's config leaves out.
    assert tok.unk == (-1 if style == "gpt2" else full.unk)
    assert tok.pad == (3 if style == "llama" else full.pad)
    # The file inside a saved directory reads the config beside it: the same as the directory.
    assert HFTokenizer(hf_dirs[style] / "tokenizer.json").special_tokens == full.special_tokens


def test_legacy_special_tokens_map(hf_dirs, tmp_path):
    # Older save_pretrained layouts: roles in special_tokens_map.json, AddedToken dicts.
    shutil.copy(hf_dirs["gpt2"] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 1024}))
    (tmp_path / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": {"content": "<|endoftext|>", "lstrip": False}, "bos_token": None})
    )
    tok = HFTokenizer(tmp_path)
    assert tok.eod == 0 and tok.bos == -1  # an explicit null is "none", not a name lookup


def test_missing_roles_fail_only_when_used(hf_dirs, tmp_path):
    shutil.copy(hf_dirs["roberta"] / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"eos_token": None, "pad_token": None, "mask_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = HFTokenizer(tmp_path)  # fine until the missing role is needed
    # A config that names roles is complete: bos, which it leaves out, is not guessed.
    assert (tok.pad, tok.mask, tok.bos) == (-1, -1, -1)
    with pytest.raises(ValueError, match=r"no end-of-document \(eos\) token"):
        _ = tok.eod
    with pytest.raises(ValueError, match="eos"):
        _ = tok.eos


def test_load_errors_are_one_line_and_name_the_file(hf_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        HFTokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer not found"):
        HFTokenizer(tmp_path / "nope.json")
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        HFTokenizer(bad)
    wrong = tmp_path / "wrong"
    shutil.copytree(hf_dirs["roberta"], wrong)
    (wrong / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<nope>"}))
    with pytest.raises(ValueError, match=r"pad_token '<nope>' is not in the tokenizer's vocab"):
        HFTokenizer(wrong)
    (wrong / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json' is not valid JSON"):
        HFTokenizer(wrong)


def test_load_tokenizer_kinds(hf_dirs, documents, tmp_path):
    sp_model = train_sentencepiece(documents[:10], tmp_path / "sp", 400, seed=1)
    assert isinstance(load_tokenizer("sentencepiece", sp_model), SentencePieceTokenizer)
    assert isinstance(load_tokenizer("auto", sp_model), SentencePieceTokenizer)
    for path in (hf_dirs["gpt2"], hf_dirs["gpt2"] / "tokenizer.json"):
        assert isinstance(load_tokenizer("huggingface", path), HFTokenizer)
        assert isinstance(load_tokenizer("auto", path), HFTokenizer)
        with pytest.raises(ValueError, match="is a Hugging Face tokenizer.*'huggingface'"):
            load_tokenizer("sentencepiece", path)
    with pytest.raises(ValueError, match="SentencePiece model.*'sentencepiece'"):
        load_tokenizer("huggingface", sp_model)
    with pytest.raises(ValueError, match="tokenizer type must be one of sentencepiece"):
        load_tokenizer("tiktoken", sp_model)


def _jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.mark.parametrize("style", STYLES)
def test_preprocess_data_writes_the_hf_vocabulary(hf_dirs, documents, tmp_path, capsys, style):
    texts = [*documents[:6], "", "y = '<|endoftext|>'  # literal\n"]
    source = _jsonl(tmp_path / "docs.jsonl", texts)
    model = hf_dirs[style] if style == "gpt2" else hf_dirs[style] / "tokenizer.json"
    argv = ["--input", str(source), "--tokenizer-type", "huggingface"]
    argv += ["--tokenizer-model", str(model), "--output-prefix", str(tmp_path / "out")]
    assert preprocess_main(argv) == 0
    assert "1 empty skipped" in capsys.readouterr().out
    tok = HFTokenizer(model)
    ds = read_indexed_dataset(str(tmp_path / "out_text_document"))
    kept = [t for t in texts if t]
    assert len(ds) == len(kept)
    for i, text in enumerate(kept):
        assert ds[i].tolist() == tok.encode(text) + [tok.eod]


def test_preprocess_data_hf_usage_errors(hf_dirs, tmp_path, capsys):
    source = _jsonl(tmp_path / "docs.jsonl", ["a = 1\n"])
    common = ["--input", str(source), "--output-prefix", str(tmp_path / "o")]
    cases = [
        (["--tokenizer-type", "huggingface", "--vocab-size", "500"], "needs --tokenizer-model"),
        (["--tokenizer-type", "huggingface", "--tokenizer-model", str(tmp_path)], "tokenizer.json"),
        (["--tokenizer-model", str(hf_dirs["gpt2"])], "use tokenizer type 'huggingface'"),
    ]
    for extra, message in cases:
        assert preprocess_main(common + extra) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("preprocess_data.py: error:"), err
        assert message in err
    assert not list(tmp_path.glob("o_*"))


def test_config_key_tokenizer_type(hf_dirs):
    config = str(REPO / "configs/gpt_tiny.yaml")
    prefix = ["data.corpus=prefix", "data.data_prefix=x", f"data.tokenizer_model={hf_dirs['gpt2']}"]
    cfg = load_config(config, [*prefix, "data.tokenizer_type=huggingface"])
    assert cfg.data.tokenizer_type == "huggingface"
    assert load_config(config, prefix).data.tokenizer_type == "sentencepiece"
    with pytest.raises(ConfigError, match=r"data\.tokenizer_type must be one of .*'hf'"):
        load_config(config, [*prefix, "data.tokenizer_type=hf"])
    with pytest.raises(ConfigError, match=r"data\.tokenizer_type 'huggingface' needs data\.corpus"):
        load_config(config, ["data.tokenizer_type=huggingface"])
    # The schema's choices are the loader's.
    assert field_spec(TextDataSection, "tokenizer_type").choices == TOKENIZER_TYPES


@pytest.fixture(scope="module")
def hf_data(hf_dirs, documents, tmp_path_factory):
    """style -> PreparedData of the 40 documents tokenized with that style's vocabulary."""
    out = tmp_path_factory.mktemp("hf_data")
    source = _jsonl(out / "docs.jsonl", documents)
    prepared = {}
    for style, path in hf_dirs.items():
        argv = ["--input", str(source), "--tokenizer-type", "huggingface"]
        argv += ["--tokenizer-model", str(path), "--output-prefix", str(out / style)]
        assert preprocess_main(argv) == 0
        prepared[style] = prepare_data_from_prefix(
            out / f"{style}_text_document", path, "huggingface"
        )
    return prepared


def test_prepare_data_from_prefix_with_hf(hf_data, hf_dirs, tmp_path):
    got = hf_data["gpt2"]
    assert got.tokenizer_type == "huggingface" and got.vocab_size == VOCAB and got.key == "text"
    assert isinstance(got.tokenizer(), HFTokenizer)
    cfg = TextDataSection(
        corpus="prefix", data_prefix=got.data_prefix, tokenizer_model=str(hf_dirs["gpt2"])
    )  # tokenizer_type left at sentencepiece: the error says what to set
    with pytest.raises(ValueError, match=r"^data\.tokenizer_model: .*'huggingface'"):
        prepare_text_data(cfg, seed=1, rank=0)
    shutil.copy(hf_dirs["roberta"] / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": None}))
    cfg = TextDataSection(
        corpus="prefix",
        data_prefix=got.data_prefix,
        tokenizer_model=str(tmp_path),
        tokenizer_type="huggingface",
    )
    with pytest.raises(ValueError, match=r"^data\.tokenizer_model: .*no end-of-document"):
        prepare_text_data(cfg, seed=1, rank=0)


def _run(config: str, family: str, data, run_dir: Path, **extra) -> dict:
    from training.loop import pretrain

    values = {
        "data.tokenizer_type": "huggingface",
        "training.train_iters": 3,
        "training.eval_interval": 3,
        "checkpoint.save_interval": 3,
        "logging.tensorboard": "false",
        "logging.peak_tflops": 1.0,  # skips the CPU peak measurement
        **extra,
    }
    pretrain(load_config(config, tiny_overrides(data, run_dir, **values), family), family=family)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(r["lm loss"]) for r in records)
    meta = json.loads((run_dir / "checkpoints/iter_0000003/metadata.json").read_text())
    return meta["model_structure"]


def test_gpt_trains_on_hf_vocabulary(hf_data, tmp_path):
    structure = _run(str(REPO / "configs/gpt_tiny.yaml"), "gpt", hf_data["gpt2"], tmp_path)
    assert structure["vocab_size"] == VOCAB
    assert structure["padded_vocab_size"] == pad_vocab_size(VOCAB, 128) == 768
    # The exported Hugging Face config gets the tokenizer's ids (no pad in GPT-2's).
    assert structure["token_ids"] == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None}


def test_roberta_trains_on_hf_vocabulary(hf_data, tmp_path):
    # Masked-LM needs <s>, </s>, <pad> and <mask>: the RoBERTa-style vocabulary has them all.
    config = str(REPO / "configs/roberta_tiny.yaml")
    structure = _run(config, "roberta", hf_data["roberta"], tmp_path, **{"model.seq_length": 32})
    assert structure["vocab_size"] == VOCAB and structure["padded_vocab_size"] == 768


def _converted_gpt2(hf_dirs, tmp_path) -> tuple[Path, Path]:
    """A tiny random GPT-2 saved by transformers beside its tokenizer, converted to a native
    checkpoint (tools/convert_checkpoint.py): ``(Hugging Face directory, checkpoints
    directory)``."""
    import torch
    import transformers

    from tools.convert_checkpoint import main as convert_main

    hf = shutil.copytree(hf_dirs["gpt2"], tmp_path / "hf")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=2, n_positions=64,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    transformers.GPT2LMHeadModel(config).save_pretrained(hf)
    native = tmp_path / "native"
    argv = ["--input", str(hf), "--output", str(native), "--format", "native"]
    assert convert_main([*argv, "--tensor", "1", "--pipeline", "1"]) == 0
    return hf, native


def test_converted_hf_model_finetunes_on_its_own_vocabulary(hf_dirs, hf_data, tmp_path, capsys):
    # The whole path: a Hugging Face GPT-2 directory (model + tokenizer) converted to a native
    # checkpoint, fine-tuned on text tokenized with that directory's tokenizer.
    hf, native = _converted_gpt2(hf_dirs, tmp_path)
    meta = json.loads(next(native.rglob("metadata.json")).read_text())
    model_keys = {
        f"model.{k}": "null" if v is None else v for k, v in meta["config"]["model"].items()
    }
    data = prepare_data_from_prefix(hf_data["gpt2"].data_prefix, hf, "huggingface")
    structure = _run(
        str(REPO / "configs/gpt_tiny.yaml"), "gpt", data, tmp_path / "run", **model_keys,
        **{"checkpoint.load": str(native), "checkpoint.finetune": "true"},
    )  # fmt: skip
    assert structure["vocab_size"] == VOCAB and structure["padded_vocab_size"] == 768
    assert f"loaded the weights of {native}" in capsys.readouterr().out


def test_hf_finetune_takes_model_and_tokenizer_from_the_checkpoint(
    hf_dirs, hf_data, tmp_path, capsys
):
    """configs/gpt_finetune_hf.yaml with only checkpoint.load and the data set: the model's
    shape and the tokenizer come from the converted checkpoint, as from_pretrained takes
    them; keys set that would build another model are all named in one line."""
    from training.loop import pretrain

    _, native = _converted_gpt2(hf_dirs, tmp_path)
    checkpoint = native / (native / "latest").read_text().strip()
    config = str(REPO / "configs/gpt_finetune_hf.yaml")
    data = [f"data.data_prefix={hf_data['gpt2'].data_prefix}", f"checkpoint.load={native}"]
    short = {
        "training.train_iters": 3, "training.micro_batch_size": 2,
        "training.global_batch_size": 4, "training.eval_interval": 3,
        "training.eval_iters": 1, "optimizer.lr_warmup_iters": 1,
        "logging.dir": tmp_path / "run", "data.cache_dir": tmp_path / "cache",
        "logging.tensorboard": "false", "logging.peak_tflops": 1.0,
        "precision.fp8_gemm_backend": "emulated", "precision.param_dtype": "fp32",
    }  # fmt: skip
    cfg = load_config(config, [*data, *(f"{k}={v}" for k, v in short.items())])
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (2, 64, 2)
    assert (m.max_positions(), m.activation) == (64, "gelu")
    assert cfg.data.tokenizer_type == "huggingface"
    assert cfg.data.tokenizer_model == str(checkpoint / "tokenizer")
    capsys.readouterr()
    summary = pretrain(cfg)
    assert summary["iteration"] == 3 and math.isfinite(summary["lm loss"])
    assert f"loaded the weights of {checkpoint}: fine-tuning" in capsys.readouterr().out

    # Keys that shape no tensor, or equal the checkpoint's, may be set.
    free = ["model.seq_length=32", "model.hidden_dropout=0.1", "model.num_layers=2"]
    assert load_config(config, [*data, *free]).model.seq_length == 32
    # gpt_tiny.yaml's model is another GPT: every key that differs, in one line.
    with pytest.raises(ConfigError) as err:
        load_config(
            str(REPO / "configs/gpt_tiny.yaml"),
            [*data, "data.corpus=prefix", "checkpoint.finetune=true"],
        )
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        f"config: checkpoint.finetune takes the model from checkpoint {checkpoint}, but 4 key(s)"
    ), message
    # seq_length shapes no tensor, but 256 does not fit the checkpoint's 64 positions.
    for key in ("num_layers=4 (checkpoint: 2)", "hidden_size=256 (checkpoint: 64)",
                "num_attention_heads=4 (checkpoint: 2)",
                "seq_length=256 (checkpoint: 64)"):  # fmt: skip
        assert f"model.{key}" in message, message
    # The hint's overrides, as printed, make the same command work.
    hint = message.rsplit("override them with the checkpoint's: ", 1)[1].split()
    assert hint == ["model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
                    "model.seq_length=64"]  # fmt: skip
    tiny = load_config(
        str(REPO / "configs/gpt_tiny.yaml"),
        [*data, "data.corpus=prefix", "checkpoint.finetune=true", *hint],
    )
    assert (tiny.model.num_layers, tiny.model.max_positions()) == (2, 64)
    # The stdlib corpus trains its own tokenizer, whose ids the model does not know.
    with pytest.raises(ConfigError, match=r"brings its own tokenizer .*data\.corpus=prefix"):
        load_config(config, [*data, "data.corpus=stdlib"])

"""Damaged inputs to the tools: convert_checkpoint, export_hf, generate, preprocess_data and
preprocess_images. Each case damages a real file (a tiny GPT saved as a Hugging Face directory
and imported as a native checkpoint, a JSON-lines corpus, an image folder) the way a full disk
or a killed copy does, or leaves a JSON file that parses but lacks a key the tool needs (or
holds a value of the wrong type), runs the tool's ``main`` and asks for what the pre-flight
gives: exit 2, one stderr line naming the file (``file:line`` for a JSON line; and the key),
no traceback, and nothing at ``--output``. A failure after writing has begun must leave
nothing behind either. A few seconds in all: the models are built once per module.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from data.corpus import stdlib_documents
from data.tokenizer import train_sentencepiece
from families.gpt_hf import GPTHFAdapter
from models.gpt import GPTConfig, GPTModel
from tools.convert_checkpoint import main as convert_main
from tools.export_hf import main as export_main
from tools.generate import main as generate_main
from tools.preprocess_data import main as preprocess_data_main
from tools.preprocess_images import main as preprocess_images_main
from training.conversion import Layout, import_hf

ITER = "iter_0000000"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
INDEX = "model.safetensors.index.json"


def truncate(path: Path) -> None:
    """What a full disk or a killed copy leaves: the first half of the file."""
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny random GPT as a Hugging Face directory ("hf"), the same split into two shards
    with an index ("sharded"), and imported as a native checkpoints directory ("native")."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    config = GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=128
    )
    model = GPTModel(config)
    params = {k: v.detach() for k, v in model.named_parameters()}
    GPTHFAdapter().save(root / "hf", params, config, vocab_size=100)
    import_hf(root / "hf", root / "native", Layout(), progress=lambda _line: None)
    sharded = root / "sharded"
    shutil.copytree(root / "hf", sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {}
    for shard, part in zip(SHARDS, (names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: tensors[n] for n in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (sharded / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"hf": root / "hf", "sharded": sharded, "native": root / "native"}


def run(capsys, main, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def assert_refused(result, culprit: str, output: Path | None = None) -> str:
    """Exit 2, stderr exactly one line naming ``culprit``, no traceback, no ``output``."""
    code, out, err = result
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert culprit in err, err
    assert "Traceback" not in out + err
    if output is not None:
        assert not output.exists(), sorted(p.name for p in output.rglob("*"))
    return err


def test_undamaged_inputs_convert(capsys, models, tmp_path):
    """The inputs the cases below damage are accepted as they are (so each refusal below is
    the damage's doing)."""
    assert run(capsys, convert_main, "--input", models["sharded"], "--output", tmp_path / "a",
               "--format", "native", "--quiet")[0] == 0  # fmt: skip
    assert run(capsys, export_main, "--checkpoint", models["native"], "--output",
               tmp_path / "b")[0] == 0  # fmt: skip
    assert (tmp_path / "b" / "model.safetensors").is_file()


# ---- native checkpoints: convert (to hf and native), export_hf, generate --------------------


def _refuses_a_damaged_copy(capsys, source: Path, tmp_path, name, damage, tool, why) -> None:
    """``tool`` on a copy of ``source`` whose file ``name`` got ``damage``: refused in one
    line naming that file and saying ``why``, nothing at the output."""
    copy = tmp_path / source.name
    shutil.copytree(source, copy)
    damage(copy / name)
    output = tmp_path / "out"
    main, args = _native_command(tool, copy, output)
    err = assert_refused(run(capsys, main, *args), str(copy / name), output)
    assert why in err and err.startswith("error: ")


def _native_command(tool: str, source: Path, output: Path) -> tuple:
    if tool == "convert-hf":
        return convert_main, ["--input", source, "--output", output, "--format", "hf"]
    if tool == "convert-native":
        return convert_main, ["--input", source, "--output", output, "--format", "native",
                              "--tensor", "1"]  # fmt: skip
    if tool == "export":
        return export_main, ["--checkpoint", source, "--output", output]
    return generate_main, ["--checkpoint", source, "--prompt", "x", "--greedy"]


def writes(data: bytes):
    """A damage: the file now holds ``data``."""
    return lambda path: path.write_bytes(data)


DELETE = object()


def edits(key: str, value=DELETE):
    """A damage that still parses: the JSON file's ``key`` (dotted: ``config.parallel.tensor``)
    is gone, or holds ``value``."""

    def damage(path: Path) -> None:
        doc = json.loads(path.read_text())
        *parents, last = key.split(".")
        obj = doc
        for name in parents:
            obj = obj[name]
        if value is DELETE:
            del obj[last]
        else:
            obj[last] = value
        path.write_text(json.dumps(doc))

    return damage


META = f"{ITER}/metadata.json"
# case: (the file inside a checkpoints directory, the damage, part of the message)
NATIVE_DAMAGE = {
    "truncated_model": (f"{ITER}/model.safetensors", truncate, "cannot read checkpoint file"),
    "garbage_metadata": (META, writes(b'{"config": {},\n  "family": '),
                         "line 2"),  # a write cut short: the message gives the line
    "truncated_metadata": (META, truncate, "cannot parse"),
    "binary_metadata": (META, writes(b"\x00\xff\xfe garbage"), "not UTF-8"),
    "latest_missing": ("latest", writes(b"iter_0000005\n"), "iter_0000005, which does not exist"),
    # metadata.json parses, but a key is missing or of the wrong type
    "no_family": (META, edits("family"), "no key 'family'"),
    "unknown_family": (META, edits("family", "bert"), "unknown model family 'bert'"),
    "no_config": (META, edits("config"), "no key 'config'"),
    "config_a_list": (META, edits("config", []), "'config' must be an object, not []"),
    "no_tensor_size": (META, edits("config.parallel.tensor"), "no key 'config.parallel.tensor'"),
    "tensor_size_a_string": (META, edits("config.parallel.tensor", "1"),
                             "'config.parallel.tensor' must be an integer, not \"1\""),
    "no_hidden_size": (META, edits("config.model.hidden_size"),
                       "no key 'config.model.hidden_size'"),  # its default: another model
    "hidden_size_a_string": (META, edits("config.model.hidden_size", "32"),
                             "model.hidden_size must be an int, got '32'"),
    "no_structure": (META, edits("model_structure"), "no key 'model_structure'"),
    "no_padded_vocab": (META, edits("model_structure.padded_vocab_size"),
                        "no key 'model_structure.padded_vocab_size'"),
    "padded_vocab_a_float": (META, edits("model_structure.padded_vocab_size", 128.0),
                             "'model_structure.padded_vocab_size' must be an integer, not 128.0"),
}  # fmt: skip


@pytest.mark.parametrize("tool", ["convert-hf", "convert-native", "export", "generate"])
@pytest.mark.parametrize("case", sorted(NATIVE_DAMAGE))
def test_damaged_native_checkpoint(capsys, models, tmp_path, tool, case):
    name, damage, why = NATIVE_DAMAGE[case]
    _refuses_a_damaged_copy(capsys, models["native"], tmp_path, name, damage, tool, why)


# ---- Hugging Face directories: convert to native, generate ---------------------------------

# case: (which directory of ``models``, the file in it, the damage, part of the message)
HF_DAMAGE = {
    "truncated_model": ("hf", "model.safetensors", truncate, "cannot read checkpoint file"),
    "garbage_config": ("hf", "config.json", writes(b'{"model_type": "gpt2",\n  "n_embd": 3'),
                       "cannot parse"),
    "truncated_shard": ("sharded", SHARDS[1], truncate, "cannot read checkpoint file"),
    "missing_shard": ("sharded", SHARDS[0], Path.unlink, "checkpoint file missing"),
    "truncated_index": ("sharded", INDEX, truncate, "cannot parse"),
    # config.json parses, but a key is missing or of the wrong type
    "no_model_type": ("hf", "config.json", edits("model_type"), "no key 'model_type'"),
    "unknown_model_type": ("hf", "config.json", edits("model_type", "bert"),
                           "model_type 'bert' is not supported"),
    "no_n_embd": ("hf", "config.json", edits("n_embd"),
                  "no key 'n_embd' (a GPT-2 config needs it)"),
    "n_layer_a_string": ("hf", "config.json", edits("n_layer", "1"),
                         "'n_layer' must be an integer, not \"1\""),
    "no_vocab_size": ("hf", "config.json", edits("vocab_size"), "no key 'vocab_size'"),
    "dropout_null": ("hf", "config.json", edits("resid_pdrop", None),
                     "'resid_pdrop' must be a number, not null"),
}  # fmt: skip


@pytest.mark.parametrize("tool", ["convert-native", "generate"])
@pytest.mark.parametrize("case", sorted(HF_DAMAGE))
def test_damaged_hf_directory(capsys, models, tmp_path, tool, case):
    kind, name, damage, why = HF_DAMAGE[case]
    _refuses_a_damaged_copy(capsys, models[kind], tmp_path, name, damage, tool, why)


# The smallest config.json of the other families' Hugging Face imports (read before the
# weights, which are not there).
ENCODER_CONFIGS = {
    "RoBERTa": {"model_type": "roberta", "vocab_size": 100, "max_position_embeddings": 20},
    "ViT": {"model_type": "vit", "image_size": 32, "patch_size": 16},
}


@pytest.mark.parametrize("tool", ["convert-native", "generate"])
@pytest.mark.parametrize("model", sorted(ENCODER_CONFIGS))
@pytest.mark.parametrize(
    "value, why",
    [(DELETE, "no key 'hidden_size' (a {} config needs it)"),
     ([32], "'hidden_size' must be an integer, not [32]")],
)  # fmt: skip
def test_encoder_config_lacking_a_key(capsys, tmp_path, tool, model, value, why):
    hf = tmp_path / "hf"
    hf.mkdir()
    config = {**ENCODER_CONFIGS[model], "hidden_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "intermediate_size": 64}  # fmt: skip
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "model.safetensors").write_bytes(b"")
    edits("hidden_size", value)(hf / "config.json")
    output = tmp_path / "out"
    main, args = _native_command(tool, hf, output)
    err = assert_refused(run(capsys, main, *args), str(hf / "config.json"), output)
    assert why.format(model) in err


# ---- failures after writing has begun --------------------------------------------------------


@pytest.mark.parametrize("tool", ["convert-native", "export"])
@pytest.mark.parametrize("existing", [False, True])
def test_failure_while_writing_leaves_no_output(
    capsys, models, tmp_path, monkeypatch, tool, existing
):
    """A failure after the tensors are written (here: the tokenizer files, the last step)
    removes everything again; an empty --output given beforehand stays, empty."""
    import training.conversion as conversion

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    name = "copy_tokenizer_files" if tool == "convert-native" else "export_tokenizer"
    monkeypatch.setattr(conversion, name, disk_full)
    output = tmp_path / "new" / "out"
    if existing:
        output.mkdir(parents=True)
    main, args = _native_command(tool, models["native"], output)
    code, out, err = run(capsys, main, *args)
    assert code == 2 and "No space left" in err and "Traceback" not in err
    if existing:
        assert output.is_dir() and not any(output.iterdir())
    else:
        assert not (tmp_path / "new").exists()


# ---- preprocess_data: JSON lines ---------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    """A 400-piece SentencePiece model on a few stdlib sources (about a second)."""
    return train_sentencepiece(stdlib_documents()[:3], tmp_path_factory.mktemp("tok") / "t", 400)


def _corpus(path: Path, bad: bytes | None = None) -> Path:
    """Three JSON lines of code; ``bad`` replaces the third."""
    texts = [p.read_text(encoding="utf-8")[:2000] for p in stdlib_documents()[:3]]
    lines = [json.dumps({"text": t, "title": f"doc {i}"}).encode() for i, t in enumerate(texts)]
    if bad is not None:
        lines[2] = bad
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize("tokenizer", ["given", "trained"])
@pytest.mark.parametrize(
    "bad, why",
    [
        (b'{"text": "caf\xe9 au lait", "title": "x"}', "not UTF-8 (byte 0xe9 at column 14)"),
        (b'{"text": "x = 1", "title": ', "invalid JSON"),
        (b'{"text": "x = 1"}', "no key 'title'"),
    ],
)
def test_damaged_jsonl_line(capsys, tmp_path, spm_model, tokenizer, bad, why):
    src = _corpus(tmp_path / "in.jsonl", bad)
    prefix = tmp_path / "out" / "corpus"
    tok = ["--tokenizer-model", spm_model] if tokenizer == "given" else ["--vocab-size", 400]
    result = run(capsys, preprocess_data_main, "--input", src, "--json-keys", "text", "title",
                 *tok, "--output-prefix", prefix)  # fmt: skip
    err = assert_refused(result, f"{src}:3: ", prefix.parent)
    assert why in err and err.startswith("preprocess_data.py: error: ")


def test_preprocess_failure_after_writing_leaves_nothing(capsys, tmp_path):
    """Every title is empty: found only once the text dataset (and the tokenizer trained
    here) are written; both go again, and the folder made for them."""
    texts = [p.read_text(encoding="utf-8")[:2000] for p in stdlib_documents()[:3]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t, "title": ""}) + "\n" for t in texts))
    prefix = tmp_path / "out" / "corpus"
    code, out, err = run(capsys, preprocess_data_main, "--input", src, "--json-keys", "text",
                         "title", "--vocab-size", 400, "--output-prefix", prefix)  # fmt: skip
    assert code == 2 and err.splitlines()[-1].endswith("no non-empty documents under key "
                                                       f"'title' in {str(src)!r}")  # fmt: skip
    assert "Traceback" not in err and out == "" and not prefix.parent.exists()


# ---- preprocess_images ---------------------------------------------------------------------


def _image_tree(root: Path, suffix: str) -> Path:
    rng = np.random.default_rng(0)
    for cls in ("a", "b"):
        (root / cls).mkdir(parents=True)
        for i in range(2):
            pixels = rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / cls / f"{i}{suffix}")
    return root


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_damaged_image(capsys, tmp_path, suffix):
    """A truncated PNG is refused by the check before writing (its chunks' lengths and CRCs);
    a JPEG cut in its pixel data only when decoded, while packing: the same one line, and
    the packing's files and folders go again."""
    tree = _image_tree(tmp_path / "in", suffix)
    culprit = tree / "b" / f"1{suffix}"  # the last image: every other one is fine
    truncate(culprit)
    prefix = tmp_path / "out" / "sub" / "set"
    result = run(capsys, preprocess_images_main, "--input", tree, "--output-prefix", prefix)
    err = assert_refused(result, f"{culprit}: cannot decode image", tmp_path / "out")
    assert err.startswith("preprocess_images.py: error: ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]

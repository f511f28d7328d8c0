"""What the files a checkpoint save and a Hugging Face export write are like for their users:
modes that honour the umask (a shared file system's other users and jobs read them), and a
ViT export that ``AutoImageProcessor.from_pretrained`` loads, preparing images as the run's
evaluation did. Hugging Face models are random and built locally (no downloads)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat

import numpy as np
import pytest
import torch
import transformers  # a test dependency (requirements.txt): the independent reference

from checkpoint.format import save_safetensors, write_tensors
from checkpoint.store import RankFiles, SaveTarget, write_rank_files
from tools.convert_checkpoint import main as convert_main
from tools.export_hf import main as export_main

SIZE, PATCH, CHANNELS, CLASSES = 8, 2, 3, 4


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_checkpoint_files_honour_the_umask(tmp_path, mask):
    """safetensors writes through a private temporary file (mode 0600); a checkpoint's
    files get what any new file gets, as its metadata.json and resharded files do."""
    tensors = {"w": torch.ones(2, 3)}
    with _umask(mask):
        write_tensors(tmp_path / "model.safetensors", tensors, {})
        save_safetensors(tensors, tmp_path / "plain.safetensors")
        target = SaveTarget.of(tmp_path / "checkpoints", 5)
        target.tmp.mkdir(parents=True)
        files = {"model_tp0_pp0.safetensors": (tensors, {})}
        write_rank_files(RankFiles(target, files, {"rng": torch.zeros(3)}, 0, "{}"))
    written = [tmp_path / "model.safetensors", tmp_path / "plain.safetensors",
               *sorted(target.tmp.iterdir())]  # fmt: skip
    assert len(written) == 5
    for path in written:
        assert _mode(path) == 0o666 & ~mask, (path.name, oct(_mode(path)))


def _run(main, *args: str) -> str:
    """A tool's ``main`` in this process; what it wrote to stderr. It must succeed."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    assert code == 0, err.getvalue()[-3000:]
    return err.getvalue()


@pytest.fixture(scope="module")
def native_vit(tmp_path_factory):
    """A native ViT checkpoint as a run writes one: a random ``ViTForImageClassification``
    (no preprocessor file) imported, with the normalisation statistics a run measures and
    records in ``model_structure`` (families/vit.py ``checkpoint_structure``)."""
    root = tmp_path_factory.mktemp("vit_export")
    torch.manual_seed(0)
    hf = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=SIZE, patch_size=PATCH, num_channels=CHANNELS, hidden_size=32,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=CLASSES,
    ))  # fmt: skip
    hf.save_pretrained(root / "hf")
    _run(convert_main, "--input", str(root / "hf"), "--output", str(root / "bare"),
         "--format", "native", "--quiet")  # fmt: skip
    _run(convert_main, "--input", str(root / "hf"), "--output", str(root / "native"),
         "--format", "native", "--quiet")  # fmt: skip
    meta_path = root / "native" / "iter_0000000" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["model_structure"].update(mean=[0.2, 0.4, 0.6], std=[0.25, 0.3, 0.35])
    meta["config"]["data"]["crop_ratio"] = 0.8
    meta_path.write_text(json.dumps(meta))
    return root


def test_vit_export_loads_in_auto_image_processor_as_the_run_evaluated(native_vit, tmp_path):
    """``preprocessor_config.json`` from the run's image size, crop ratio and statistics:
    transformers' processor gives the pixels of data/image_data.py's evaluation view of a
    non-square image; the export says "image processor", not "tokenizer"; the weights file
    honours the umask."""
    from data.image_data import _eval_view

    out = tmp_path / "exported"
    with _umask(0o022):
        said = _run(export_main, "--checkpoint", str(native_vit / "native"), "--output", str(out))
    assert "tokenizer" not in said
    assert "image processor: preprocessor_config.json" in said
    assert _mode(out / "model.safetensors") == 0o644
    processor = transformers.AutoImageProcessor.from_pretrained(out)
    # 14 x 11 -> 12 x 10 -> the centre 8 x 8: whole-pixel crop offsets (an odd margin's half
    # pixel rounds to even in torchvision's and this project's crop, down in transformers').
    image = np.random.default_rng(0).integers(0, 256, (14, 11, CHANNELS), dtype=np.uint8)
    got = processor(image, return_tensors="pt", input_data_format="channels_last")
    got = got["pixel_values"][0]
    view = _eval_view(image, SIZE, 0.8).astype(np.float32) / 255
    mean, std = np.array([0.2, 0.4, 0.6]), np.array([0.25, 0.3, 0.35])
    want = torch.from_numpy(((view - mean) / std).astype(np.float32)).permute(2, 0, 1)
    assert got.shape == (CHANNELS, SIZE, SIZE)
    assert (got - want).abs().max() <= 1e-5
    # The model it goes with takes those pixels.
    model = transformers.ViTForImageClassification.from_pretrained(out)
    assert model(pixel_values=got[None]).logits.shape == (1, CLASSES)


def test_vit_export_without_statistics_says_why_it_has_no_processor(native_vit, tmp_path):
    """An import from a directory without a processor records no statistics: nothing to
    write, and the line says so (in the image processor's words)."""
    out = tmp_path / "exported"
    said = _run(export_main, "--checkpoint", str(native_vit / "bare"), "--output", str(out))
    assert "image processor: none written" in said and "tokenizer" not in said
    assert not (out / "preprocessor_config.json").exists()

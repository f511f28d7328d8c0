"""ViT image classification end to end: the real entry point on the bundled digits, every
parallel layout against one process, resume, an image folder against its packed form, and the
family's input errors.

Model: ``configs/vit_tiny.yaml`` shrunk by ``vit_overrides`` to 2 layers, hidden 32, 4x4
patches (4 patches + the class token: 5 tokens, padded to 6 under sequence parallelism), 2
micro-batches of 4 images per step, 6 steps at lr 3e-3, evaluating at 3 and 6.

- Through ``pretrain_vit.py`` under torchrun, 2 data-parallel ranks at te (dropout 0.1): the
  family's metrics (``loss``, ``accuracy``) and their validation twins, a ``vit`` checkpoint.
- fp32, dropout 0, same seed and data: TP=2 with sequence parallelism, PP=2 and DP=2 (also
  with the distributed optimizer) against the single process: every logged loss within 1e-5
  relative (the fp32 equivalence bar of the GPT and RoBERTa tests), every final weight,
  reassembled from the last checkpoint, within 1e-4 relative L2 per tensor
  (``multiproc.ADAM_WEIGHT_BAR``: Adam magnifies the rounding of near-eps gradient elements;
  attention key
  biases: rounding noise of an exactly-zero true gradient, checked in magnitude), and equal
  accuracies.
- Resume at te: 3 steps, then resumed to 6, on 2 ranks, logs bitwise the straight run's values.
- Real pixels in files: 100 digits written as PNG files in an image-folder tree, trained from the
  folder (decoded by 2 DataLoader workers) and from its packed form
  (``tools/preprocess_images.py``): identical batches, so bitwise identical losses.
- Errors: a missing image folder exits 2 with one line naming ``data.path``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO
from multiproc import ADAM_WEIGHT_BAR, launch, rank_env, reassembled_errors, run_ranks, torchrun

CONFIG = str(REPO / "configs/vit_tiny.yaml")
ENTRY = "pretrain_vit.py"
STEPS = 6
TOLERANCE = 1e-5
FP32 = {"model.hidden_dropout": 0.0, "model.attention_dropout": 0.0}
TE = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
LAYOUTS = {
    "single": (1, {}),
    "tp2_sp": (2, {"parallel.tensor": 2, "parallel.sequence_parallel": "true"}),
    "pp2": (2, {"parallel.pipeline": 2}),
    "dp2": (2, {}),
    "dp2_dist": (2, {"optimizer.distributed": "true"}),
}
PARALLEL = [name for name in LAYOUTS if name != "single"]


def vit_overrides(run_dir, level="te", **extra) -> list[str]:
    """Overrides that shrink configs/vit_tiny.yaml to a seconds-long job."""
    values = {
        "model.num_layers": 2,
        "model.hidden_size": 32,
        "model.num_attention_heads": 2,
        "model.patch_size": 4,
        "training.train_iters": STEPS,
        "training.micro_batch_size": 4,
        "training.global_batch_size": 8,
        "training.eval_interval": 3,
        "training.eval_iters": 1,
        "optimizer.lr": 3e-3,
        "optimizer.lr_warmup_iters": 1,
        "logging.interval": 1,
        "logging.dir": str(run_dir),
        "logging.tensorboard": "false",
        "logging.peak_tflops": 1.0,
        "checkpoint.save_interval": 3,
        "precision.level": level,
        "precision.fp8_gemm_backend": "emulated",
    }
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _checkpoint(run_dir: Path, iteration: int = STEPS) -> Path:
    return run_dir / "checkpoints" / f"iter_{iteration:07d}"


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoint.format import reassemble

    return reassemble(_checkpoint(run_dir), "model")


def _metadata(run_dir: Path) -> dict:
    return json.loads((_checkpoint(run_dir) / "metadata.json").read_text())


@pytest.fixture(scope="module")
def digits_folder(tmp_path_factory) -> tuple[Path, Path]:
    """100 digits (10 per class) as 8x8 grayscale PNG files in an image-folder tree, and the
    packed prefix ``tools/preprocess_images.py`` writes from it."""
    from PIL import Image

    from data.image_data import digits_source

    root = tmp_path_factory.mktemp("digits_folder")
    source = digits_source()
    for label in range(10):
        folder = root / "images" / f"digit_{label}"
        folder.mkdir(parents=True)
        for k, i in enumerate(np.flatnonzero(source.labels == label)[:10]):
            Image.fromarray(source.image(int(i))[:, :, 0], mode="L").save(folder / f"{k}.png")
    prefix = root / "packed" / "digits"
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools/preprocess_images.py"), "--input",
         str(root / "images"), "--output-prefix", str(prefix), "--channels", "1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return root / "images", prefix


@pytest.fixture(scope="module")
def entry_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vit_entry") / "run"
    proc = torchrun(2, ["--config", CONFIG, *vit_overrides(run_dir, "te", **TE)], timeout=240,
                    entry=ENTRY)  # fmt: skip
    return run_dir, proc


def _worker(rank: int, world: int, port: int, configs: list[list[str]]) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.loop import pretrain

    for overrides in configs:
        pretrain(load_config(CONFIG, overrides, family="vit"), family="vit")
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(digits_folder, tmp_path_factory) -> dict[str, Path]:
    """Every fp32 layout, the te run stopped at 3 and resumed to 6, and the folder and packed
    runs; returns each run's directory."""
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    folder, prefix = digits_folder
    root = tmp_path_factory.mktemp("vit_runs")
    names = [*LAYOUTS, "resumed", "folder", "packed"]
    dirs = {name: root / name for name in names}
    resumed = [
        vit_overrides(dirs["resumed"], "te", **TE, **extra)
        for extra in ({"training.exit_interval": 3}, {})
    ]
    files = {"data.channels": 1, "data.split": "80,20,0", **FP32}
    from_files = [
        vit_overrides(dirs["folder"], "fp32", **files, **{"data.dataset": "folder",
                      "data.path": str(folder), "data.num_workers": 2}),
        vit_overrides(dirs["packed"], "fp32", **files, **{"data.dataset": "packed",
                      "data.path": str(prefix)}),
    ]  # fmt: skip
    for world in (1, 2):
        configs = [
            vit_overrides(dirs[n], "fp32", **FP32, **extra)
            for n, (w, extra) in LAYOUTS.items()
            if w == world
        ]
        configs += from_files if world == 1 else resumed
        run_ranks(_worker, world, (configs,), timeout=300, start_method="fork")
    return dirs


def test_entry_point_trains_and_logs_the_family_metrics(entry_run):
    run_dir, proc = entry_run
    assert "world 2 (tp 1 pp 1 dp 2)" in proc.stdout and "images/s: " in proc.stdout
    records = _records(run_dir)
    for r in records:
        assert r["samples-per-second"] == pytest.approx(8 / r["iteration-time"])
    assert [r["iteration"] for r in records] == [*range(1, STEPS + 1)]
    for r in records:
        assert math.isfinite(r["loss"]) and 0.0 <= r["accuracy"] <= 1.0
    validated = [r for r in records if "loss validation" in r]
    assert [r["iteration"] for r in validated] == [3, 6]
    assert all(0.0 <= r["accuracy validation"] <= 1.0 for r in validated)
    meta = _metadata(run_dir)
    structure = meta["model_structure"]
    assert meta["family"] == "vit" and structure["num_classes"] == 10
    assert structure["classes"] == [str(i) for i in range(10)] and structure["num_channels"] == 1
    weights = _final_weights(run_dir)
    assert weights["patch_embedding.weight"].shape == (32, 16)
    assert weights["position_embeddings.weight"].shape == (5, 32)


def loss_error(run_dir: Path, ref_dir: Path) -> float:
    records, ref = _records(run_dir), _records(ref_dir)
    assert [r["iteration"] for r in records] == [r["iteration"] for r in ref]
    pairs = [(r[k], q[k]) for r, q in zip(records, ref) for k in ("loss", "loss validation")
             if k in q]  # fmt: skip
    assert len(pairs) == STEPS + 2
    return max(abs(a - b) / abs(b) for a, b in pairs)


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_losses_match_single_process(runs, layout):
    assert loss_error(runs[layout], runs["single"]) < TOLERANCE


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_accuracy_matches_single_process(runs, layout):
    keys = ("accuracy", "accuracy validation")
    ref = [[r.get(k) for k in keys] for r in _records(runs["single"])]
    assert [[r.get(k) for k in keys] for r in _records(runs[layout])] == ref


@pytest.mark.parametrize("layout", PARALLEL)
def test_layout_final_weights_match_single_process(runs, layout):
    structure = _metadata(runs["single"])["model_structure"]
    errors, key_bias = reassembled_errors(
        _final_weights(runs[layout]), _final_weights(runs["single"]), structure
    )
    assert {"class_token.weight", "patch_embedding.weight", "classifier.weight"} <= set(errors)
    assert max(errors.values()) < ADAM_WEIGHT_BAR, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert key_bias < 1e-5


def test_layouts_ran_as_named(runs):
    assert {"model_pp0.safetensors", "model_pp1.safetensors"} <= {
        p.name for p in _checkpoint(runs["pp2"]).iterdir()
    }
    assert {"model_tp0.safetensors", "model_tp1.safetensors"} <= {
        p.name for p in _checkpoint(runs["tp2_sp"]).iterdir()
    }
    assert {"optimizer_dp0.safetensors", "optimizer_dp1.safetensors"} <= {
        p.name for p in _checkpoint(runs["dp2_dist"]).iterdir()
    }


def test_resume_gives_identical_losses(entry_run, runs):
    resumed, straight = _records(runs["resumed"]), _records(entry_run[0])
    keys = ("loss", "accuracy", "loss validation", "accuracy validation")
    assert [r["iteration"] for r in resumed] == [*range(1, STEPS + 1)]
    assert [[r.get(k) for k in keys] for r in resumed] == [
        [r.get(k) for k in keys] for r in straight
    ]


def test_image_folder_and_its_packed_form_train_identically(runs):
    keys = ("loss", "accuracy", "loss validation", "accuracy validation")
    folder, packed = _records(runs["folder"]), _records(runs["packed"])
    assert [r["iteration"] for r in folder] == [*range(1, STEPS + 1)]
    assert [[r.get(k) for k in keys] for r in folder] == [[r.get(k) for k in keys] for r in packed]
    weights = _final_weights(runs["folder"])
    other = _final_weights(runs["packed"])
    assert all(torch.equal(weights[k], other[k]) for k in weights)


def test_missing_image_folder_is_one_line(tmp_path):
    run_dir = tmp_path / "run"
    args = vit_overrides(run_dir, **{"data.dataset": "folder", "data.path": str(tmp_path / "no")})
    code, _, err = launch(1, ["--config", CONFIG, *args], entry=ENTRY)[0]
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "data.path" in lines[0], lines
    assert not run_dir.exists()


def _export(checkpoint: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "tools/export_hf.py"), "--checkpoint", str(checkpoint),
         "--output", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("layout", ["single", "tp2_sp"])
def test_exported_checkpoint_gives_the_same_logits_in_transformers(runs, layout, tmp_path):
    """tools/export_hf.py on a trained checkpoint (one process, or TP=2+SP shards): transformers
    loads it and its logits equal this project's model with the reassembled weights."""
    import transformers

    from families.vit import ViTModelSection
    from models.vit import ViTModel
    from tools.export_hf import main as export_main

    # The tool's main in this process; the script itself runs as a process below.
    args = ["--checkpoint", str(_checkpoint(runs[layout])), "--output", str(tmp_path / "hf")]
    assert export_main(args) == 0
    hf = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    meta = _metadata(runs[layout])
    assert hf.config.id2label[3] == "3"
    s = meta["model_structure"]
    config = ViTModelSection(**meta["config"]["model"]).resolved(
        num_classes=s["num_classes"], num_channels=s["num_channels"]
    )
    ours = ViTModel(config).eval()
    weights = {k: v for k, v in _final_weights(runs[layout]).items() if k in ours.state_dict()}
    result = ours.load_state_dict(weights, strict=False)
    assert not result.missing_keys, result
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(pixel_values=images).logits - ours(images)["logits"]).abs().max()
    assert diff <= 1e-4, diff


def test_export_refuses_a_non_checkpoint_in_one_line(tmp_path):
    proc = _export(tmp_path, tmp_path / "hf")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "hf").exists()

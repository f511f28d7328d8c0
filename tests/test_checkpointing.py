"""Checkpoint files: atomic publication, pruning, the latest pointer, clear errors for damaged
checkpoints, and refusal of other format versions (checkpoint/store.py)."""

from __future__ import annotations

import json

import pytest
import torch

from checkpoint.format import FORMAT_VERSION, read_layouts
from checkpoint.store import (
    CheckpointError,
    check_format,
    latest_checkpoint,
    load_checkpoint,
    read_metadata,
    save_checkpoint,
)

MODEL, OPTIMIZER = "model.safetensors", "optimizer.safetensors"
FILES = (MODEL, OPTIMIZER)


def _save(root, iteration, keep_last=2):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) + iteration
    model = {"w": weight, "tied": weight}  # shared storage, as tied embeddings are
    optimizer = {"w:exp_avg": torch.ones(2, 3), "w:step": torch.tensor(float(iteration))}
    return save_checkpoint(
        root,
        iteration,
        files={MODEL: (model, {}), OPTIMIZER: (optimizer, {})},  # no layouts: whole tensors
        metadata={"consumed_samples": iteration * 4},
        device=torch.device("cpu"),
        rank=0,
        keep_last=keep_last,
    )


def test_round_trip_latest_pointer_and_pruning(tmp_path):
    for it in (1, 2, 3):
        _save(tmp_path, it)
    assert latest_checkpoint(tmp_path).name == "iter_0000003"
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert not list(tmp_path.glob(".tmp_*")) and not (tmp_path / ".latest.tmp").exists()
    ckpt = load_checkpoint(latest_checkpoint(tmp_path), rank=0, files=FILES)
    assert set(ckpt.files) == set(FILES)
    model, optimizer = ckpt.files[MODEL], ckpt.files[OPTIMIZER]
    assert torch.equal(model["w"], torch.arange(6.0).reshape(2, 3) + 3)
    assert torch.equal(model["w"], model["tied"])
    assert torch.equal(optimizer["w:exp_avg"], torch.ones(2, 3))
    assert optimizer["w:step"].item() == 3
    assert ckpt.metadata["iteration"] == 3 and ckpt.metadata["consumed_samples"] == 12
    assert ckpt.metadata["format_version"] == FORMAT_VERSION
    assert "torch_cpu" in ckpt.rng
    # Every tensor carries a layout (whole tensors here) in its file's header.
    layouts = read_layouts(ckpt.path / MODEL)
    assert set(layouts) == {"w", "tied"}
    assert layouts["w"]["partition_dim"] is None and layouts["w"]["dtype"] == "float32"


def test_load_reads_only_the_requested_files(tmp_path):
    path = _save(tmp_path, 1)
    ckpt = load_checkpoint(path, rank=0, files=(OPTIMIZER,))
    assert set(ckpt.files) == {OPTIMIZER}
    assert load_checkpoint(path, rank=0, files=()).files == {}
    # A rank without an RNG file (e.g. a different world size) gets none back.
    assert load_checkpoint(path, rank=5, files=()).rng == {}


def test_resave_of_the_same_iteration_replaces_it(tmp_path):
    _save(tmp_path, 1)
    path = _save(tmp_path, 1)
    assert [p.name for p in tmp_path.glob("iter_*")] == ["iter_0000001"]
    assert latest_checkpoint(tmp_path) == path


def test_keep_last_zero_keeps_everything(tmp_path):
    for it in (1, 2, 3):
        _save(tmp_path, it, keep_last=0)
    assert len(list(tmp_path.glob("iter_*"))) == 3


def test_no_checkpoint_yet(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_half_written_checkpoint_is_ignored(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / ".tmp_iter_0000002").mkdir()  # a crash mid-save leaves only this behind
    (tmp_path / ".tmp_iter_0000002" / MODEL).write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "iter_0000001"
    _save(tmp_path, 2)  # the next save replaces the debris
    assert not (tmp_path / ".tmp_iter_0000002").exists()
    assert latest_checkpoint(tmp_path).name == "iter_0000002"


def test_corrupt_tensor_file_names_the_file(tmp_path):
    path = _save(tmp_path, 1)
    (path / MODEL).write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path, rank=0, files=FILES)
    load_checkpoint(path, rank=0, files=(OPTIMIZER,))  # the other file is still readable


def test_missing_tensor_file_names_the_file(tmp_path):
    path = _save(tmp_path, 1)
    (path / OPTIMIZER).unlink()
    with pytest.raises(CheckpointError, match="checkpoint file missing: .*optimizer.safetensors"):
        load_checkpoint(path, rank=0, files=FILES)


def test_missing_and_bad_metadata_name_the_file(tmp_path):
    path = _save(tmp_path, 1)
    (path / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="metadata.json"):
        load_checkpoint(path, rank=0, files=FILES)
    (path / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="checkpoint file missing: .*metadata.json"):
        read_metadata(path)
    (tmp_path / "latest").write_text("iter_0000042\n")
    with pytest.raises(CheckpointError, match="iter_0000042"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize("version", [1, 99, None])
def test_other_format_versions_are_refused_in_one_line(tmp_path, version):
    """A version-1 checkpoint (per-layout names, index-keyed optimizer state) cannot be read
    as canonical tensors: refused before any tensor is read, in one line naming the version."""
    path = _save(tmp_path, 1)
    meta = json.loads((path / "metadata.json").read_text())
    if version is None:
        del meta["format_version"]  # written before the version was recorded
    else:
        meta["format_version"] = version
    (path / "metadata.json").write_text(json.dumps(meta))
    for refuse in (
        lambda: check_format(path, read_metadata(path)),
        lambda: load_checkpoint(path, rank=0, files=FILES),
    ):
        with pytest.raises(CheckpointError) as info:
            refuse()
        message = str(info.value)
        assert "\n" not in message
        assert f"format version {version};" in message
        assert f"reads format {FORMAT_VERSION}" in message
        assert str(path / "metadata.json") in message
    check_format(path, dict(meta, format_version=FORMAT_VERSION))  # the current one passes

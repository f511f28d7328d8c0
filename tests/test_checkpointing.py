"""Checkpoint files: atomic publication, pruning, and clear errors for damaged checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from training.checkpointing import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _save(root, iteration, keep_last=2):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3) + iteration
    return save_checkpoint(
        root,
        iteration,
        model_state={"w": weight, "tied": weight},  # shared storage, as tied embeddings are
        optimizer_state={"state.0.exp_avg": torch.ones(3)},
        metadata={"consumed_samples": iteration * 4},
        device=torch.device("cpu"),
        rank=0,
        writes_replicated=True,
        keep_last=keep_last,
    )


def test_round_trip_latest_pointer_and_pruning(tmp_path):
    for it in (1, 2, 3):
        _save(tmp_path, it)
    assert latest_checkpoint(tmp_path).name == "iter_0000003"
    assert sorted(p.name for p in tmp_path.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    ckpt = load_checkpoint(latest_checkpoint(tmp_path), rank=0)
    assert torch.equal(ckpt.model["w"], ckpt.model["tied"])
    assert ckpt.metadata["iteration"] == 3 and ckpt.metadata["consumed_samples"] == 12
    assert "torch_cpu" in ckpt.rng


def test_no_checkpoint_yet(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_half_written_checkpoint_is_ignored(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / ".tmp_iter_0000002").mkdir()  # a crash mid-save leaves only this behind
    (tmp_path / ".tmp_iter_0000002" / "model.safetensors").write_bytes(b"partial")
    assert latest_checkpoint(tmp_path).name == "iter_0000001"
    _save(tmp_path, 2)  # the next save replaces the debris
    assert not (tmp_path / ".tmp_iter_0000002").exists()


def test_corrupt_tensor_file_names_the_file(tmp_path):
    path = _save(tmp_path, 1)
    (path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path, rank=0)


def test_missing_and_bad_metadata_name_the_file(tmp_path):
    path = _save(tmp_path, 1)
    (path / "metadata.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="metadata.json"):
        load_checkpoint(path, rank=0)
    (path / "metadata.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(CheckpointError, match="format_version 99"):
        load_checkpoint(path, rank=0)
    (tmp_path / "latest").write_text("iter_0000042\n")
    with pytest.raises(CheckpointError, match="iter_0000042"):
        latest_checkpoint(tmp_path)

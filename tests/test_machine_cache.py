"""Per-machine measurements are made once and reused (fp8train/machine_cache.py)."""

from __future__ import annotations

import json

import torch

from fp8train import machine_cache


def test_a_measurement_is_made_once_per_machine_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(tmp_path))
    calls = []

    def measure():
        calls.append(1)
        return 0.5

    cpu = torch.device("cpu")
    value, source = machine_cache.remember("peak", cpu, measure)
    assert value == 0.5 and source.startswith("measured now, cached in")
    value, source = machine_cache.remember("peak", cpu, lambda: 9.0)
    assert value == 0.5 and source.startswith("cached in") and len(calls) == 1
    stored = json.loads((tmp_path / "machine.json").read_text())
    key = machine_cache.machine_key(cpu)
    assert stored[key]["peak"]["value"] == 0.5 and "torch" in key and "cores" in key


def test_a_damaged_or_unwritable_cache_only_means_measuring(tmp_path, monkeypatch):
    (tmp_path / "machine.json").write_text("{not json")
    monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(tmp_path))
    assert machine_cache.remember("peak", torch.device("cpu"), lambda: 2.0)[0] == 2.0
    blocked = tmp_path / "file"
    blocked.write_text("x")  # a cache directory under a regular file cannot be created
    monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(blocked / "sub"))
    value, source = machine_cache.remember("peak", torch.device("cpu"), lambda: 3.0)
    assert value == 3.0 and "not writable" in source


def test_a_rate_keeps_the_best_measurement(tmp_path, monkeypatch):
    """A peak first measured on a busy machine (low) is replaced by a later, higher one."""
    monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert machine_cache.remember("peak", cpu, lambda: 0.03, best=max)[0] == 0.03
    assert machine_cache.remember("peak", cpu, lambda: 0.09, best=max)[0] == 0.09
    value, source = machine_cache.remember("peak", cpu, lambda: 0.05, best=max)
    assert value == 0.09 and source.startswith("best measured")

"""Crash-safe saving: a SIGKILL at any point of a save leaves ``latest`` naming a complete
checkpoint (the previous one or the new one), and the next save recovers.

Each trial forks a process that saves one checkpoint and SIGKILLs itself at the Nth file
system step of the save (every write, fsync, rename, removal and pointer update is a step,
counted by wrapping those functions in the child), for N = 1, 2, ... until a save finishes
without reaching N. Both kinds of save are tried: a new iteration, and a re-save of the very
iteration ``latest`` names (a run restarted from scratch into the same directory).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal

import pytest
import torch

from checkpoint import store as checkpointing
from checkpoint.store import latest_checkpoint, load_checkpoint, save_checkpoint

FILE = "model.safetensors"
STEPS = ("write_tensors", "save_safetensors", "_fsync", "_write_pointer", "_prune")


def _save(root, iteration: int, value: float) -> None:
    save_checkpoint(
        root, iteration, files={FILE: ({"w": torch.full((4,), value)}, {})},
        metadata={"config": {}, "value": value}, device=torch.device("cpu"), rank=0,
    )  # fmt: skip


def _child(root, iteration: int, value: float, kill_at: int) -> None:
    """Save, dying by SIGKILL at file-system step ``kill_at``; exit 0 if the save finished."""
    count = 0

    def wrap(owner, name):
        original = getattr(owner, name)

        def step(*args, **kwargs):
            nonlocal count
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        setattr(owner, name, step)

    for name in STEPS:
        wrap(checkpointing, name)
    for owner, name in ((os, "replace"), (shutil, "rmtree")):
        wrap(owner, name)
    _save(root, iteration, value)
    os._exit(0)


def _value_of_latest(root) -> float:
    path = latest_checkpoint(root)
    ckpt = load_checkpoint(path, rank=0, files=(FILE,))  # every file present and readable
    value = ckpt.metadata["value"]
    assert torch.equal(ckpt.files[FILE]["w"], torch.full((4,), value))
    assert ckpt.metadata["iteration"] == int(path.name.removeprefix(".tmp_").split("_")[1])
    return value


@pytest.mark.parametrize("resave", [False, True], ids=["new_iteration", "resave_latest"])
def test_a_kill_at_any_point_of_a_save_leaves_latest_complete(tmp_path, resave):
    ctx = mp.get_context("fork")  # the child inherits the imports: milliseconds per trial
    base = tmp_path / "base"
    _save(base, 1, 1.0)
    if resave:
        _save(base, 2, 2.0)  # latest -> iter_0000002, which the trials save again
    before, after = (2.0, 20.0) if resave else (1.0, 2.0)
    kill_at, finished = 1, False
    while not finished:
        root = tmp_path / f"trial{kill_at}"
        shutil.copytree(base, root)
        child = ctx.Process(target=_child, args=(root, 2, after, kill_at))
        child.start()
        child.join(60)
        finished = child.exitcode == 0
        assert finished or child.exitcode == -signal.SIGKILL, child.exitcode
        seen = _value_of_latest(root)
        assert seen in (before, after), (kill_at, seen)
        if finished:
            assert seen == after
        # The next save in the same directory (a restarted run) recovers and publishes.
        _save(root, 3, 3.0)
        assert _value_of_latest(root) == 3.0
        assert not list(root.glob(".old_*")) and not list(root.glob(".tmp_*"))
        kill_at += 1
    print(f"\n{kill_at - 2} kill points, then a finished save")
    assert kill_at > 8  # the save has many steps; each was a kill point

"""Asynchronous checkpoint saving (``checkpoint.async_save``, checkpoint/async_writer.py).

- The tiny GPT on 2 gloo ranks with dropout, saving every 2 steps in the background, is stopped
  by a real SIGTERM (sent while a writer thread is writing) and resumed: every iteration's loss
  equals the synchronous run's, and every checkpoint both runs wrote holds bitwise the same
  tensors and counters.
- 2 gloo ranks with one rank's writer held back: ``latest`` keeps naming the previous
  checkpoint while any rank still writes, the snapshot is not changed by later in-place
  updates, a second save waits for the first, and a failed write raises on every rank.
- A SIGKILL while the writer is in flight leaves ``latest`` on the previous checkpoint, and
  the next save clears the unpublished directory.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import end_worker, logged_losses, rank_env, run_ranks
from safetensors.torch import load_file

from checkpoint import store as checkpointing
from checkpoint.async_writer import CheckpointSaver
from checkpoint.store import CheckpointError, latest_checkpoint, load_checkpoint

STEPS, EVERY = 8, 2


def _hold_writes(when, action) -> None:
    """In this process, run ``action(path)`` before each tensor file whose path satisfies
    ``when`` is written (the real write follows)."""
    original = checkpointing.write_tensors

    def write(path, tensors, layouts):
        if when(path):
            action(path)
        return original(path, tensors, layouts)

    checkpointing.write_tensors = write


# ---------------------------------------------------------------------------------------------
# The tiny GPT end to end


def _train_worker(rank, world, port, runs) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from training.config import load_config
    from training.loop import pretrain

    for overrides, signal_at in runs:
        if signal_at and rank == 0:  # once, from the writer thread, while it writes
            sent = []

            def send(path, sent=sent):
                if not sent:
                    sent.append(path)
                    os.kill(os.getpid(), signal.SIGTERM)

            tmp = f".tmp_iter_{signal_at:07d}"
            _hold_writes(lambda path, tmp=tmp: tmp in str(path), send)
        summary = pretrain(load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides))
        if signal_at:
            assert summary["stopped_by"] == "SIGTERM" and summary["iteration"] < STEPS, summary
    end_worker()


def test_async_run_stopped_by_sigterm_resumes_as_the_synchronous_run(tiny_data, tmp_path):
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    def overrides(run_dir, asynchronous):
        return tiny_overrides(
            tiny_data, run_dir, "te",
            **{"training.train_iters": STEPS, "checkpoint.save_interval": EVERY,
               "checkpoint.keep_last": 0, "checkpoint.async_save": asynchronous,
               "model.hidden_dropout": 0.1, "model.attention_dropout": 0.1,
               "training.eval_iters": 0},
        )  # fmt: skip

    sync, background = tmp_path / "sync", tmp_path / "async"
    runs = [
        (overrides(sync, False), 0),
        (overrides(background, True), 4),  # SIGTERM while iteration 4's files are written
        (overrides(background, True), 0),  # the same command resumes
    ]
    run_ranks(_train_worker, 2, (runs,), timeout=300, start_method="fork")

    assert logged_losses(background) == logged_losses(sync)
    saved = {p.name for p in (background / "checkpoints").glob("iter_*")}
    stopped = [n for n in saved if int(n[5:]) % EVERY]  # the signal's save, off the interval
    assert len(stopped) <= 1 and {"iter_0000002", "iter_0000004", f"iter_{STEPS:07d}"} <= saved
    assert (background / "checkpoints" / "latest").read_text().strip() == f"iter_{STEPS:07d}"
    assert not list((background / "checkpoints").glob(".tmp_*"))
    for name in sorted(saved & {p.name for p in (sync / "checkpoints").glob("iter_*")}):
        a, b = sync / "checkpoints" / name, background / "checkpoints" / name
        files = sorted(p.name for p in a.glob("*.safetensors"))
        assert files == sorted(p.name for p in b.glob("*.safetensors")), name
        for file in files:
            x, y = load_file(a / file), load_file(b / file)
            assert x.keys() == y.keys(), (name, file)
            for key in x:
                assert x[key].dtype == y[key].dtype and torch.equal(x[key], y[key]), (file, key)
        ma, mb = (json.loads((d / "metadata.json").read_text()) for d in (a, b))
        for key in ("iteration", "consumed_samples", "scheduler", "loss_scaler", "counters"):
            assert ma[key] == mb[key], (name, key)


# ---------------------------------------------------------------------------------------------
# The protocol on 2 gloo ranks, one writer held back


def _name(path) -> str | None:
    return path.name if path is not None else None


def _protocol_worker(rank, world, port, root) -> None:
    rank_env(rank, world, port)
    import torch.distributed as dist

    dist.init_process_group("gloo")
    saver = CheckpointSaver(root, device=torch.device("cpu"), rank=rank, keep_last=2,
                            asynchronous=True)  # fmt: skip
    live = torch.arange(4.0) + 10 * rank
    files = {f"part{rank}.safetensors": ({"w": live, "tied": live}, {})}

    def save(iteration):
        saver.save(iteration, files, {"config": {}, "step": iteration})

    save(1)
    saver.finish()
    assert _name(latest_checkpoint(root)) == "iter_0000001"

    # Rank 1's writer waits for a gate; rank 0's finishes.
    gate, entered = threading.Event(), threading.Event()

    def hold(path):
        entered.set()
        assert gate.wait(120)

    if rank == 1:
        _hold_writes(lambda path: True, hold)
    save(2)
    expected = live.clone()
    live.add_(100.0)  # the optimizer step after the save updates the tensors in place
    if rank == 1:
        assert entered.wait(120)
    for _ in range(3):  # rank 1 is still writing: nothing is published
        saver.poll()
        assert saver.in_flight
        assert _name(latest_checkpoint(root)) == "iter_0000001"
    while rank == 0 and saver.writing:
        time.sleep(0.01)
    dist.barrier()
    if rank == 0:  # rank 0's file is complete, yet the checkpoint is not published
        assert torch.equal(load_file(root / ".tmp_iter_0000002" / "part0.safetensors")["w"],
                           expected)  # fmt: skip
    dist.barrier()
    if rank == 1:
        gate.set()
    deadline = time.monotonic() + 120
    while saver.in_flight:
        assert time.monotonic() < deadline
        saver.poll()
        time.sleep(0.01)
    ckpt = load_checkpoint(latest_checkpoint(root), rank, (f"part{rank}.safetensors",))
    assert ckpt.path.name == "iter_0000002" and ckpt.metadata["step"] == 2
    stored = ckpt.files[f"part{rank}.safetensors"]
    assert torch.equal(stored["w"], expected) and torch.equal(stored["tied"], expected)

    # A second save waits for the first: rank 1 releases its gate 0.3 s into save 3's write.
    gate.clear()
    save(3)
    if rank == 1:
        threading.Timer(0.3, gate.set).start()
    save(4)  # publishes 3 first, which needs rank 1's file
    assert _name(latest_checkpoint(root)) == "iter_0000003"
    assert rank == 0 or gate.is_set()  # rank 1: its write of 3 was released before
    assert (root / "iter_0000003" / "part1.safetensors").exists()
    saver.finish()
    assert _name(latest_checkpoint(root)) == "iter_0000004"
    assert sorted(p.name for p in root.glob("iter_*")) == ["iter_0000003", "iter_0000004"]

    # A failed write: every rank raises, naming the rank; latest stays where it was.
    if rank == 1:

        def fail(path):
            raise OSError(28, "No space left on device")

        _hold_writes(lambda path: ".tmp_iter_0000005" in str(path), fail)
    save(5)
    with pytest.raises(CheckpointError, match="rank 1 could not write.*No space left"):
        saver.finish()
    assert not saver.in_flight
    assert _name(latest_checkpoint(root)) == "iter_0000004"
    end_worker()


def test_latest_moves_only_after_every_rank_has_written(tmp_path):
    run_ranks(_protocol_worker, 2, (tmp_path,), timeout=120, start_method="fork")


# ---------------------------------------------------------------------------------------------
# A kill while the writer is in flight


def _killed_child(root) -> None:
    saver = CheckpointSaver(root, device=torch.device("cpu"), rank=0, keep_last=2,
                            asynchronous=True)  # fmt: skip
    files = {"model.safetensors": ({"w": torch.ones(4)}, {})}
    saver.save(1, files, {"config": {}})
    saver.finish()

    def die(path):
        os.kill(os.getpid(), signal.SIGKILL)  # the main thread is training meanwhile

    _hold_writes(lambda path: True, die)
    saver.save(2, files, {"config": {}})
    time.sleep(60)


def test_a_kill_while_writing_leaves_the_previous_checkpoint(tmp_path):
    child = mp.get_context("fork").Process(target=_killed_child, args=(tmp_path,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert _name(latest_checkpoint(tmp_path)) == "iter_0000001"
    assert (tmp_path / ".tmp_iter_0000002").is_dir()
    saver = CheckpointSaver(tmp_path, device=torch.device("cpu"), rank=0, keep_last=2,
                            asynchronous=False)  # fmt: skip
    saver.save(3, {"model.safetensors": ({"w": torch.zeros(4)}, {})}, {"config": {}})
    assert _name(latest_checkpoint(tmp_path)) == "iter_0000003"
    assert not list(tmp_path.glob(".tmp_*"))

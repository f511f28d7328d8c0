"""Checkpoint saving for the training loop, synchronous or in the background (``async_save``).

A synchronous save (``checkpoint/store.py``'s ``save_checkpoint``) stops every rank
until its files are written, flushed and published. With ``checkpoint.async_save=true`` the
step loop waits only for a copy of the state in host memory; a background thread per rank
writes and flushes the files while training goes on, and the checkpoint is published later.

Protocol (every collective on the main thread, over the default group; the writer thread
only touches files, because collectives issued from two threads on one group interleave and
deadlock on gloo and nccl alike):

1. ``save(N)``, collective, on the same iteration on every rank: first ``finish()`` the save
   in flight, if any (a second save waits for the first); then ``begin_save``: rank 0 clears
   debris and makes ``.tmp_iter_N``, a barrier; then each rank copies its tensors, RNG states
   and (rank 0) metadata of iteration N to host memory (``rank_files(copy=True)``: private
   copies, so the optimizer step that follows cannot change what is written) and starts its
   writer thread on them. The main thread returns to training.
2. The writer thread writes this rank's files into ``.tmp_iter_N`` and fsyncs each one; it
   records success or the error. It never touches ``latest``.
3. ``poll()``, collective, called by the loop once per step while a save is in flight (every
   rank has one, started at the same iteration, so every rank calls it at the same steps):
   one all-reduce of (ranks still writing, ranks that failed). While any rank is writing it
   returns at once. When none is, ``publish_save`` runs: rank 0 fsyncs the directory, renames
   it into place, moves ``latest`` (``_publish``, crash-safe as for a synchronous save) and
   prunes; a barrier. A failed write raises ``CheckpointError`` on every rank naming the rank
   and its error; ``latest`` stays on the previous checkpoint.
4. ``finish()``, collective: join this rank's writer, then the same agreement and
   publication as ``poll`` (which now finds every rank done). The loop calls it at the next
   save, after the last save of a run (``training.train_iters`` reached, a signal, the exit
   interval or time limit) before announcing it, and when a ``TrainingError`` (raised on every
   rank at the same step) ends the run. So a run that ends leaves ``latest`` where a
   synchronous run leaves it, and resumes identically.

A crash (or a kill) while a writer is in flight leaves ``latest`` on the previous complete
checkpoint and a ``.tmp_iter_N`` directory that the next save clears (``_recover``), as for a
synchronous save. Any other error leaving the loop may have stopped only some ranks, which
then cannot agree: the save in flight is not published (``abandon``), as if the process had
crashed.

Threads rather than processes: the writer shares the snapshot with the main thread (no
second copy into shared memory, no pickling), and its time goes to file writes and fsync,
which release the GIL. What it still costs the step loop is CPU time where training and
writing share cores, the GIL while safetensors serialises, and one small all-reduce per
step while a save is in flight (``benchmarks/bench_save.py`` measures both). The default is off,
as Megatron's ``--async-save`` is: each rank holds a host copy of the tensors it saves until
they are written, and ``latest`` moves a few steps after the save's iteration instead of at
it; turn it on where a save's stall is worth that memory.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from checkpoint.store import (
    CheckpointError,
    RankFiles,
    SaveTarget,
    begin_save,
    publish_save,
    rank_files,
    save_checkpoint,
    write_rank_files,
)
from parallel.topology import gather_texts

__all__ = ["CheckpointSaver"]


class _Writer:
    """One rank's background write of one checkpoint."""

    def __init__(self, part: RankFiles):
        self.part = part
        self.error: str | None = None
        self.seconds = 0.0
        self.thread = threading.Thread(
            target=self._run, name=f"checkpoint-writer-{part.target.final.name}", daemon=True
        )
        self.thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        try:
            write_rank_files(self.part)
        except BaseException as exc:  # reported on the main thread, by every rank
            self.error = f"{type(exc).__name__}: {exc}"
        self.seconds = time.perf_counter() - start

    @property
    def target(self) -> SaveTarget:
        return self.part.target


class CheckpointSaver:
    """The loop's checkpoint saves. Every method but ``abandon`` is collective over the
    default group: all ranks call it at the same point of the same step.

    ``log(text)``: called on publication (the loop prints it on the rank that logs).
    ``blocked_seconds``: time the calling thread has spent inside ``save``/``poll``/``finish``
    (what saving cost the step loop); ``last_write_seconds``: how long the last background
    write took on this rank.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        device: torch.device,
        rank: int,
        keep_last: int,
        asynchronous: bool,
        log=None,
    ):
        self.directory = Path(directory)
        self.device, self.rank, self.keep_last = device, rank, keep_last
        self.asynchronous = asynchronous
        self.log = log or (lambda text: None)
        self.blocked_seconds = 0.0
        self.last_write_seconds = 0.0
        self._writer: _Writer | None = None

    @property
    def in_flight(self) -> bool:
        """A background save has started and is not yet published (the same on every rank)."""
        return self._writer is not None

    @property
    def writing(self) -> bool:
        """This rank's background write is still running (local: says nothing of the others)."""
        return self._writer is not None and self._writer.thread.is_alive()

    def save(self, iteration: int, files: dict, metadata: dict) -> None:
        """Save ``files`` (this rank's: file name -> (tensors, layouts)) and ``metadata`` as
        the checkpoint of ``iteration``: at once, or (async) copied to host memory and
        written in the background after the previous save is published."""
        start = time.perf_counter()
        try:
            self._finish()
            if not self.asynchronous:
                save_checkpoint(
                    self.directory, iteration, files=files, metadata=metadata,
                    device=self.device, rank=self.rank, keep_last=self.keep_last,
                )  # fmt: skip
                self.log(f"saved checkpoint at iteration {iteration} to {self.directory}")
                return
            target = begin_save(self.directory, iteration, self.rank)
            part = rank_files(target, files, metadata, self.device, self.rank, copy=True)
            self._writer = _Writer(part)
        finally:
            self.blocked_seconds += time.perf_counter() - start

    def poll(self) -> None:
        """Publish the save in flight if every rank has written its files; else return at
        once. Nothing (no collective) when no save is in flight."""
        if self._writer is None:
            return
        start = time.perf_counter()
        try:
            if self._agreed_done():
                self._publish()
        finally:
            self.blocked_seconds += time.perf_counter() - start

    def finish(self) -> None:
        """Wait for the save in flight, then publish it (nothing when none is)."""
        start = time.perf_counter()
        try:
            self._finish()
        finally:
            self.blocked_seconds += time.perf_counter() - start

    def abandon(self) -> None:
        """Local, for an error that may have stopped only this rank: the save in flight is
        not published (its directory stays a ``.tmp_*`` that the next save clears)."""
        self._writer = None

    def _finish(self) -> None:
        if self._writer is None:
            return
        self._writer.thread.join()
        if not self._agreed_done():  # cannot happen: this rank and every other has joined
            raise CheckpointError(f"{self._writer.target.tmp}: ranks disagree on the save")
        self._publish()

    def _agreed_done(self) -> bool:
        """Collective: True when every rank's writer has ended; raises on every rank when one
        failed, naming it."""
        writer = self._writer
        alive = writer.thread.is_alive()
        counts = torch.tensor(
            [int(alive), int(not alive and writer.error is not None)], dtype=torch.int64
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = counts.to(self.device)
            dist.all_reduce(counts)
        writing, failed = (int(x) for x in counts.tolist())
        if writing:
            return False
        if failed:
            self._writer = None
            errors = gather_texts(writer.error or "", self.device)
            rank, error = next((r, e) for r, e in enumerate(errors) if e)
            raise CheckpointError(
                f"{writer.target.tmp}: rank {rank} could not write its checkpoint files "
                f"({error}); latest still names the previous checkpoint"
            )
        return True

    def _publish(self) -> None:
        writer, self._writer = self._writer, None
        publish_save(writer.target, self.rank, self.keep_last)
        self.last_write_seconds = writer.seconds
        self.log(
            f"saved checkpoint at iteration {writer.target.iteration} to {self.directory} "
            f"(written in the background in {writer.seconds:.2f} s)"
        )

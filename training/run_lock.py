"""One job per checkpoint directory, and no worker outliving its launcher.

A job holds an exclusive ``flock`` on ``{checkpoint.dir}/.lock`` for its lifetime (rank 0
takes it; the kernel drops it when the process dies, so a dead holder keeps nothing). A
second job on the same directory is refused in one line naming the holder, instead of two
jobs saving into one directory (measured: ``latest`` then named checkpoints with missing
files). Workers started by torchrun's agent ask the kernel for SIGTERM when the agent dies
(``PR_SET_PDEATHSIG``), so a ``kill -9`` of the launcher does not leave them training as
orphans: the signal handler saves and they exit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch

from parallel.topology import gather_texts
from training.checkpointing import CheckpointError

__all__ = ["RunLock", "acquire_run_lock", "die_with_parent"]


class RunLock:
    """The held lock (keep a reference for the run's lifetime; ``release`` ends it)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def __del__(self) -> None:  # a run that ended by an exception
        self.release()

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _try_lock(directory: Path) -> tuple[int | None, str]:
    import fcntl

    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        return None, f"checkpoint.dir={directory} cannot be created or written: {err.strerror}"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        return None, (
            f"checkpoint.dir={directory} is in use by a running job ({holder}); stop it or "
            "choose another checkpoint.dir / logging.dir"
        )
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
    return fd, ""


def acquire_run_lock(directory: str | os.PathLike, rank: int, device: torch.device) -> RunLock:
    """Collective: rank 0 takes the lock and every rank learns whether it got it; a refusal
    raises ``CheckpointError`` on every rank with rank 0's reason."""
    fd, reason = _try_lock(Path(directory)) if rank == 0 else (None, "")
    reason = gather_texts(reason, device)[0]  # rank 0's
    if reason:
        raise CheckpointError(reason)
    return RunLock(fd)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: deliver ``sig`` to this process when its parent (torchrun's agent) dies."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)

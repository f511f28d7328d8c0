"""One job per checkpoint directory, and no worker outliving its launcher.

A job holds an exclusive lock on ``{checkpoint.dir}/.lock`` for its lifetime (global rank 0
takes it; the kernel drops it when the process dies, so a dead holder keeps nothing). A
second job on the same directory is refused in one line naming the holder, instead of two
jobs saving into one directory (measured: ``latest`` then named checkpoints with missing
files). The lock is a POSIX record lock (``lockf``), not ``flock``: a process forked by the
holder (a data-loader worker) does not inherit it, so it cannot keep a dead holder's lock.
The price: closing any other descriptor of ``.lock`` in the holding process drops the lock,
so nothing but ``RunLock`` opens it there. On NFS both kinds go through the server's lock
manager.

Workers started by torchrun's agent ask the kernel for a signal when the agent dies
(``PR_SET_PDEATHSIG``, ``PARENT_DEATH_SIGNAL``), so a ``kill -9`` of the launcher does not
leave them training as orphans: the signal handler saves and they exit. An agent that died
before a worker asked (it imports for seconds first) is caught too: ``training.launcher``
names itself in ``FP8TRAIN_AGENT_PID``, and a worker that does not find it among its
ancestors stops.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the launcher imports this module before torch: keep it light
    import torch

__all__ = [
    "AGENT_PID_VAR",
    "PARENT_DEATH_SIGNAL",
    "RunLock",
    "acquire_run_lock",
    "die_with_parent",
    "run_lock_problem",
]

AGENT_PID_VAR = "FP8TRAIN_AGENT_PID"  # set by training.launcher for its workers


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
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        reason = _in_use(directory, fd)
        os.close(fd)
        return None, reason
    os.ftruncate(fd, 0)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {stamp}\n".encode(), 0)
    return fd, ""


def _in_use(directory: Path, fd: int) -> str:
    holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
    return (
        f"checkpoint.dir={directory} is in use by a running job ({holder}); stop it or "
        "choose another checkpoint.dir / logging.dir"
    )


def run_lock_problem(directory: str | os.PathLike) -> str | None:
    """The refusal ``acquire_run_lock`` would give now (a live job holds the directory), or
    None; creates nothing (the pre-flight asks before reading a live run's checkpoints,
    which that run may be pruning). Only a probe: the answer can change a moment later."""
    import fcntl

    path = Path(directory)
    try:
        fd = os.open(path / ".lock", os.O_RDWR)
    except OSError:  # no lock file (never run) or not ours to open: acquiring will tell
        return None
    try:
        # A shared lock: it conflicts only with a holder's exclusive one, so the workers of
        # one job probing at the same moment cannot refuse each other.
        try:
            fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return _in_use(path, fd)
        fcntl.lockf(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def acquire_run_lock(directory: str | os.PathLike, rank: int, device: torch.device) -> RunLock:
    """Collective: rank 0 takes the lock and every rank learns whether it got it; a refusal
    raises ``CheckpointError`` on every rank with rank 0's reason."""
    from checkpoint.store import CheckpointError
    from parallel.topology import gather_texts

    fd, reason = _try_lock(Path(directory)) if rank == 0 else (None, "")
    reason = gather_texts(reason, device)[0]  # rank 0's
    if reason:
        raise CheckpointError(reason)
    return RunLock(fd)


# The parent-death signal. Not SIGTERM: the kernel sends it once per reparenting, and a
# multi-threaded agent's death reparents a worker several times (to another of its dying
# threads, then to init; measured: two signals 14 ms apart), which a second-signal-aborts
# handler would take for a user's second Ctrl-C. training/signals.py stops on the first and
# ignores the repeats; with no handler installed its default action ends the process.
PARENT_DEATH_SIGNAL = signal.SIGUSR2


def die_with_parent(sig: int = PARENT_DEATH_SIGNAL) -> None:
    """Linux: deliver ``sig`` to this process when its parent (torchrun's agent) dies, and at
    once when the agent is already gone (a worker orphaned while it was starting)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        return
    agent = os.environ.get(AGENT_PID_VAR, "")
    if agent.isdigit():  # under training.launcher: is it still above us?
        orphaned = int(agent) not in _ancestors()
    else:  # plain torchrun: only a death since this call began is seen
        orphaned = os.getppid() != parent
    if orphaned:
        os.kill(os.getpid(), sig)


def _ancestors() -> set[int]:
    """Pids of this process's parent, its parent's parent, ... (from /proc). An ancestor,
    not only the parent: a job started inside another launcher's worker keeps that one's
    variable, and its own agent sits between."""
    found, pid = set(), os.getppid()
    while pid > 1 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as fh:
                pid = int(fh.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found

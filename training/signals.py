"""Stop on SIGTERM / SIGINT with a checkpoint, as Megatron's exit-signal handler does.

Schedulers send SIGTERM before killing a job; Ctrl-C sends SIGINT (torchrun's agent, whose
workers sit in sessions of their own, turns it into a SIGTERM to each worker). The first
signal only sets a flag: the current step finishes, the ranks agree at the step's end that
one of them was signalled (``StopSignals.agreed``: one small all-reduce), every rank saves
the checkpoint collectively and the run ends normally, well inside torchrun's shutdown
timeout. A second signal restores the default action and re-raises it: an immediate stop.
The signal a torchrun worker gets when its launcher dies (``PARENT_DEATH_SIGNAL``,
training/run_lock.py) stops the run the same way, but repeats of it never abort: the kernel
sends it once per reparenting.
"""

from __future__ import annotations

import os
import signal
import threading

import torch
import torch.distributed as dist

from training.run_lock import PARENT_DEATH_SIGNAL

__all__ = ["StopSignals"]

_HANDLED = (signal.SIGTERM, signal.SIGINT, PARENT_DEATH_SIGNAL)
# What the console line calls each signal ("received SIGTERM: saved checkpoint ...").
_NAMES = {PARENT_DEATH_SIGNAL: f"{PARENT_DEATH_SIGNAL.name} (the launcher died)"}


class StopSignals:
    """Installed while a run trains (``with StopSignals(enabled): ...``)."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and threading.current_thread() is threading.main_thread()
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if self.enabled:
            for sig in _HANDLED:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        if signum == PARENT_DEATH_SIGNAL:  # the kernel may repeat it: never an abort
            if self.received is None:
                self.received = signum
            return
        if self.received is not None:  # the second signal: stop now, by its default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.received = signum

    def agreed(self, device: torch.device) -> str | None:
        """The name of a signal any rank received (collective over the default group), or
        None. Every rank calls it at the same point of every step."""
        if not self.enabled:
            return None
        code = self.received or 0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([code], dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return _NAMES.get(code, signal.Signals(code).name) if code else None

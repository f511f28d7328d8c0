"""``python -m training.launcher [torchrun options] pretrain_X.py [args]``: torchrun, ending
with one line of its own instead of the agent's tracebacks (what ``make train`` runs).

- SIGTERM / SIGINT (Ctrl-C): the agent passes SIGTERM to the workers, which finish their step
  and save (training/signals.py); the agent then raises, and plain torchrun prints that as a
  traceback. Here it is one line, exit 0.
- A worker that exits non-zero: plain torchrun prints a ``ChildFailedError`` report (about 40
  lines) after the worker's own message. Here: nothing more when every failed worker exited 2
  (bad input, already reported in one line by rank 0), else one line naming the first failed
  rank and its exit code; the launcher exits with that code.
- ``--max-restarts N``: restarted workers resume from the latest checkpoint. The rendezvous
  store is not shared with the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): restarted
  gloo workers could otherwise pick up addresses the dead attempt left in it and hang.
"""

from __future__ import annotations

import logging
import os
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own notices ("shutting down workers", "Sending process ... closing signal")
    # would follow the workers' one-line reports; errors still show.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except SignalException as err:
        name = getattr(err.sigval, "name", str(err.sigval))
        print(f"fp8train: stopped by {name}; the workers saved a checkpoint at their last "
              "completed step, and the same command resumes from it", flush=True)  # fmt: skip
        return 0
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        codes = [f.exitcode for _, f in failures]
        if all(code == 2 for code in codes):
            return 2
        rank, first = failures[0]
        print(
            f"error: rank {rank} exited with code {first.exitcode} (its output is above)",
            file=sys.stderr,
            flush=True,
        )
        return first.exitcode if first.exitcode and first.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

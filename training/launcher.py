"""``python -m training.launcher [torchrun options] pretrain_X.py [args]``: torchrun, ending
with one line of its own instead of the agent's tracebacks (what ``make train`` runs).

- SIGTERM / SIGINT (Ctrl-C): the agent passes SIGTERM to the workers, which finish their step
  and save (training/signals.py); the agent then raises, and plain torchrun prints that as a
  traceback. Here it is one line, exit 0.
- A worker that exits non-zero: plain torchrun prints a ``ChildFailedError`` report (about 40
  lines) after the worker's own message. Here: nothing more when every failed worker exited 2
  (bad input, already reported in one line by rank 0), else one line naming the first failed
  rank and its exit code; the launcher exits with that code.
- Before torchrun starts any worker, the pre-flight (training/preflight.py) checks the config
  for the world size ``nnodes x nproc_per_node``: layout, batch split, directories, data,
  tokenizer, the checkpoint to resume. A problem is one line, exit 2, and no worker starts.
  It needs to know the family: the script must be ``pretrain_<family>.py`` of a registered
  family (any other script is launched unchecked; its workers check themselves).
- ``--max-restarts N``: restarted workers resume from the latest checkpoint. The rendezvous
  store is not shared with the workers (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): each start
  of the workers gets a store of its own, hosted by rank 0, with nothing in it from a dead
  attempt. Our workers also cope with the agent's shared store that plain torchrun gives
  them (parallel/topology.py: keys of their own for each start); a script launched
  unchecked might not.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from training.run_lock import AGENT_PID_VAR

__all__ = ["main", "preflight_error"]

_ENTRY = re.compile(r"pretrain_(\w+)\.py")


def _world_size(args) -> int | None:
    """``nnodes x nproc_per_node`` as torchrun resolves them; None for an elastic range of
    nodes or a value torchrun itself will refuse."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    try:
        low, high = parse_min_max_nnodes(args.nnodes)
        per_node = determine_local_world_size(args.nproc_per_node)
    except (ValueError, RuntimeError):
        return None
    return low * per_node if low == high else None


def preflight_error(args) -> str | None:
    """The pre-flight's one-line error for torchrun's parsed ``args``, or None (passed, or
    not a ``pretrain_<family>.py`` script). A malformed script command line exits 2 with
    argparse's usage message, as the script would."""
    match = _ENTRY.fullmatch(Path(args.training_script).name)
    if args.module or args.no_python or match is None:
        return None
    from families import family_names

    family = match.group(1)
    if family not in family_names():
        return None
    from training.entry_point import entry_parser
    from training.preflight import PREFLIGHT_ERRORS, check_run

    parser = entry_parser(family)
    parser.prog = args.training_script
    entry = parser.parse_args(args.training_script_args)
    try:
        check_run(entry.config, entry.overrides, family, _world_size(args))
    except PREFLIGHT_ERRORS as err:
        return f"error: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # see the docstring
    # This process is the workers' agent: a worker that finds it gone at start-up stops
    # (training/run_lock.py die_with_parent).
    os.environ[AGENT_PID_VAR] = str(os.getpid())
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent's own notices ("shutting down workers", "Sending process ... closing signal")
    # would follow the workers' one-line reports; errors still show.
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    # ... and its "failed (exitcode: N) local_rank: ..." error repeats what the handler of
    # ChildFailedError below reports in one line (or rank 0 already did, for exit 2).
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: not record.getMessage().startswith("failed (exitcode")
    )
    args = parse_args(sys.argv[1:] if argv is None else argv)
    problem = preflight_error(args)
    if problem:
        print(problem, file=sys.stderr, flush=True)
        return 2
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

"""The body of every ``pretrain_<family>.py`` entry point: parse, pre-flight, train.

A bad config, layout, data file, tokenizer, directory or checkpoint prints one line naming
the culprit and exits 2 before anything is written: the pre-flight (training/preflight.py)
runs before this worker joins a process group, so under plain ``torchrun`` every worker
stops at once. Under torchrun the line also goes to the agent's error file
(``TORCHELASTIC_ERROR_FILE``), so its failure report names it as the root cause instead of
"To enable traceback see ...". The entry points differ only in the model family they name.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

__all__ = ["entry_parser", "main"]


def entry_parser(family: str, description: str = "") -> argparse.ArgumentParser:
    """The entry points' command line (``--config FILE [key=value ...]``); the launcher
    parses a script's arguments with it too."""
    parser = argparse.ArgumentParser(description=description or f"Pretrain a {family} model")
    parser.add_argument("--config", required=True, help="YAML config file (see docs/CONFIG.md)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    return parser


# In this node's attempt directory: the first worker to create it prints the line.
_MARKER = "fp8train_error_line"


def _first_to_fail(fallback: bool) -> bool:
    """Whether this worker prints the ``error:`` line of a failure every worker hits alike.

    Under torchrun the first of this node's workers to fail: once one worker has exited, the
    agent SIGTERMs the others, so a fixed rank (local rank 0) may be ended before it prints
    and the user sees no line. "First" is whoever creates the marker (O_CREAT|O_EXCL: atomic,
    exactly one wins) in the directory torchrun's DefaultLogsSpecs.reify makes for this start
    of the node's workers, ``.../attempt_<n>/<local rank>/error.json`` two levels up from
    TORCHELASTIC_ERROR_FILE: shared by them all, and emptied (rmtree, makedirs) at every
    start, even one that keeps the restart count, so a restart prints again. Not a directory
    of our own in /tmp: nothing would make it fresh per start or remove it. Another layout (a
    custom --logs_specs), no error file (--log-dir os.devnull, not under torchrun) or no
    marker made: ``fallback``, the rule of a fixed rank.
    """
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE", "")
    rank_dir = os.path.dirname(error_file)
    attempt_dir = os.path.dirname(rank_dir)
    default_layout = (
        os.path.basename(error_file) == "error.json"
        and os.path.basename(rank_dir).isdigit()
        and os.path.basename(attempt_dir).startswith("attempt_")
    )
    if not default_layout:
        return fallback
    try:
        os.close(os.open(os.path.join(attempt_dir, _MARKER), os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False  # another worker of this start failed first and prints
    except OSError:
        return fallback
    return True


def _report(err: BaseException, printing: bool) -> None:
    """``error: ...`` on stderr from the rank that prints, and into this worker's torchrun
    error file (the agent's failure report shows it in place of a traceback)."""
    line = f"error: {err}"
    if printing:
        print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        # torch.distributed.elastic's error-file format (ErrorHandler.record_exception),
        # with our line where it puts the traceback.
        info = {"py_callstack": line, "timestamp": str(int(time.time()))}
        try:
            with open(path, "w") as fh:
                json.dump({"message": {"message": line, "extraInfo": info}}, fh)
        except OSError:
            pass  # the report then says "To enable traceback see ..."; the line is above


def main(family: str, argv: list[str] | None = None, description: str = "") -> int:
    args = entry_parser(family, description).parse_args(argv)

    # megatron-core warns at import that TE/apex are absent; we use neither on purpose.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    from training.preflight import PREFLIGHT_ERRORS, check_run

    rank = os.environ.get("RANK", "0")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: stop when the agent dies
        from training.run_lock import die_with_parent

        die_with_parent()
    # Before any process group: every worker checks alike and stops alone; one line per
    # node (its first worker to fail), so a node that alone lacks a file still says so.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg, plan = check_run(args.config, args.overrides, family, world)
    except PREFLIGHT_ERRORS as err:
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            # The agent's SIGTERM (sent once another worker has exited) must not end the
            # worker that _first_to_fail chose between choosing and printing; it exits in
            # milliseconds anyway. Not outside torchrun: main also runs inside tests.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _report(err, _first_to_fail(os.environ.get("LOCAL_RANK", rank) == "0"))
        return 2
    # Imported after the pre-flight: the loop pulls in megatron-core (seconds) that a run
    # stopped by it never needs.
    from parallel.topology import destroy_distributed
    from training.loop import pretrain
    from training.step import TrainingError

    # Every rank fails alike from here on (the same check, or the same step); one line for
    # the run: the first worker to fail on the first node (the agent may end rank 0 first).
    first_node = os.environ.get("GROUP_RANK", "0") == "0"
    try:
        pretrain(cfg, family=family, plan=plan)
    except PREFLIGHT_ERRORS as err:  # bad input found later (e.g. while loading)
        _report(err, first_node and _first_to_fail(rank == "0"))
        destroy_distributed(together=False)
        return 2
    except TrainingError as err:  # raised on every rank at the same step
        _report(err, first_node and _first_to_fail(rank == "0"))
        destroy_distributed(together=False)
        return 1
    destroy_distributed()
    return 0

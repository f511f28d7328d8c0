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
    # node (its local rank 0), so a node that alone lacks a file still says so.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        cfg, plan = check_run(args.config, args.overrides, family, world)
    except PREFLIGHT_ERRORS as err:
        _report(err, os.environ.get("LOCAL_RANK", rank) == "0")
        return 2
    # Imported after the pre-flight: the loop pulls in megatron-core (seconds) that a run
    # stopped by it never needs.
    from parallel.topology import destroy_distributed
    from training.loop import pretrain
    from training.step import TrainingError

    try:
        pretrain(cfg, family=family, plan=plan)
    except PREFLIGHT_ERRORS as err:  # bad input found later (e.g. while loading)
        # Every rank hits the same check; one line from rank 0 is enough.
        _report(err, rank == "0")
        destroy_distributed(together=False)
        return 2
    except TrainingError as err:  # raised on every rank at the same step
        _report(err, rank == "0")
        destroy_distributed(together=False)
        return 1
    destroy_distributed()
    return 0

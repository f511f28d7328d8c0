"""The body of every ``pretrain_<family>.py`` entry point: parse, load the strict config, train.

A bad config or layout prints one line naming the culprit and exits 2 before anything is
written; the entry points differ only in the model family they name.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

__all__ = ["main"]


def main(family: str, argv: list[str] | None = None, description: str = "") -> int:
    parser = argparse.ArgumentParser(description=description or f"Pretrain a {family} model")
    parser.add_argument("--config", required=True, help="YAML config file (see docs/CONFIG.md)")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    args = parser.parse_args(argv)

    # megatron-core warns at import that TE/apex are absent; we use neither on purpose.
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
    from parallel.topology import TopologyError, destroy_distributed
    from training.checkpointing import CheckpointError
    from training.config import ConfigError, load_config
    from training.loop import TrainingError, pretrain

    rank = os.environ.get("RANK", "0")
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a torchrun worker: stop when the agent dies
        from training.run_lock import die_with_parent

        die_with_parent()
    try:
        cfg = load_config(args.config, args.overrides, family)
        pretrain(cfg, family=family)
    except (ConfigError, TopologyError, CheckpointError) as err:
        # Every rank hits the same check; one line from rank 0 is enough.
        if rank == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        destroy_distributed(together=False)
        return 2
    except TrainingError as err:  # raised on every rank at the same step
        if rank == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        destroy_distributed(together=False)
        return 1
    destroy_distributed()
    return 0

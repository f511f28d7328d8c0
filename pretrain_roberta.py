"""Pretrain a RoBERTa encoder (masked LM):
``torchrun --nproc_per_node N pretrain_roberta.py --config X.yaml [key=value ...]``.

Thin entry point: the RoBERTa family (families/roberta.py) through training/entry_point.py.
"""

from __future__ import annotations

import sys

from training.entry_point import main

if __name__ == "__main__":
    sys.exit(main("roberta", description=__doc__.splitlines()[0]))

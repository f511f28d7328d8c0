"""Pretrain a GPT: ``torchrun --nproc_per_node N pretrain_gpt.py --config X.yaml [key=value ...]``.

Thin entry point: the GPT family (families/gpt.py) through training/entry_point.py.
"""

from __future__ import annotations

import sys

from training.entry_point import main

if __name__ == "__main__":
    sys.exit(main("gpt", description=__doc__.splitlines()[0]))

"""Pretrain a Vision Transformer (image classification):
``torchrun --nproc_per_node N pretrain_vit.py --config X.yaml [key=value ...]``.

Thin entry point: the ViT family (families/vit.py) through training/entry_point.py.
"""

from __future__ import annotations

import sys

from training.entry_point import main

if __name__ == "__main__":
    sys.exit(main("vit", description=__doc__.splitlines()[0]))

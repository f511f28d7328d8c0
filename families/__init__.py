"""Model families: each is one module behind ``ModelFamily`` (builder, data, batch, loss,
FLOPs, metric names, checkpoint structure), registered by name. training/ asks the registry
for a family and calls only the interface, so a new family needs no edit there.

    from families import get_family
    gpt = get_family("gpt")

``load_pretrained(path)``: a single-process model in eval mode from a native checkpoint (any
layout, any level, dequantized to FP32) or a Hugging Face directory (families/pretrained.py).
"""

from __future__ import annotations

from families.base import (
    DEFAULT_FAMILY,
    HFImport,
    LossSums,
    ModelFamily,
    checkpoint_family,
    family_for_hf,
    family_names,
    get_family,
    register_family,
)
from families.pretrained import load_pretrained

__all__ = [
    "DEFAULT_FAMILY",
    "HFImport",
    "LossSums",
    "ModelFamily",
    "checkpoint_family",
    "family_for_hf",
    "family_names",
    "get_family",
    "load_pretrained",
    "register_family",
]

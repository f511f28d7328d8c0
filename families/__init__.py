"""Model families: each is one module behind ``ModelFamily`` (builder, data, batch, loss,
FLOPs, metric names, checkpoint structure), registered by name. training/ asks the registry
for a family and calls only the interface, so a new family needs no edit there.

    from families import get_family
    gpt = get_family("gpt")
"""

from __future__ import annotations

from families.base import (
    DEFAULT_FAMILY,
    HFImport,
    LossSums,
    ModelFamily,
    family_for_hf,
    family_names,
    get_family,
    register_family,
)

__all__ = [
    "DEFAULT_FAMILY",
    "HFImport",
    "LossSums",
    "ModelFamily",
    "family_for_hf",
    "family_names",
    "get_family",
    "register_family",
]

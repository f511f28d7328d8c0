"""Random streams keyed by what they are for, so that datasets are resume-exact.

A dataset draws every random choice (an epoch's order, a sample's mask or crop) from a numpy
Generator seeded by ``(seed, part, tag, index)`` alone: the same key gives the same stream in
any process, after any other reads, and different keys give independent streams. No global
RNG is touched.
"""

from __future__ import annotations

import numpy as np

__all__ = ["keyed_rng"]


def keyed_rng(seed: int, part: int, tag: int, index: int) -> np.random.Generator:
    """The Generator of key ``(seed, part, tag, index)`` (each in ``[0, 2**32)``, index up to
    ``2**64``)."""
    # Fixed-length 32-bit words: SeedSequence treats trailing zero words and multi-word ints
    # ambiguously, a fixed layout keeps every key its own stream.
    words = np.array([seed, part, tag, index >> 32, index & 0xFFFFFFFF], dtype=np.uint32)
    return np.random.default_rng(np.random.SeedSequence(words))

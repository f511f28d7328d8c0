"""Key/value cache for incremental decoding of a single-process decoder (``GPTModel``).

Generating token n+1 from scratch reruns the whole prefix through every layer; with the keys
and values of the prefix kept, each step runs only the new tokens and attends over the stored
prefix. One ``LayerKVCache`` per transformer layer holds ``[batch, query groups, max_length,
head_dim]`` buffers (the groups, not the query heads: grouped-query attention stores each
shared k/v head once), allocated at the first append with the dtype and device of the
layer's own keys, so the cache follows whatever precision the model runs at.

Inference only: ``GPTModel`` runs the cached path under ``torch.no_grad`` (appending in place
would invalidate tensors an earlier step saved for backward).
"""

from __future__ import annotations

import torch

__all__ = ["KVCache", "LayerKVCache"]


class LayerKVCache:
    """One layer's keys and values; ``length`` positions are filled."""

    def __init__(self, max_length: int):
        if max_length < 1:
            raise ValueError(f"KV cache max_length={max_length}: must be >= 1")
        self.max_length = max_length
        self.length = 0
        self.keys: torch.Tensor | None = None  # [b, G, max_length, d] once allocated
        self.values: torch.Tensor | None = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' ``k``/``v`` ``[b, G, s, d]`` after the cached ones; returns
        the keys and values of every position so far, ``[b, G, length + s, d]`` (views)."""
        b, g, s, d = k.shape
        end = self.length + s
        if end > self.max_length:
            raise ValueError(
                f"KV cache full: {self.length} cached + {s} new tokens > max_length "
                f"{self.max_length}"
            )
        if self.keys is None:
            shape = (b, g, self.max_length, d)
            self.keys = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.values = torch.empty(shape, dtype=v.dtype, device=v.device)
        elif (b, g, d) != (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3]):
            raise ValueError(
                f"KV cache holds [batch, groups, head_dim] = {self.keys.shape[0]}, "
                f"{self.keys.shape[1]}, {self.keys.shape[3]}; got {b}, {g}, {d}"
            )
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """The caches of all ``num_layers`` layers of one model, for sequences of up to
    ``max_length`` tokens (prompt and generated together). Every sequence of the batch has the
    same length: there is no padding. Get one from ``GPTModel.new_kv_cache``."""

    def __init__(self, num_layers: int, max_length: int):
        self.layers = [LayerKVCache(max_length) for _ in range(num_layers)]
        self.max_length = max_length

    @property
    def length(self) -> int:
        """Positions cached so far (the position id of the next token)."""
        return self.layers[0].length if self.layers else 0

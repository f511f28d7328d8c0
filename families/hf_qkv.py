"""Query/key/value layout between Hugging Face encoders and the shared blocks.

Hugging Face BERT-style models (RoBERTa, ViT) keep ``query``, ``key`` and ``value`` as three
``[heads * d, ...]`` tensors; models/transformer.py fuses them into one ``qkv`` tensor grouped
per head (``[q_0, k_0, v_0, q_1, k_1, v_1, ...]``, each ``d`` rows), so that a tensor-parallel
split of whole heads is a contiguous block of rows. Both directions, for weights and biases.
"""

from __future__ import annotations

import torch

__all__ = ["fuse_qkv", "split_qkv"]


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """Three ``[heads * d, ...]`` tensors -> the fused ``[3 * heads * d, ...]`` per-head one."""
    d = q.shape[0] // heads
    parts = [t.reshape(heads, d, *t.shape[1:]) for t in (q, k, v)]
    return torch.stack(parts, 1).reshape(3 * heads * d, *q.shape[1:])


def split_qkv(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``fuse_qkv``: ``(q, k, v)``, each ``[heads * d, ...]``."""
    d = qkv.shape[0] // (3 * heads)
    q, k, v = qkv.reshape(heads, 3, d, *qkv.shape[1:]).unbind(1)
    return tuple(t.reshape(heads * d, *t.shape[2:]) for t in (q, k, v))

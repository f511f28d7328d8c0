"""Models on shared transformer blocks. No torch.distributed calls here: a model is handed its
tensor-parallel group and builds on parallel/'s layers, which do the communicating. Loading a
model from a checkpoint needs its family: ``families.load_pretrained``."""

from __future__ import annotations

from models.gpt import GPTConfig, GPTModel, pad_vocab_size
from models.transformer import TransformerConfig, TransformerLayer

__all__ = [
    "GPTConfig",
    "GPTModel",
    "TransformerConfig",
    "TransformerLayer",
    "pad_vocab_size",
]

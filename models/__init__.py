"""Models on shared transformer blocks. No torch.distributed here: parallelism wraps these."""

from __future__ import annotations

from models.gpt import GPTConfig, GPTModel, pad_vocab_size
from models.transformer import TransformerConfig, TransformerLayer

__all__ = ["GPTConfig", "GPTModel", "TransformerConfig", "TransformerLayer", "pad_vocab_size"]

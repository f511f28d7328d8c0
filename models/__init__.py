"""Models on shared transformer blocks. No torch.distributed calls here: a model is handed its
tensor-parallel group and builds on parallel/'s layers, which do the communicating."""

from __future__ import annotations

from models.gpt import GPTConfig, GPTModel, pad_vocab_size
from models.transformer import TransformerConfig, TransformerLayer

__all__ = [
    "GPTConfig",
    "GPTModel",
    "TransformerConfig",
    "TransformerLayer",
    "load_pretrained",
    "pad_vocab_size",
]


def load_pretrained(path, device="cpu"):
    """A single-process model in eval mode from a native checkpoint (any layout, any level,
    dequantized to FP32) or a Hugging Face directory: ``[batch, seq]`` token ids give
    ``[batch, seq, vocab]`` logits (GPT, RoBERTa), ``[batch, channels, height, width]`` images
    ``[batch, classes]`` logits (ViT).

    The one place models/ reaches up: reading a checkpoint needs its family's adapter
    (families/pretrained.py), so the import happens at call time; no module of models/
    imports families.
    """
    from families.pretrained import load_pretrained as load

    return load(path, device)

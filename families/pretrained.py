"""One model from any checkpoint, for inference: ``load_pretrained``.

A native checkpoint (any parallel layout, any precision level) is read through the canonical
format (``ModelFamily.checkpoint_model``: full tensors, scaled FP16/FP8 storage dequantized to
FP32); a Hugging Face directory through its family's adapter (``ModelFamily.import_hf``).
Either way the model is built once, single-process, with plain FP32 linears, and loaded
strictly: a tensor the model lacks, or one it misses, raises naming it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from families.base import ModelFamily, checkpoint_family, family_for_hf_directory

__all__ = ["LogitsOf", "load_pretrained", "read_pretrained"]


def read_pretrained(path: str | Path) -> tuple[ModelFamily, object, dict[str, torch.Tensor]]:
    """``(family, model config, single-process tensors)`` of a native checkpoint (an
    ``iter_*`` directory, or a checkpoints directory with ``latest``) or a Hugging Face
    directory (``config.json`` + safetensors). FP8 scaling state is left out; a damaged
    checkpoint raises naming its file (``ModelFamily.checkpoint_model``)."""
    from checkpoint.store import read_metadata, resolve_checkpoint

    path = Path(path)
    if (path / "config.json").exists():
        family = family_for_hf_directory(path)
        imported = family.import_hf(path)
        return family, imported.config, imported.tensors
    checkpoint = resolve_checkpoint(path)
    family = checkpoint_family(read_metadata(checkpoint))
    _, config, tensors = family.checkpoint_model(checkpoint)
    return family, config, tensors


def load_pretrained(path: str | Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """A single-process model in eval mode, FP32, on ``device``, from ``path`` (see
    ``read_pretrained``). GPT and RoBERTa map ``[batch, seq]`` token ids to ``[batch, seq,
    padded vocab]`` logits; ViT ``[batch, channels, height, width]`` images to ``[batch,
    classes]`` logits."""
    from models.context import BuildContext
    from parallel.pipeline.layout import PipelineLayout

    family, config, tensors = read_pretrained(path)
    model = family.build_model(config, BuildContext(), PipelineLayout(config.num_layers, 1, 1, 0))
    model.load_canonical_state_dict(tensors)
    if family.logits_output is not None:
        model = LogitsOf(model, family.logits_output)
    return model.to(device).eval()


class LogitsOf(torch.nn.Module):
    """A model whose forward returns a dict, as one returning the entry ``key`` (the
    logits): ``model`` and its ``config`` stay reachable."""

    def __init__(self, model: torch.nn.Module, key: str):
        super().__init__()
        self.model, self.key = model, key

    @property
    def config(self):
        return self.model.config

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.model(*args, **kwargs)[self.key]

"""The ViT family: image classification with ``models.vit.ViTModel``.

Data: ``data.image_data`` (the bundled digits by default, an image folder or a packed set),
split per class, seeded resume-exact augmentation; normalisation statistics measured on the
training images unless ``data.mean``/``data.std`` are given. Loss: the cross entropy of the
class-token logits, averaged over the images (``loss``), and the share of images classified
right (``accuracy``).

FLOPs per step (forward + backward, Megatron's 6x rule per GEMM), with N patches, s = N + 1
tokens, C p^2 values per patch and K classes:
``6 B [s L (h(q+2kv) + 2 q s + q h + 2 h f) + N C p^2 h + h K]``: the blocks with
bidirectional attention (``layer_flops_per_step(causal=False)``), the patch embedding and the
classifier. Sequence-parallel padding rows are not counted (they are not model work).

Hugging Face ``ViTForImageClassification`` import and export: families/vit_hf.py
(``ViTFamily.hf_adapter``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from families.base import LossSums, ModelFamily
from families.config_fields import doc_field
from families.data_sections import ImageDataSection
from families.sections import TransformerSection
from families.vit_hf import ViTHFAdapter
from models.transformer import ACTIVATIONS
from models.vit import ViTConfig, ViTModel

__all__ = ["ViTData", "ViTFamily", "ViTModelSection"]


@dataclass(frozen=True)
class ViTModelSection(TransformerSection):
    """The ``model`` section of a ViT run: the blocks' keys (pre-LN, exact GELU) and the
    image geometry. The classes and channels come from the data."""

    FAMILY: ClassVar[str] = "vit"

    image_size: int = doc_field(224, "Input images are image_size x image_size pixels.", ge=1)
    patch_size: int = doc_field(16, "Square patch side; divides image_size.", ge=1)
    activation: Literal[ACTIVATIONS] = doc_field(
        "gelu_exact", "MLP activation: gelu_exact (erf, ViT), gelu (tanh) or swiglu."
    )
    norm_epsilon: float = doc_field(1e-6, "Epsilon of the norm layers.", gt=0)

    def build_config(self, num_classes: int = 2, num_channels: int = 3) -> ViTConfig:
        return ViTConfig.from_model_section(
            self, num_classes=num_classes, num_channels=num_channels
        )


@dataclass
class ViTData:
    """What ``prepare_data`` found: the sources, the class names and the normalisation."""

    source: Any
    valid_source: Any
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def classes(self) -> list[str]:
        return list(self.source.classes)


def _source(kind: str, path: str | None, channels: int):
    from data.image_data import digits_source, folder_source, packed_source

    if kind == "digits":
        return digits_source()
    if kind == "folder":
        return folder_source(path, channels=channels)
    return packed_source(path)


def _keyed(key: str, open_source, *args):
    """``open_source(*args)``; its error as a ValueError starting with ``key``."""
    try:
        return open_source(*args)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"{key}: {err}") from None


def _check_channel_values(mean, std, channels: int) -> None:
    for key, values in (("data.mean", mean), ("data.std", std)):
        if values is not None and len(values) not in (1, channels):
            raise ValueError(f"{key} has {len(values)} values; the images have {channels} channels")


def _model_config(cfg, classes, channels: int) -> ViTConfig:
    return cfg.model.resolved(num_classes=len(classes), num_channels=channels)


class ViTFamily(ModelFamily):
    name = "vit"
    model_section = ViTModelSection
    data_section = ImageDataSection
    metric_names = ("loss", "accuracy")
    sample_unit = "images"

    def preflight(self, cfg) -> ViTConfig:
        """The sources' roots, class folders or packed index (no image decoded) and the
        given normalisation statistics' lengths."""
        from data.image_data import check_source

        d = cfg.data
        classes, channels = _keyed("data.path", check_source, d.dataset, d.path, d.channels)
        if d.valid_path is not None:
            _keyed("data.valid_path", check_source, d.dataset, d.valid_path, d.channels)
        _check_channel_values(d.channel_values("mean"), d.channel_values("std"), channels)
        return _model_config(cfg, classes, channels)

    def prepare_data(self, cfg, rank: int) -> ViTData:
        from data.image_data import channel_mean_std, split_indices

        d = cfg.data
        source = _keyed("data.path", _source, d.dataset, d.path, d.channels)
        valid = None
        if d.valid_path is not None:
            valid = _keyed("data.valid_path", _source, d.dataset, d.valid_path, d.channels)
        mean, std = d.channel_values("mean"), d.channel_values("std")
        if mean is None or std is None:
            # Measured on the training part only (the validation images stay unseen).
            train = split_indices(source.labels, d.split, cfg.training.seed)[0]
            m, s = channel_mean_std(source, train)
            mean = mean or tuple(float(x) for x in m)
            std = std or tuple(float(x) for x in s)
        _check_channel_values(mean, std, source.channels)
        return ViTData(source, valid, tuple(mean), tuple(std))

    def model_config(self, cfg, data: ViTData, tensor_parallel: int) -> ViTConfig:
        return _model_config(cfg, data.classes, data.source.channels)

    def planned_model_config(self, cfg, tensor_parallel: int) -> ViTConfig:
        return self.preflight(cfg)  # the sources' classes and channels: no image decoded

    def example_batch(self, config: ViTConfig, micro_batch_size: int) -> dict:
        c, size = config.num_channels, config.image_size
        return {
            "images": torch.zeros(micro_batch_size, c, size, size),
            "labels": torch.zeros(micro_batch_size, dtype=torch.int64),
        }

    def build_model(self, config: ViTConfig, ctx, pipeline) -> ViTModel:
        return ViTModel(config, ctx, pipeline)

    def build_datasets(self, cfg, data: ViTData, train_samples: int, valid_samples: int):
        from data.image_data import build_image_datasets

        d = cfg.data
        return build_image_datasets(
            data.source,
            split=d.split,
            seed=cfg.training.seed,
            image_size=cfg.model.image_size,
            train_samples=train_samples,
            valid_samples=valid_samples,
            mean=data.mean,
            std=data.std,
            crop_scale=(d.crop_scale_min, 1.0),
            hflip=d.hflip,
            crop_ratio=d.crop_ratio,
            valid_source=data.valid_source,
        )

    def loader_workers(self, cfg) -> int:
        return cfg.data.num_workers

    logits_output = "logits"
    hf_adapter = ViTHFAdapter()
    hf_model_types = ViTHFAdapter.model_types

    def config_from_checkpoint(self, metadata: dict) -> ViTConfig:
        structure = metadata["model_structure"]
        section = ViTModelSection(**metadata["config"]["model"])
        return section.resolved(
            num_classes=structure["num_classes"], num_channels=structure["num_channels"]
        )

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"images": batch["images"]}

    def loss(self, output: dict, batch: dict) -> tuple[torch.Tensor, LossSums]:
        logits, labels = output["logits"].float(), batch["labels"]
        total = F.cross_entropy(logits, labels, reduction="sum")
        right = (logits.detach().argmax(-1) == labels).float().sum()
        n = labels.numel()
        return total / n, {"loss": (total, n), "accuracy": (right, n)}

    def flops_per_step(self, config: ViTConfig, global_batch_size: int) -> float:
        b, h = global_batch_size, config.hidden_size
        blocks = config.layer_flops_per_step(b, config.seq_length, causal=False)
        embed = 6.0 * b * config.num_patches * config.patch_dim * h
        return blocks + embed + 6.0 * b * h * config.num_classes

    def checkpoint_structure(self, config: ViTConfig, data: ViTData | None = None) -> dict:
        return {
            "family": self.name,
            "fused": config.fused_tensors(),
            "image_size": config.image_size,
            "patch_size": config.patch_size,
            "num_channels": config.num_channels,
            "num_classes": config.num_classes,
            "classes": data.classes if data is not None else None,
            "mean": list(data.mean) if data is not None else None,
            "std": list(data.std) if data is not None else None,
        }

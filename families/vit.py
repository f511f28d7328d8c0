"""The ViT family: image classification with ``models.vit.ViTModel``, and its Hugging Face
state-dict adapter.

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

``ViTForImageClassification`` checkpoints (``config.json`` + ``model.safetensors``) map onto the
single-process names in both directions: Hugging Face's ``Conv2d`` patch projection
``[h, C, p, p]`` is ``patch_embedding.weight`` ``[h, C p^2]`` (same values, flattened), its
``cls_token`` ``[1, 1, h]`` and ``position_embeddings`` ``[1, s, h]`` drop the leading ones, and
Q, K, V are fused per head (families/hf_qkv.py). Importing at another ``image_size``
interpolates the position embeddings (``models.vit.interpolate_position_embeddings``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from families.base import (
    HFImport,
    LossSums,
    ModelFamily,
    encoder_fields_from_hf,
    read_hf_config,
    section_values,
)
from families.config_fields import doc_field
from families.data_sections import ImageDataSection
from families.hf_qkv import fuse_qkv, split_qkv
from families.sections import TransformerSection
from models.transformer import ACTIVATIONS
from models.vit import ViTConfig, ViTModel, interpolate_position_embeddings

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = [
    "ViTModelSection",
    "ViTFamily",
    "config_from_hf",
    "config_to_hf",
    "state_from_hf",
    "state_to_hf",
    "save_hf",
    "load_hf",
    "export_checkpoint",
]


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
    hf_model_types = ("vit",)

    def config_from_checkpoint(self, metadata: dict) -> ViTConfig:
        structure = metadata["model_structure"]
        section = ViTModelSection(**metadata["config"]["model"])
        return section.resolved(
            num_classes=structure["num_classes"], num_channels=structure["num_channels"]
        )

    def import_hf(self, directory, divisible_by: int = 128) -> HFImport:
        """``ViTForImageClassification`` (no vocabulary: ``divisible_by`` is unused); the
        class names come from its ``id2label``."""
        config, tensors = load_hf(directory)
        labels = _labels(read_hf_config(directory))
        classes = [labels.get(str(i), labels.get(i)) for i in range(config.num_classes)]
        structure = self.checkpoint_structure(config)
        structure["classes"] = classes if all(c is not None for c in classes) else None
        return HFImport(config, tensors, structure, section_values(ViTModelSection, config))

    def export_hf(self, checkpoint, directory):
        return export_checkpoint(checkpoint, directory)

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


# ---------------------------------------------------------------------------------------------
# Hugging Face ViTForImageClassification

_LAYER = {  # Hugging Face module (layer index as {i}) -> this project's single-process name
    "layernorm_before": "input_norm",
    "attention.output.dense": "attention.proj",
    "layernorm_after": "post_attention_norm",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
}
_TOP = {
    "vit.embeddings.patch_embeddings.projection.bias": "patch_embedding.bias",
    "vit.layernorm.weight": "final_norm.weight",
    "vit.layernorm.bias": "final_norm.bias",
    "classifier.weight": "classifier.weight",
    "classifier.bias": "classifier.bias",
}
_LAYER_KEY = re.compile(r"vit\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")


def _labels(hf: JsonObject) -> dict:
    return hf.need("id2label", (dict, None), None) or {}


def config_from_hf(hf: dict, **overrides) -> ViTConfig:
    """A ``ViTConfig`` from a Hugging Face ``config.json`` dict. A key it needs and the dict
    lacks, or a value of the wrong type, raises ``CheckpointError`` naming the file and the
    key."""
    from checkpoint.format import JsonObject  # the format reader: no model code

    hf = JsonObject.wrap(hf, "config.json")
    if not hf.need("qkv_bias", bool, True):
        raise ValueError(f"{hf.file} qkv_bias=false: this project's ViT has QKV biases")
    fields = dict(
        **encoder_fields_from_hf(hf, dropout=0.0, why="a ViT config needs it"),
        image_size=hf.need("image_size", int, 224),
        patch_size=hf.need("patch_size", int, 16),
        num_channels=hf.need("num_channels", int, 3),
        num_classes=hf.need("num_labels", (int, None), None) or len(_labels(hf)) or 2,
    )
    fields.update(overrides)
    return ViTConfig(**fields)


def config_to_hf(config: ViTConfig, classes: list[str] | None = None) -> dict:
    """The ``config.json`` fields of ``ViTForImageClassification`` for this model."""
    if config.activation == "swiglu" or not config.add_bias_linear:
        raise ValueError("Hugging Face ViT has a GELU MLP and biases")
    act = "gelu" if config.activation == "gelu_exact" else "gelu_new"
    names = classes or [str(i) for i in range(config.num_classes)]
    return {
        "architectures": ["ViTForImageClassification"],
        "model_type": "vit",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.ffn_hidden_size,
        "hidden_act": act,
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "layer_norm_eps": config.norm_epsilon,
        "image_size": config.image_size,
        "patch_size": config.patch_size,
        "num_channels": config.num_channels,
        "qkv_bias": True,
        "id2label": {str(i): n for i, n in enumerate(names)},
        "label2id": {n: i for i, n in enumerate(names)},
    }


def state_from_hf(hf: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> this project's single-process parameters; the position table
    is interpolated when ``config.image_size`` gives another patch grid. Unknown keys raise
    naming the key."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, value in hf.items():
        if key in _TOP:
            out[_TOP[key]] = value
        elif key == "vit.embeddings.cls_token":
            out["class_token.weight"] = value.reshape(-1)
        elif key == "vit.embeddings.position_embeddings":
            table = value.reshape(value.shape[-2], value.shape[-1])
            out["position_embeddings.weight"] = interpolate_position_embeddings(table, config.grid)
        elif key == "vit.embeddings.patch_embeddings.projection.weight":
            out["patch_embedding.weight"] = value.reshape(value.shape[0], -1)
        elif (m := _LAYER_KEY.match(key)) is not None:
            layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
            if module.startswith("attention.attention."):
                qkv.setdefault((layer, kind), {})[module.rsplit(".", 1)[1]] = value
            elif module in _LAYER:
                out[f"layers.{layer}.{_LAYER[module]}.{kind}"] = value
            else:
                raise KeyError(f"Hugging Face tensor {key!r} has no place in ViTModel")
        else:
            raise KeyError(f"Hugging Face tensor {key!r} has no place in ViTModel")
    for (layer, kind), parts in qkv.items():
        out[f"layers.{layer}.attention.qkv.{kind}"] = fuse_qkv(
            parts["query"], parts["key"], parts["value"], config.num_attention_heads
        )
    return out


def state_to_hf(state: dict[str, torch.Tensor], config: ViTConfig) -> dict[str, torch.Tensor]:
    """Inverse of ``state_from_hf`` (at the model's own image size)."""
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_layer = {v: k for k, v in _LAYER.items()}
    c, p, h = config.num_channels, config.patch_size, config.hidden_size
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in inverse_top:
            out[inverse_top[name]] = value
        elif name == "class_token.weight":
            out["vit.embeddings.cls_token"] = value.reshape(1, 1, h)
        elif name == "position_embeddings.weight":
            out["vit.embeddings.position_embeddings"] = value.reshape(1, -1, h)
        elif name == "patch_embedding.weight":
            out["vit.embeddings.patch_embeddings.projection.weight"] = value.reshape(h, c, p, p)
        elif (m := re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", name)) is not None:
            layer, module, kind = m.groups()
            prefix = f"vit.encoder.layer.{layer}"
            if module == "attention.qkv":
                parts = split_qkv(value, config.num_attention_heads)
                for part, t in zip(("query", "key", "value"), parts):
                    out[f"{prefix}.attention.attention.{part}.{kind}"] = t
            elif module in inverse_layer:
                out[f"{prefix}.{inverse_layer[module]}.{kind}"] = value
        # anything else (FP8 scaling state) has no Hugging Face counterpart
    return {k: v.contiguous() for k, v in out.items()}


def save_hf(
    directory: str | Path, state: dict, config: ViTConfig, classes: list[str] | None = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that
    ``ViTForImageClassification.from_pretrained`` loads (FP32 values)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu() for k, v in state_to_hf(state, config).items()}
    (out / "config.json").write_text(json.dumps(config_to_hf(config, classes), indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hf(directory: str | Path, image_size: int | None = None):
    """``(ViTConfig, parameters)`` from a Hugging Face ``ViTForImageClassification``
    directory; ``image_size`` other than the checkpoint's interpolates the positions."""
    from checkpoint.format import load_safetensors  # names a damaged file

    path = Path(directory)
    hf = read_hf_config(path)
    config = config_from_hf(hf, **({"image_size": image_size} if image_size else {}))
    return config, state_from_hf(load_safetensors(path / "model.safetensors"), config)


def export_checkpoint(checkpoint: str | Path, directory: str | Path) -> Path:
    """A training checkpoint of this family (any layout, any level) as a Hugging Face
    ``ViTForImageClassification`` (full tensors from the canonical format)."""
    structure, config, params = ViTFamily().checkpoint_model(checkpoint)
    return save_hf(directory, params, config, structure.get("classes"))

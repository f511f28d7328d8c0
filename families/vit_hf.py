"""Hugging Face adapter of the ViT family (``ViTHFAdapter``): ``ViTForImageClassification``
checkpoints (``config.json`` + safetensors) <-> ``models.vit.ViTModel``'s single-process names,
in both directions. What every family's adapter shares (directories, sharded files, export,
the QKV layout) is families/hf_adapter.py's.

Layout facts: Hugging Face's ``Conv2d`` patch projection ``[h, C, p, p]`` is
``patch_embedding.weight`` ``[h, C p^2]`` (same values, flattened), its ``cls_token``
``[1, 1, h]`` and ``position_embeddings`` ``[1, s, h]`` drop the leading ones, and Q, K, V are
fused per head (``HFAdapter.fuse_qkv`` with one head per group). Importing at another
``image_size`` interpolates the position embeddings (``models.vit.interpolate_position_
embeddings``). The class names travel as ``id2label``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from families.hf_adapter import EncoderHFAdapter
from models.vit import ViTConfig, interpolate_position_embeddings

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = ["PREPROCESSOR", "ViTHFAdapter", "image_processor_config"]

PREPROCESSOR = "preprocessor_config.json"  # what AutoImageProcessor.from_pretrained reads
EVAL_CROP_RATIO = 0.875  # data.crop_ratio's default, for a checkpoint whose config lacks it

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


def image_processor_config(
    image_size: int, channels: int, mean, std, crop_ratio: float = EVAL_CROP_RATIO
) -> dict:
    """A Hugging Face ``CLIPImageProcessor`` configuration that gives the pixels this
    project's evaluation view does (data/image_data.py): the shorter side resized to
    ``image_size / crop_ratio`` (rounded half up; bilinear, as Pillow antialiases it), the
    centre ``image_size`` square cut out (a crop offset of half a pixel may round the other
    way), ``pixels / 255`` normalised by the run's per-channel ``mean`` and ``std`` (one
    value: every channel). Grayscale runs keep one channel (no RGB conversion)."""
    short = math.floor(image_size / crop_ratio + 0.5)

    def per_channel(values) -> list[float]:
        values = [float(v) for v in values]
        return values * channels if len(values) == 1 else values

    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": short},
        "resample": 2,  # PIL.Image.BILINEAR
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": per_channel(mean),
        "image_std": per_channel(std),
        "do_convert_rgb": channels == 3,
    }


def _labels(hf: JsonObject) -> dict:
    return hf.need("id2label", (dict, None), None) or {}


class ViTHFAdapter(EncoderHFAdapter):
    """``ViTForImageClassification`` <-> ``ViTModel`` (module doc). The extra fact of
    ``save``/``config_to_hf``/``state_to_hf``: ``classes``, the class names (None: "0",
    "1", ...). ``load(directory, image_size=...)`` at another image size interpolates the
    position embeddings."""

    family = "vit"
    model_types = ("vit",)
    layer_prefix = "vit.encoder.layer"
    attention_module = "attention.attention"
    layer_modules = _LAYER
    model_name = "ViTModel"

    def config_from_hf(self, hf: dict, **overrides) -> ViTConfig:
        """A ``ViTConfig`` from a Hugging Face ``config.json`` dict (``overrides``: any
        ``ViTConfig`` field, e.g. ``image_size``). Errors as ``HFAdapter.config_from_hf``'s."""
        from checkpoint.format import JsonObject  # the format reader: no model code

        hf = JsonObject.wrap(hf, "config.json")
        if not hf.need("qkv_bias", bool, True):
            raise ValueError(f"{hf.file} qkv_bias=false: this project's ViT has QKV biases")
        fields = dict(
            **self.encoder_fields_from_hf(hf, dropout=0.0, why="a ViT config needs it"),
            image_size=hf.need("image_size", int, 224),
            patch_size=hf.need("patch_size", int, 16),
            num_channels=hf.need("num_channels", int, 3),
            num_classes=hf.need("num_labels", (int, None), None) or len(_labels(hf)) or 2,
        )
        fields.update(overrides)
        return ViTConfig(**fields)

    def config_to_hf(self, config: ViTConfig, classes: list[str] | None = None) -> dict:
        """The ``config.json`` fields of ``ViTForImageClassification`` for this model."""
        if config.activation == "swiglu" or not config.add_bias_linear:
            raise ValueError("Hugging Face ViT has a GELU MLP and biases")
        names = classes or [str(i) for i in range(config.num_classes)]
        return {
            "architectures": ["ViTForImageClassification"],
            "model_type": "vit",
            **self.encoder_fields_to_hf(config),
            "image_size": config.image_size,
            "patch_size": config.patch_size,
            "num_channels": config.num_channels,
            "qkv_bias": True,
            "id2label": {str(i): n for i, n in enumerate(names)},
            "label2id": {n: i for i, n in enumerate(names)},
        }

    def state_from_hf(self, hf: dict[str, torch.Tensor], config: ViTConfig) -> dict:
        """Hugging Face tensors -> this project's single-process parameters; the position
        table is interpolated when ``config.image_size`` gives another patch grid. Unknown
        keys raise naming the key."""
        out, rest = self.layers_from_hf(hf, config.num_attention_heads)
        for key, value in rest.items():
            if key in _TOP:
                out[_TOP[key]] = value
            elif key == "vit.embeddings.cls_token":
                out["class_token.weight"] = value.reshape(-1)
            elif key == "vit.embeddings.position_embeddings":
                table = value.reshape(value.shape[-2], value.shape[-1])
                out["position_embeddings.weight"] = interpolate_position_embeddings(
                    table, config.grid
                )
            elif key == "vit.embeddings.patch_embeddings.projection.weight":
                out["patch_embedding.weight"] = value.reshape(value.shape[0], -1)
            else:
                raise self.no_place(key)
        return out

    def state_to_hf(
        self,
        state: dict[str, torch.Tensor],
        config: ViTConfig,
        classes: list[str] | None = None,  # the config's only (save passes every extra fact)
    ) -> dict[str, torch.Tensor]:
        """Inverse of ``state_from_hf`` (at the model's own image size); FP8 scaling state
        has no Hugging Face counterpart and is left out."""
        out, rest = self.layers_to_hf(state, config.num_attention_heads)
        inverse_top = {v: k for k, v in _TOP.items()}
        c, p, h = config.num_channels, config.patch_size, config.hidden_size
        for name, value in rest.items():
            if name in inverse_top:
                out[inverse_top[name]] = value
            elif name == "class_token.weight":
                out["vit.embeddings.cls_token"] = value.reshape(1, 1, h)
            elif name == "position_embeddings.weight":
                out["vit.embeddings.position_embeddings"] = value.reshape(1, -1, h)
            elif name == "patch_embedding.weight":
                out["vit.embeddings.patch_embeddings.projection.weight"] = value.reshape(h, c, p, p)
        return {k: v.contiguous() for k, v in out.items()}

    def import_config(self, hf: JsonObject, divisible_by: int) -> tuple[ViTConfig, dict]:
        """No vocabulary (``divisible_by`` is unused); the fact: the class names from
        ``id2label`` (None unless it names every class)."""
        config = self.config_from_hf(hf)
        labels = _labels(hf)
        classes = [labels.get(str(i), labels.get(i)) for i in range(config.num_classes)]
        return config, {"classes": classes if all(c is not None for c in classes) else None}

    def export_extra(self, structure: JsonObject) -> dict:
        return {"classes": structure.get("classes")}

    inputs = "image processor"

    def write_inputs(self, metadata: JsonObject, directory: Path) -> str | None:
        """``preprocessor_config.json`` (``image_processor_config``) from the run's image size,
        channels and normalisation statistics, unless the export already holds one (an
        import's own, carried through); a checkpoint without statistics (an import from a
        directory without a processor) gets none, and the line says why."""
        path = Path(directory) / PREPROCESSOR
        if path.exists():
            return None
        structure = metadata["model_structure"]
        mean, std = structure.get("mean"), structure.get("std")
        if mean is None or std is None:
            return (
                f"{self.inputs}: none written (the checkpoint records no normalisation "
                "statistics: it was imported from a directory without a preprocessor_config.json)"
            )
        size, channels = structure["image_size"], structure["num_channels"]
        data = (metadata.get("config") or {}).get("data") or {}
        crop = data.get("crop_ratio", EVAL_CROP_RATIO)
        config = image_processor_config(size, channels, mean, std, crop)
        path.write_text(json.dumps(config, indent=2) + "\n")
        short = config["size"]["shortest_edge"]
        return (
            f"{self.inputs}: {PREPROCESSOR} (CLIPImageProcessor: shorter side to {short}, centre "
            f"{size}x{size}, mean {config['image_mean']}, std {config['image_std']}: the run's "
            "evaluation view)"
        )

"""Vision Transformer (ViT) for image classification, on the shared transformer blocks.

Embeddings: the image is cut into ``patch_size`` x ``patch_size`` patches in row-major grid
order, each flattened channel-first (``[c, row, col]``, the layout of a stride-``p``
convolution's weight, so ``patch_embedding`` equals Hugging Face's ``Conv2d`` projection), and
mapped by ``patch_embedding`` (``C p^2 -> h``). A learned ``class_token`` is prepended and learned
``position_embeddings`` (``num_patches + 1`` rows, the class token's first) are added; then
dropout. Blocks: pre-LN, bidirectional (``causal=False``), exact GELU by default (ViT's).
Head: ``final_norm`` (LayerNorm) on the class token, then ``classifier`` (``h -> classes``).

Precision: every transformer GEMM (QKV, attention projection, fc1, fc2) goes through
``fp8train.linear.Linear`` with the recipe. ``patch_embedding`` and ``classifier`` are built with
``recipe=None`` and stay in higher precision at every level: the patch embedding reads raw,
normalised pixels (its input has no amax history worth trusting at step 0, and it is
``C p^2 / (24 h)`` of a layer's GEMM work: 0.2% for ViT-B/16), and the classifier feeds the
softmax directly, like GPT's output head. The class token, position embeddings and norms follow
the precision table (higher precision).

Tensor parallelism: the embeddings, ``final_norm`` and ``classifier`` are replicated. Under
sequence parallelism the token sequence (``num_patches + 1``, odd for square grids) is padded
with zero rows to a multiple of the TP size; padded positions are masked out as attention keys,
so the real positions compute exactly what one process computes. The last stage gathers the
sequence before the head (``gather_from_region``), so every rank's head gradient is whole.

Position embeddings for another image size (``interpolate_position_embeddings``): the patch
rows are resized on their 2-D grid with bicubic interpolation (the class token's row is kept),
as timm and Hugging Face do when fine-tuning at a new resolution.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from fp8train.linear import Linear
from models.base import LayerDict, ParallelModel
from models.context import BuildContext
from models.transformer import (
    DEFAULT_LAYER_SPEC,
    LayerNorm,
    LayerSpec,
    TransformerConfig,
    TransformerLayer,
    init_parameter_,
)
from parallel.tensor_parallel.mappings import gather_from_region, scatter_to_region

__all__ = ["ViTConfig", "ViTModel", "interpolate_position_embeddings", "patchify"]


@dataclass(kw_only=True)
class ViTConfig(TransformerConfig):
    """ViT shape; field names equal the config file's ``model.*`` keys.

    ``num_classes`` and ``num_channels`` come from the data set (given by the family).
    """

    image_size: int
    patch_size: int
    num_classes: int
    num_channels: int = 3
    activation: str = "gelu_exact"
    norm_position: str = "pre"

    def __post_init__(self):
        super().__post_init__()
        for name in ("image_size", "patch_size", "num_classes", "num_channels"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 1")
        if self.image_size % self.patch_size:
            raise ValueError(
                f"model.image_size ({self.image_size}) must be a multiple of model.patch_size "
                f"({self.patch_size})"
            )
        if self.norm_position != "pre":
            raise ValueError("model.norm_position: ViT is pre-LN (a final norm on the output)")

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid

    @property
    def seq_length(self) -> int:
        """Tokens per image: the patches and the class token."""
        return self.num_patches + 1

    @property
    def patch_dim(self) -> int:
        return self.num_channels * self.patch_size * self.patch_size


def patchify(images: torch.Tensor, patch_size: int) -> torch.Tensor:
    """``[b, C, H, W]`` -> ``[b, (H/p)(W/p), C p p]``: patches in row-major grid order, each
    flattened as ``[c, row, col]`` (a stride-p convolution's weight layout)."""
    b, c, h, w = images.shape
    p = patch_size
    if h % p or w % p:
        raise ValueError(f"image {h}x{w} is not a whole number of {p}x{p} patches")
    x = images.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // p) * (w // p), c * p * p)


def interpolate_position_embeddings(table: torch.Tensor, grid: int) -> torch.Tensor:
    """``[1 + g^2, h]`` position rows (class token first) resized to a ``grid`` x ``grid``
    patch grid by bicubic interpolation; the class token's row is kept."""
    old = math.isqrt(table.shape[0] - 1)
    if old * old != table.shape[0] - 1:
        raise ValueError(f"{table.shape[0] - 1} patch positions are not a square grid")
    if old == grid:
        return table
    cls, patches = table[:1], table[1:]
    h = table.shape[1]
    x = patches.float().reshape(1, old, old, h).permute(0, 3, 1, 2)  # [1, h, g, g]
    x = F.interpolate(x, size=(grid, grid), mode="bicubic", align_corners=False)
    x = x.permute(0, 2, 3, 1).reshape(grid * grid, h).to(table.dtype)
    return torch.cat([cls, x])


class ViTModel(ParallelModel):
    """``forward_chunk`` inputs: ``images`` ``[b, C, H, W]`` float (normalised pixels) and
    optional ``labels`` ``[b]``. The last chunk returns ``{"logits": [b, classes] float32}``.

    Names: ``patch_embedding``, ``class_token``, ``position_embeddings`` (first stage);
    ``layers.{i}`` (global index); ``final_norm``, ``classifier`` (last stage).
    """

    # The blocks' attention and MLP classes. A class attribute, not a constructor argument:
    # the single-process reference of a split model is rebuilt through ``(config, ctx,
    # pipeline)`` alone (models.base), so a variant is a subclass that overrides this.
    layer_spec: ClassVar[LayerSpec] = DEFAULT_LAYER_SPEC

    def __init__(self, config: ViTConfig, ctx: BuildContext | None = None, pipeline=None):
        ctx = ctx or BuildContext()
        tp = ctx.tp if ctx.sequence_parallel else 1
        # The sequence is padded to a multiple of the TP size under SP (module doc).
        self.padded_seq_length = -(-config.seq_length // tp) * tp
        ctx.check_sequence_split(self.padded_seq_length)
        super().__init__(config, ctx, pipeline)

    def build(self, ctx: BuildContext) -> None:
        cfg, device, stage = self.config, ctx.device, self.pipeline
        h = cfg.hidden_size
        if stage.has_embedding():
            # recipe=None: stays in higher precision (module doc).
            self.patch_embedding = Linear(cfg.patch_dim, h, recipe=None, device=device)
            self.class_token = ClassToken(h, device=device)
            self.position_embeddings = nn.Embedding(cfg.seq_length, h, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        spec = self.layer_spec
        self.layers = LayerDict(
            (str(i), TransformerLayer(cfg, ctx, causal=False, recompute=cfg.recompute, spec=spec))
            for i in stage.local_layers()
        )
        if stage.has_head():
            self.final_norm = LayerNorm(h, eps=cfg.norm_epsilon, device=device)
            self.classifier = Linear(h, cfg.num_classes, recipe=None, device=device)

    def init_parameter(self, module_name, module, param_name, tensor) -> None:
        """Megatron's init (``models.transformer.init_parameter_``); the class token N(0, std)
        like the position rows."""
        cfg = self.config
        if isinstance(module, ClassToken):
            nn.init.normal_(tensor, 0.0, cfg.init_method_std)
            return
        init_parameter_(
            module_name, module, param_name, tensor, cfg.init_method_std, cfg.num_layers
        )

    def pipeline_copies(self) -> dict[str, bool]:
        return {}  # nothing is tied across stages

    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        seq = self.padded_seq_length // (self.ctx.tp if self.sequence_parallel else 1)
        return (micro_batch_size, seq, self.config.hidden_size)

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        """The whole model (one stage): ``forward_chunk(0, None, {"images": images})``."""
        if self.pipeline.is_split:
            raise RuntimeError("this ViTModel is one pipeline stage: use forward_chunk")
        return self.forward_chunk(0, None, {"images": images})

    def forward_chunk(self, chunk: int, hidden: torch.Tensor | None, inputs: dict):
        stage = self.pipeline
        if stage.has_embedding(chunk):
            hidden = self._embed(inputs["images"])
        mask = self._key_mask(hidden.device)
        for i in stage.chunk_layers(chunk):
            hidden = self.layers[i](hidden, None, mask)  # [b, s(/tp), h]
        if not stage.has_head(chunk):
            return hidden
        return self._head(hidden)

    def _key_mask(self, device: torch.device) -> torch.Tensor | None:
        """``[1, 1, 1, s]``: True at the real tokens; None when nothing is padded."""
        s, real = self.padded_seq_length, self.config.seq_length
        if s == real:
            return None
        return (torch.arange(s, device=device) < real)[None, None, None, :]

    def _embed(self, images: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        if tuple(images.shape[1:]) != (cfg.num_channels, cfg.image_size, cfg.image_size):
            raise ValueError(
                f"images of shape {tuple(images.shape[1:])}, the model takes "
                f"({cfg.num_channels}, {cfg.image_size}, {cfg.image_size})"
            )
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(patchify(images.to(dtype), cfg.patch_size))  # [b, N, h]
        cls = self.class_token.weight.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.position_embeddings.weight.to(x.dtype)
        x = self.dropout(x)  # [b, N + 1, h]
        pad = self.padded_seq_length - cfg.seq_length
        if pad:
            x = F.pad(x, (0, 0, 0, pad))  # zero rows, masked out as keys
        if self.sequence_parallel:
            x = scatter_to_region(x, self.tp_group, dim=1, meter=self.meter)  # [b, s/tp, h]
        return x

    def _head(self, x: torch.Tensor) -> dict:
        if self.sequence_parallel:
            x = gather_from_region(x, self.tp_group, dim=1, meter=self.meter)  # [b, s, h]
        cls = self.final_norm(x[:, 0])  # [b, h]: the class token
        return {"logits": self.classifier(cls).float()}  # [b, classes]


class ClassToken(nn.Module):
    """The learned class token, ``weight`` ``[h]`` (a module so that it has a name and an
    init of its own; constructing it draws nothing)."""

    def __init__(self, hidden_size: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device))

    def forward(self) -> torch.Tensor:
        return self.weight

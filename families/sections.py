"""The ``model`` sections shared by the transformer families: the blocks' keys.

``TransformerSection`` holds the keys every family built on models/transformer.py reads;
``TextTransformerSection`` adds a token model's sequence length and vocabulary padding. A
family's own section subclasses one of them with its keys (GPT: families/gpt.py; ViT, whose
sequence is its patches: families/vit.py). Defaults and choices
are taken from the model's own config (``TransformerConfig``), and a section is validated by
building that config (``resolved``), so a default or a cross-key rule is written once, where
the model needs it.
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

from families.config_fields import ConfigError, Section, doc_field
from models.gpt import pad_vocab_size
from models.transformer import (
    ACTIVATIONS,
    NORM_POSITIONS,
    NORMALIZATIONS,
    RECOMPUTE,
    TransformerConfig,
)
from parallel.pipeline.layout import PipelineLayout, PipelineLayoutError

__all__ = ["TextTransformerSection", "TransformerSection"]

_T = {f.name: f.default for f in dataclasses.fields(TransformerConfig)}


@dataclass(frozen=True)
class TransformerSection(Section):
    """The blocks' keys. Subclasses set ``FAMILY`` (the family the section belongs to) and
    implement ``resolved`` (the family's model config built from the section)."""

    SECTION: ClassVar[str] = "model"
    FAMILY: ClassVar[str] = ""

    num_layers: int = doc_field(4, "Transformer layers.", ge=1)
    hidden_size: int = doc_field(256, "Model width h.", ge=1)
    num_attention_heads: int = doc_field(4, "Query heads.", ge=1)
    num_query_groups: int | None = doc_field(
        _T["num_query_groups"],
        "Key/value heads; null = one per query head (MHA), fewer = GQA.",
        ge=1,
    )
    kv_channels: int | None = doc_field(
        _T["kv_channels"], "Per-head width; null = hidden_size / heads.", ge=1
    )
    ffn_hidden_size: int | None = doc_field(
        _T["ffn_hidden_size"],
        "MLP width; null = 4*hidden (gelu) or int(8/3*hidden) rounded up to a multiple of 64 "
        "(swiglu, which keeps the parameter count of a 4*hidden gelu MLP).",
        ge=1,
    )
    normalization: Literal[NORMALIZATIONS] = doc_field(_T["normalization"], "Norm layer type.")
    norm_epsilon: float = doc_field(_T["norm_epsilon"], "Epsilon of the norm layers.", gt=0)
    activation: Literal[ACTIVATIONS] = doc_field(
        _T["activation"],
        "MLP activation: gelu (tanh approximation, GPT-2), gelu_exact (erf, BERT/RoBERTa) or "
        "swiglu (Llama).",
    )
    norm_position: Literal[NORM_POSITIONS] = doc_field(
        _T["norm_position"],
        "pre: norm before attention and MLP (GPT, Megatron's BERT); post: after each residual "
        "add (BERT/RoBERTa, as Hugging Face checkpoints need).",
    )
    add_bias_linear: bool = doc_field(
        _T["add_bias_linear"], "Biases in the linear layers (false for Llama)."
    )
    hidden_dropout: float = doc_field(
        _T["hidden_dropout"], "Dropout after attention/MLP.", ge=0, lt=1
    )
    attention_dropout: float = doc_field(
        _T["attention_dropout"], "Dropout on attention probabilities.", ge=0, lt=1
    )
    init_method_std: float = doc_field(
        _T["init_method_std"], "Std of the normal weight initialisation.", gt=0
    )
    recompute: Literal[RECOMPUTE] = doc_field(
        _T["recompute"],
        "Activation recompute: none; full (keep each layer's input, rerun the layer in "
        "backward: least memory, ~1/3 more compute); selective (rerun only the attention core, "
        "whose s*s probabilities dominate activation memory at long sequences). Losses and "
        "gradients are bit-identical to none, FP8 scales included.",
    )

    def _check(self) -> None:
        # The model's own config holds the cross-key rules (one place): build it and report
        # its first complaint in the config's words.
        self.resolved()

    @abstractmethod
    def build_config(self, **given) -> TransformerConfig:
        """The family's model config from this section; ``given`` supplies the fields that
        come from the data (a padded vocabulary, an input size), with placeholder values
        when only the section's rules are being checked."""
        raise NotImplementedError(f"{type(self).__name__}.build_config")

    def resolved(self, **given) -> TransformerConfig:
        """``build_config`` with a ``ConfigError`` naming the key when the combination is
        impossible."""
        try:
            return self.build_config(**given)
        except ValueError as err:
            raise self._err(str(err)) from None

    def check_parallel(self, parallel) -> None:
        """Each tensor-parallel rank owns whole heads, whole KV groups and an equal MLP
        slice; the layers split evenly over the pipeline stages and virtual chunks."""
        shape = self.resolved()
        for key, value in (
            ("model.num_attention_heads", shape.num_attention_heads),
            ("model.num_query_groups", shape.num_query_groups),
            ("model.ffn_hidden_size", shape.ffn_hidden_size),
        ):
            if value % parallel.tensor:
                raise ConfigError(
                    f"config: {key} ({value}) must be divisible by parallel.tensor "
                    f"({parallel.tensor})"
                )
        try:  # the pipeline split's one rule lives in PipelineLayout
            PipelineLayout(self.num_layers, parallel.pipeline, parallel.virtual_stages)
        except PipelineLayoutError as err:
            raise ConfigError(f"config: {err}") from None

    def check_fp8_blocks(self, parallel, block: int) -> None:
        """Block-wise FP8 scales (``block``-wide tiles) under tensor parallelism: every
        dimension a rank's weight shard is cut along must be a whole number of blocks, or a
        shard boundary would cut a block and each rank would scale a different tile than the
        single-process model does."""
        if parallel.tensor == 1:
            return
        shape = self.resolved()
        kv = shape.kv_channels
        for key, value in (
            ("model.ffn_hidden_size", shape.ffn_hidden_size),
            ("the attention width (model.num_attention_heads x kv channels)",
             shape.num_attention_heads * kv),
            ("the key/value width (model.num_query_groups x kv channels)",
             shape.num_query_groups * kv),
        ):  # fmt: skip
            if (value // parallel.tensor) % block:
                raise ConfigError(
                    f"config: precision.fp8_granularity=block with parallel.tensor="
                    f"{parallel.tensor} cuts {key} ({value}) into shards of "
                    f"{value // parallel.tensor}, not a multiple of the {block}-wide FP8 "
                    "blocks (a shard boundary would split a block)"
                )

    # Resolved values: the fields keep null (so the stored config says "default"), these give
    # the concrete numbers every consumer must use (computed by the model config).
    def query_groups(self) -> int:
        return self.resolved().num_query_groups

    def kv_channels_or_default(self) -> int:
        return self.resolved().kv_channels

    def ffn_size(self) -> int:
        return self.resolved().ffn_hidden_size


@dataclass(frozen=True)
class TextTransformerSection(TransformerSection):
    """The blocks' keys plus what a token model adds: the sequence length and the vocabulary
    padding (GPT, RoBERTa)."""

    seq_length: int = doc_field(256, "Tokens per training sample.", ge=1)
    make_vocab_size_divisible_by: int = doc_field(
        128,
        "Pad the vocabulary to a multiple of this (times parallel.tensor, as in Megatron).",
        ge=1,
    )

    def check_parallel(self, parallel) -> None:
        """The blocks' rules, and sequence parallelism splits the sequence evenly."""
        super().check_parallel(parallel)
        if parallel.sequence_parallel and self.seq_length % parallel.tensor:
            raise ConfigError(
                f"config: model.seq_length={self.seq_length} is not divisible by "
                f"parallel.tensor={parallel.tensor} (sequence parallelism splits the sequence)"
            )

    def padded_vocab_size(self, vocab_size: int, tensor: int = 1) -> int:
        return pad_vocab_size(vocab_size, self.make_vocab_size_divisible_by, tensor)

"""Hugging Face adapter of the RoBERTa family (``RobertaHFAdapter``): ``RobertaForMaskedLM``
checkpoints (``config.json`` + safetensors) <-> ``models.roberta.RobertaModel``'s
single-process names, in both directions. What every family's adapter shares (directories,
sharded files, export, the QKV layout, vocabulary padding) is families/hf_adapter.py's.

Files are read and written by their safetensors key names (``roberta.encoder.layer.0.
attention.self.query.weight``, ...), which transformers keeps on disk.

Layout facts: Hugging Face keeps Q, K and V apart, this project fuses them per head
(``HFAdapter.fuse_qkv`` with one head per group); the vocabulary is padded on import and cut
on export; the decoder is tied to the word embedding (only ``lm_head.bias`` is written);
``hidden_act="gelu"`` is the exact erf GELU. The binary (sentence-order) head has no place in
``RobertaForMaskedLM`` and is left out of an export.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from families.hf_adapter import EncoderHFAdapter
from models.gpt import pad_vocab_size
from models.roberta import RobertaConfig

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = ["RobertaHFAdapter"]

# Hugging Face key (layer index as {i}) -> this project's single-process name.
_LAYER = {
    "attention.output.dense": "attention.proj",
    "attention.output.LayerNorm": "post_attention_norm",
    "intermediate.dense": "mlp.fc1",
    "output.dense": "mlp.fc2",
    "output.LayerNorm": "post_mlp_norm",
}
_TOP = {
    "roberta.embeddings.word_embeddings.weight": "word_embeddings.weight",
    "roberta.embeddings.position_embeddings.weight": "position_embeddings.weight",
    "roberta.embeddings.token_type_embeddings.weight": "token_type_embeddings.weight",
    "roberta.embeddings.LayerNorm.weight": "embedding_norm.weight",
    "roberta.embeddings.LayerNorm.bias": "embedding_norm.bias",
    "lm_head.dense.weight": "lm_dense.weight",
    "lm_head.dense.bias": "lm_dense.bias",
    "lm_head.layer_norm.weight": "lm_norm.weight",
    "lm_head.layer_norm.bias": "lm_norm.bias",
    "lm_head.bias": "lm_bias.bias",
}
_VOCAB_ROWS = ("word_embeddings.weight", "lm_bias.bias")
_NEEDS = "a RoBERTa config needs it"


def _vocab_size(hf: JsonObject) -> int:
    return hf.need("vocab_size", int, why=_NEEDS)


class RobertaHFAdapter(EncoderHFAdapter):
    """``RobertaForMaskedLM`` <-> ``RobertaModel`` (module doc). The extra fact of
    ``save``/``config_to_hf``/``state_to_hf``: ``vocab_size``, the true vocabulary."""

    family = "roberta"
    model_types = ("roberta",)
    layer_prefix = "roberta.encoder.layer"
    attention_module = "attention.self"
    layer_modules = _LAYER
    model_name = "RobertaModel"

    def config_from_hf(
        self, hf: dict, padded_vocab_size: int | None = None, **overrides
    ) -> RobertaConfig:
        """A ``RobertaConfig`` from a Hugging Face ``config.json`` dict (post-LN, like the
        checkpoint); ``padded_vocab_size`` defaults to the checkpoint's vocabulary. Errors as
        ``HFAdapter.config_from_hf``'s."""
        from checkpoint.format import JsonObject  # the format reader: no model code

        hf = JsonObject.wrap(hf, "config.json")
        pad = hf.need("pad_token_id", int, 1)
        max_pos = hf.need("max_position_embeddings", int, why=_NEEDS)
        fields = dict(
            **self.encoder_fields_from_hf(hf, dropout=0.1, why=_NEEDS),
            norm_position="post",
            seq_length=max_pos - pad - 1,
            max_position_embeddings=max_pos,
            padding_idx=pad,
            type_vocab_size=hf.need("type_vocab_size", int, 1),
            vocab_size=padded_vocab_size or _vocab_size(hf),
        )
        fields.update(overrides)
        return RobertaConfig(**fields)

    def config_to_hf(self, config: RobertaConfig, vocab_size: int) -> dict:
        """The ``config.json`` fields of ``RobertaForMaskedLM`` for this model and the true
        (unpadded) ``vocab_size``."""
        if config.norm_position != "post" or config.activation == "swiglu":
            raise ValueError("Hugging Face RoBERTa is post-LN with a GELU MLP")
        return {
            "architectures": ["RobertaForMaskedLM"],
            "model_type": "roberta",
            "vocab_size": vocab_size,
            **self.encoder_fields_to_hf(config),
            "max_position_embeddings": config.max_position_embeddings,
            "type_vocab_size": config.type_vocab_size,
            "pad_token_id": config.padding_idx,
            "tie_word_embeddings": True,
        }

    def state_from_hf(
        self, hf: dict[str, torch.Tensor], config: RobertaConfig
    ) -> dict[str, torch.Tensor]:
        """Hugging Face tensors -> this project's single-process parameters (QKV fused per
        head, vocabulary padded with zero rows). Unknown keys raise naming the key."""
        out, rest = self.layers_from_hf(hf, config.num_attention_heads)
        for key, value in rest.items():
            if key in _TOP:
                out[_TOP[key]] = value
            elif key not in ("lm_head.decoder.weight", "lm_head.decoder.bias"):
                raise self.no_place(key)  # (the decoder is tied to the word embedding)
        for name in _VOCAB_ROWS:
            if name in out:
                out[name] = self.pad_rows(out[name], config.vocab_size)
        return out

    def state_to_hf(
        self, state: dict[str, torch.Tensor], config: RobertaConfig, vocab_size: int
    ) -> dict[str, torch.Tensor]:
        """Inverse of ``state_from_hf``: QKV split per head, the vocabulary cut to
        ``vocab_size`` rows; the tied decoder is written as Hugging Face does
        (``lm_head.bias`` only). The binary head (``pooler``, ``binary_head``) and FP8
        scaling state have no place in ``RobertaForMaskedLM`` and are left out."""
        out, rest = self.layers_to_hf(state, config.num_attention_heads)
        inverse_top = {v: k for k, v in _TOP.items()}
        for name, value in rest.items():
            if name in inverse_top:
                value = value[:vocab_size] if name in _VOCAB_ROWS else value
                out[inverse_top[name]] = value
        return {k: v.contiguous() for k, v in out.items()}

    def import_config(self, hf: JsonObject, divisible_by: int) -> tuple[RobertaConfig, dict]:
        """The vocabulary padded to a multiple of ``divisible_by``; the fact: the true
        ``vocab_size``."""
        vocab = _vocab_size(hf)
        return self.config_from_hf(hf, pad_vocab_size(vocab, divisible_by)), {"vocab_size": vocab}

    def export_extra(self, structure: JsonObject) -> dict:
        return {"vocab_size": self.true_vocab_size(structure)}

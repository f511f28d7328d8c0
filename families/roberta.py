"""The RoBERTa family: so far its model config and Hugging Face state-dict adapter.

``RobertaForMaskedLM`` checkpoints (``config.json`` + ``model.safetensors``) map onto
``models.roberta.RobertaModel``'s single-process names, in both directions. Files are read
and written by their safetensors key names (``roberta.encoder.layer.0.attention.self.query.
weight``, ...), which transformers keeps on disk. Masked-LM data and training (the family's
``ModelFamily`` methods) are not built yet: ``pretrain_roberta.py`` does not exist.

Layout facts the adapter handles: Hugging Face keeps Q, K and V apart, this project fuses them
per head (``[q_0, k_0, v_0, q_1, ...]``, models/transformer.py); Hugging Face's vocabulary is
the tokenizer's, this project's is padded (``make_vocab_size_divisible_by``): rows are added
with zeros on import and dropped on export; ``hidden_act="gelu"`` is the exact erf GELU.
"""

from __future__ import annotations

import re

import torch

from models.roberta import RobertaConfig

__all__ = ["config_from_hf", "config_to_hf", "state_from_hf", "state_to_hf"]

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
_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}


def config_from_hf(hf: dict, padded_vocab_size: int | None = None, **overrides) -> RobertaConfig:
    """A ``RobertaConfig`` from a Hugging Face ``config.json`` dict (post-LN, like the
    checkpoint); ``padded_vocab_size`` defaults to the checkpoint's vocabulary."""
    act = hf.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"config.json hidden_act={act!r}: not one of {sorted(_ACTIVATIONS)}")
    pad = hf.get("pad_token_id", 1)
    max_pos = hf["max_position_embeddings"]
    fields = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"],
        norm_epsilon=hf.get("layer_norm_eps", 1e-12),
        activation=_ACTIVATIONS[act],
        norm_position="post",
        hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
        attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
        init_method_std=hf.get("initializer_range", 0.02),
        seq_length=max_pos - pad - 1,
        max_position_embeddings=max_pos,
        padding_idx=pad,
        type_vocab_size=hf.get("type_vocab_size", 1),
        vocab_size=padded_vocab_size or hf["vocab_size"],
    )
    fields.update(overrides)
    return RobertaConfig(**fields)


def config_to_hf(config: RobertaConfig, vocab_size: int) -> dict:
    """The ``config.json`` fields of ``RobertaForMaskedLM`` for this model and the true
    (unpadded) ``vocab_size``."""
    if config.norm_position != "post" or config.activation == "swiglu":
        raise ValueError("Hugging Face RoBERTa is post-LN with a GELU MLP")
    act = "gelu" if config.activation == "gelu_exact" else "gelu_new"
    return {
        "architectures": ["RobertaForMaskedLM"],
        "model_type": "roberta",
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.ffn_hidden_size,
        "hidden_act": act,
        "hidden_dropout_prob": config.hidden_dropout,
        "attention_probs_dropout_prob": config.attention_dropout,
        "max_position_embeddings": config.max_position_embeddings,
        "type_vocab_size": config.type_vocab_size,
        "initializer_range": config.init_method_std,
        "layer_norm_eps": config.norm_epsilon,
        "pad_token_id": config.padding_idx,
        "tie_word_embeddings": True,
    }


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit {rows}")
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def state_from_hf(hf: dict[str, torch.Tensor], config: RobertaConfig) -> dict[str, torch.Tensor]:
    """Hugging Face tensors -> this project's single-process parameters (QKV fused per head,
    vocabulary padded with zero rows). Unknown keys raise naming the key."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    pattern = re.compile(r"roberta\.encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")
    for key, value in hf.items():
        if key in _TOP:
            out[_TOP[key]] = value
            continue
        if key == "lm_head.decoder.weight":
            continue  # tied to the word embedding
        if key == "lm_head.decoder.bias":
            continue  # the same tensor as lm_head.bias
        m = pattern.match(key)
        if m is None:
            raise KeyError(f"Hugging Face tensor {key!r} has no place in RobertaModel")
        layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
        if module.startswith("attention.self."):
            qkv.setdefault((layer, kind), {})[module.rsplit(".", 1)[1]] = value
        elif module in _LAYER:
            out[f"layers.{layer}.{_LAYER[module]}.{kind}"] = value
        else:
            raise KeyError(f"Hugging Face tensor {key!r} has no place in RobertaModel")
    heads, d = config.num_attention_heads, config.kv_channels
    for (layer, kind), parts in qkv.items():
        q, k, v = (
            parts[n].reshape(heads, d, *parts[n].shape[1:]) for n in ("query", "key", "value")
        )
        out[f"layers.{layer}.attention.qkv.{kind}"] = torch.stack([q, k, v], 1).reshape(
            3 * heads * d, *q.shape[2:]
        )
    for name in _VOCAB_ROWS:
        if name in out:
            out[name] = _pad_rows(out[name], config.vocab_size)
    return out


def state_to_hf(
    state: dict[str, torch.Tensor], config: RobertaConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Inverse of ``state_from_hf``: QKV split per head, the vocabulary cut to ``vocab_size``
    rows; the tied decoder is written as Hugging Face does (``lm_head.bias`` only)."""
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_layer = {v: k for k, v in _LAYER.items()}
    heads, d = config.num_attention_heads, config.kv_channels
    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name in _VOCAB_ROWS:
            value = value[:vocab_size]
        if name in inverse_top:
            out[inverse_top[name]] = value
            continue
        m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", name)
        if m is None:
            continue  # FP8 scaling state and other buffers have no Hugging Face counterpart
        layer, module, kind = m.groups()
        prefix = f"roberta.encoder.layer.{layer}"
        if module == "attention.qkv":
            q, k, v = value.reshape(heads, 3, d, *value.shape[1:]).unbind(1)
            for part, t in zip(("query", "key", "value"), (q, k, v)):
                out[f"{prefix}.attention.self.{part}.{kind}"] = t.reshape(heads * d, *t.shape[2:])
        elif module in inverse_layer:
            out[f"{prefix}.{inverse_layer[module]}.{kind}"] = value
    return {k: v.contiguous() for k, v in out.items()}

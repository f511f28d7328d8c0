"""The RoBERTa family: masked-LM pretraining of ``models.roberta.RobertaModel``, and its
Hugging Face state-dict adapter.

Data: the default corpus (the stdlib sources) with a SentencePiece vocabulary that has a
``<mask>`` control symbol (``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, ``<pad>`` 3, ``<mask>`` 4), or a
Megatron prefix whose tokenizer has one; samples from ``data.mlm_data`` (full sentences packed
across documents, dynamic 80/10/10 masking per sample index). Loss: the token cross entropy
over the chosen positions (``lm loss``) and the share of them predicted right
(``mlm accuracy``). FLOPs: the encoder blocks with bidirectional attention (every score
counts) plus the masked-LM head (``h x h`` dense and the ``h x V`` decoder) at every position:
``6 B s [L (h(q+2kv) + 2 q s + q h + 2 h f) + h^2 + h V]`` (the binary head's ``h^2 + 2h`` per
sample is left out: under 0.01% of a step). With ``model.add_binary_head`` the samples are
sentence-order pairs (``data.mlm_data``) and the objective adds the pair cross entropy's mean
to the masked-LM mean, as Megatron's BERT does; ``sop loss`` and ``sop accuracy`` are logged.

``RobertaForMaskedLM`` checkpoints (``config.json`` + ``model.safetensors``) map onto
``models.roberta.RobertaModel``'s single-process names, in both directions. Files are read
and written by their safetensors key names (``roberta.encoder.layer.0.attention.self.query.
weight``, ...), which transformers keeps on disk.

Layout facts the adapter handles: Hugging Face keeps Q, K and V apart, this project fuses them
per head (``[q_0, k_0, v_0, q_1, ...]``, models/transformer.py); Hugging Face's vocabulary is
the tokenizer's, this project's is padded (``make_vocab_size_divisible_by``): rows are added
with zeros on import and dropped on export; ``hidden_act="gelu"`` is the exact erf GELU.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from data.mlm_data import MLMSpecialTokens, build_mlm_datasets
from data.prepare import check_text_data, prepare_text_data
from data.tokenizer import SentencePieceTokenizer
from families.base import (
    HFImport,
    LossSums,
    ModelFamily,
    encoder_fields_from_hf,
    read_hf_config,
    section_values,
)
from families.config_fields import doc_field
from families.hf_qkv import fuse_qkv, split_qkv
from families.sections import TextTransformerSection
from models.gpt import pad_vocab_size
from models.roberta import RobertaConfig, RobertaModel
from models.transformer import ACTIVATIONS, NORM_POSITIONS

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = [
    "export_checkpoint",
    "load_hf",
    "save_hf",
    "RobertaData",
    "RobertaFamily",
    "RobertaModelSection",
    "config_from_hf",
    "config_to_hf",
    "state_from_hf",
    "state_to_hf",
]

_R = {f.name: f.default for f in fields(RobertaConfig)}


@dataclass(frozen=True)
class RobertaModelSection(TextTransformerSection):
    """The ``model`` section of a RoBERTa run: the blocks' keys (post-LN and exact GELU by
    default, as RoBERTa), positions, the binary head and the masked-LM data's probabilities."""

    FAMILY: ClassVar[str] = "roberta"

    activation: Literal[ACTIVATIONS] = doc_field(
        _R["activation"],
        "MLP activation: gelu_exact (erf, BERT/RoBERTa), gelu (tanh approximation) or swiglu.",
    )
    norm_position: Literal[NORM_POSITIONS] = doc_field(
        _R["norm_position"],
        "post: norm after each residual add (BERT/RoBERTa, as Hugging Face checkpoints need); "
        "pre: before attention and MLP (Megatron's BertModel).",
    )
    max_position_embeddings: int | None = doc_field(
        _R["max_position_embeddings"],
        "Position table size; null = seq_length + padding id + 1 (RoBERTa numbers positions "
        "after the padding id).",
        ge=1,
    )
    add_binary_head: bool = doc_field(
        False,
        "Binary (sentence-order) head: samples become `<s> A </s></s> B </s>` segment pairs from "
        "one document, swapped half the time, with two token types; adds sop loss/accuracy.",
    )
    mask_prob: float = doc_field(0.15, "Share of the tokens chosen for prediction.", gt=0, lt=1)
    mask_replace_prob: float = doc_field(
        0.8, "Of the chosen tokens, the share replaced by <mask>.", ge=0, le=1
    )
    random_replace_prob: float = doc_field(
        0.1, "Of the chosen tokens, the share replaced by a random token (the rest are kept).",
        ge=0, le=1,
    )  # fmt: skip

    def _check(self) -> None:
        super()._check()
        if self.mask_replace_prob + self.random_replace_prob > 1:
            raise self._err(
                f"model.mask_replace_prob ({self.mask_replace_prob:g}) + "
                f"model.random_replace_prob ({self.random_replace_prob:g}) must be <= 1"
            )

    def build_config(self, vocab_size: int = 1, padding_idx: int = 1) -> RobertaConfig:
        return RobertaConfig.from_model_section(
            self, vocab_size=vocab_size, padding_idx=padding_idx,
            type_vocab_size=2 if self.add_binary_head else 1,
        )  # fmt: skip


@dataclass(frozen=True)
class RobertaData:
    tokenizer: SentencePieceTokenizer
    data_prefix: str

    def special(self) -> MLMSpecialTokens:
        t = self.tokenizer
        return MLMSpecialTokens(
            bos=t.bos, eos=t.eod, pad=t.pad, mask=t.mask, vocab_size=t.vocab_size,
            never_mask=frozenset({t.unk}),
            # Lines are the sentences that full-sentence packing keeps whole (code corpus).
            sentence_ends=frozenset({t.newline} if t.newline >= 0 else ()),
        )  # fmt: skip


def _roberta_data(prepared) -> RobertaData:
    """The prepared corpus with its tokenizer, which must have the masked-LM pieces."""
    tokenizer = prepared.tokenizer()
    for piece, token_id in (("<mask>", tokenizer.mask), ("<pad>", tokenizer.pad)):
        if token_id < 0:
            raise ValueError(
                f"data.tokenizer_model: {prepared.tokenizer_model} has no {piece} piece "
                "(masked-LM training needs <s>, </s>, <pad> and <mask>)"
            )
    return RobertaData(tokenizer, prepared.data_prefix)


class RobertaFamily(ModelFamily):
    name = "roberta"
    model_section = RobertaModelSection
    # Megatron's BERT names "lm loss" and "sop loss"; the sop pair only with the binary head.
    metric_names = ("lm loss", "mlm accuracy", "sop loss", "sop accuracy")
    perplexity_metrics = ("lm loss",)
    # Masked-LM data needs a <mask> piece: the default corpus's tokenizer is trained with it
    # (a cache of its own, apart from GPT's).
    control_symbols = ("<mask>",)

    def run_metrics(self, cfg) -> tuple[str, ...]:
        if cfg.model.add_binary_head:
            return self.metric_names
        return self.metric_names[:2]

    def preflight(self, cfg) -> RobertaConfig | None:
        """The data files' headers and the tokenizer with its masked-LM pieces."""
        prepared = check_text_data(cfg.data, cfg.training.seed, self.control_symbols)
        if prepared is None:  # the default corpus, built when the run starts
            return None
        return self.model_config(cfg, _roberta_data(prepared), cfg.parallel.tensor)

    def prepare_data(self, cfg, rank: int) -> RobertaData:
        prepared = prepare_text_data(cfg.data, cfg.training.seed, rank, self.control_symbols)
        return _roberta_data(prepared)

    def model_config(self, cfg, data: RobertaData, tensor_parallel: int) -> RobertaConfig:
        vocab = pad_vocab_size(
            data.tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, tensor_parallel
        )
        return cfg.model.resolved(vocab_size=vocab, padding_idx=data.tokenizer.pad)

    def build_model(self, config: RobertaConfig, ctx, pipeline) -> RobertaModel:
        return RobertaModel(config, ctx, pipeline)

    def build_datasets(self, cfg, data: RobertaData, train_samples: int, valid_samples: int):
        m = cfg.model
        return build_mlm_datasets(
            data.data_prefix,
            seq_length=m.seq_length,
            seed=cfg.training.seed,
            split=cfg.data.split,
            train_samples=train_samples,
            valid_samples=valid_samples,
            special=data.special(),
            mask_prob=m.mask_prob,
            random_prob=m.random_replace_prob,
            keep_prob=1.0 - m.mask_replace_prob - m.random_replace_prob,
            binary_head=m.add_binary_head,
        )

    logits_output = "lm"
    hf_model_types = ("roberta",)

    def config_from_checkpoint(self, metadata: dict) -> RobertaConfig:
        structure = metadata["model_structure"]
        section = RobertaModelSection(**metadata["config"]["model"])
        return section.resolved(
            vocab_size=structure["padded_vocab_size"], padding_idx=structure["padding_idx"]
        )

    def import_hf(self, directory, divisible_by: int = 128) -> HFImport:
        """``RobertaForMaskedLM``: the vocabulary padded with zero rows."""
        vocab = _vocab_size(read_hf_config(directory))
        config, tensors = load_hf(directory, pad_vocab_size(vocab, divisible_by))
        structure = {**self.checkpoint_structure(config), "vocab_size": vocab}
        section = section_values(RobertaModelSection, config)
        section["make_vocab_size_divisible_by"] = divisible_by
        return HFImport(config, tensors, structure, section)

    def export_hf(self, checkpoint, directory):
        return export_checkpoint(checkpoint, directory)

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "tokens": batch["tokens"],
            "attention_mask": batch["attention_mask"],
            "token_types": batch["token_types"],
            "labels": batch["labels"],
        }

    def loss(self, output: dict, batch: dict) -> tuple[torch.Tensor, LossSums]:
        # output["lm"]: per-token cross entropy [b, s]; only the chosen positions count.
        mask = batch["loss_mask"].float()
        total, count = (output["lm"].float() * mask).sum(), mask.sum()
        correct = (output["lm_correct"] * mask).sum()
        sums = {"lm loss": (total, count), "mlm accuracy": (correct, count)}
        objective = total / count.clamp(min=1)
        binary = output.get("binary")
        if binary is not None:  # sentence order: Megatron's BERT adds the two means
            label = batch["sop_label"]
            sop = F.cross_entropy(binary.float(), label, reduction="sum")
            right = (binary.detach().argmax(-1) == label).float().sum()
            sums["sop loss"] = (sop, label.numel())
            sums["sop accuracy"] = (right, label.numel())
            objective = objective + sop / label.numel()
        return objective, sums

    def flops_per_step(self, config: RobertaConfig, global_batch_size: int) -> float:
        b, s, h = global_batch_size, config.seq_length, config.hidden_size
        head = 6.0 * b * s * (h * h + h * config.vocab_size)
        return config.layer_flops_per_step(b, s, causal=False) + head

    def checkpoint_structure(self, config: RobertaConfig, data: RobertaData | None = None) -> dict:
        return {
            "family": self.name,
            "fused": config.fused_tensors(),
            "vocab_size": data.tokenizer.vocab_size if data is not None else None,
            "padded_vocab_size": config.vocab_size,
            "vocab_tensors": ["word_embeddings.weight", "lm_bias.bias"],
            "padding_idx": config.padding_idx,
            "norm_position": config.norm_position,
        }


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


def config_from_hf(hf: dict, padded_vocab_size: int | None = None, **overrides) -> RobertaConfig:
    """A ``RobertaConfig`` from a Hugging Face ``config.json`` dict (post-LN, like the
    checkpoint); ``padded_vocab_size`` defaults to the checkpoint's vocabulary. A key it
    needs and the dict lacks, or a value of the wrong type, raises ``CheckpointError`` naming
    the file and the key."""
    from checkpoint.format import JsonObject  # the format reader: no model code

    hf = JsonObject.wrap(hf, "config.json")
    pad = hf.need("pad_token_id", int, 1)
    max_pos = hf.need("max_position_embeddings", int, why=_NEEDS)
    fields = dict(
        **encoder_fields_from_hf(hf, dropout=0.1, why=_NEEDS),
        norm_position="post",
        seq_length=max_pos - pad - 1,
        max_position_embeddings=max_pos,
        padding_idx=pad,
        type_vocab_size=hf.need("type_vocab_size", int, 1),
        vocab_size=padded_vocab_size or _vocab_size(hf),
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
    for (layer, kind), parts in qkv.items():
        out[f"layers.{layer}.attention.qkv.{kind}"] = fuse_qkv(
            parts["query"], parts["key"], parts["value"], config.num_attention_heads
        )
    for name in _VOCAB_ROWS:
        if name in out:
            out[name] = _pad_rows(out[name], config.vocab_size)
    return out


def state_to_hf(
    state: dict[str, torch.Tensor], config: RobertaConfig, vocab_size: int
) -> dict[str, torch.Tensor]:
    """Inverse of ``state_from_hf``: QKV split per head, the vocabulary cut to ``vocab_size``
    rows; the tied decoder is written as Hugging Face does (``lm_head.bias`` only). The binary
    head (``pooler``, ``binary_head``) has no place in ``RobertaForMaskedLM`` and is left out."""
    inverse_top = {v: k for k, v in _TOP.items()}
    inverse_layer = {v: k for k, v in _LAYER.items()}
    heads = config.num_attention_heads
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
            for part, t in zip(("query", "key", "value"), split_qkv(value, heads)):
                out[f"{prefix}.attention.self.{part}.{kind}"] = t
        elif module in inverse_layer:
            out[f"{prefix}.{inverse_layer[module]}.{kind}"] = value
    return {k: v.contiguous() for k, v in out.items()}


def save_hf(directory: str | Path, state: dict, config: RobertaConfig, vocab_size: int) -> Path:
    """Write ``config.json`` + ``model.safetensors`` that ``RobertaForMaskedLM.from_pretrained``
    loads, from this project's single-process parameters (FP32 values)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: v.detach().float().cpu() for k, v in state_to_hf(state, config, vocab_size).items()
    }
    (out / "config.json").write_text(json.dumps(config_to_hf(config, vocab_size), indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_hf(directory: str | Path, padded_vocab_size: int | None = None):
    """``(RobertaConfig, parameters)`` from a Hugging Face ``RobertaForMaskedLM`` directory."""
    from checkpoint.format import load_safetensors  # names a damaged file

    path = Path(directory)
    config = config_from_hf(read_hf_config(path), padded_vocab_size)
    return config, state_from_hf(load_safetensors(path / "model.safetensors"), config)


def export_checkpoint(checkpoint: str | Path, directory: str | Path) -> Path:
    """A training checkpoint of this family (any parallel layout, any level) as a Hugging Face
    ``RobertaForMaskedLM``: full tensors from the canonical format (dequantized), the model
    config from the checkpoint's own config and ``model_structure``."""
    structure, config, params = RobertaFamily().checkpoint_model(checkpoint)
    return save_hf(directory, params, config, structure["vocab_size"])

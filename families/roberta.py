"""The RoBERTa family: masked-LM pretraining of ``models.roberta.RobertaModel``.

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

Hugging Face ``RobertaForMaskedLM`` import and export: families/roberta_hf.py
(``RobertaFamily.hf_adapter``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F

from data.mlm_data import MLMSpecialTokens, build_mlm_datasets
from data.prepare import check_text_data, planned_vocabulary, prepare_text_data
from data.tokenizer import SentencePieceTokenizer
from families.base import LossSums, ModelFamily
from families.config_fields import doc_field
from families.roberta_hf import RobertaHFAdapter
from families.sections import TextTransformerSection
from models.gpt import pad_vocab_size
from models.roberta import RobertaConfig, RobertaModel
from models.transformer import ACTIVATIONS, NORM_POSITIONS

__all__ = ["RobertaData", "RobertaFamily", "RobertaModelSection"]

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
    # On the console its masked-LM loss reads as such, beside "mlm accuracy".
    console_labels = {"lm loss": "mlm loss", "lm loss PPL": "mlm PPL"}
    # Masked-LM data needs a <mask> piece: the default corpus's tokenizer is trained with it
    # (a cache of its own, apart from GPT's).
    control_symbols = ("<mask>",)

    def run_metrics(self, cfg) -> tuple[str, ...]:
        if cfg.model.add_binary_head:
            return self.metric_names
        return self.metric_names[:2]

    def preflight(self, cfg) -> RobertaConfig | None:
        """The data files' headers, the tokenizer with its masked-LM pieces, and
        ``data.split`` against the documents (a train set, and a valid one when weighted)."""
        prepared = check_text_data(cfg.data, cfg.training.seed, self.control_symbols)
        if prepared is None:  # the default corpus, built when the run starts
            return None
        cfg.data.check_split(prepared.num_documents, ("train",), ("train", "valid"))
        return self.model_config(cfg, _roberta_data(prepared), cfg.parallel.tensor)

    def prepare_data(self, cfg, rank: int) -> RobertaData:
        prepared = prepare_text_data(cfg.data, cfg.training.seed, rank, self.control_symbols)
        return _roberta_data(prepared)

    def model_config(self, cfg, data: RobertaData, tensor_parallel: int) -> RobertaConfig:
        vocab = pad_vocab_size(
            data.tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, tensor_parallel
        )
        return cfg.model.resolved(vocab_size=vocab, padding_idx=data.tokenizer.pad)

    def planned_model_config(self, cfg, tensor_parallel: int) -> RobertaConfig:
        vocab, pad = planned_vocabulary(cfg.data)
        padded = pad_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tensor_parallel)
        return cfg.model.resolved(vocab_size=padded, padding_idx=pad)

    def example_batch(self, config: RobertaConfig, micro_batch_size: int) -> dict:
        shape = (micro_batch_size, config.seq_length)
        ids = torch.zeros(shape, dtype=torch.int64)
        batch = {
            "tokens": ids, "labels": ids.clone(), "loss_mask": torch.ones(shape),
            "attention_mask": torch.ones(shape, dtype=torch.int64), "token_types": ids.clone(),
        }  # fmt: skip
        if config.add_binary_head:
            batch["sop_label"] = torch.zeros(micro_batch_size, dtype=torch.int64)
        return batch

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
    hf_adapter = RobertaHFAdapter()
    hf_model_types = RobertaHFAdapter.model_types

    def config_from_checkpoint(self, metadata: dict) -> RobertaConfig:
        structure = metadata["model_structure"]
        section = RobertaModelSection(**metadata["config"]["model"])
        return section.resolved(
            vocab_size=structure["padded_vocab_size"], padding_idx=structure["padding_idx"]
        )

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

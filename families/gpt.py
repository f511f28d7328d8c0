"""The GPT family (GPT-2 and Llama styles): causal LM on Megatron indexed data.

Data: the default corpus (the Python standard library's sources with a SentencePiece
vocabulary trained on them) or a Megatron ``.bin/.idx`` prefix with its tokenizer; samples from
megatron-core's ``GPTDataset`` (``tokens``, ``labels``, ``loss_mask``, ``position_ids``).
Loss: the token cross entropy, masked and averaged over the micro-batch's counted tokens
(``lm loss``). FLOPs: Megatron's causal formula (``gpt_flops_per_step``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import torch

from data.gpt_data import build_gpt_datasets
from data.paths import check_directory
from data.prepare import check_text_data, planned_vocabulary, prepare_text_data
from data.tokenizer import SentencePieceTokenizer
from families.base import LossSums, ModelFamily
from families.config_fields import doc_field
from families.gpt_hf import GPTHFAdapter
from families.sections import TextTransformerSection
from models.gpt import POSITION_EMBEDDING_TYPES, GPTConfig, GPTModel, pad_vocab_size

__all__ = ["GPTData", "GPTFamily", "GPTModelSection", "gpt_flops_per_step"]

_GPT = {f.name: f.default for f in fields(GPTConfig)}


@dataclass(frozen=True)
class GPTModelSection(TextTransformerSection):
    """The ``model`` section of a GPT run: the blocks' keys plus positions and the head."""

    FAMILY: ClassVar[str] = "gpt"

    max_position_embeddings: int | None = doc_field(
        _GPT["max_position_embeddings"], "Positions the model supports; null = seq_length.", ge=1
    )
    position_embedding_type: Literal[POSITION_EMBEDDING_TYPES] = doc_field(
        _GPT["position_embedding_type"], "learned_absolute (GPT-2/3) or rope (rotary, Llama)."
    )
    rotary_base: float = doc_field(_GPT["rotary_base"], "RoPE theta (only with rope).", gt=0)
    untie_embeddings_and_output_weights: bool = doc_field(
        _GPT["untie_embeddings_and_output_weights"],
        "Separate output head instead of reusing the input embedding.",
    )

    def build_config(self, vocab_size: int = 1) -> GPTConfig:
        return GPTConfig.from_model_section(self, vocab_size)

    def max_positions(self) -> int:
        return self.resolved().max_position_embeddings


def gpt_flops_per_step(
    *,
    batch: int,
    seq: int,
    layers: int,
    hidden: int,
    vocab: int,
    heads: int,
    query_groups: int,
    kv_channels: int,
    ffn: int,
    swiglu: bool,
) -> float:
    """FLOPs of one training step (forward + backward), causal, as Megatron counts them.

    6·B·s·[L·(h(q+2kv) + q·s + q·h + h·f·(3 if swiglu else 2)) + h·V], with
    q = kv_channels·heads and kv = kv_channels·query_groups.
    """
    q = kv_channels * heads
    kv = kv_channels * query_groups
    per_layer = hidden * (q + 2 * kv) + q * seq + q * hidden + hidden * ffn * (3 if swiglu else 2)
    return 6.0 * batch * seq * (layers * per_layer + hidden * vocab)


@dataclass(frozen=True)
class GPTData:
    tokenizer: SentencePieceTokenizer
    data_prefix: str


class GPTFamily(ModelFamily):
    name = "gpt"
    model_section = GPTModelSection
    metric_names = ("lm loss",)
    perplexity_metrics = ("lm loss",)

    def preflight(self, cfg) -> GPTConfig | None:
        """The data files' headers and the tokenizer (data/prepare.py ``check_text_data``),
        ``data.cache_dir``, where megatron-core's sample indices go, and ``data.split``
        against the documents (``build_datasets`` reads a train and a valid set, and refuses
        a weighted test set without documents)."""
        prepared = check_text_data(cfg.data, cfg.training.seed)
        check_directory("data.cache_dir", cfg.data.cache_dir)
        if prepared is None:  # the default corpus, built when the run starts
            return None
        cfg.data.check_split(prepared.num_documents)
        data = GPTData(prepared.tokenizer(), prepared.data_prefix)
        return self.model_config(cfg, data, cfg.parallel.tensor)

    def prepare_data(self, cfg, rank: int) -> GPTData:
        prepared = prepare_text_data(cfg.data, cfg.training.seed, rank)
        return GPTData(prepared.tokenizer(), prepared.data_prefix)

    def model_config(self, cfg, data: GPTData, tensor_parallel: int) -> GPTConfig:
        vocab = pad_vocab_size(
            data.tokenizer.vocab_size, cfg.model.make_vocab_size_divisible_by, tensor_parallel
        )
        return cfg.model.resolved(vocab_size=vocab)

    def planned_model_config(self, cfg, tensor_parallel: int) -> GPTConfig:
        vocab, _ = planned_vocabulary(cfg.data)
        padded = pad_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, tensor_parallel)
        return cfg.model.resolved(vocab_size=padded)

    def example_batch(self, config: GPTConfig, micro_batch_size: int) -> dict[str, torch.Tensor]:
        shape = (micro_batch_size, config.seq_length)
        tokens = torch.zeros(shape, dtype=torch.int64)
        return {"tokens": tokens, "labels": tokens.clone(), "loss_mask": torch.ones(shape)}

    def build_model(self, config: GPTConfig, ctx, pipeline) -> GPTModel:
        return GPTModel(config, ctx, pipeline)

    def build_datasets(self, cfg, data: GPTData, train_samples: int, valid_samples: int):
        return build_gpt_datasets(
            data.data_prefix,
            data.tokenizer,
            seq_length=cfg.model.seq_length,
            seed=cfg.training.seed,
            split=cfg.data.split,
            train_samples=train_samples,
            valid_samples=valid_samples,
            cache_dir=os.path.join(cfg.data.cache_dir, "indices"),
        )

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = {"tokens": batch["tokens"], "labels": batch["labels"]}
        if "position_ids" in batch:
            inputs["position_ids"] = batch["position_ids"]
        return inputs

    def loss(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, LossSums]:
        # output: the per-token cross entropy [b, s]; the mask drops padding / end-of-document.
        mask = batch["loss_mask"].float()
        total, count = (output.float() * mask).sum(), mask.sum()
        return total / count.clamp(min=1), {"lm loss": (total, count)}

    def flops_per_step(self, config: GPTConfig, global_batch_size: int) -> float:
        """Megatron's causal formula (``gpt_flops_per_step``): the blocks plus the head."""
        b, s = global_batch_size, config.seq_length
        head = 6.0 * b * s * config.hidden_size * config.vocab_size
        return config.layer_flops_per_step(b, s, causal=True) + head

    def checkpoint_structure(self, config: GPTConfig, data: GPTData | None = None) -> dict:
        """Fused tensors by name pattern (``*`` = any layer index) and the vocabulary:
        ``qkv`` rows are ``[G x (r q-heads, k, v) x d]`` (models/transformer.py), SwiGLU's
        ``fc1`` rows ``[gate | up]``; the word embedding (and an untied head) has
        ``padded_vocab_size`` rows of which the first ``vocab_size`` are real."""
        fused = config.fused_tensors()
        vocab_tensors = ["word_embeddings.weight"]
        if config.untie_embeddings_and_output_weights:
            vocab_tensors.append("output_layer.weight")
        return {
            "family": self.name,
            "fused": fused,
            "vocab_size": data.tokenizer.vocab_size if data is not None else None,
            "padded_vocab_size": config.vocab_size,
            "vocab_tensors": vocab_tensors,
            "token_ids": _token_ids(data),
        }

    # GPT2LMHeadModel and LlamaForCausalLM (families/gpt_hf.py).
    hf_adapter = GPTHFAdapter()
    hf_model_types = GPTHFAdapter.model_types

    def config_from_checkpoint(self, metadata: dict) -> GPTConfig:
        structure = metadata["model_structure"]
        section = GPTModelSection(**metadata["config"]["model"])
        return section.resolved(vocab_size=structure["padded_vocab_size"])


def _token_ids(data: GPTData | None) -> dict | None:
    """The tokenizer's special ids, for an exported Hugging Face config (None when unknown)."""
    if data is None:
        return None
    t = data.tokenizer
    ids = {"bos_token_id": t.bos, "eos_token_id": t.eod, "pad_token_id": t.pad}
    return {k: (int(v) if v is not None and v >= 0 else None) for k, v in ids.items()}

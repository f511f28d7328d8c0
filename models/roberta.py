"""RoBERTa (and BERT-style) bidirectional encoder with a masked-LM head and an optional binary
(sentence-order) head, on the shared transformer blocks.

Embeddings: word + learned position + token type, then LayerNorm and dropout (BERT's
embedding block). Positions follow RoBERTa: a token's position is ``padding_idx + 1 + (its
index among the non-pad tokens)`` and pads get ``padding_idx`` (Hugging Face's
``create_position_ids_from_input_ids``), so ``max_position_embeddings`` is ``seq_length + 2``
for the usual ``padding_idx`` 1. Blocks: ``causal=False`` with a key-padding mask, post-LN
(``norm_position="post"``, what Hugging Face RoBERTa checkpoints need) or pre-LN (Megatron's
BertModel), exact erf GELU (``activation="gelu_exact"``) or the tanh one.

MLM head: ``lm_dense`` (h -> h) -> GELU -> ``lm_norm`` -> logits against the tied word
embedding plus ``lm_bias`` (a ``VocabParallelBias``: split with the vocabulary under TP).
Binary head (``add_binary_head``): ``pooler`` (h -> h, tanh) on the first token, then
``binary_head`` (h -> 2).

Precision: every transformer GEMM (QKV, attention projection, fc1, fc2) goes through
``fp8train.linear.Linear`` with the recipe; the heads (``lm_dense``, the tied decoder,
``pooler``, ``binary_head``) are built with ``recipe=None`` and stay in higher precision at
every level, like GPT's output head: they feed softmaxes directly and are a small share of
the FLOPs. Embeddings, norms and biases follow the precision table (higher precision).

Tensor parallelism: the heads are replicated; under sequence parallelism the last stage first
gathers the sequence (``gather_from_region``: each rank then computes the heads on the whole
sequence, and the backward keeps this rank's slice of the gradient), so every rank's head
gradient is already the whole one.
"""

from __future__ import annotations

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
from parallel.tensor_parallel.cross_entropy import (
    vocab_parallel_argmax,
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from parallel.tensor_parallel.layers import VocabParallelBias, VocabParallelEmbedding
from parallel.tensor_parallel.mappings import gather_from_region, scatter_to_region

__all__ = ["RobertaConfig", "RobertaModel", "roberta_position_ids"]


@dataclass(kw_only=True)
class RobertaConfig(TransformerConfig):
    """Encoder shape; field names equal the config file's ``model.*`` keys where they exist.

    ``vocab_size`` is the padded vocabulary; ``padding_idx`` the tokenizer's pad id.
    """

    seq_length: int
    vocab_size: int
    norm_position: str = "post"  # BERT/RoBERTa; "pre" is Megatron's BertModel
    activation: str = "gelu_exact"
    max_position_embeddings: int | None = None  # None -> seq_length + padding_idx + 1
    padding_idx: int = 1
    type_vocab_size: int = 1  # RoBERTa: 1; 2 with the binary (sentence-order) head
    add_binary_head: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length + self.padding_idx + 1
        if self.seq_length + self.padding_idx + 1 > self.max_position_embeddings:
            raise ValueError(
                f"model.max_position_embeddings ({self.max_position_embeddings}) must be >= "
                f"model.seq_length + padding index + 1 ({self.seq_length + self.padding_idx + 1})"
                " (RoBERTa's positions start after the padding index)"
            )
        if self.add_binary_head and self.type_vocab_size < 2:
            raise ValueError("the binary head needs two token types (type_vocab_size >= 2)")


def roberta_position_ids(tokens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """``[b, s]`` positions: ``padding_idx + 1 + k`` for the k-th non-pad token of a row,
    ``padding_idx`` for pads (Hugging Face RoBERTa's numbering)."""
    mask = tokens.ne(padding_idx).long()
    return torch.cumsum(mask, dim=1) * mask + padding_idx


def _fp32_grad_lookup(table: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    """``table(ids)`` with its weight gradient summed in FP32 and rounded to the table's dtype
    once. A BF16 table's own backward adds the looked-up rows' gradients in BF16 (CPU
    ``index_add_``), so a row that many tokens share loses bits to swamping: the one
    token-type row (type_vocab_size 1) sums all b*s tokens and came out 5-24% off, 3% too
    small on average, enough for bf16 RoBERTa to fall behind fp32. Forward values are
    unchanged (exact casts); these tables are small, so their FP32 copy costs nothing."""
    weight = table.weight
    if weight.dtype == torch.float32:
        return table(ids)
    return F.embedding(ids, weight.float()).to(weight.dtype)


class RobertaModel(ParallelModel):
    """``forward_chunk`` inputs: ``tokens`` ``[b, s]``, optional ``attention_mask`` ``[b, s]``
    (1 = token, 0 = padding; default: ``tokens != padding_idx``), ``token_types``
    ``[b, s]``, ``labels`` ``[b, s]`` (-100 = not predicted). The last chunk returns
    ``{"lm": per-token MLM loss [b, s] (with labels) or logits [b, s, V] (without),
    "lm_correct": [b, s] float, 1 where the argmax is the label (with labels), "binary":
    [b, 2] logits or None}``.

    Names: ``word_embeddings``, ``position_embeddings``, ``token_type_embeddings``,
    ``embedding_norm`` (first stage); ``layers.{i}`` (global index); ``lm_dense``,
    ``lm_norm``, ``lm_bias``, ``pooler``, ``binary_head`` (last stage; the last stage also
    holds a copy of ``word_embeddings`` for the tied decoder when the model is split).
    """

    # The blocks' attention and MLP classes. A class attribute, not a constructor argument:
    # the single-process reference of a split model is rebuilt through ``(config, ctx,
    # pipeline)`` alone (models.base), so a variant is a subclass that overrides this.
    layer_spec: ClassVar[LayerSpec] = DEFAULT_LAYER_SPEC

    def __init__(self, config: RobertaConfig, ctx: BuildContext | None = None, pipeline=None):
        ctx = ctx or BuildContext()
        ctx.check_sequence_split(config.seq_length)
        super().__init__(config, ctx, pipeline)

    def build(self, ctx: BuildContext) -> None:
        cfg, device, group, stage = self.config, ctx.device, ctx.tp_group, self.pipeline
        h, skip = cfg.hidden_size, not ctx.materialize
        self.word_embeddings = None
        if stage.has_embedding() or stage.has_head():  # the decoder is tied to it
            if group is None:
                self.word_embeddings = nn.Embedding(cfg.vocab_size, h, device=device)
            else:
                self.word_embeddings = VocabParallelEmbedding(
                    cfg.vocab_size, h, group=group, device=device, skip_init=skip,
                    meter=ctx.meter,
                )  # fmt: skip
        if stage.has_embedding():
            self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h, device=device)
            self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, h, device=device)
            self.embedding_norm = LayerNorm(h, eps=cfg.norm_epsilon, device=device)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        spec = self.layer_spec
        self.layers = LayerDict(
            (str(i), TransformerLayer(cfg, ctx, causal=False, recompute=cfg.recompute, spec=spec))
            for i in stage.local_layers()
        )
        if not stage.has_head():
            return
        # recipe=None: the heads stay in higher precision (module doc).
        self.lm_dense = Linear(h, h, recipe=None, device=device)
        self.lm_norm = LayerNorm(h, eps=cfg.norm_epsilon, device=device)
        self.lm_bias = VocabParallelBias(cfg.vocab_size, group=group, device=device, skip_init=skip)
        if cfg.add_binary_head:
            self.pooler = Linear(h, h, recipe=None, device=device)
            self.binary_head = Linear(h, 2, recipe=None, device=device)

    def init_parameter(self, module_name, module, param_name, tensor) -> None:
        """Megatron's init (``models.transformer.init_parameter_``)."""
        cfg = self.config
        init_parameter_(
            module_name, module, param_name, tensor, cfg.init_method_std, cfg.num_layers
        )

    def pipeline_copies(self) -> dict[str, bool]:
        if not self.pipeline.is_split:
            return {}
        return {"word_embeddings.weight": self.pipeline.has_embedding()}

    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        seq = self.config.seq_length // (self.ctx.tp if self.sequence_parallel else 1)
        return (micro_batch_size, seq, self.config.hidden_size)

    def forward(self, tokens: torch.Tensor, **inputs) -> dict:
        """The whole model (one stage): ``forward_chunk(0, None, {"tokens": tokens, ...})``."""
        if self.pipeline.is_split:
            raise RuntimeError("this RobertaModel is one pipeline stage: use forward_chunk")
        return self.forward_chunk(0, None, {"tokens": tokens, **inputs})

    def forward_chunk(self, chunk: int, hidden: torch.Tensor | None, inputs: dict):
        cfg, stage = self.config, self.pipeline
        tokens = inputs["tokens"]
        mask = inputs.get("attention_mask")
        keep = tokens.ne(cfg.padding_idx) if mask is None else mask.bool()
        attn_mask = keep[:, None, None, :]  # [b, 1, 1, s]: every query sees the real keys
        if stage.has_embedding(chunk):
            hidden = self._embed(tokens, inputs.get("token_types"))
        for i in stage.chunk_layers(chunk):
            hidden = self.layers[i](hidden, None, attn_mask)  # [b, s(/tp), h]
        if not stage.has_head(chunk):
            return hidden
        return self._heads(hidden, inputs.get("labels"))

    def _embed(self, tokens: torch.Tensor, token_types: torch.Tensor | None) -> torch.Tensor:
        positions = roberta_position_ids(tokens, self.config.padding_idx)
        if token_types is None:
            token_types = torch.zeros_like(tokens)
        types = _fp32_grad_lookup(self.token_type_embeddings, token_types)
        x = self.word_embeddings(tokens) + types
        x = x + _fp32_grad_lookup(self.position_embeddings, positions)  # [b, s, h]
        x = self.dropout(self.embedding_norm(x))
        if self.sequence_parallel:
            x = scatter_to_region(x, self.tp_group, dim=1, meter=self.meter)  # [b, s/tp, h]
        return x

    def _heads(self, x: torch.Tensor, labels: torch.Tensor | None) -> dict:
        group, meter = self.tp_group, self.meter
        if self.sequence_parallel:
            # The heads run on the whole sequence.
            x = gather_from_region(x, group, dim=1, meter=meter)  # [b, s, h]
        binary = None
        if self.config.add_binary_head:
            binary = self.binary_head(torch.tanh(self.pooler(x[:, 0]))).float()  # [b, 2]
        y = self.lm_norm(F.gelu(self.lm_dense(x), approximate=self._gelu))  # [b, s, h]
        if group is None:
            logits = self.lm_bias(F.linear(y, self.word_embeddings.weight)).float()  # [b, s, V]
            if labels is None:
                return {"lm": logits, "binary": binary}
            b, s = logits.shape[:2]
            loss = F.cross_entropy(logits.view(b * s, -1), labels.reshape(b * s), reduction="none")
            correct = (logits.detach().argmax(-1) == labels).float()
            return {"lm": loss.view(b, s), "lm_correct": correct, "binary": binary}
        logits = vocab_parallel_logits(y, self.word_embeddings.weight, group, meter=meter)
        logits = self.lm_bias(logits).float()  # [b, s, V/tp]
        if labels is None:
            return {"lm": gather_from_region(logits, group, dim=-1, meter=meter), "binary": binary}
        correct = (vocab_parallel_argmax(logits.detach(), group, meter=meter) == labels).float()
        loss = vocab_parallel_cross_entropy(logits, labels, group, meter=meter)
        return {"lm": loss, "lm_correct": correct, "binary": binary}

    @property
    def _gelu(self) -> str:
        return "none" if self.config.activation == "gelu_exact" else "tanh"

"""GPT decoder: GPT-2/GPT-3 by default, with the Llama switches (RoPE, RMSNorm, SwiGLU, GQA,
untied head).

Every transformer GEMM goes through ``fp8train.linear.Linear`` with the precision recipe (see
``models/transformer.py`` for the fused QKV and fc1 layouts). The output head does not: it is
either the tied word-embedding matrix or an untied ``output_layer`` built with ``recipe=None``,
and both are embedding-class weights, kept in higher precision at every level because
(a) the logits feed the softmax directly, so FP8 error there shifts every token probability
(TE and MS-AMP keep the vocab projection out of FP8 for this reason), and (b) a tied matrix is
also the input embedding, a lookup table the precision table keeps in FP32/BF16.

Logits are returned, and the cross entropy computed, in float32 even when parameters are bf16.

Incremental decoding: ``forward(tokens, kv_cache=model.new_kv_cache())`` runs only the new
tokens against the keys and values cached by earlier calls (models/kv_cache.py), for a
single-process model in eval mode; without a cache the forward is the training one.
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
from models.kv_cache import KVCache
from models.transformer import (
    DEFAULT_LAYER_SPEC,
    LayerSpec,
    TransformerConfig,
    TransformerLayer,
    init_parameter_,
    make_norm,
    rotary_cos_sin,
)
from parallel.tensor_parallel.cross_entropy import (
    vocab_parallel_cross_entropy,
    vocab_parallel_logits,
)
from parallel.tensor_parallel.layers import ColumnParallelLinear, VocabParallelEmbedding
from parallel.tensor_parallel.mappings import gather_from_region, scatter_to_region

__all__ = ["GPTConfig", "GPTModel", "KVCache", "LayerDict", "pad_vocab_size"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")


def pad_vocab_size(vocab_size: int, divisible_by: int = 128, tp_size: int = 1) -> int:
    """Megatron's ``make_vocab_size_divisible_by``: round up to a multiple of
    ``divisible_by * tp_size`` so the head GEMM has friendly shapes and splits evenly under TP.
    """
    multiple = divisible_by * tp_size
    if multiple < 1:
        raise ValueError(f"make_vocab_size_divisible_by * tp_size = {multiple}: must be >= 1")
    return -(-vocab_size // multiple) * multiple


@dataclass(kw_only=True)
class GPTConfig(TransformerConfig):
    """GPT model shape; field names equal the config file's ``model.*`` keys.

    ``vocab_size`` is the padded size (see ``pad_vocab_size``), given by the caller.
    """

    seq_length: int
    vocab_size: int
    max_position_embeddings: int | None = None  # None -> seq_length
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    untie_embeddings_and_output_weights: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"model.position_embedding_type={self.position_embedding_type!r}: choose one "
                f"of {POSITION_EMBEDDING_TYPES}"
            )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"model.max_position_embeddings ({self.max_position_embeddings}) must be >= "
                f"model.seq_length ({self.seq_length})"
            )
        if self.position_embedding_type == "rope" and self.kv_channels % 2:
            raise ValueError(f"RoPE needs an even model.kv_channels, got {self.kv_channels}")
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size={self.vocab_size}: must be >= 1")

    @classmethod
    def from_model_section(cls, section: object, vocab_size: int) -> GPTConfig:
        """``TransformerConfig.from_model_section`` with the (padded) vocabulary, which
        depends on the tokenizer and the padding, not on the model section."""
        return super().from_model_section(section, vocab_size=vocab_size)


class GPTModel(ParallelModel):
    """Decoder-only LM. ``forward(tokens)`` -> float32 logits, or per-token loss with labels.

    Module names (used by checkpoints and by ``fp8_stats``): ``word_embeddings``,
    ``position_embeddings`` (learned only), ``layers.{i}.{input_norm, attention.qkv,
    attention.proj, post_attention_norm, mlp.fc1, mlp.fc2}`` with the default layer spec (a
    ``layer_spec`` of other sublayers names theirs), ``final_norm``, ``output_layer`` (untied
    only).

    Pipeline parallelism (``pipeline``: this rank's ``PipelineLayout``): the module holds only
    this stage's layers (global names, see ``LayerDict``), the embeddings on the first stage,
    the final norm and head on the last; ``forward_chunk`` runs one model chunk. With a tied
    head the last stage keeps its own copy of ``word_embeddings``, equal at the start (both are
    cut from one full model) and kept equal by summing the two copies' gradients
    (``pipeline_copies``), as Megatron does.
    """

    # The blocks' attention and MLP classes. A class attribute, not a constructor argument:
    # the single-process reference of a split model is rebuilt through ``(config, ctx,
    # pipeline)`` alone (models.base), so a variant is a subclass that overrides this.
    layer_spec: ClassVar[LayerSpec] = DEFAULT_LAYER_SPEC

    def __init__(
        self,
        config: GPTConfig,
        ctx: BuildContext | None = None,
        pipeline=None,
    ):
        ctx = ctx or BuildContext()
        ctx.check_sequence_split(config.seq_length)
        super().__init__(config, ctx, pipeline)

    def build(self, ctx: BuildContext) -> None:
        config, device = self.config, ctx.device
        h, group, stage = config.hidden_size, ctx.tp_group, self.pipeline
        skip = not ctx.materialize
        self.word_embeddings = None
        if stage.has_embedding() or (stage.has_head() and self._tied):
            if group is None:
                self.word_embeddings = nn.Embedding(config.vocab_size, h, device=device)
            else:
                self.word_embeddings = VocabParallelEmbedding(
                    config.vocab_size, h, group=group, device=device, skip_init=skip,
                    meter=ctx.meter,
                )  # fmt: skip
        self.position_embeddings = (
            nn.Embedding(config.max_position_embeddings, h, device=device)
            if config.position_embedding_type == "learned_absolute" and stage.has_embedding()
            else None
        )
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        spec = self.layer_spec
        self.layers = LayerDict(
            (str(i), TransformerLayer(config, ctx, recompute=config.recompute, spec=spec))
            for i in stage.local_layers()
        )
        self.final_norm = None
        self.output_layer = None
        if not stage.has_head():
            return
        sp_group = group if ctx.sequence_parallel else None
        self.final_norm = make_norm(config, device=device, sp_group=sp_group, meter=ctx.meter)
        # recipe=None: the head stays in higher precision (module docstring).
        if not self._tied:
            if group is None:
                self.output_layer = Linear(h, config.vocab_size, False, recipe=None, device=device)
            else:
                self.output_layer = ColumnParallelLinear(
                    h, config.vocab_size, group=group, bias=False,
                    sequence_parallel=ctx.sequence_parallel, device=device, skip_init=skip,
                    meter=ctx.meter,
                )  # fmt: skip

    @property
    def _tied(self) -> bool:
        return not self.config.untie_embeddings_and_output_weights

    def init_parameter(self, module_name, module, param_name, tensor) -> None:
        """Megatron's init (``models.transformer.init_parameter_``)."""
        cfg = self.config
        init_parameter_(
            module_name, module, param_name, tensor, cfg.init_method_std, cfg.num_layers
        )

    def pipeline_copies(self) -> dict[str, bool]:
        """A tied head keeps a copy of ``word_embeddings`` on the last stage; the first
        stage's is the counted one."""
        if not self._tied or self.word_embeddings is None or not self.pipeline.is_split:
            return {}
        return {"word_embeddings.weight": self.pipeline.has_embedding()}

    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        """``[micro, seq, hidden]``, the sequence split over TP under sequence parallelism."""
        seq = self.config.seq_length // (self.ctx.tp if self.sequence_parallel else 1)
        return (micro_batch_size, seq, self.config.hidden_size)

    def forward(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
    ) -> torch.Tensor:
        """tokens ``[b, s]`` int64 -> logits ``[b, s, V]`` float32, or with ``labels`` ``[b, s]``
        the unreduced cross entropy ``[b, s]`` float32 (Megatron style: the caller applies the
        loss mask and averages). Labels equal to -100 give zero loss.

        kv_cache (``new_kv_cache``; inference, no autograd): ``tokens`` are the next ``s``
        tokens after the ``kv_cache.length`` cached ones (default positions continue from
        there); their keys and values are appended to the cache and the result covers only
        them. Feeding a sequence in any number of chunks gives the logits of one full forward.
        """
        if kv_cache is not None:
            return self._forward_cached(tokens, position_ids, labels, kv_cache)
        if self.pipeline.is_split:
            raise RuntimeError(
                "this GPTModel is one pipeline stage; run it chunk by chunk with forward_chunk "
                "(parallel/pipeline/engine.py does)"
            )
        position_ids = self._positions(tokens, position_ids)
        x = self._embed(tokens, position_ids)
        x = self._run_layers(x, position_ids, self.layers)
        return self._head(x, labels)

    def forward_chunk(self, chunk: int, hidden: torch.Tensor | None, inputs: dict):
        """Run model chunk ``chunk`` of this pipeline stage. ``inputs``: ``tokens`` ``[b, s]``,
        optional ``position_ids`` and ``labels``. The model's first chunk embeds the tokens
        (``hidden`` is None); the others continue from the received ``hidden`` ``[b, s, h]``
        (``[b, s/tp, h]`` under sequence parallelism). The last chunk returns what
        ``forward`` returns; the others the hidden states to send on."""
        stage = self.pipeline
        tokens = inputs["tokens"]
        position_ids = self._positions(tokens, inputs.get("position_ids"))
        if stage.has_embedding(chunk):
            hidden = self._embed(tokens, position_ids)
        layers = [self.layers[i] for i in stage.chunk_layers(chunk)]
        hidden = self._run_layers(hidden, position_ids, layers)
        if stage.has_head(chunk):
            return self._head(hidden, inputs.get("labels"))
        return hidden

    def new_kv_cache(self, max_length: int | None = None) -> KVCache:
        """An empty KV cache for sequences of up to ``max_length`` tokens (prompt and
        generation; default and upper bound ``max_position_embeddings``)."""
        self._check_cache_use()
        limit = self.config.max_position_embeddings
        max_length = limit if max_length is None else max_length
        if not 1 <= max_length <= limit:
            raise ValueError(
                f"KV cache max_length={max_length}: must be in [1, max_position_embeddings={limit}]"
            )
        return KVCache(self.config.num_layers, max_length)

    def _check_cache_use(self) -> None:
        if self.is_parallel:
            raise ValueError(
                f"KV cache: this GPTModel is one slice of a parallel model (tensor parallel "
                f"{self.ctx.tp}, {self.pipeline.stages} pipeline stages); the cache is for a "
                "single-process model (TP=1, PP=1), e.g. from families.load_pretrained"
            )
        if self.training:
            # Dropout would differ from step to step, and FP8 linears would advance their
            # delayed-scaling state on every decoding step.
            raise ValueError("KV cache: the model must be in eval mode (call model.eval())")

    @torch.no_grad()
    def _forward_cached(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor | None,
        labels: torch.Tensor | None,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        self._check_cache_use()
        if len(kv_cache.layers) != self.config.num_layers:
            raise ValueError(
                f"KV cache has {len(kv_cache.layers)} layers, the model "
                f"{self.config.num_layers}: make it with model.new_kv_cache()"
            )
        past, s = kv_cache.length, tokens.shape[1]
        if past + s > kv_cache.max_length:  # checked before any layer appends
            raise ValueError(
                f"KV cache full: {past} cached + {s} new tokens > max_length {kv_cache.max_length}"
            )
        if position_ids is None:
            position_ids = torch.arange(past, past + s, device=tokens.device)[None]  # [1, s]
        x = self._embed(tokens, position_ids)
        x = self._run_layers(x, position_ids, self.layers, kv_cache)
        return self._head(x, labels)

    def _positions(self, tokens: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        if position_ids is not None:
            return position_ids
        s = tokens.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(
                f"sequence length {s} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
        return torch.arange(s, device=tokens.device)[None]  # [1, s]

    def _embed(self, tokens: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(tokens)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)  # [b, s, h]
        x = self.embedding_dropout(x)
        if self.sequence_parallel:
            # From here to the head every rank holds its slice of the sequence: norms, dropout
            # and residuals work on [b, s/tp, h]; the GEMM layers gather and scatter.
            x = scatter_to_region(x, self.tp_group, dim=1, meter=self.meter)  # [b, s/tp, h]
        return x

    def _run_layers(
        self, x: torch.Tensor, position_ids: torch.Tensor, layers, kv_cache: KVCache | None = None
    ) -> torch.Tensor:
        cfg = self.config
        rotary = None
        if cfg.position_embedding_type == "rope":
            rotary = rotary_cos_sin(position_ids, cfg.kv_channels, cfg.rotary_base)
        if kv_cache is not None:
            for layer, cache in zip(layers, kv_cache.layers, strict=True):
                x = layer(x, rotary, kv_cache=cache)  # [b, s, h]
            return x
        for layer in layers:
            x = layer(x, rotary)  # [b, s, h]
        return x

    def _head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        x = self.final_norm(x)  # [b, s, h]
        if self.tp_group is not None:
            return self._parallel_head(x, labels)
        if self.output_layer is not None:
            logits = self.output_layer(x)  # [b, s, V]
        else:
            logits = F.linear(x, self.word_embeddings.weight)  # [b, s, V]
        logits = logits.float()  # softmax / cross entropy in fp32 at every level
        if labels is None:
            return logits
        b, s = logits.shape[:2]
        loss = F.cross_entropy(
            logits.view(b * s, -1), labels.reshape(b * s), reduction="none"
        )  # [b*s]
        return loss.view(b, s)

    def _parallel_head(self, x: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """Vocab-parallel head: each rank holds ``[b, s, V/tp]`` logits; the loss never gathers
        the full vocabulary (logits are gathered only when asked for without labels)."""
        group = self.tp_group
        if self.output_layer is not None:
            logits = self.output_layer(x)  # [b, s, V/tp]
        else:
            # [b, s, V/tp]
            logits = vocab_parallel_logits(
                x, self.word_embeddings.weight, group,
                sequence_parallel=self.sequence_parallel, meter=self.meter,
            )  # fmt: skip
        logits = logits.float()
        if labels is None:
            return gather_from_region(logits, group, dim=-1, meter=self.meter)  # [b, s, V]
        return vocab_parallel_cross_entropy(logits, labels, group, meter=self.meter)  # [b, s]

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Unique parameters (a tied head counts once). ``exclude_embeddings`` drops the word and
        position embeddings and an untied output layer (Kaplan et al.'s non-embedding count).
        """
        skip: set[int] = set()
        if exclude_embeddings:
            embeds = (self.word_embeddings, self.position_embeddings, self.output_layer)
            skip = {id(p) for m in embeds if m is not None for p in m.parameters()}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

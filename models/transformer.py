"""Transformer blocks shared by GPT, RoBERTa and ViT.

Pre-norm layers (``x + attn(norm(x))``, ``x + mlp(norm(x))``) whose four GEMMs (fused QKV,
attention output projection, fc1, fc2) all go through ``fp8train.linear.Linear`` with the
model's precision recipe, so an FP8 level changes every transformer GEMM and nothing else.
Norms, biases and embeddings stay in higher precision at every level (the precision table).

Fused QKV layout (checkpoint conversion depends on it). Megatron's per-query-group interleaving:
the ``qkv.weight`` rows ``[G * (r + 2) * d, hidden]`` with G = num_query_groups,
r = num_attention_heads // G (query heads per group) and d = kv_channels are ordered

    for g in range(G):  [q head g*r, ..., q head g*r + r-1, k head g, v head g]   (each d rows)

so ``qkv.view(G, r + 2, d, hidden)`` splits it. Chosen over ``[q | k | v]`` blocks because a
tensor-parallel column split of dim 0 then hands each rank whole query groups (no per-block
re-split) and Megatron checkpoints use the same order. With G == heads (plain MHA) it is
``[q0, k0, v0, q1, k1, v1, ...]``.

Fused SwiGLU fc1 layout: ``fc1.weight`` rows are ``[gate (f rows) | up (f rows)]`` and the
activation is ``silu(gate) * up`` (Megatron's single-rank layout; a TP split must split each
half, not dim 0 as a whole).

Activation recompute (``recompute``: Megatron's ``--recompute-granularity``): "full" keeps only
each layer's input and reruns the whole layer in backward; "selective" reruns only the attention
core (the ``scaled_dot_product_attention`` call, whose ``[b, heads, s, s]`` probabilities are the
largest activation per FLOP of recompute). Both give bit-identical losses and gradients: the
checkpoint restores the RNG for dropout (the tensor-parallel tracker's stream included, see
``_recompute_contexts``) and FP8 casts replay the original scales (``fp8train.linear``).

Layer specs: a ``TransformerLayer`` builds its attention and MLP from a ``LayerSpec`` (the
classes, megatron-core's ModuleSpec idea kept to the two parts that vary), so a mixture of
experts or another attention is a new class in its own file plus a spec, not an edit of this
block; ``DEFAULT_LAYER_SPEC`` (``SelfAttention``, ``MLP``) is what GPT, RoBERTa and ViT use.

GELU is the tanh approximation, as in the published GPT-2 code (HF ``gelu_new``), so converted
GPT-2 weights reproduce its logits; exact erf-GELU differs by < 1e-3 per element.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from fp8train.linear import Linear, compiled_recompute_contexts, recompute_scale_contexts
from models.context import BuildContext, tp_size
from models.kv_cache import LayerKVCache
from parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from parallel.tensor_parallel.mappings import copy_to_region
from parallel.tensor_parallel.random import get_tracker

__all__ = [
    "TransformerConfig",
    "LayerNorm",
    "RMSNorm",
    "SequenceParallelLayerNorm",
    "SequenceParallelRMSNorm",
    "layer_norm",
    "make_norm",
    "rotary_cos_sin",
    "apply_rotary",
    "SelfAttention",
    "MLP",
    "LayerSpec",
    "DEFAULT_LAYER_SPEC",
    "TransformerLayer",
    "column_linear",
    "row_linear",
    "RECOMPUTE",
    "init_parameter_",
    "ACTIVATIONS",
    "NORMALIZATIONS",
    "NORM_POSITIONS",
    "check_recompute",
    "default_ffn_size",
    "tp_size",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "gelu_exact", "swiglu")  # gelu: tanh approximation (GPT-2); exact: erf
NORM_POSITIONS = ("pre", "post")  # pre-LN (GPT, Megatron's BERT) or post-LN (BERT/RoBERTa)
RECOMPUTE = ("none", "full", "selective")


def check_recompute(recompute: str) -> None:
    """The one check of ``model.recompute`` (the config schema's Literal lists the same)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"model.recompute={recompute!r}: choose one of {RECOMPUTE}")


def default_ffn_size(hidden_size: int, activation: str) -> int:
    """The MLP width when ``model.ffn_hidden_size`` is null: 4h, or for SwiGLU 8h/3 rounded up
    to a multiple of 64 (3 matrices of 8h/3 hold as many parameters as 2 of 4h)."""
    if activation == "swiglu":
        return -(-int(8 * hidden_size / 3) // 64) * 64
    return 4 * hidden_size


def _sharded_rng(active: bool):
    """Dropout on tensors that differ per tensor-parallel rank (local heads, sequence shards)
    draws from the per-rank stream, so shards get independent masks; replicated tensors keep the
    default stream, identical on every rank."""
    return get_tracker().fork() if active else contextlib.nullcontext()


class _TrackerReplay:
    """Runs the block with the TP RNG tracker's streams as they were in ``snapshot``, then puts
    back the streams as they are now: the recompute must redraw the original forward's shard
    dropout masks (the checkpoint restores only the default generators) without moving the
    streams, which the rest of the forward has already advanced. Re-enterable (a class, not a
    generator) like the FP8 scale replay it wraps."""

    def __init__(self, snapshot: dict[str, torch.Tensor], inner) -> None:
        self.snapshot, self.inner = snapshot, inner
        self.saved: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        tracker = get_tracker()
        self.saved.append(tracker.get_states())
        tracker.set_states(self.snapshot)
        self.inner.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            self.inner.__exit__(*exc)
        finally:
            get_tracker().set_states(self.saved.pop())


def _recompute_contexts():
    """``context_fn`` for ``torch.utils.checkpoint``, called at the start of the original
    forward: FP8 scale record/replay, plus the TP RNG tracker's streams captured now and
    restored for the recompute."""
    forward, recompute = recompute_scale_contexts()
    tracker = get_tracker()
    if not tracker.names():  # no tensor-parallel streams: nothing more to replay
        return forward, recompute
    return forward, _TrackerReplay(tracker.get_states(), recompute)


def _checkpoint(fn, *args):
    # use_reentrant=False: works with inputs that need no grad and with custom autograd
    # Functions' non-tensor ctx state; preserve_rng_state: dropout redraws the same masks.
    if torch.compiler.is_compiling():
        # Compiled, the recompute is part of the backward graph; its policy keeps the FP8
        # casts' forward scales (fp8train.linear.compiled_recompute_contexts). Compile takes
        # selective-checkpoint contexts only.
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            preserve_rng_state=True,
            context_fn=compiled_recompute_contexts,
        )
    return checkpoint(
        fn, *args, use_reentrant=False, preserve_rng_state=True, context_fn=_recompute_contexts
    )


def column_linear(in_f, out_f, bias, ctx: BuildContext, blocks: int = 1):
    """The output-splitting GEMM: an fp8train Linear, or its column-parallel shard under TP
    (under sequence parallelism its input arrives as sequence shards and is all-gathered).
    ``blocks``: the output is that many fused blocks, each split over the ranks. Public so a
    block plugged in through a ``LayerSpec`` splits the way the stock ones do."""
    if ctx.tp_group is None:
        return Linear(in_f, out_f, bias, **ctx.linear_kwargs())
    return ColumnParallelLinear(
        in_f, out_f, group=ctx.tp_group, bias=bias, blocks=blocks,
        sequence_parallel=ctx.sequence_parallel, skip_init=not ctx.materialize,
        meter=ctx.meter, **ctx.linear_kwargs(),
    )  # fmt: skip


def row_linear(in_f, out_f, bias, ctx: BuildContext):
    """The input-splitting GEMM: its partial outputs are all-reduced over the TP group, or
    reduce-scattered into sequence shards under sequence parallelism."""
    if ctx.tp_group is None:
        return Linear(in_f, out_f, bias, **ctx.linear_kwargs())
    return RowParallelLinear(
        in_f, out_f, group=ctx.tp_group, bias=bias, sequence_parallel=ctx.sequence_parallel,
        skip_init=not ctx.materialize, meter=ctx.meter, **ctx.linear_kwargs(),
    )  # fmt: skip


@dataclass(kw_only=True)
class TransformerConfig:
    """Fields of the shared blocks; the names equal the config file's ``model.*`` keys.

    ``None`` fields are resolved in ``__post_init__`` so a built config is fully concrete.
    These defaults and checks are the only ones: the YAML schema (training/config_schema.py)
    takes its ``model.*`` defaults from here and validates by building the family's config.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None -> num_attention_heads (plain MHA)
    kv_channels: int | None = None  # None -> hidden_size // num_attention_heads
    ffn_hidden_size: int | None = None  # None -> 4h, or 8h/3 rounded up to 64 for swiglu
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    activation: str = "gelu"
    norm_position: str = "pre"
    add_bias_linear: bool = True
    hidden_dropout: float = 0.0  # the config schema's defaults: the YAML and the class agree
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    recompute: str = "none"  # activation recompute: one of RECOMPUTE (module doc)

    def __post_init__(self):
        check_recompute(self.recompute)
        for name in ("num_layers", "hidden_size", "num_attention_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be >= 1")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(
                f"model.normalization={self.normalization!r}: choose one of {NORMALIZATIONS}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation={self.activation!r}: choose one of {ACTIVATIONS}")
        if self.norm_position not in NORM_POSITIONS:
            raise ValueError(
                f"model.norm_position={self.norm_position!r}: choose one of {NORM_POSITIONS}"
            )
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.num_query_groups})"
            )
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"model.hidden_size ({self.hidden_size}) must be divisible by "
                    f"model.num_attention_heads ({self.num_attention_heads}) when "
                    "model.kv_channels is null"
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = default_ffn_size(self.hidden_size, self.activation)
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name}={getattr(self, name)}: must be in [0, 1)")

    @classmethod
    def from_model_section(cls, section: object, **given):
        """Build from any object (or mapping) whose attributes are named like the fields.

        Missing attributes keep the field default; extra ones (tokenizer settings, ...) are
        ignored. ``given`` supplies fields that do not come from the config section (a
        padded vocabulary, a data-dependent input size) and wins over the section.
        """
        get = section.get if isinstance(section, Mapping) else lambda k, d: getattr(section, k, d)
        missing = object()
        kwargs = {}
        for f in fields(cls):
            value = given[f.name] if f.name in given else get(f.name, missing)
            if value is not missing:
                kwargs[f.name] = value
        return cls(**kwargs)

    def layer_flops_per_step(self, batch: int, seq: int, causal: bool = True) -> float:
        """FLOPs of the ``num_layers`` blocks in one training step (forward + backward) over
        ``batch`` sequences of ``seq`` tokens, as Megatron counts them:
        ``6·B·s·L·(h(q+2kv) + c·q·s + q·h + h·f·(3 if swiglu else 2))`` with
        q = kv_channels·heads, kv = kv_channels·query_groups and c = 1 for a causal mask
        (half the score and value GEMMs are masked out), 2 for a bidirectional one."""
        h, f = self.hidden_size, self.ffn_hidden_size
        q = self.kv_channels * self.num_attention_heads
        kv = self.kv_channels * self.num_query_groups
        attn_core = (1 if causal else 2) * q * seq
        mlp = h * f * (3 if self.activation == "swiglu" else 2)
        per_layer = h * (q + 2 * kv) + attn_core + q * h + mlp
        return 6.0 * batch * seq * self.num_layers * per_layer

    def fused_tensors(self, prefix: str = "layers.*") -> dict[str, dict]:
        """The shared blocks' fused GEMM weights, for checkpoint readers and converters:
        ``qkv`` rows grouped per query group (module doc), SwiGLU's ``fc1`` as
        ``[gate | up]``. Keys are module-name patterns (``*`` = any layer index)."""
        groups = self.num_query_groups
        fused = {
            f"{prefix}.attention.qkv": {
                "kind": "qkv_grouped",
                "query_groups": groups,
                "heads_per_group": self.num_attention_heads // groups,
                "head_dim": self.kv_channels,
            }
        }
        if self.activation == "swiglu":
            fused[f"{prefix}.mlp.fc1"] = {"kind": "gate_up", "blocks": 2}
        return fused


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 whatever the parameter dtype (bf16 mean-squares lose bits)."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def layer_norm(x: torch.Tensor, shape, weight, bias, eps: float) -> torch.Tensor:
    """``F.layer_norm``; on the CPU with low-precision tensors, its backward runs in float32.
    The CPU's BF16 LayerNorm backward sums the weight and bias gradients over the tokens in
    BF16 (measured: 2.6% and 2.9% off a float64 sum over 1024 tokens, against 4e-7 in
    float32), where CUDA's kernel accumulates in float32, so a bf16 reference on the CPU would
    carry an error a GPU run does not have. The forward and what it keeps for backward are
    the native kernel's (the same memory). The planner's meta step takes this path too, so a
    plan and the CPU step it is checked against run the same operations (for a CUDA run the
    plan then counts the float32 backward's extra traffic, a few bytes per norm element)."""
    if x.is_cuda or x.dtype == torch.float32:
        return F.layer_norm(x, shape, weight, bias, eps)
    return _Fp32BackwardLayerNorm.apply(x, weight, bias, tuple(shape), eps)


class _Fp32BackwardLayerNorm(torch.autograd.Function):
    """LayerNorm whose forward is ``F.layer_norm`` as it is and whose backward recomputes it
    in float32 from the saved input: the gradients are float32 sums, rounded once to their
    tensors' dtypes."""

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        ctx.save_for_backward(x, weight, bias)
        ctx.shape, ctx.eps = shape, eps
        return F.layer_norm(x, shape, weight, bias, eps)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        x, weight, bias = (None if t is None else t.float() for t in saved)
        # The float32 statistics, then the kernel autograd would run for a float32
        # F.layer_norm: written out rather than through torch.autograd.grad, which
        # torch.compile cannot trace inside a backward.
        _, mean, rstd = torch.native_layer_norm(x, ctx.shape, weight, bias, ctx.eps)
        mask = [bool(need) for need in ctx.needs_input_grad[:3]]
        mask = [mask[0], mask[1] and weight is not None, mask[2] and bias is not None]
        found = torch.ops.aten.native_layer_norm_backward(
            grad.float(), x, ctx.shape, mean, rstd, weight, bias, mask
        )
        grads = [g.to(t.dtype) if g is not None else None for g, t in zip(found, saved)]
        return (*grads, None, None)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters and state) through ``layer_norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class SequenceParallelLayerNorm(LayerNorm):
    """LayerNorm on a sequence shard ``[b, s/tp, h]``. Its parameters pass through
    ``copy_to_region``, so in backward each rank's partial gradient (from its own tokens) is
    summed over the tensor-parallel group and every rank holds the full gradient."""

    def __init__(self, *args, group, meter=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.meter = group, meter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = (copy_to_region(t, self.group, meter=self.meter) for t in (self.weight, self.bias))
        return layer_norm(x, self.normalized_shape, w, b, self.eps)


class SequenceParallelRMSNorm(RMSNorm):
    """RMSNorm on a sequence shard; gradient handling as ``SequenceParallelLayerNorm``."""

    def __init__(self, *args, group, meter=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.group, self.meter = group, meter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = copy_to_region(self.weight, self.group, meter=self.meter)
        return (y * weight.float()).to(x.dtype)


def make_norm(config: TransformerConfig, device=None, sp_group=None, meter=None) -> nn.Module:
    """The configured norm; ``sp_group``: it runs on sequence shards of that TP group (its
    gradient all-reduce counted by ``meter``)."""
    h, eps = config.hidden_size, config.norm_epsilon
    if sp_group is not None:
        if config.normalization == "RMSNorm":
            return SequenceParallelRMSNorm(h, eps, device=device, group=sp_group, meter=meter)
        return SequenceParallelLayerNorm(h, eps=eps, device=device, group=sp_group, meter=meter)
    if config.normalization == "RMSNorm":
        return RMSNorm(h, eps, device=device)
    return LayerNorm(h, eps=eps, device=device)


def rotary_cos_sin(
    position_ids: torch.Tensor, dim: int, base: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[b, s, 1, dim]`` in float32 for rotate-half RoPE (Llama/Megatron style).

    Recomputed every forward instead of cached in buffers: it costs O(s * dim), and buffers
    would be cast by ``model.to(bfloat16)``, whose 8-bit mantissa garbles angles at large
    positions.
    """
    inv_freq = base ** (
        -torch.arange(0, dim, 2, device=position_ids.device, dtype=torch.float32) / dim
    )  # [dim/2]
    freqs = position_ids.float()[..., None] * inv_freq  # [b, s, dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [b, s, 1, dim]
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[b, s, n, d]`` by the angles; the arithmetic runs in float32."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class SelfAttention(nn.Module):
    """Multi-head / grouped-query self-attention with a fused QKV GEMM (layout: module doc)."""

    def __init__(
        self,
        config: TransformerConfig,
        ctx: BuildContext | None = None,
        *,
        causal: bool = True,
        recompute_core: bool = False,
    ):
        super().__init__()
        ctx = ctx or BuildContext()
        self.recompute_core = recompute_core  # selective recompute of the SDPA call
        # Under tensor parallelism each rank owns whole query groups (the QKV layout makes a
        # contiguous column split do exactly that): local head and group counts.
        tp = ctx.tp
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.head_dim = config.kv_channels
        self.causal = causal
        self.dropout_p = config.attention_dropout
        self.tp_sharded = tp > 1
        qkv_out = self.num_groups * (self.num_heads // self.num_groups + 2) * self.head_dim * tp
        bias = config.add_bias_linear
        self.qkv = column_linear(config.hidden_size, qkv_out, bias, ctx)
        proj_in = self.num_heads * self.head_dim * tp
        self.proj = row_linear(proj_in, config.hidden_size, bias, ctx)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        """x ``[b, s, h]`` -> ``[b, s, h]``.

        attn_mask: optional boolean mask broadcastable to ``[b, heads, s, s]`` (True = attend),
        for padding in bidirectional models; a causal layer ANDs it with the causal mask.
        kv_cache (inference): ``x`` holds only the new tokens, which follow the cached ones;
        their k/v are appended and they attend over the whole cached prefix (an ``attn_mask``
        then covers ``[b, heads, s, cached + s]``).
        """
        G, d = self.num_groups, self.head_dim
        r = self.num_heads // G
        qkv = self.qkv(x)  # [b, s, G*(r+2)*d]; full s even when x is a sequence shard
        b, s = qkv.shape[:2]
        qkv = qkv.view(b, s, G, r + 2, d)  # [b, s, G, r+2, d]
        q = qkv[:, :, :, :r].reshape(b, s, self.num_heads, d)  # [b, s, H, d]
        k = qkv[:, :, :, r]  # [b, s, G, d]
        v = qkv[:, :, :, r + 1]  # [b, s, G, d]
        if rotary is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, H|G, s, d]
        causal = self.causal
        if kv_cache is not None:
            k, v, attn_mask, causal = self._extend_from_cache(k, v, attn_mask, kv_cache)
        elif causal and attn_mask is not None:
            tri = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            attn_mask, causal = attn_mask & tri, False
        dropout_p = self.dropout_p if self.training else 0.0
        if self.recompute_core and torch.is_grad_enabled():
            y = _checkpoint(self._core, q, k, v, attn_mask, dropout_p, causal)
        else:
            y = self._core(q, k, v, attn_mask, dropout_p, causal)  # [b, H, s, d]
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * d)  # [b, s, H*d]
        return self.proj(y)  # [b, s, h]

    def _extend_from_cache(self, k, v, attn_mask, kv_cache: LayerKVCache):
        """The new tokens' k/v ``[b, G, s, d]`` -> ``(k, v, attn_mask, causal)`` over all
        ``past + s`` positions. The causal mask becomes explicit: SDPA's ``is_causal`` aligns
        the triangle to the top-left corner, so with ``past`` keys before the queries it would
        hide most of the prefix; query i sits at position past + i and sees keys 0..past + i."""
        s, past = k.shape[2], kv_cache.length
        k, v = kv_cache.append(k, v)  # [b, G, past + s, d]
        if self.causal and s > 1:  # a single new token sees every key: no mask needed
            tri = torch.ones(s, past + s, dtype=torch.bool, device=k.device).tril(past)
            attn_mask = tri if attn_mask is None else attn_mask & tri
        return k, v, attn_mask, False

    def _core(self, q, k, v, attn_mask, dropout_p: float, causal: bool) -> torch.Tensor:
        """q ``[b, H, s, d]``, k/v ``[b, G, s', d]`` (s' = s, or cached + s with a KV cache)
        -> ``[b, H, s, d]``; the selective-recompute region (no parameters, no FP8 casts: only
        softmax, dropout and two batched GEMMs)."""
        # Query head i reads kv group i // r: exactly SDPA's enable_gqa broadcast.
        with _sharded_rng(self.tp_sharded and dropout_p > 0):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=causal,
                enable_gqa=self.num_groups != self.num_heads,
            )


class MLP(nn.Module):
    """GELU MLP (h -> f -> h; tanh or exact erf GELU) or SwiGLU with fused ``[gate | up]``
    fc1 (h -> 2f -> h)."""

    def __init__(self, config: TransformerConfig, ctx: BuildContext | None = None):
        super().__init__()
        ctx = ctx or BuildContext()
        self.swiglu = config.activation == "swiglu"
        self.gelu_approximate = "none" if config.activation == "gelu_exact" else "tanh"
        f = config.ffn_hidden_size
        bias = config.add_bias_linear
        # SwiGLU: each rank takes a slice of the gate half and the matching slice of the up half.
        fc1_out, blocks = (2 * f, 2) if self.swiglu else (f, 1)
        self.fc1 = column_linear(config.hidden_size, fc1_out, bias, ctx, blocks)
        self.fc2 = row_linear(f, config.hidden_size, bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc1(x)  # [b, s, f] or [b, s, 2f]
        if self.swiglu:
            gate, up = y.chunk(2, dim=-1)  # [b, s, f] each
            y = F.silu(gate) * up
        else:
            y = F.gelu(y, approximate=self.gelu_approximate)
        return self.fc2(y)  # [b, s, h]


@dataclass(frozen=True)
class LayerSpec:
    """What a ``TransformerLayer`` builds its two sublayers from: classes (or any callables)
    built as ``attention(config, ctx, causal=..., recompute_core=...)`` and
    ``mlp(config, ctx)``, in that order, under the names ``attention`` and ``mlp``.

    Their forwards are ``attention(x, rotary, attn_mask, kv_cache)`` and ``mlp(x)``, each
    ``[b, s, h]`` (sequence shards under sequence parallelism) -> ``[b, s, h]``, as
    ``SelfAttention`` and ``MLP``. A replacement that makes its GEMMs with
    ``column_linear`` / ``row_linear`` gets the context's FP8 recipe, tensor and sequence
    parallelism, and slice-wise materialisation (``models.base``: those layers have
    ``reset_parameters()``). What reads module names stays the family's to adapt:
    ``init_parameter_`` scales the output projections named ``proj`` and ``fc2``, and
    ``TransformerConfig.fused_tensors`` and ``layer_flops_per_step`` describe the stock ``MLP``.
    """

    attention: Callable[..., nn.Module] = SelfAttention
    mlp: Callable[..., nn.Module] = MLP

    def __post_init__(self):
        for name in ("attention", "mlp"):
            if not callable(getattr(self, name)):
                raise TypeError(f"LayerSpec.{name}={getattr(self, name)!r} is not callable")


DEFAULT_LAYER_SPEC = LayerSpec()  # GPT, RoBERTa, ViT: fused-QKV attention and the stock MLP


class TransformerLayer(nn.Module):
    """Pre-norm block (``norm_position="pre"``): ``x + drop(attn(input_norm(x)))`` then
    ``x + drop(mlp(post_attention_norm(x)))``. Post-norm (BERT/RoBERTa):
    ``post_attention_norm(x + drop(attn(x)))`` then ``post_mlp_norm(x + drop(mlp(x)))``.

    recompute: one of ``RECOMPUTE`` (module doc); applies only while autograd records.
    attn_mask: boolean, broadcastable to ``[b, heads, s, s]``, True = attend (padding masks).
    kv_cache: this layer's ``LayerKVCache`` for incremental decoding (``SelfAttention``).
    spec: the attention and MLP classes (``LayerSpec``); the norms, residuals, dropout and
    recompute around them are this block's whatever the spec.
    """

    def __init__(
        self,
        config: TransformerConfig,
        ctx: BuildContext | None = None,
        *,
        causal: bool = True,
        recompute: str = "none",
        spec: LayerSpec = DEFAULT_LAYER_SPEC,
    ):
        super().__init__()
        ctx = ctx or BuildContext()
        check_recompute(recompute)
        self.recompute = recompute
        sp_group = ctx.tp_group if ctx.sequence_parallel else None

        def norm() -> nn.Module:
            return make_norm(config, device=ctx.device, sp_group=sp_group, meter=ctx.meter)

        self.post_norm = config.norm_position == "post"
        if not self.post_norm:
            self.input_norm = norm()
        # Construction order (input norm, attention, norm, MLP, norm) is the RNG draw order
        # of the initialisation: keep it whatever the spec.
        self.attention = spec.attention(
            config, ctx, causal=causal, recompute_core=recompute == "selective"
        )
        self.post_attention_norm = norm()
        self.mlp = spec.mlp(config, ctx)
        if self.post_norm:
            self.post_mlp_norm = norm()
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = ctx.sequence_parallel

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        attn_mask: torch.Tensor | None = None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        if kv_cache is not None:  # inference: no recompute, and the cache is written once
            return self._forward(x, rotary, attn_mask, kv_cache)
        if self.recompute == "full" and torch.is_grad_enabled():
            return _checkpoint(self._forward, x, rotary, attn_mask)
        return self._forward(x, rotary, attn_mask)

    def _forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attn_mask: torch.Tensor | None,
        kv_cache: LayerKVCache | None = None,
    ) -> torch.Tensor:
        sharded = self.sequence_parallel and self.training and self.dropout.p > 0
        if self.post_norm:
            attn = self.attention(x, rotary, attn_mask, kv_cache)
            with _sharded_rng(sharded):
                x = self.post_attention_norm(x + self.dropout(attn))  # [b, s, h]
            mlp = self.mlp(x)
            with _sharded_rng(sharded):
                return self.post_mlp_norm(x + self.dropout(mlp))  # [b, s, h]
        attn = self.attention(self.input_norm(x), rotary, attn_mask, kv_cache)
        with _sharded_rng(sharded):
            x = x + self.dropout(attn)  # [b, s, h]
        mlp = self.mlp(self.post_attention_norm(x))
        with _sharded_rng(sharded):
            x = x + self.dropout(mlp)  # [b, s, h]
        return x


def init_parameter_(
    module_name: str, module: nn.Module, param_name: str, tensor, std: float, num_layers: int
) -> None:
    """Megatron's init of one parameter: linear weights and embeddings N(0, std), the
    residual-branch output projections (attention ``proj``, ``fc2``) N(0, std / sqrt(2 L))
    because each layer adds two residual branches whose variance otherwise grows with depth;
    biases zero; norm scales one."""
    if isinstance(module, Linear) and param_name == "weight":
        if module_name.rsplit(".", 1)[-1] in ("proj", "fc2"):
            std = std / math.sqrt(2.0 * num_layers)
        nn.init.normal_(tensor, 0.0, std)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(tensor, 0.0, std)
    elif param_name == "bias":
        nn.init.zeros_(tensor)
    else:  # LayerNorm / RMSNorm scale
        nn.init.ones_(tensor)

"""Hugging Face adapter of the GPT family (``GPTHFAdapter``): ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` checkpoints (``config.json`` + safetensors) <-> ``models.gpt.GPTModel``'s
single-process names. What every family's adapter shares (directories, export, the grouped
QKV layout, vocabulary padding) is families/hf_adapter.py's ``HFAdapter``.

Files are read and written by their safetensors key names, which is what ``save_pretrained``
writes in transformers 5 (checked against 5.23): ``transformer.wte.weight``,
``transformer.h.{i}.attn.c_attn.weight``, ... for GPT-2 and ``model.embed_tokens.weight``,
``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight`` for Llama. A checkpoint
of the bare ``GPT2Model`` / ``LlamaModel`` (keys without the ``transformer.`` / ``model.``
prefix, as some published GPT-2 files are) reads the same.

Which style a ``GPTConfig`` is, is decided by the config: learned positions + LayerNorm + a
GELU MLP with biases is GPT-2; RoPE + RMSNorm + SwiGLU is Llama; anything else has no
Hugging Face class here and raises.

Layout facts the adapter handles, and why:

- GPT-2 stores its linear layers as ``Conv1D`` with weights ``[in, out]`` (``y = x W + b``);
  this project's ``Linear`` is ``[out, in]``: every GPT-2 GEMM weight is transposed.
- GPT-2's ``c_attn`` is ``[q | k | v]`` along its output; Llama keeps ``q_proj``, ``k_proj``,
  ``v_proj`` apart, with fewer key/value heads under GQA. Both are fused grouped per query
  group (``HFAdapter.fuse_qkv``); GPT-2 is the case r = 1.
- Llama's ``q_proj``/``k_proj`` rows are already in rotate-half RoPE order (Meta's weights are
  permuted by the Hugging Face conversion), the order ``models.transformer.apply_rotary``
  uses: no per-head permutation either.
- SwiGLU: ``gate_proj`` and ``up_proj`` stack into ``fc1`` as ``[gate | up]``;
  ``down_proj`` is ``fc2``, ``o_proj`` the attention ``proj``.
- GELU: GPT-2's ``gelu_new`` (and its equal-valued variants) is the tanh approximation, this
  project's ``gelu``; Hugging Face's plain ``gelu`` is the exact erf one (``gelu_exact``).
- The vocabulary: the embedding (and an untied head) gets zero rows on import and loses them
  on export (``HFAdapter.pad_rows``); the tokenizer's special ids travel in ``config.json``.
- transformers 5 writes RoPE settings as ``rope_parameters`` (``rope_theta``, ``rope_type``);
  older files have a top-level ``rope_theta`` and ``rope_scaling``. Both are read; export
  writes both, so transformers 4 readers find ``rope_theta`` too. Only unscaled RoPE
  (``rope_type`` "default") is this project's ``rotary_cos_sin``; linear, dynamic, yarn,
  llama3, ... scaling raise.
- Buffers that some files carry (GPT-2's causal ``attn.bias`` / ``attn.masked_bias``, old
  Llama's ``rotary_emb.inv_freq``) are skipped; FP8 scaling state and other non-parameter
  entries of a training state are left out on export.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

from checkpoint.format import is_model_parameter
from families.hf_adapter import HFAdapter
from models.gpt import GPTConfig, pad_vocab_size

if TYPE_CHECKING:
    from checkpoint.format import JsonObject

__all__ = ["GPTHFAdapter"]

# GPT-2 activation_function -> this project's activation (equal functions only).
_GELU = {
    "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_python_tanh": "gelu",
    "gelu_fast": "gelu", "gelu": "gelu_exact", "gelu_python": "gelu_exact",
}  # fmt: skip
_SILU = ("silu", "swish")
_PREFIX = {"gpt2": "transformer.", "llama": "model."}
_VOCAB_ROWS = ("word_embeddings.weight", "output_layer.weight")

# Per-layer modules that map one to one: (Hugging Face, ours, transposed weight).
_GPT2_LAYER = [
    ("ln_1", "input_norm", False),
    ("attn.c_proj", "attention.proj", True),
    ("ln_2", "post_attention_norm", False),
    ("mlp.c_fc", "mlp.fc1", True),
    ("mlp.c_proj", "mlp.fc2", True),
]
_LLAMA_LAYER = [
    ("input_layernorm", "input_norm", False),
    ("self_attn.o_proj", "attention.proj", False),
    ("post_attention_layernorm", "post_attention_norm", False),
    ("mlp.down_proj", "mlp.fc2", False),
]
# Llama modules that this project fuses: Hugging Face module -> (our module, role).
_LLAMA_FUSED = {
    "self_attn.q_proj": ("attention.qkv", "q"),
    "self_attn.k_proj": ("attention.qkv", "k"),
    "self_attn.v_proj": ("attention.qkv", "v"),
    "mlp.gate_proj": ("mlp.fc1", "gate"),
    "mlp.up_proj": ("mlp.fc1", "up"),
}
# Tensors outside the layers (Hugging Face name after the prefix -> ours).
_TOP = {
    "gpt2": {
        "wte.weight": "word_embeddings.weight", "wpe.weight": "position_embeddings.weight",
        "ln_f.weight": "final_norm.weight", "ln_f.bias": "final_norm.bias",
    },
    "llama": {"embed_tokens.weight": "word_embeddings.weight", "norm.weight": "final_norm.weight"},
}  # fmt: skip
# Buffers some files carry (per layer; Llama's top-level one in _TOP_BUFFERS): skipped.
_BUFFERS = {"gpt2": ("attn.bias", "attn.masked_bias"), "llama": ("self_attn.rotary_emb.inv_freq",)}
_TOP_BUFFERS = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")
_LAYER_KEY = {"gpt2": re.compile(r"h\.(\d+)\.(.+)$"), "llama": re.compile(r"layers\.(\d+)\.(.+)$")}


# ---------------------------------------------------------------------------------------------
# config.json


def _refuse(hf: JsonObject, key: str, value, why: str) -> ValueError:
    return ValueError(f"{hf.file} {key}={value!r}: {why}")


_GPT2, _LLAMA = "a GPT-2 config needs it", "a Llama config needs it"


def _rope_theta(hf: JsonObject) -> float:
    """RoPE theta from transformers 5's ``rope_parameters`` or the older ``rope_theta`` +
    ``rope_scaling``; scaled RoPE raises naming the key."""
    params = hf.need("rope_parameters", (dict, None), None)
    key = "rope_parameters"
    if params is None:
        params, key = hf.need("rope_scaling", (dict, None), None) or {}, "rope_scaling"
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        type_key = "rope_type" if "rope_type" in params else "type"
        raise _refuse(
            hf, f"{key}.{type_key}", kind, "only unscaled RoPE (rope_type 'default') is supported"
        )
    theta = hf.need("rope_theta", float, 10000.0)
    return params.need("rope_theta", float, theta) if params else theta


def _gpt2_fields(hf: JsonObject) -> dict:
    act = hf.need("activation_function", str, "gelu_new")
    if act not in _GELU:
        raise _refuse(hf, "activation_function", act, f"not one of {sorted(_GELU)}")
    for key, want in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
    ):
        if hf.get(key, want) != want:
            raise _refuse(hf, key, hf[key], f"only {want} is supported")
    h, positions = hf.need("n_embd", int, why=_GPT2), hf.need("n_positions", int, why=_GPT2)
    return dict(
        num_layers=hf.need("n_layer", int, why=_GPT2),
        hidden_size=h,
        num_attention_heads=hf.need("n_head", int, why=_GPT2),
        ffn_hidden_size=hf.need("n_inner", (int, None), None) or 4 * h,
        normalization="LayerNorm",
        norm_epsilon=hf.need("layer_norm_epsilon", float, 1e-5),
        activation=_GELU[act],
        add_bias_linear=True,
        hidden_dropout=hf.need("resid_pdrop", float, 0.1),
        attention_dropout=hf.need("attn_pdrop", float, 0.1),
        init_method_std=hf.need("initializer_range", float, 0.02),
        seq_length=positions,
        max_position_embeddings=positions,
        position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=not hf.need("tie_word_embeddings", bool, True),
    )


def _llama_fields(hf: JsonObject) -> dict:
    act = hf.need("hidden_act", str, "silu")
    if act not in _SILU:
        raise _refuse(hf, "hidden_act", act, "Llama's MLP here is SwiGLU (silu)")
    attn_bias, mlp_bias = hf.need("attention_bias", bool, False), hf.need("mlp_bias", bool, False)
    if attn_bias != mlp_bias:  # add_bias_linear covers all four GEMMs or none
        key = "attention_bias" if attn_bias else "mlp_bias"
        raise _refuse(
            hf, key, True, "biases on only the attention or only the MLP GEMMs are not supported "
            "(add_bias_linear is one switch: attention_bias and mlp_bias must be equal)",
        )  # fmt: skip
    heads = hf.need("num_attention_heads", int, why=_LLAMA)
    max_pos = hf.need("max_position_embeddings", int, 2048)
    return dict(
        num_layers=hf.need("num_hidden_layers", int, why=_LLAMA),
        hidden_size=hf.need("hidden_size", int, why=_LLAMA),
        num_attention_heads=heads,
        num_query_groups=hf.need("num_key_value_heads", (int, None), None) or heads,
        kv_channels=hf.need("head_dim", (int, None), None),  # None -> hidden_size // heads
        ffn_hidden_size=hf.need("intermediate_size", int, why=_LLAMA),
        normalization="RMSNorm",
        norm_epsilon=hf.need("rms_norm_eps", float, 1e-6),
        activation="swiglu",
        add_bias_linear=attn_bias,
        hidden_dropout=0.0,
        attention_dropout=hf.need("attention_dropout", float, 0.0),
        init_method_std=hf.need("initializer_range", float, 0.02),
        seq_length=max_pos,
        max_position_embeddings=max_pos,
        position_embedding_type="rope",
        rotary_base=_rope_theta(hf),
        untie_embeddings_and_output_weights=not hf.need("tie_word_embeddings", bool, False),
    )


def _vocab_size(hf: JsonObject) -> int:
    return hf.need("vocab_size", int, why="a GPT-2 or Llama config needs it")


_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _no_place(key: str) -> KeyError:
    return KeyError(f"Hugging Face tensor {key!r} has no place in GPTModel")


def _no_place_ours(name: str, why: str) -> KeyError:
    return KeyError(f"parameter {name!r} has no place in the Hugging Face model ({why})")


class GPTHFAdapter(HFAdapter):
    """``GPT2LMHeadModel`` / ``LlamaForCausalLM`` <-> ``GPTModel`` (module doc). The extra
    facts of ``save``/``config_to_hf``/``state_to_hf``: ``vocab_size`` (the true vocabulary)
    and, for the config only, the tokenizer's ``token_ids``."""

    family = "gpt"
    model_types = ("gpt2", "llama")

    def config_from_hf(
        self, hf: dict, padded_vocab_size: int | None = None, **overrides
    ) -> GPTConfig:
        """A ``GPTConfig`` from a ``config.json`` dict of model_type "gpt2" or "llama".

        ``padded_vocab_size`` defaults to the checkpoint's vocabulary padded to a multiple of
        128; ``seq_length`` to the checkpoint's maximum positions; ``overrides`` (any
        ``GPTConfig`` field) win. Errors as ``HFAdapter.config_from_hf``'s.
        """
        from checkpoint.format import JsonObject  # the format reader: no model code

        hf = JsonObject.wrap(hf, "config.json")
        kind = hf.get("model_type")
        if kind == "gpt2":
            fields = _gpt2_fields(hf)
        elif kind == "llama":
            fields = _llama_fields(hf)
        else:
            raise _refuse(hf, "model_type", kind, "choose 'gpt2' or 'llama'")
        fields["vocab_size"] = padded_vocab_size or pad_vocab_size(_vocab_size(hf), 128)
        fields.update(overrides)
        return GPTConfig(**fields)

    @staticmethod
    def hf_style(config: GPTConfig) -> str:
        """The Hugging Face style of this architecture, "gpt2" or "llama"; any other raises."""
        c = config
        if c.norm_position != "pre":
            raise ValueError(f"model.norm_position={c.norm_position!r}: GPT-2 and Llama are pre-LN")
        if (c.position_embedding_type, c.normalization, c.activation) == (
            "rope", "RMSNorm", "swiglu",
        ):  # fmt: skip
            return "llama"
        if (c.position_embedding_type, c.normalization) == ("learned_absolute", "LayerNorm") and (
            c.activation in ("gelu", "gelu_exact")
        ):
            if not c.add_bias_linear:
                raise ValueError("model.add_bias_linear=false: GPT-2's linear layers have biases")
            if c.num_query_groups != c.num_attention_heads:
                raise ValueError("model.num_query_groups: GPT-2 has no grouped-query attention")
            if c.kv_channels * c.num_attention_heads != c.hidden_size:
                raise ValueError("model.kv_channels: GPT-2's heads are hidden_size / heads wide")
            return "gpt2"
        raise ValueError(
            "no Hugging Face class for position_embedding_type="
            f"{c.position_embedding_type!r}, normalization={c.normalization!r}, "
            f"activation={c.activation!r}: GPT-2 is learned_absolute + LayerNorm + gelu, "
            "Llama is rope + RMSNorm + swiglu"
        )

    def config_to_hf(
        self, config: GPTConfig, vocab_size: int, token_ids: dict | None = None
    ) -> dict:
        """The ``config.json`` fields of ``GPT2LMHeadModel`` or ``LlamaForCausalLM`` for this
        model and the true (unpadded) ``vocab_size``. ``token_ids``: optional
        ``bos_token_id``/``eos_token_id``/``pad_token_id`` of the tokenizer (unknown ids are
        written as null rather than the Hugging Face class defaults, which belong to other
        vocabularies)."""
        c = config
        ids = {k: None for k in _TOKEN_IDS} | (token_ids or {})
        tied = not c.untie_embeddings_and_output_weights
        if self.hf_style(c) == "gpt2":
            return {
                "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "vocab_size": vocab_size, "n_embd": c.hidden_size, "n_layer": c.num_layers,
                "n_head": c.num_attention_heads, "n_inner": c.ffn_hidden_size,
                "n_positions": c.max_position_embeddings,
                "activation_function": "gelu_new" if c.activation == "gelu" else "gelu",
                "layer_norm_epsilon": c.norm_epsilon, "resid_pdrop": c.hidden_dropout,
                "embd_pdrop": c.hidden_dropout, "attn_pdrop": c.attention_dropout,
                "initializer_range": c.init_method_std, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                "tie_word_embeddings": tied, **ids,
            }  # fmt: skip
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.ffn_hidden_size, "num_hidden_layers": c.num_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels,
            "hidden_act": "silu", "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.norm_epsilon,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rotary_base},
            "rope_theta": c.rotary_base, "attention_bias": c.add_bias_linear,
            "mlp_bias": c.add_bias_linear, "attention_dropout": c.attention_dropout,
            "initializer_range": c.init_method_std, "tie_word_embeddings": tied, **ids,
        }  # fmt: skip

    def state_from_hf(self, hf: dict[str, torch.Tensor], config: GPTConfig) -> dict:
        """Hugging Face tensors (safetensors key names) -> this project's single-process
        parameters: Conv1D weights transposed (GPT-2), QKV fused per query group, gate/up
        stacked into fc1 (Llama), the vocabulary padded with zero rows. Unknown keys raise
        naming the key."""
        style = self.hf_style(config)
        prefix, top, buffers = _PREFIX[style], _TOP[style], _BUFFERS[style]
        tied = not config.untie_embeddings_and_output_weights
        biases = config.add_bias_linear
        out: dict[str, torch.Tensor] = {}
        parts: dict[str, dict[str, torch.Tensor]] = {}  # our fused name -> HF pieces by role
        for key, value in hf.items():
            if key == "lm_head.weight":
                if not tied:  # a tied head's copy (some files store it) is the embedding
                    out["output_layer.weight"] = value
                continue
            local = key.removeprefix(prefix)
            if local in _TOP_BUFFERS:
                continue
            if local in top:
                out[top[local]] = value
                continue
            m = _LAYER_KEY[style].match(local)
            if m is None:
                raise _no_place(key)
            layer, rest = m.groups()
            if rest in buffers:
                continue
            module, _, kind = rest.rpartition(".")
            if kind not in ("weight", "bias") or (
                kind == "bias" and style == "llama" and (not biases or "layernorm" in module)
            ):  # Llama's norms never have biases, its GEMMs only with attention/mlp_bias
                raise _no_place(key)
            ours = f"layers.{layer}"
            table = _GPT2_LAYER if style == "gpt2" else _LLAMA_LAYER
            match = [(o, t) for h, o, t in table if h == module]
            if match:
                name, transpose = match[0]
                out[f"{ours}.{name}.{kind}"] = (
                    value.t() if transpose and kind == "weight" else value
                )
            elif style == "gpt2" and module == "attn.c_attn":
                value = value.t() if kind == "weight" else value
                parts[f"{ours}.attention.qkv.{kind}"] = dict(zip("qkv", value.chunk(3)))
            elif style == "llama" and module in _LLAMA_FUSED:
                target, role = _LLAMA_FUSED[module]
                parts.setdefault(f"{ours}.{target}.{kind}", {})[role] = value
            else:
                raise _no_place(key)
        gate_up = {n: p for n, p in parts.items() if n.endswith((".fc1.weight", ".fc1.bias"))}
        for name, piece in gate_up.items():
            if set(piece) != {"gate", "up"}:
                raise KeyError(f"{name}: Hugging Face gate_proj or up_proj tensor missing")
            out[name] = torch.cat([piece["gate"], piece["up"]])
        qkv = {n: p for n, p in parts.items() if n not in gate_up}
        out.update(self.fuse_qkv_pieces(qkv, config.num_query_groups, ("q", "k", "v")))
        for name in _VOCAB_ROWS:
            if name in out:
                out[name] = self.pad_rows(out[name], config.vocab_size)
        return {k: v.contiguous() for k, v in out.items()}

    def state_to_hf(
        self,
        state: dict[str, torch.Tensor],
        config: GPTConfig,
        vocab_size: int,
        token_ids: dict | None = None,  # the config's only (save passes every extra fact)
    ) -> dict[str, torch.Tensor]:
        """Inverse of ``state_from_hf`` (keys as ``save_pretrained`` writes them), the
        vocabulary cut to ``vocab_size`` rows. Entries that are not parameters (FP8 scaling
        state, scales) are left out; a parameter with no Hugging Face place raises naming
        it."""
        style = self.hf_style(config)
        prefix = _PREFIX[style]
        top = {v: k for k, v in _TOP[style].items()}
        table = {o: (h, t) for h, o, t in (_GPT2_LAYER if style == "gpt2" else _LLAMA_LAYER)}
        layer_key = "h" if style == "gpt2" else "layers"
        groups = config.num_query_groups
        per_group = config.num_attention_heads // groups
        out: dict[str, torch.Tensor] = {}
        for name, value in state.items():
            module, _, kind = name.rpartition(".")
            if kind not in ("weight", "bias") or not is_model_parameter(name):
                continue  # FP8 scaling state and other buffers have no Hugging Face counterpart
            if name in _VOCAB_ROWS:
                value = value[:vocab_size]
            if name == "output_layer.weight":
                if not config.untie_embeddings_and_output_weights:
                    raise _no_place_ours(name, "the config ties the head to the embedding")
                out["lm_head.weight"] = value
                continue
            if name in top:
                out[prefix + top[name]] = value
                continue
            m = re.fullmatch(r"layers\.(\d+)\.(.+)", module)
            if m is None:
                raise _no_place_ours(name, "unknown module")
            layer, sub = m.groups()
            base = f"{prefix}{layer_key}.{layer}"
            if sub in table:
                hf_name, transpose = table[sub]
                t = value.t() if transpose and kind == "weight" else value
                out[f"{base}.{hf_name}.{kind}"] = t
            elif sub == "attention.qkv":
                q, k, v = self.split_qkv(value, groups, per_group)
                if style == "gpt2":
                    fused = torch.cat([q, k, v])
                    out[f"{base}.attn.c_attn.{kind}"] = fused.t() if kind == "weight" else fused
                else:
                    for role, t in zip("qkv", (q, k, v)):
                        out[f"{base}.self_attn.{role}_proj.{kind}"] = t
            elif sub == "mlp.fc1" and style == "llama":
                gate, up = value.chunk(2)
                out[f"{base}.mlp.gate_proj.{kind}"] = gate
                out[f"{base}.mlp.up_proj.{kind}"] = up
            else:
                raise _no_place_ours(name, "unknown module")
        return {k: v.contiguous() for k, v in out.items()}

    def import_config(self, hf: JsonObject, divisible_by: int) -> tuple[GPTConfig, dict]:
        """The true vocabulary padded to a multiple of ``divisible_by``; the facts: the true
        ``vocab_size`` and the ``token_ids`` config.json gives (null where it gives none)."""
        vocab = _vocab_size(hf)
        ids = {k: hf.get(k) for k in _TOKEN_IDS}
        ids = {k: v if isinstance(v, int) else None for k, v in ids.items()}
        config = self.config_from_hf(hf, pad_vocab_size(vocab, divisible_by))
        return config, {"vocab_size": vocab, "token_ids": ids}

    def export_extra(self, structure: JsonObject) -> dict:
        return {
            "vocab_size": self.true_vocab_size(structure),
            "token_ids": structure.get("token_ids"),
        }

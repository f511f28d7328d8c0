"""A family's Hugging Face side, written once: ``HFAdapter``.

Why a base class: reading a Hugging Face model directory (``config.json`` + safetensors, one
file or shards), writing one, exporting a training checkpoint, and the Q/K/V and vocabulary
layouts are the same for every family; what differs is the names and the config keys. A
family's adapter (families/gpt_hf.py, roberta_hf.py, vit_hf.py) implements only those: the
config both ways (``config_from_hf``, ``config_to_hf``), the tensors both ways
(``state_from_hf``, ``state_to_hf``), what an import reads from ``config.json`` besides the
model (``import_config``) and what an export needs from a checkpoint's ``model_structure``
(``export_extra``). BERT-style encoders (RoBERTa, ViT) share their layers' names and config
keys too (``EncoderHFAdapter``). The family gets ``import_hf``/``export_hf`` from its adapter
(``ModelFamily.hf_adapter``, families/base.py).

Layouts every adapter shares:

- Q/K/V: models/transformer.py fuses them into one ``qkv`` tensor grouped per query group:
  for each group g its r query heads, then k head g and v head g (``[G x (r q-heads, k, v) x d]``
  rows), so a tensor-parallel split of whole groups is a contiguous block of rows. Hugging
  Face keeps q, k and v apart (GPT-2's ``c_attn`` concatenates them). Hugging Face's grouped
  attention maps query head i to kv head ``i // r`` (``repeat_kv``), the head order of that
  grouping, so no head is permuted; multi-head attention is G = heads, r = 1
  (``[q_0, k_0, v_0, q_1, ...]``).
- The vocabulary: Hugging Face's is the tokenizer's, this project's is padded
  (``make_vocab_size_divisible_by``): zero rows are added on import (``pad_rows``) and cut on
  export (the checkpoint's true ``vocab_size``).
- Files: ``model.safetensors``, or the shards ``model.safetensors.index.json`` lists (what
  ``save_pretrained`` writes above ``max_shard_size``); written as one FP32
  ``model.safetensors`` (what every ``from_pretrained`` reads).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from families.base import read_hf_config

if TYPE_CHECKING:
    from checkpoint.format import JsonObject
    from families.base import ModelFamily

__all__ = ["EncoderHFAdapter", "HFAdapter"]

Tensors = dict[str, torch.Tensor]

# Hugging Face BERT-style hidden_act -> this project's activation (equal functions only).
_ENCODER_ACTIVATIONS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
_QKV = ("query", "key", "value")  # a BERT-style layer's attention modules


class HFAdapter(ABC):
    """One family's Hugging Face model directories. Subclasses set ``family`` and
    ``model_types`` and implement the abstract methods; the rest is shared."""

    # The registry name of the family whose checkpoints ``export`` writes by default.
    family: ClassVar[str]
    # The ``config.json`` ``model_type`` values it reads (the family's ``hf_model_types``).
    model_types: ClassVar[tuple[str, ...]]
    # What turns a user's raw inputs into the model's, as an export's one line names it: a
    # tokenizer (text families: training/tokenizer_files.py writes it) or an image processor.
    inputs: ClassVar[str] = "tokenizer"

    # -- per family ------------------------------------------------------------------------

    @abstractmethod
    def config_from_hf(self, hf: dict, **overrides) -> Any:
        """The model config of a ``config.json`` dict (``overrides``: config fields). Settings
        this project cannot reproduce raise ``ValueError`` naming the key; a key it needs and
        the dict lacks, or a value of the wrong type, ``CheckpointError`` naming the file
        ("config.json" for a dict made in memory) and the key."""

    @abstractmethod
    def config_to_hf(self, config: Any, **extra) -> dict:
        """The ``config.json`` fields for this model config and the ``extra`` facts a model
        config does not hold (``export_extra``: the true vocabulary, token ids, class names)."""

    @abstractmethod
    def state_from_hf(self, hf: Tensors, config: Any) -> Tensors:
        """Hugging Face tensors (safetensors key names) -> this project's single-process
        parameters. A key with no place raises ``KeyError`` naming it."""

    @abstractmethod
    def state_to_hf(self, state: Tensors, config: Any, **extra) -> Tensors:
        """Inverse of ``state_from_hf`` (keys as ``save_pretrained`` writes them; ``extra``
        as for ``config_to_hf``). Entries that are not parameters (FP8 scaling state) are
        left out."""

    @abstractmethod
    def import_config(self, hf: JsonObject, divisible_by: int) -> tuple[Any, dict]:
        """``(model config, facts)`` an import builds from ``config.json`` ``hf``: the config
        with its vocabulary, if any, padded to a multiple of ``divisible_by``, and the
        ``model_structure`` entries the file gives (true vocabulary, token ids, classes)."""

    @abstractmethod
    def export_extra(self, structure: JsonObject) -> dict:
        """The ``extra`` keywords of ``save`` for a checkpoint of this ``model_structure``."""

    def write_inputs(self, metadata: JsonObject, directory: Path) -> str | None:
        """Write into export ``directory`` the files that prepare raw inputs for the model
        where the family makes them itself from checkpoint ``metadata`` (ViT: the image
        processor of its run's evaluation view); one line saying what was written, or None
        where the family has none (text: its tokenizer is written from the run's files)."""
        return None

    # -- shared ----------------------------------------------------------------------------

    @staticmethod
    def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
        """``q`` ``[H*d, ...]``, ``k`` and ``v`` ``[G*d, ...]`` (weights or biases) -> the fused
        ``[G*(r+2)*d, ...]`` tensor grouped per query group, r = H / G (module doc)."""
        rest = q.shape[1:]
        d = k.shape[0] // groups
        parts = (
            q.reshape(groups, -1, *rest),
            k.reshape(groups, d, *rest),
            v.reshape(groups, d, *rest),
        )
        return torch.cat(parts, 1).reshape(-1, *rest)

    @staticmethod
    def split_qkv(
        qkv: torch.Tensor, groups: int, heads_per_group: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Inverse of ``fuse_qkv``: ``(q [H*d, ...], k [G*d, ...], v [G*d, ...])``."""
        rest = qkv.shape[1:]
        r = heads_per_group
        d = qkv.shape[0] // (groups * (r + 2))
        q, k, v = qkv.reshape(groups, (r + 2) * d, *rest).split([r * d, d, d], 1)
        return tuple(t.reshape(-1, *rest) for t in (q, k, v))

    def fuse_qkv_pieces(
        self, pieces: dict[str, Tensors], groups: int, roles: tuple[str, str, str]
    ) -> Tensors:
        """``{fused name: {role: Hugging Face tensor}}`` (``roles``: the q, k and v roles'
        names) -> ``{fused name: fused tensor}`` (``fuse_qkv``); a piece missing raises
        naming the fused tensor."""
        fused = {}
        for name, piece in pieces.items():
            if set(piece) != set(roles):
                raise KeyError(
                    f"{name}: Hugging Face q, k or v tensor missing (have {sorted(piece)})"
                )
            fused[name] = self.fuse_qkv(*(piece[role] for role in roles), groups)
        return fused

    @staticmethod
    def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
        """``t`` with zero rows appended up to ``rows`` (a padded vocabulary); more rows than
        that raise."""
        if t.shape[0] > rows:
            raise ValueError(f"vocabulary of {t.shape[0]} rows does not fit {rows}")
        if t.shape[0] == rows:
            return t
        return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])

    @staticmethod
    def read_tensors(directory: str | Path) -> Tensors:
        """Every tensor of a Hugging Face directory: ``model.safetensors``, or the shards that
        ``model.safetensors.index.json`` lists; a missing or damaged file raises
        ``CheckpointError`` naming it."""
        from checkpoint.format import CheckpointError, load_safetensors, read_json

        path = Path(directory)
        index = path / "model.safetensors.index.json"
        if not index.exists():
            return load_safetensors(path / "model.safetensors")
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(f"{index}: no 'weight_map' of tensor names to shard files")
        tensors: Tensors = {}
        for shard in sorted(set(weight_map.values())):
            tensors.update(load_safetensors(path / shard))
        return tensors

    def load(self, directory: str | Path, **overrides) -> tuple[Any, Tensors]:
        """``(model config, parameters)`` of a Hugging Face directory (``overrides``: the
        keywords of ``config_from_hf``), the vocabulary as the config says."""
        config = self.config_from_hf(read_hf_config(directory), **overrides)
        return config, self.state_from_hf(self.read_tensors(directory), config)

    def import_model(self, directory: str | Path, divisible_by: int = 128):
        """``(model config, parameters, facts)`` of a Hugging Face directory as an import
        takes it (``import_config``): the vocabulary, if any, padded to a multiple of
        ``divisible_by`` with zero rows."""
        config, facts = self.import_config(read_hf_config(directory), divisible_by)
        return config, self.state_from_hf(self.read_tensors(directory), config), facts

    def save(self, directory: str | Path, state: Tensors, config: Any, **extra) -> Path:
        """Write ``config.json`` + ``model.safetensors`` (FP32) that the Hugging Face class
        loads, from this project's single-process parameters (``extra``: as for
        ``config_to_hf``); returns the directory."""
        hf_config = self.config_to_hf(config, **extra)
        tensors = {
            k: v.detach().float().cpu() for k, v in self.state_to_hf(state, config, **extra).items()
        }
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(hf_config, indent=2))
        from checkpoint.format import save_safetensors  # the format: no model code

        save_safetensors(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return out

    def export(
        self, checkpoint: str | Path, directory: str | Path, family: ModelFamily | None = None
    ) -> Path:
        """Training checkpoint ``checkpoint`` (any parallel layout, any level) as a Hugging
        Face directory: read through ``family.checkpoint_model`` (the format checked, full
        tensors from the canonical format, dequantized, FP8 scaling state left out; a
        checkpoint of another family refused), written by ``save``. ``family``: the
        registered ``self.family`` unless given (a family derived from it)."""
        from families.base import get_family  # the registry, for the default family

        family = family or get_family(self.family)
        structure, config, params = family.checkpoint_model(checkpoint)
        return self.save(directory, params, config, **self.export_extra(structure))

    @staticmethod
    def true_vocab_size(structure: JsonObject) -> int:
        """A checkpoint's true (unpadded) vocabulary, from its ``model_structure``; a
        checkpoint without one raises naming its metadata file."""
        vocab = structure.get("vocab_size")
        if vocab is None:
            raise ValueError(
                f"{structure.file}: model_structure has no vocab_size (the true vocabulary)"
            )
        return vocab


class EncoderHFAdapter(HFAdapter):
    """A BERT-style encoder's adapter (RoBERTa, ViT): the ``config.json`` fields those share
    (``encoder_fields_from_hf``/``encoder_fields_to_hf``) and the layers' tensors both ways
    (``layers_from_hf``/``layers_to_hf``): Hugging Face's separate query, key and value
    modules fused per head, the other modules by ``layer_modules``. Subclasses set the
    layers' key prefix, the attention module and the table."""

    # Hugging Face key of layer i: "{layer_prefix}.{i}.{module}.{weight|bias}".
    layer_prefix: ClassVar[str]
    # The module holding query, key and value ("attention.self" in RoBERTa).
    attention_module: ClassVar[str]
    # Hugging Face module -> this project's, inside a layer (the rest of the modules).
    layer_modules: ClassVar[dict[str, str]]
    # The model class, for the messages.
    model_name: ClassVar[str]

    def no_place(self, key: str) -> KeyError:
        return KeyError(f"Hugging Face tensor {key!r} has no place in {self.model_name}")

    def layers_from_hf(self, hf: Tensors, heads: int) -> tuple[Tensors, Tensors]:
        """``(the layers' tensors under this project's names, QKV fused per head; the other
        tensors, as they were)``. A layer key of no known module raises naming it."""
        pattern = re.compile(rf"{re.escape(self.layer_prefix)}\.(\d+)\.(.+)\.(weight|bias)$")
        ours: Tensors = {}
        rest: Tensors = {}
        qkv: dict[str, Tensors] = {}  # fused name -> query, key, value
        for key, value in hf.items():
            m = pattern.match(key)
            if m is None:
                rest[key] = value
                continue
            layer, module, kind = m.groups()
            if module.startswith(f"{self.attention_module}."):
                role = module.rsplit(".", 1)[1]
                qkv.setdefault(f"layers.{layer}.attention.qkv.{kind}", {})[role] = value
            elif module in self.layer_modules:
                ours[f"layers.{layer}.{self.layer_modules[module]}.{kind}"] = value
            else:
                raise self.no_place(key)
        ours.update(self.fuse_qkv_pieces(qkv, heads, _QKV))
        return ours, rest

    def layers_to_hf(self, state: Tensors, heads: int) -> tuple[Tensors, Tensors]:
        """Inverse of ``layers_from_hf``: ``(the layers' tensors under Hugging Face's names;
        the tensors outside the layers)``. Inside a layer, anything else (FP8 scaling state)
        is left out."""
        inverse = {ours: theirs for theirs, ours in self.layer_modules.items()}
        hf: Tensors = {}
        rest: Tensors = {}
        for name, value in state.items():
            m = re.match(r"layers\.(\d+)\.(.+)\.(weight|bias)$", name)
            if m is None:
                rest[name] = value
                continue
            layer, module, kind = m.groups()
            prefix = f"{self.layer_prefix}.{layer}"
            if module == "attention.qkv":
                for role, t in zip(_QKV, self.split_qkv(value, heads)):
                    hf[f"{prefix}.{self.attention_module}.{role}.{kind}"] = t
            elif module in inverse:
                hf[f"{prefix}.{inverse[module]}.{kind}"] = value
        return hf, rest

    @staticmethod
    def encoder_fields_from_hf(hf: JsonObject, *, dropout: float, why: str) -> dict:
        """The model fields that BERT-style ``config.json`` files (RoBERTa's, ViT's) share,
        read with ``JsonObject.need`` (``why``: who needs a missing key, for the message;
        ``dropout``: both dropout probabilities' default). An activation without an equal
        here raises naming the key."""
        act = hf.need("hidden_act", str, "gelu")
        if act not in _ENCODER_ACTIVATIONS:
            raise ValueError(
                f"{hf.file} hidden_act={act!r}: not one of {sorted(_ENCODER_ACTIVATIONS)}"
            )
        return dict(
            num_layers=hf.need("num_hidden_layers", int, why=why),
            hidden_size=hf.need("hidden_size", int, why=why),
            num_attention_heads=hf.need("num_attention_heads", int, why=why),
            ffn_hidden_size=hf.need("intermediate_size", int, why=why),
            norm_epsilon=hf.need("layer_norm_eps", float, 1e-12),
            activation=_ENCODER_ACTIVATIONS[act],
            hidden_dropout=hf.need("hidden_dropout_prob", float, dropout),
            attention_dropout=hf.need("attention_probs_dropout_prob", float, dropout),
            init_method_std=hf.need("initializer_range", float, 0.02),
        )

    @staticmethod
    def encoder_fields_to_hf(config: Any) -> dict:
        """Inverse of ``encoder_fields_from_hf``: those ``config.json`` fields of a model
        config with a GELU MLP (exact: "gelu"; tanh: "gelu_new")."""
        return {
            "hidden_size": config.hidden_size,
            "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_attention_heads,
            "intermediate_size": config.ffn_hidden_size,
            "hidden_act": "gelu" if config.activation == "gelu_exact" else "gelu_new",
            "hidden_dropout_prob": config.hidden_dropout,
            "attention_probs_dropout_prob": config.attention_dropout,
            "initializer_range": config.init_method_std,
            "layer_norm_eps": config.norm_epsilon,
        }

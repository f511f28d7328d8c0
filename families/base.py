"""The model-family interface and its registry.

A family answers, for one kind of model, everything the training spine would otherwise hard-code:
how to prepare and read its data, how to build its model for a layout, which batch entries the
model reads on every pipeline stage, how the model's output becomes named loss sums, how many
FLOPs a step costs, and how its tensors are fused (for checkpoint readers and converters).

Loss convention (Megatron's): ``loss`` returns the micro-batch's objective, a mean over what
it counts (the training loop divides by the number of micro-batches and applies the loss
scale), and for every metric in ``metric_names`` a ``(sum, count)`` pair; the loop adds the
pairs over micro-batches, data-parallel replicas and pipeline stages and logs ``sum / count``.
The first metric is the headline loss (NaN counting, the console line).
"""

from __future__ import annotations

import dataclasses
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from families.config_fields import Section
from families.data_sections import TextDataSection

if TYPE_CHECKING:  # annotations only: families sit below training/
    from checkpoint.format import JsonObject
    from models.base import ParallelModel
    from models.context import BuildContext
    from parallel.pipeline.layout import PipelineLayout

__all__ = [
    "HFImport",
    "LossSums",
    "parameters_only",
    "section_values",
    "ModelFamily",
    "LOOP_METRICS",
    "LOOP_METRIC_PREFIXES",
    "register_family",
    "BUILTIN_FAMILIES",
    "get_family",
    "checkpoint_family",
    "family_names",
    "family_for_hf",
    "family_for_hf_directory",
    "read_hf_config",
    "DEFAULT_FAMILY",
]

LossSums = dict[str, tuple[torch.Tensor, torch.Tensor]]


@dataclass
class HFImport:
    """A Hugging Face model read as a family's: its model ``config``, the single-process
    ``tensors``, the checkpoint ``structure`` (as ``checkpoint_structure`` gives it, with the
    true vocabulary and token ids from the Hugging Face config) and the YAML ``model`` section
    that builds the same model (``model_section``, every key explicit)."""

    config: Any
    tensors: dict[str, torch.Tensor]
    structure: dict
    model_section: dict


def section_values(section: type, config: Any) -> dict:
    """The ``model`` section keys of ``section`` read off a built model ``config`` (the
    section's keys are the config's field names; a key the config lacks keeps its default)."""
    return {f.name: getattr(config, f.name, f.default) for f in dataclasses.fields(section)}


def parameters_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` without the FP8 scaling state (``checkpoint.format.is_model_parameter``):
    what an export writes and an inference model loads."""
    from checkpoint.format import is_model_parameter  # the format's names: no model code

    return {name: value for name, value in tensors.items() if is_model_parameter(name)}


_REGISTRY: dict[str, ModelFamily] = {}


class ModelFamily(ABC):
    """One model family. Subclasses set ``name`` and ``metric_names`` and implement every
    abstract method (a missing one is a TypeError when the family is instantiated).

    ``cfg`` below is the run's ``training.config.Config``; errors about it are ``ValueError``
    whose message starts with the config key (the loop reports them as config errors).
    """

    name: ClassVar[str]
    # The YAML ``model`` section of this family's runs: a families.config_fields.Section
    # (usually a families.sections.TransformerSection) whose FAMILY is ``name``.
    model_section: ClassVar[type]
    # The YAML ``data`` section of its runs (families/data_sections.py): text by default.
    data_section: ClassVar[type] = TextDataSection
    # Every loss metric the family can report, headline first; each is logged as-is and as
    # "<name> validation". A run reports ``run_metrics(cfg)`` of them (e.g. without an optional
    # head's loss when the head is off).
    metric_names: ClassVar[tuple[str, ...]]
    # Metrics whose validation value also gets a perplexity twin ("<name> validation ppl").
    perplexity_metrics: ClassVar[tuple[str, ...]] = ()
    # What one sample is, for the console's throughput ("images/s" for ViT); the metric is
    # "samples-per-second" for every family.
    sample_unit: ClassVar[str] = "samples"
    # The console's name of a metric (or of "<name> PPL", its validation perplexity) where
    # the metric's own name, kept in metrics.jsonl and TensorBoard, would mislead there
    # (RoBERTa's Megatron-named "lm loss" is a masked-LM loss).
    console_labels: ClassVar[dict[str, str]] = {}

    def run_metrics(self, cfg) -> tuple[str, ...]:
        """The metrics a run of ``cfg`` reports and ``loss`` returns: ``metric_names`` or a
        subset of it in the same order, the headline always first. Default: all of them."""
        return tuple(self.metric_names)

    # The entry of the model's output dict that holds the logits (RoBERTa "lm", ViT
    # "logits"); None: the model returns the logits tensor itself (GPT without labels).
    # ``load_pretrained`` returns a model that gives that tensor.
    logits_output: ClassVar[str | None] = None
    # Hugging Face ``config.json`` ``model_type`` values this family imports (``import_hf``).
    hf_model_types: ClassVar[tuple[str, ...]] = ()
    # Extra pieces a SentencePiece tokenizer trained for this family must have (RoBERTa:
    # "<mask>"); part of the default corpus's cache key.
    control_symbols: ClassVar[tuple[str, ...]] = ()

    def config_from_checkpoint(self, metadata: dict) -> Any:
        """The model config a training checkpoint's ``metadata.json`` describes (its
        ``config.model`` and ``model_structure``): what a reader builds to hold its tensors."""
        raise NotImplementedError(f"model family {self.name!r} cannot read its checkpoints yet")

    # The family's Hugging Face adapter (a families.hf_adapter.HFAdapter instance: config and
    # tensors both ways, directories, checkpoint export); None: the family has none, and
    # ``import_hf``/``export_hf`` refuse. (Typed Any: the adapter module imports this one.)
    hf_adapter: ClassVar[Any] = None

    def _hf_adapter(self, what: str) -> Any:
        if self.hf_adapter is None:
            raise NotImplementedError(f"model family {self.name!r} has no Hugging Face {what} yet")
        return self.hf_adapter

    def import_hf(self, directory, divisible_by: int = 128) -> HFImport:
        """A Hugging Face model directory of one of ``hf_model_types`` as this family's model
        (``HFImport``, through ``hf_adapter``); the vocabulary, if any, padded to a multiple of
        ``divisible_by``. The structure is ``checkpoint_structure``'s with what the directory's
        config.json says (the true vocabulary, token ids, class names)."""
        config, tensors, facts = self._hf_adapter("import").import_model(directory, divisible_by)
        structure = {**self.checkpoint_structure(config), **facts}
        section = section_values(self.model_section, config)
        if "make_vocab_size_divisible_by" in section:
            section["make_vocab_size_divisible_by"] = divisible_by
        return HFImport(config, tensors, structure, section)

    def export_hf(self, checkpoint, directory):
        """Write training checkpoint ``checkpoint`` (any layout, any level) as a Hugging Face
        model directory (through ``hf_adapter``); returns the directory. Families without an
        adapter raise."""
        return self._hf_adapter("export").export(checkpoint, directory, family=self)

    def checkpoint_model(self, checkpoint) -> tuple[JsonObject, Any, dict[str, torch.Tensor]]:
        """What an inference model or an export of training checkpoint ``checkpoint`` (a
        checkpoint directory, or a checkpoints directory with ``latest``; any layout, any
        level) needs: its ``model_structure``, its model config (``config_from_checkpoint``)
        and its parameters, full tensors from the canonical format (dequantized; FP8 scaling
        state left out: ``parameters_only``). The format is checked first (version, every
        model file present with its layout header: ``checkpoint.reshard.SourceCheckpoint``),
        so a damaged checkpoint raises ``CheckpointError`` naming its file; one of another
        family raises ``ValueError``."""
        from checkpoint.format import reassemble  # the format reader
        from checkpoint.reshard import SourceCheckpoint
        from checkpoint.store import resolve_checkpoint

        checkpoint = resolve_checkpoint(checkpoint)
        meta = SourceCheckpoint(checkpoint, kinds=("model",)).metadata  # the format check
        structure = meta["model_structure"]
        found = structure.need("family", str, why="the model's family")
        if found != self.name:
            raise ValueError(f"{checkpoint} holds a {found!r} model, not {self.name}")
        config = self.config_from_checkpoint(meta)
        return structure, config, parameters_only(reassemble(checkpoint))

    def loader_workers(self, cfg) -> int:
        """Worker processes that build this run's batches (``data.sampler.micro_batches``);
        0 = in the training process (cheap items: memory-mapped token windows)."""
        return 0

    def preflight(self, cfg) -> Any:
        """Check before any worker starts, building and writing nothing, what
        ``prepare_data`` would find wrong: data files missing or not in their format, a
        tokenizer that does not load, a cache directory that cannot be created; raise
        ``ValueError`` starting with the config key (training/preflight.py). Return this
        run's model config (``model_config`` for ``cfg.parallel.tensor``) when it is known
        without building anything, so a checkpoint to resume is checked against it there;
        else None. Default: no checks, None (the checks happen in ``prepare_data``)."""
        return None

    @abstractmethod
    def prepare_data(self, cfg, rank: int) -> Any:
        """Make the data usable (build caches, train a tokenizer) and return what the other
        methods need. The loop calls it on rank 0 first, then on the others."""

    @abstractmethod
    def model_config(self, cfg, data: Any, tensor_parallel: int) -> Any:
        """The model's config for this run (e.g. with the vocabulary padded for TP)."""

    @abstractmethod
    def build_model(
        self, config: Any, ctx: BuildContext, pipeline: PipelineLayout
    ) -> ParallelModel:
        """This rank's slice of the model (a ``models.base.ParallelModel``)."""

    @abstractmethod
    def build_datasets(self, cfg, data: Any, train_samples: int, valid_samples: int):
        """``(train, valid)`` map-style datasets of dicts of tensors; valid may be None.
        Called on every rank."""

    @abstractmethod
    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The entries of a micro-batch that ``forward_chunk`` reads (on every stage)."""

    @abstractmethod
    def loss(
        self, output: torch.Tensor, batch: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, LossSums]:
        """``(objective, {metric: (sum, count)})`` of one micro-batch (module doc)."""

    @abstractmethod
    def flops_per_step(self, config: Any, global_batch_size: int) -> float:
        """Model FLOPs of one optimizer step (forward + backward) over the global batch."""

    def planned_model_config(self, cfg, tensor_parallel: int) -> Any:
        """The model config of a run that is only planned (training/planning/): built from the
        config alone, with what ``model_config`` takes from the prepared data (the
        vocabulary, the classes) read without preparing any (no corpus built or read)."""
        raise NotImplementedError(f"model family {self.name!r} cannot be planned yet")

    def example_batch(self, config: Any, micro_batch_size: int) -> dict[str, torch.Tensor]:
        """One micro-batch with every entry ``model_inputs`` and ``loss`` read, in the shapes
        and dtypes the family's data gives; the values mean nothing (a plan runs on fake
        tensors, where only shapes and dtypes exist)."""
        raise NotImplementedError(f"model family {self.name!r} cannot be planned yet")

    @abstractmethod
    def checkpoint_structure(self, config: Any, data: Any = None) -> dict:
        """JSON-ready facts a checkpoint reader or converter needs beyond each tensor's own
        layout: fused tensors (QKV groups, SwiGLU halves), the true and padded vocabulary."""


# The keys the training loop writes into every metrics record, in its order (training/metrics.py
# builds each record from this tuple, the family's metrics after the first two); a family's
# metric may not shadow one, nor start with a prefix of the loop's own key families: device
# memory (mem-*-bytes), per-stage memory (mem-stage*/...), FP8 health (fp8/<layer>/...).
LOOP_METRICS = (
    "iteration", "consumed-samples", "learning-rate", "grad-norm", "loss-scale", "batch-size",
    "iteration-time", "samples-per-second", "throughput", "mfu", "bytes-per-param",
    "bytes-per-param-by-role", "comm-bytes", "wire-bytes-per-grad-element",
    "wire-bytes-per-grad-element-all", "wire-bytes-per-element", "skipped-iterations",
    "nan-iterations", "eta-seconds",
)  # fmt: skip
LOOP_METRIC_PREFIXES = ("mem-", "fp8/")


def register_family(family: ModelFamily, *, replace: bool = False) -> ModelFamily:
    """Make ``family`` available as ``get_family(family.name)``; returns it. A different
    family under a taken name is refused unless ``replace`` (re-registering the same class,
    e.g. when its module is imported again, is allowed)."""
    if not isinstance(family, ModelFamily):
        raise TypeError(f"{family!r} is not a ModelFamily")
    section = getattr(type(family), "model_section", None)
    if not (isinstance(section, type) and issubclass(section, Section)):
        raise TypeError(f"family {family.name!r}: model_section must be a config Section class")
    data = getattr(type(family), "data_section", None)
    if not (isinstance(data, type) and issubclass(data, Section) and data.SECTION == "data"):
        raise TypeError(f"family {family.name!r}: data_section must be a config Section 'data'")
    if section.FAMILY != family.name:
        raise ValueError(
            f"family {family.name!r}: its model_section {section.__name__} says FAMILY="
            f"{section.FAMILY!r}"
        )
    names = tuple(family.metric_names)
    if not names:
        raise ValueError(f"family {family.name!r}: metric_names is empty")
    clash = sorted(set(names) & set(LOOP_METRICS)) or sorted(
        n
        for n in names
        if n.endswith((" validation", " validation ppl")) or n.startswith(LOOP_METRIC_PREFIXES)
    )
    if clash:
        raise ValueError(f"family {family.name!r}: metric name {clash[0]!r} is reserved")
    unknown = sorted(set(family.perplexity_metrics) - set(names))
    if unknown:
        raise ValueError(f"family {family.name!r}: perplexity metric {unknown[0]!r} not a metric")
    old = _REGISTRY.get(family.name)
    if old is not None and type(old) is not type(family) and not replace:
        raise ValueError(
            f"model family {family.name!r} is already registered ({type(old).__qualname__})"
        )
    _REGISTRY[family.name] = family
    return family


# The built-in families: the class implementing each, imported and registered on first use.
# Named here rather than imported: the family modules import this one, and the registry must
# not import them back (an import circle), nor load every family to answer for one.
BUILTIN_FAMILIES = {
    "gpt": "families.gpt:GPTFamily",
    "roberta": "families.roberta:RobertaFamily",
    "vit": "families.vit:ViTFamily",
}


def _builtin() -> None:
    for name, where in BUILTIN_FAMILIES.items():
        if name not in _REGISTRY:
            module, cls = where.split(":")
            register_family(getattr(importlib.import_module(module), cls)())


def read_hf_config(directory) -> JsonObject:
    """A Hugging Face model directory's ``config.json``; a missing one raises naming it, as
    does a damaged one (``CheckpointError``) and, when read, a key it lacks or a value of the
    wrong type (``JsonObject.need``)."""
    from checkpoint.format import read_json  # the format reader: no model code

    path = Path(directory) / "config.json"
    if not path.exists():
        raise ValueError(f"{path}: missing (not a Hugging Face model directory)")
    return read_json(path)


def family_for_hf_directory(directory) -> ModelFamily:
    """The family importing the Hugging Face model in ``directory`` (by its model_type); a
    config.json without one, or with one no family imports, raises naming the file."""
    from checkpoint.format import CheckpointError

    hf = read_hf_config(directory)
    try:
        return family_for_hf(hf.need("model_type", str, why="it names the architecture"))
    except ValueError as err:
        raise CheckpointError(f"{hf.file}: {err}") from None


def family_for_hf(model_type: str) -> ModelFamily:
    """The family importing Hugging Face ``model_type`` (config.json's): a built-in one first,
    then the others in the order they registered (a family derived from a built-in one
    inherits its ``hf_model_types``)."""
    _builtin()
    ordered = sorted(_REGISTRY.values(), key=lambda f: f.name not in BUILTIN_FAMILIES)
    for family in ordered:
        if model_type in family.hf_model_types:
            return family
    known = sorted(t for f in _REGISTRY.values() for t in f.hf_model_types)
    raise ValueError(f"Hugging Face model_type {model_type!r} is not supported; known: {known}")


def get_family(name: str) -> ModelFamily:
    """The registered family ``name``; the built-in ones register on first use."""
    if name not in _REGISTRY:
        _builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown model family {name!r}; registered: {', '.join(family_names())}"
        ) from None


def checkpoint_family(metadata) -> ModelFamily:
    """The family that wrote a checkpoint, from its metadata (``checkpoint.store.read_metadata``);
    a ``family`` no registered family has raises naming metadata.json."""
    from checkpoint.format import CheckpointError

    try:
        return get_family(metadata["family"])
    except ValueError as err:
        raise CheckpointError(f"{metadata.file}: {err}") from None


DEFAULT_FAMILY = "gpt"  # what a config without a family (and pretrain_gpt.py) trains


def family_names() -> list[str]:
    _builtin()
    return sorted(_REGISTRY)

"""The parallel plumbing every model family shares: stage split, slice-wise materialisation,
tied copies across pipeline stages, tensor-parallel shards, and single-process tensor names.

A family's model subclasses ``ParallelModel`` and implements the abstract methods; a missing
one is a ``TypeError`` when the model is built, not a silently wrong gradient norm later.

Materialisation. A single-process model (no TP, one pipeline stage) is built as written, then
``init_weights()``. Any other layout builds only its own slice, uninitialised, and fills it
from a *replay* of the single-process initialisation, one tensor at a time:

1. the single-process structure is built on the meta device (shapes, no memory);
2. construction draws: for every module that owns parameters, in ``named_modules`` order,
   its ``reset_parameters()`` runs on full-size CPU scratch tensors, so the RNG advances
   exactly as constructing the single-process model does;
3. values: every parameter, in the same order, gets a full-size CPU tensor filled by
   ``init_parameter`` (the family's init), and this rank copies its slice of it.

So every layout starts from bitwise the single-process weights, the RNG stream after the build
is the same as there, and at most one full tensor (plus this rank's slice) is alive at a time.
Rule for families: a module that owns parameters either has ``reset_parameters()`` (the
``nn`` layers, ``fp8train.linear.Linear``) or draws nothing when constructed.

Names. Under TP a parallel linear holds its shard in an inner ``Linear``
(``qkv.linear.weight``); ``canonical_name`` drops that ``linear`` (the layer's ``shard_child``)
so every layout speaks the single-process names (``qkv.weight``), which checkpoints store. The
map it reads is built once per model, in one walk of the modules, after ``build``.
``tensor_layouts`` says how each stored tensor relates to the full one (split dimension and
blocks, per-shard state, pipeline copies), as each parallel layer reports it
(``shard_layouts``), so a reader can reassemble full tensors without this code.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import replace

import torch
from torch import nn

from fp8train.linear import Linear
from models.context import BuildContext
from parallel.pipeline.layout import PipelineLayout
from parallel.tensor_parallel.layers import ShardLayout, is_parallel_layer, shard_from_full
from parallel.tensor_parallel.mappings import group_rank

__all__ = ["LayerDict", "ParallelModel"]

_WHOLE = ShardLayout()  # a tensor no parallel layer splits: stored whole on every rank


class LayerDict(nn.ModuleDict):
    """Transformer layers keyed by their *global* index, so a pipeline stage holding layers 4
    and 5 names them ``layers.4`` and ``layers.5`` exactly as the whole model does (a stage's
    checkpoint is a subset of the single-rank one). Accepts ``layers[4]``; iterates modules."""

    def __getitem__(self, index: int | str) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self.values())


class ParallelModel(nn.Module, ABC):
    """Base of every family's model. Subclasses keep the ``(config, ctx, pipeline)`` signature
    (the single-process reference is built through it) and implement:

    - ``build(ctx)``: create this stage's modules (``self.pipeline`` says which layers;
      name them as the single-process model does, layers in a ``LayerDict``);
    - ``init_parameter(module_name, module, param_name, tensor)``: fill one full-size,
      single-process parameter in place (the family's initialisation);
    - ``forward_chunk(chunk, hidden, inputs)``: run model chunk ``chunk`` of this stage;
    - ``pipeline_copies()``: names of parameters that two stages hold (a tied head);
    - ``stage_activation_shape(micro_batch_size)``: the tensor passed between stages.

    ``config`` must have ``num_layers``.
    """

    def __init__(self, config, ctx: BuildContext | None = None, pipeline=None):
        super().__init__()
        # canonical_name's map (shard-child path -> layer path); None until first needed.
        self._shard_child_paths: dict[str, str] | None = None
        ctx = ctx or BuildContext()
        self.config = config
        self.ctx = ctx
        self.recipe = ctx.recipe
        self.tp_group = ctx.tp_group
        self.meter = ctx.meter  # where the tensor-parallel collectives count their bytes
        self.sequence_parallel = ctx.sequence_parallel
        self.pipeline = pipeline or PipelineLayout(config.num_layers)
        if self.pipeline.num_layers != config.num_layers:
            raise ValueError(
                f"pipeline layout has {self.pipeline.num_layers} layers, the model "
                f"{config.num_layers}"
            )
        if not ctx.initialize:  # shapes and dtypes only (a plan): no values to fill
            self.build(replace(ctx, materialize=False))
            self.refresh_names()
            return
        if self.tp_group is None and not self.pipeline.is_split:
            self.build(ctx)
            self.refresh_names()
            if torch.device(ctx.device or "cpu").type != "meta":
                self.init_weights()
            return
        # Build this rank's slice with a forked RNG (its own draws must not count), then fill
        # it from the replayed single-process init (module doc).
        with torch.random.fork_rng(devices=[]):
            self.build(replace(ctx, materialize=False))
        self.refresh_names()
        self._materialize()

    # ---- what a family implements -------------------------------------------------------

    @abstractmethod
    def build(self, ctx: BuildContext) -> None:
        """Create this pipeline stage's modules for ``ctx`` (see the class doc)."""

    @abstractmethod
    def init_parameter(
        self, module_name: str, module: nn.Module, param_name: str, tensor: torch.Tensor
    ) -> None:
        """Fill ``tensor`` (full single-process shape, FP32, CPU) with the initial value of
        ``module_name.param_name``; ``module`` is the single-process module that owns it."""

    @abstractmethod
    def forward_chunk(self, chunk: int, hidden: torch.Tensor | None, inputs: dict):
        """Model chunk ``chunk`` of this stage. The first chunk of the model reads ``inputs``
        (``hidden`` is None); others continue from ``hidden``. The last returns the family's
        output (what its ``loss`` reads); the others the activations to send on."""

    @abstractmethod
    def pipeline_copies(self) -> dict[str, bool]:
        """Parameters this stage holds that another stage holds too (a tied head's copy of
        the word embedding): name -> whether this stage's copy is the one counted in norms.
        Their gradients are summed over the stages that hold them. Empty when none."""

    @abstractmethod
    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        """Shape of the activations one micro-batch sends between pipeline stages."""

    # ---- single process -----------------------------------------------------------------

    @property
    def is_parallel(self) -> bool:
        return self.tp_group is not None or self.pipeline.is_split

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter in place and reset FP8 scaling state; call after
        ``to_empty`` when built on meta. Single-process models only."""
        if self.is_parallel:
            raise RuntimeError("init_weights on one slice: slices are filled at build time")
        for module_name, module in self.named_modules():
            for param_name, param in module.named_parameters(recurse=False):
                self.init_parameter(module_name, module, param_name, param.data)
            if isinstance(module, Linear):
                module.reset_fp8_state()  # fresh scales, e.g. after to_empty on a meta build

    # ---- slice-wise materialisation -----------------------------------------------------

    @torch.no_grad()
    def _materialize(self) -> None:
        rng = torch.get_rng_state()
        reference = type(self)(self.config, replace(self.ctx.single(), device="meta"))
        owned = list(_parameters_by_module(reference))
        # A module built off ctx.device would draw from the RNG here and hold real values:
        # every slice would silently start from other weights than the single process.
        for module_name, module, params in owned:
            if any(not module._parameters[n].is_meta for n in params):
                raise RuntimeError(
                    f"{type(self).__name__}.build: module {module_name!r} ignores ctx.device "
                    "(create every parameter on ctx.device)"
                )
        if not torch.equal(rng, torch.get_rng_state()):
            raise RuntimeError(
                f"{type(self).__name__}.build draws random numbers on the meta device: create "
                "modules on ctx.device and initialise in init_parameter / reset_parameters"
            )
        # 2. the construction draws of the single-process model, on scratch tensors
        for _, module, params in owned:
            reset = getattr(module, "reset_parameters", None)
            if reset is None:
                continue  # draws nothing when constructed (the class-doc rule)
            metas = {name: module._parameters[name] for name in params}
            try:
                for name, meta in metas.items():
                    module._parameters[name] = nn.Parameter(
                        torch.empty(meta.shape, dtype=meta.dtype), meta.requires_grad
                    )
                reset()
            finally:
                module._parameters.update(metas)
        # 3. the values, one full tensor at a time; this rank keeps its slice
        local = dict(self.named_parameters(remove_duplicate=False))
        by_name = {self.canonical_name(n): p for n, p in local.items()}
        partitions = self.tensor_partitions()
        filled = set()
        for module_name, module, params in owned:
            for param_name in params:
                meta = module._parameters[param_name]
                name = f"{module_name}.{param_name}" if module_name else param_name
                full = torch.empty(meta.shape, dtype=meta.dtype)
                self.init_parameter(module_name, module, param_name, full)
                target = by_name.get(name)
                if target is None:
                    continue  # another stage's parameter
                part = partitions.get(name)
                if part is not None:
                    full = shard_from_full(full, part[0], self.tp_group, part[1])
                target.copy_(full)
                filled.add(name)
        missing = sorted(set(by_name) - filled)
        if missing:
            raise RuntimeError(
                f"{type(self).__name__}: no single-process parameter for {missing[:3]}: a slice "
                "must name its tensors as the single-process model does"
            )

    # ---- names, shards and copies -------------------------------------------------------

    def refresh_names(self) -> None:
        """Forget ``canonical_name``'s map. The constructor calls it once ``build`` is done;
        call it again after adding or replacing a parallel layer on a built model."""
        self._shard_child_paths = None

    def _shard_child_map(self) -> dict[str, str]:
        paths = self._shard_child_paths
        if paths is None:
            paths = {
                f"{path}.{module.shard_child}": path
                for path, module in self.named_modules()
                if path and is_parallel_layer(module) and module.shard_child
            }
            self._shard_child_paths = paths
        return paths

    def canonical_name(self, name: str) -> str:
        """The single-process name of local tensor ``name`` (``qkv.linear.weight`` under TP
        is ``qkv.weight``); unchanged for everything else."""
        paths = self._shard_child_map()
        if paths:
            # Longest module prefix first: a few dict lookups per name, no module walk.
            end = name.rfind(".")
            while end > 0:
                layer = paths.get(name[:end])
                if layer is not None:
                    return layer + name[end:]
                end = name.rfind(".", 0, end)
        return name

    def _shard_layouts(self) -> dict[str, ShardLayout]:
        """Canonical name -> ``ShardLayout`` of every tensor a tensor-parallel layer stores,
        as the layer reports it; empty without TP (there is nothing to split)."""
        out: dict[str, ShardLayout] = {}
        if self.tp_group is None:
            return out
        for path, module in self.named_modules():
            if is_parallel_layer(module):
                for name, layout in module.shard_layouts().items():
                    out[f"{path}.{name}" if path else name] = layout
        return out

    def tensor_partitions(self) -> dict[str, tuple[int, int]]:
        """Canonical name -> (split dimension, blocks) of every tensor-parallel shard."""
        return {
            name: (layout.partition_dim, layout.blocks)
            for name, layout in self._shard_layouts().items()
            if layout.partition_dim is not None
        }

    def tensor_parallel_sharded(self) -> set[int]:
        """ids of parameters split across the tensor-parallel group (the rest are replicated):
        gradient norms sum these over the group and count replicated ones once."""
        partitions = self.tensor_partitions()
        return {
            id(p)
            for n, p in self.named_parameters(remove_duplicate=False)
            if self.canonical_name(n) in partitions
        }

    def shared_parameters(self) -> list[nn.Parameter]:
        """This stage's parameters that other stages hold copies of (gradients summed over
        the pipeline's embedding group); empty without a pipeline."""
        if not self.pipeline.is_split:
            return []
        params = dict(self.named_parameters())
        return [params[name] for name in self.pipeline_copies()]

    def pipeline_duplicates(self) -> set[int]:
        """ids of parameters that are copies of another stage's: norms count them once."""
        if not self.pipeline.is_split:
            return set()
        params = dict(self.named_parameters())
        return {id(params[n]) for n, counted in self.pipeline_copies().items() if not counted}

    def tensor_layouts(self) -> dict[str, dict]:
        """For every entry of ``canonical_state_dict``: how the stored tensor relates to the
        full single-process one, as JSON-ready dicts (checkpoint/format.py reads
        them): ``partition_dim``/``blocks`` (null: whole), ``tp_rank``/``tp_size``,
        ``per_shard`` (state each shard keeps for itself, e.g. FP8 scaling),
        ``scale_inv`` (name of the scale of a scaled FP16/FP8 weight), ``scale_block`` (the
        block of a block-scaled FP8 weight's scale grid; absent: one scale),
        ``pipeline_copy`` (another stage stores the counted copy)."""
        layouts = self._shard_layouts()
        copies = {n for n, counted in self.pipeline_copies().items() if not counted}
        copies = copies if self.pipeline.is_split else set()
        scaled = self._scaled_weights()
        tp = self.ctx.tp
        rank = group_rank(self.tp_group) if self.tp_group is not None else 0
        out = {}
        for name in self.canonical_state_dict():
            layout = layouts.get(name, _WHOLE)
            owner = name.rsplit(".", 1)[0]
            entry = {
                "partition_dim": layout.partition_dim,
                "blocks": layout.blocks,
                "tp_rank": rank,
                "tp_size": tp,
                "per_shard": layout.per_shard,
                "pipeline_copy": name in copies,
            }
            if name.endswith(".weight") and f"{owner}.weight_scale_inv" in scaled:
                entry["scale_inv"] = f"{owner}.weight_scale_inv"
                block = scaled[f"{owner}.weight_scale_inv"]
                if block is not None:
                    entry["scale_block"] = list(block)
            out[name] = entry
        return out

    def _scaled_weights(self) -> dict[str, tuple[int, int] | None]:
        """Canonical name of each scaled weight's ``weight_scale_inv`` -> its block (None:
        one scale per tensor)."""
        return {
            self.canonical_name(f"{n}.weight_scale_inv"): getattr(m, "weight_block", None)
            for n, m in self.named_modules()
            if isinstance(m, Linear) and hasattr(m, "weight_scale_inv")
        }

    def canonical_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()`` under single-process names (this rank's slices)."""
        return {self.canonical_name(k): v for k, v in self.state_dict().items()}

    def load_canonical_state_dict(
        self, tensors: dict[str, torch.Tensor], partial: bool = False
    ) -> None:
        """Inverse of ``canonical_state_dict`` for the same layout: strict, or with
        ``partial`` only the given tensors (the rest keep their values). An unknown name
        raises either way."""
        local = {self.canonical_name(k): k for k in self.state_dict()}
        unknown = sorted(set(tensors) - set(local))
        if unknown:
            raise KeyError(f"tensors this model does not have: {unknown[:3]}")
        self.load_state_dict({local[k]: v for k, v in tensors.items()}, strict=not partial)

    def canonical_parameter_names(self) -> dict[int, str]:
        """id(parameter) -> single-process name."""
        return {id(p): self.canonical_name(n) for n, p in self.named_parameters()}

    # ---- shared helpers -----------------------------------------------------------------

    def linear_modules(self) -> Iterator[tuple[str, Linear]]:
        """(name, Linear) of every ``fp8train.linear.Linear``, e.g. ``layers.0.attention.qkv``
        (under TP the inner shard, ``layers.0.attention.qkv.linear``)."""
        for name, m in self.named_modules():
            if isinstance(m, Linear):
                yield name, m

    def fp8_stats(self) -> dict[str, object]:
        """Each FP8 Linear's ``fp8_stats()`` keyed by module name; empty at non-FP8 levels."""
        stats: dict[str, object] = {}
        for name, m in self.linear_modules():
            s = m.fp8_stats()
            if s:
                stats[name] = s
        return stats


def _parameters_by_module(model: nn.Module):
    """(module name, module, [its own parameter names]) in ``named_modules`` order, for
    modules that own parameters: the single-process construction and init order."""
    for module_name, module in model.named_modules():
        params = [n for n, _ in module.named_parameters(recurse=False)]
        if params:
            yield module_name, module, params

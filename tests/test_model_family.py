"""A second model family defined in this file alone, trained under every parallel layout.

The toy family is the worked example of "adding a model family" (docs): a bidirectional
sequence classifier on synthetic data. Each sample is a float feature sequence ``[seq, d_in]``
drawn from the run's seed; a fixed random linear "teacher" of the mean feature gives its class.
The model is input projection -> ``num_layers`` non-causal ``TransformerLayer`` blocks -> final
norm -> mean over the sequence -> classification head, and it is registered at import, so
spawned or forked ranks see it. Nothing in training/ or parallel/ knows about it. Its blocks
also show the other extension point, a layer spec: their MLP is this file's ``ToyGatedMLP``
(GEGLU from the project's parallel linears), swapped in through ``ToyModel.layer_spec`` with
no edit of models/transformer.py, so every layout below trains the swapped class too.

Each layout trains it through ``training.loop.pretrain(cfg, family="toy")`` for 5 fp32 steps
(4 micro-batches of 2 per step, dropout 0, one evaluation at the end) and is checked against
the single-process run: every logged loss (training and validation) within 1e-5 relative (the
fp32 equivalence bar) and every final weight, reassembled from the layout's last checkpoint,
under the same names and within 1e-4 relative L2 per tensor (``multiproc.ADAM_WEIGHT_BAR``:
Adam magnifies the rounding of near-eps gradient elements), except the attention key biases,
which are rounding noise in every run and are checked to stay noise-sized (``weight_errors``).
Layouts: TP=2, TP=2 with sequence parallelism, PP=2, PP=2 x virtual 2 (world size 2, run one
after the other in one pair of forked ranks). Measured (with the gated MLP): pipeline losses
bitwise equal, weights <= 8.8e-8 (the grad norm summed over the stages moves the clip
coefficient by an FP32 ulp); TP losses 8.6e-8, weights <= 3.0e-7, 3.9e-7 with sequence
parallelism (sharded GEMMs sum in another grouping); key biases <= 5.6e-7 in magnitude.

In one process: each pipeline stage of the toy model holds bitwise the single-process tensors
(slice-wise materialisation), and a family or model class that forgets an abstract method is a
TypeError when it is made.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from multiproc import ADAM_WEIGHT_BAR, rank_env, reassembled_errors, run_ranks
from torch import nn

from families import LossSums, ModelFamily, register_family
from families.sections import TextTransformerSection
from fp8train.linear import Linear
from models.base import LayerDict, ParallelModel
from models.context import BuildContext
from models.transformer import (
    LayerSpec,
    TransformerConfig,
    TransformerLayer,
    column_linear,
    make_norm,
    row_linear,
)
from parallel.pipeline.layout import PipelineLayout
from parallel.tensor_parallel.mappings import gather_from_region, scatter_to_region

# ---------------------------------------------------------------------------------------------
# The toy family: config, data, model, family.


@dataclass(kw_only=True)
class ToyConfig(TransformerConfig):
    """The shared blocks' fields (from the config's ``model`` section) plus the toy's own:
    ``input_size`` and ``num_classes`` come from the data, as GPT's vocabulary does."""

    seq_length: int
    input_size: int
    num_classes: int


@dataclass(frozen=True)
class ToySection(TextTransformerSection):
    """The toy's YAML ``model`` section: the blocks' keys (defaults and rules from
    ``TransformerConfig``); its own shape fields come from the data, so none are added."""

    FAMILY: ClassVar[str] = "toy"

    def build_config(self, input_size: int = 1, num_classes: int = 2) -> ToyConfig:
        return ToyConfig.from_model_section(self, input_size=input_size, num_classes=num_classes)


@dataclass(frozen=True)
class ToyData:
    """What ``prepare_data`` hands the other methods: the shape of the synthetic task."""

    input_size: int
    num_classes: int


class ToyDataset(torch.utils.data.Dataset):
    """Map-style: item ``i`` is ``{"features": [seq, d_in] float32, "label": int64 scalar}``."""

    def __init__(self, features: torch.Tensor, labels: torch.Tensor):
        self.features, self.labels = features, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.features[i], "label": self.labels[i]}


def synthetic_samples(n: int, seq: int, data: ToyData, seed: int):
    """``n`` samples from a private generator (the global RNG is the model's): Gaussian
    features, labelled by a fixed random linear teacher of their mean over the sequence."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(data.input_size, data.num_classes, generator=gen)
    features = torch.randn(n, seq, data.input_size, generator=gen)
    labels = (features.mean(dim=1) @ teacher).argmax(dim=-1)
    return features, labels


class ToyGatedMLP(nn.Module):
    """GEGLU, ``fc2(gelu(gate(x)) * up(x))`` (h -> f, f -> h): the stock ``MLP``'s place in
    the toy's blocks, through its ``LayerSpec``. ``gate`` and ``up`` are two unfused
    column-parallel GEMMs, so each rank holds matching slices of both and their product needs
    no communication (no fused-layout metadata either); ``fc2`` is row-parallel."""

    def __init__(self, config: TransformerConfig, ctx: BuildContext):
        super().__init__()
        h, f, bias = config.hidden_size, config.ffn_hidden_size, config.add_bias_linear
        self.gate = column_linear(h, f, bias, ctx)
        self.up = column_linear(h, f, bias, ctx)
        self.fc2 = row_linear(f, h, bias, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.gelu(self.gate(x), approximate="tanh") * self.up(x)  # [b, s, f/tp]
        return self.fc2(y)  # [b, s, h]


class ToyModel(ParallelModel):
    """``features [b, s, d_in]`` -> logits ``[b, num_classes]`` (float32).

    Names, as the single-process model has them: ``input_proj`` (first stage), ``layers.{i}``
    (global index), ``final_norm`` and ``head`` (last stage). The input projection and the
    head are small and replicated over tensor-parallel ranks; the transformer blocks split
    themselves when ``ctx.tp_group`` is set. Block MLPs are ``ToyGatedMLP`` (``layer_spec``):
    ``layers.{i}.mlp.{gate, up, fc2}``.
    """

    layer_spec: ClassVar[LayerSpec] = LayerSpec(mlp=ToyGatedMLP)

    def build(self, ctx: BuildContext) -> None:
        cfg, stage, device = self.config, self.pipeline, ctx.device
        if stage.has_embedding():
            # recipe=None: kept in high precision at every level, like GPT's embeddings.
            self.input_proj = Linear(cfg.input_size, cfg.hidden_size, recipe=None, device=device)
        spec = self.layer_spec
        self.layers = LayerDict(
            (str(i), TransformerLayer(cfg, ctx, causal=False, recompute=cfg.recompute, spec=spec))
            for i in stage.local_layers()
        )
        if stage.has_head():
            sp_group = ctx.tp_group if ctx.sequence_parallel else None
            self.final_norm = make_norm(cfg, device=device, sp_group=sp_group)
            self.head = Linear(cfg.hidden_size, cfg.num_classes, recipe=None, device=device)

    def init_parameter(self, module_name, module, param_name, tensor) -> None:
        """Linear weights N(0, init_method_std), biases zero, norm scales one."""
        if isinstance(module, Linear) and param_name == "weight":
            nn.init.normal_(tensor, 0.0, self.config.init_method_std)
        elif param_name == "bias":
            nn.init.zeros_(tensor)
        else:
            nn.init.ones_(tensor)

    def forward_chunk(self, chunk: int, hidden: torch.Tensor | None, inputs: dict):
        stage, group = self.pipeline, self.tp_group
        if stage.has_embedding(chunk):
            hidden = self.input_proj(inputs["features"])  # [b, s, h]
            if self.sequence_parallel:
                hidden = scatter_to_region(hidden, group, dim=1)  # [b, s/tp, h]
        for i in stage.chunk_layers(chunk):
            hidden = self.layers[i](hidden)
        if not stage.has_head(chunk):
            return hidden  # sent to the next stage
        hidden = self.final_norm(hidden)
        if self.sequence_parallel:
            # The pooling and head are replicated, so every rank's gradient of the gathered
            # tensor is the whole gradient: gather_from_region (backward keeps this rank's
            # slice), not gather_from_sequence_region (backward would sum the copies).
            hidden = gather_from_region(hidden, group, dim=1)  # [b, s, h]
        return self.head(hidden.mean(dim=1)).float()  # [b, classes]

    def pipeline_copies(self) -> dict[str, bool]:
        return {}  # no parameter lives on two stages

    def stage_activation_shape(self, micro_batch_size: int) -> tuple[int, ...]:
        seq = self.config.seq_length // (self.ctx.tp if self.sequence_parallel else 1)
        return (micro_batch_size, seq, self.config.hidden_size)


class ToyFamily(ModelFamily):
    """Sequence classification on synthetic data (module doc). Metrics: the mean cross
    entropy (``loss``, the headline) and ``accuracy``, each a ``(sum, count)`` over samples."""

    name = "toy"
    model_section = ToySection
    metric_names = ("loss", "accuracy")

    def __init__(self, input_size: int = 8, num_classes: int = 4):
        self.input_size, self.num_classes = input_size, num_classes

    def prepare_data(self, cfg, rank: int) -> ToyData:
        return ToyData(self.input_size, self.num_classes)  # generated in memory: nothing to do

    def model_config(self, cfg, data: ToyData, tensor_parallel: int) -> ToyConfig:
        # The blocks' keys (and seq_length, recompute) come from the toy's model section.
        return cfg.model.resolved(input_size=data.input_size, num_classes=data.num_classes)

    def build_model(self, config: ToyConfig, ctx, pipeline) -> ToyModel:
        return ToyModel(config, ctx, pipeline)

    def build_datasets(self, cfg, data: ToyData, train_samples: int, valid_samples: int):
        n = train_samples + valid_samples
        features, labels = synthetic_samples(n, cfg.model.seq_length, data, cfg.training.seed)
        train = ToyDataset(features[:train_samples], labels[:train_samples])
        return train, ToyDataset(features[train_samples:], labels[train_samples:])

    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"features": batch["features"]}

    def loss(self, output: torch.Tensor, batch: dict) -> tuple[torch.Tensor, LossSums]:
        labels = batch["label"]
        total = F.cross_entropy(output, labels, reduction="sum")
        count = torch.tensor(float(labels.numel()), device=output.device)
        correct = (output.argmax(dim=-1) == labels).sum().float()
        return total / count, {"loss": (total, count), "accuracy": (correct, count)}

    def flops_per_step(self, config: ToyConfig, global_batch_size: int) -> float:
        """The blocks (bidirectional: every score counts) plus the projection and head;
        ``layer_flops_per_step`` counts the stock MLP's two GEMMs, the gated one has a third."""
        b, s, h = global_batch_size, config.seq_length, config.hidden_size
        blocks = config.layer_flops_per_step(b, s, causal=False)
        gate = 6.0 * b * s * config.num_layers * h * config.ffn_hidden_size
        return blocks + gate + 6.0 * b * (s * config.input_size * h + h * config.num_classes)

    def checkpoint_structure(self, config: ToyConfig, data: ToyData | None = None) -> dict:
        """The shared blocks' fused tensors (layouts in models/transformer.py)."""
        fused = config.fused_tensors()
        return {"family": self.name, "fused": fused, "num_classes": config.num_classes}


register_family(ToyFamily())

# ---------------------------------------------------------------------------------------------
# Training it under every layout.

STEPS = 5
# name -> (world size, parallel section)
LAYOUTS = {
    "single": (1, {}),
    "tp2": (2, {"tensor": 2}),
    "tp2_sp": (2, {"tensor": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline": 2}),
    "pp2_v2": (2, {"pipeline": 2, "virtual_pipeline": 2}),
}
PARALLEL = [name for name in LAYOUTS if name != "single"]
TOLERANCE = 1e-5  # fp32: the project's equivalence bar


def toy_config(run_dir: Path, parallel: dict) -> dict:
    """A seconds-long fp32 run: 4 layers (PP=2 x virtual 2 needs 4), 4 micro-batches of 2."""
    return {
        "model": {
            "num_layers": 4, "hidden_size": 32, "num_attention_heads": 4, "seq_length": 8,
            "hidden_dropout": 0.0, "attention_dropout": 0.0,
        },
        "data": {"cache_dir": str(run_dir / "cache")},
        "training": {
            "train_iters": STEPS, "micro_batch_size": 2, "global_batch_size": 8,
            "eval_interval": STEPS, "eval_iters": 1, "seed": 1234,
        },
        "optimizer": {"lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 1},
        "precision": {"level": "fp32"},
        "parallel": parallel,
        # peak_tflops: skip the CPU peak measurement; no TensorBoard thread in the ranks.
        "logging": {"dir": str(run_dir), "interval": 1, "tensorboard": False, "peak_tflops": 1.0},
        "checkpoint": {"save_interval": 0, "resume": False},
    }  # fmt: skip


def _worker(rank: int, world: int, port: int, configs: list[dict]) -> None:
    """One rank of every run in ``configs``, one after the other (later runs reuse the process
    group and add their own groups)."""
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.config import config_from_dict
    from training.loop import pretrain

    for cfg in configs:
        pretrain(config_from_dict(cfg, family="toy"))
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Train every layout once (one forked process, then one pair of forked ranks); returns
    each layout's run directory (``metrics.jsonl``, ``checkpoints/``)."""
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    root = tmp_path_factory.mktemp("toy_family")
    dirs = {name: root / name for name in LAYOUTS}
    for world in (1, 2):
        configs = [toy_config(dirs[n], p) for n, (w, p) in LAYOUTS.items() if w == world]
        run_ranks(_worker, world, (configs,), timeout=300, start_method="fork")
    return dirs


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from checkpoint.format import reassemble
    from checkpoint.store import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None and path.name == f"iter_{STEPS:07d}", path
    return reassemble(path, "model")


def _metadata(run_dir: Path) -> dict:
    return json.loads((run_dir / "checkpoints" / f"iter_{STEPS:07d}" / "metadata.json").read_text())


def loss_error(run_dir: Path, ref_dir: Path) -> float:
    """Worst relative error of the logged training and validation losses."""
    records, ref = _records(run_dir), _records(ref_dir)
    assert (
        [r["iteration"] for r in records] == [r["iteration"] for r in ref] == [*range(1, STEPS + 1)]
    )
    pairs = [
        (r[k], q[k]) for r, q in zip(records, ref) for k in ("loss", "loss validation") if k in q
    ]
    assert len(pairs) == STEPS + 1  # every step, and the one evaluation
    return max(abs(a - b) / abs(b) for a, b in pairs)


def weight_errors(run_dir: Path, ref_dir: Path) -> tuple[dict[str, float], float]:
    """Final weights of a run against the reference's (``multiproc.reassembled_errors``)."""
    structure = _metadata(ref_dir)["model_structure"]
    return reassembled_errors(_final_weights(run_dir), _final_weights(ref_dir), structure)


@pytest.mark.parametrize("layout", PARALLEL)
def test_losses_match_single_process(runs, layout):
    assert loss_error(runs[layout], runs["single"]) < TOLERANCE


@pytest.mark.parametrize("layout", PARALLEL)
def test_final_weights_match_single_process(runs, layout):
    errors, key_bias = weight_errors(runs[layout], runs["single"])
    assert max(errors.values()) < ADAM_WEIGHT_BAR, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert key_bias < 1e-5  # noise: 1% of one Adam step at lr 1e-3


def test_single_process_run_logs_the_family_metrics(runs):
    records = _records(runs["single"])
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records)
    assert math.isfinite(records[-1]["loss validation"])
    assert 0.0 <= records[-1]["accuracy validation"] <= 1.0
    assert "loss validation ppl" not in records[-1]  # perplexity_metrics is empty
    weights = _final_weights(runs["single"])
    assert {"input_proj.weight", "layers.3.attention.qkv.weight", "head.bias"} <= set(weights)
    meta = _metadata(runs["single"])
    assert meta["family"] == "toy" and meta["model_structure"]["num_classes"] == 4


def test_a_checkpoint_of_another_family_is_refused_before_building(runs, tmp_path):
    """Resuming the toy's checkpoint as GPT fails in one line naming both families, before
    any data, model or process group is built."""
    from training.config import ConfigError, config_from_dict
    from training.loop import pretrain

    toy = runs["single"] / "checkpoints" / f"iter_{STEPS:07d}"
    cfg = toy_config(tmp_path, {})
    cfg["checkpoint"] = {"load": str(toy)}
    with pytest.raises(ConfigError, match="holds a 'toy' model; this run trains 'gpt'"):
        pretrain(config_from_dict(cfg))  # the default family's model section: GPT


def _model_config() -> ToyConfig:
    from training.config import config_from_dict

    cfg = config_from_dict(toy_config(Path("unused"), {}), family="toy")
    return ToyFamily().model_config(cfg, ToyFamily().prepare_data(cfg, 0), tensor_parallel=1)


def test_pipeline_stages_are_cut_from_the_single_process_model():
    """In one process (a pipeline layout needs no process group to be built): each stage holds
    the single-process model's tensors under the same names, bitwise, and leaves the RNG where
    building the whole model does (the materialisation rule of models/base.py)."""
    config = _model_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        full = dict(ToyModel(config).named_parameters())
        after = torch.rand(4)
        held = []
        for rank in (0, 1):
            torch.manual_seed(0)
            stage = ToyModel(
                config, BuildContext(), PipelineLayout(config.num_layers, 2, rank=rank)
            )
            assert torch.equal(torch.rand(4), after)
            for name, p in stage.named_parameters():
                assert torch.equal(p, full[name]), name
            held += [name for name, _ in stage.named_parameters()]
    assert sorted(held) == sorted(full)  # the stages partition the model


def test_the_layer_spec_puts_the_toy_mlp_in_every_block(runs):
    """The spec reaches every block: each ``mlp`` is ``ToyGatedMLP``, the forward runs it and
    the loss's gradient reaches all its weights, and the trained checkpoint holds its tensors
    and no stock ``fc1`` (that the layouts train it alike is checked above)."""
    config = _model_config()
    model = ToyModel(config)
    mlps = [layer.mlp for layer in model.layers]
    assert len(mlps) == config.num_layers and all(type(m) is ToyGatedMLP for m in mlps)
    ran = []
    for m in mlps:
        m.register_forward_hook(lambda module, args, out: ran.append(module))
    features = torch.randn(2, config.seq_length, config.input_size)
    logits = model.forward_chunk(0, None, {"features": features})
    F.cross_entropy(logits, torch.tensor([0, 1])).backward()
    assert ran == mlps
    for name, p in model.named_parameters():
        if ".mlp." in name and name.endswith("weight"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name
    trained = _final_weights(runs["single"])
    assert {f"layers.3.mlp.{part}.weight" for part in ("gate", "up", "fc2")} <= set(trained)
    assert not any(".mlp.fc1." in name for name in trained)


def test_a_layer_spec_refuses_what_it_cannot_build():
    with pytest.raises(TypeError, match="LayerSpec.mlp"):
        LayerSpec(mlp="ToyGatedMLP")


# ---------------------------------------------------------------------------------------------
# A family or model that forgets an abstract method fails when it is made, not later.


def _without(cls: type, method: str, base: type) -> type:
    """A direct subclass of ``base`` with ``cls``'s own methods except ``method``."""
    body = {k: v for k, v in vars(cls).items() if not k.startswith("__") and k != method}
    return type(f"No_{method}", (base,), body)


@pytest.mark.parametrize("method", sorted(ModelFamily.__abstractmethods__))
def test_family_missing_a_method_cannot_be_instantiated(method):
    incomplete = _without(ToyFamily, method, ModelFamily)
    with pytest.raises(TypeError, match=method):
        incomplete()
    with pytest.raises(TypeError, match="not a ModelFamily"):
        register_family(incomplete)  # the class, not an instance


@pytest.mark.parametrize("method", sorted(ParallelModel.__abstractmethods__))
def test_model_missing_a_method_fails_at_build(method):
    incomplete = _without(ToyModel, method, ParallelModel)

    class Family(ToyFamily):
        def build_model(self, config, ctx, pipeline):
            return incomplete(config, ctx, pipeline)

    config = _model_config()
    with pytest.raises(TypeError, match=method):
        Family().build_model(config, BuildContext(), PipelineLayout(config.num_layers))


@pytest.mark.parametrize(
    "metric",
    ["eta-seconds", "grad-norm", "mem-allocated-bytes", "fp8/layers.0/amax", "loss validation"],
)
def test_a_metric_that_shadows_the_loops_is_refused(metric):
    """A family's metric may not take a key of the loop's records (``LOOP_METRICS``, the
    tuple the loop builds every record from) nor one of its key families (memory, FP8
    health, validation)."""

    class Shadowing(ToyFamily):  # the toy family's name: refused before any name check
        metric_names = ("loss", metric)

    with pytest.raises(ValueError, match="is reserved"):
        register_family(Shadowing())


def test_a_family_without_a_hugging_face_adapter_refuses_import_and_export(tmp_path):
    """``import_hf``/``export_hf`` come from the family's ``hf_adapter``; the toy family has
    none, so both refuse, naming the family, before reading anything."""
    assert ToyFamily.hf_adapter is None and ToyFamily.hf_model_types == ()
    with pytest.raises(NotImplementedError, match="'toy' has no Hugging Face import yet"):
        ToyFamily().import_hf(tmp_path)
    with pytest.raises(NotImplementedError, match="'toy' has no Hugging Face export yet"):
        ToyFamily().export_hf(tmp_path, tmp_path / "hf")

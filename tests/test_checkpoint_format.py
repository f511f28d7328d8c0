"""The canonical checkpoint format (checkpoint/format.py): its reader on synthetic
files, and the issue's acceptance test on real checkpoints.

Synthetic: every layout the format describes (column and row splits, SwiGLU-style blocks
regrouped as ``parallel.tensor_parallel.layers.shard_from_full`` shards them, per-shard state,
per-shard ``scale_inv``, pipeline and data-parallel copies, a missing shard), written with
``write_tensors`` and read back with ``reassemble``.

Acceptance: the tiny GPT trained 3 steps by ``training.loop.pretrain`` at TP=2 x PP=2 (4
forked ranks) and in one process, same seed, data and config, fp32. The model combines every
layout feature at once: 4 layers (2 per stage), a tied embedding (the last stage stores a
pipeline copy), SwiGLU (``fc1`` = [gate | up]: blocks=2, weight and bias), grouped-query
attention (4 heads in 2 groups, one group per TP rank), column and row splits. Both final
checkpoints are reassembled by the reader in a fresh interpreter that must not import any
model code, and must hold the same tensor names and, per tensor, the same values to the
project's fp32 bar, 1e-5 relative L2 (tests/test_distributed_optimizer.py,
tests/test_pipeline_training.py). Measured: 8.3e-7 model, 6.7e-7 optimizer state.

Two documented exceptions:
- the key entries of ``qkv.bias``: their true gradient is exactly zero (softmax ignores q.b_k),
  so Adam turns FP32 rounding noise into steps of ~1e-6 and these entries are noise in every
  run; as in tests/test_distributed_optimizer.py they are checked to stay noise-sized (< 1e-5)
  in both runs instead of relative to each other (with them, qkv.bias differs by ~1e-4).
- per-shard state (``per_shard`` in the format) is stacked one row per tensor-parallel rank,
  so its reassembled shape depends on TP. At fp32 there is none: the optimizer's ``:step``
  counts are whole tensors, equal on every shard.

O2 at TP=2 against its TP=1 run (weights stored as FP16 shards with per-shard power-of-two
scales, dequantized by the reader): no bitwise agreement is possible, since each weight shard
has its own FP8 scales and amax history (tests/test_tp_training.py). Bars, per tensor:
- relative to the FP8 noise, as in tests/test_distributed_optimizer.py: ||tp2 - tp1|| <=
  2.5 ||tp1 - tp1_fp32|| (two runs carrying FP8 noise of one size are at most ~2x it apart);
  measured max 1.57 (model), 1.50 (optimizer state).
- the dequantized linear weights: 0.03 relative L2; measured max 0.014 (row-parallel proj
  and fc2, whose init std is 0.02/sqrt(2*layers)); the O2-vs-fp32 distance is the same size.
  A misplaced shard or a scale applied to the wrong shard moves a weight by O(1).
- the FP8 weight amax histories (per-shard rows): their maximum over the shards is the full
  weight's amax, which the TP=1 run recorded; amax is 1-Lipschitz in the max norm and Adam
  moves an element at most ~lr per step, so the two differ by at most twice the sum of the
  3 learning rates, 2 x 1.6e-3 (bar 3.5e-3: Adam's bound is ~1.001 lr, plus weight decay and
  FP16 storage rounding); measured 2e-4. Rows from the wrong shards would differ by ~1e-2.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import pretrain_ranks
from safetensors.torch import load_file, save_file

from checkpoint.format import (
    optimizer_layouts,
    read_layouts,
    reassemble,
    reassemble_tensor,
    write_tensors,
)

# ---------------------------------------------------------------------------------------------
# Synthetic files


def _layout(dim=None, rank=0, size=1, blocks=1, per_shard=False, copy=False, scale=None):
    entry = {
        "partition_dim": dim,
        "blocks": blocks,
        "tp_rank": rank,
        "tp_size": size,
        "per_shard": per_shard,
        "pipeline_copy": copy,
    }
    if scale is not None:
        entry["scale_inv"] = scale
    return entry


def _write_shards(directory, stem, name, shards, dim, blocks=1, extra=None):
    """``{stem}_tp{r}.safetensors`` per shard, each also holding the ``extra`` whole tensors."""
    for r, shard in enumerate(shards):
        tensors = {name: shard, **(extra or {})}
        layouts = {name: _layout(dim, r, len(shards), blocks)}
        layouts.update({k: _layout(rank=r, size=len(shards)) for k in extra or {}})
        write_tensors(directory / f"{stem}_tp{r}.safetensors", tensors, layouts)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 1], ids=["column", "row"])
def test_splits_concatenate_along_the_partition_dim(tmp_path, dim, tp):
    full = torch.randn(8, 12)
    bias = torch.randn(12)  # replicated on every rank: kept once
    _write_shards(tmp_path, "model", "w", full.chunk(tp, dim), dim, extra={"b": bias})
    out = reassemble(tmp_path)
    assert set(out) == {"w", "b"}
    assert torch.equal(out["w"], full) and torch.equal(out["b"], bias)
    layouts = read_layouts(tmp_path / "model_tp1.safetensors")
    assert layouts["w"]["partition_dim"] == dim and layouts["w"]["dtype"] == "float32"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_blocks_regroup_the_shard_from_full_convention(tmp_path, monkeypatch, dim, tp):
    """SwiGLU's fc1 is [gate | up]: each block is split across the ranks and a rank holds
    [gate piece | up piece] (``shard_from_full``); the reader regroups block-major."""
    from parallel.tensor_parallel import layers

    # shard_from_full asks the group for its size and rank: stand in a rank number for it.
    monkeypatch.setattr(layers, "group_size", lambda group: tp)
    monkeypatch.setattr(layers, "group_rank", lambda group: group)
    full = torch.randn(16, 8) if dim == 0 else torch.randn(8, 16)
    gate, up = full.chunk(2, dim)
    shards = [layers.shard_from_full(full, dim, r, blocks=2) for r in range(tp)]
    for r, shard in enumerate(shards):  # the convention, spelled out
        expected = torch.cat([gate.chunk(tp, dim)[r], up.chunk(tp, dim)[r]], dim)
        assert torch.equal(shard, expected)
    assert not torch.equal(torch.cat(shards, dim), full)  # plain concatenation is wrong
    _write_shards(tmp_path, "model", "fc1.weight", shards, dim, blocks=2)
    assert torch.equal(reassemble(tmp_path)["fc1.weight"], full)
    # The bias of a column-parallel SwiGLU fc1 is split the same way (dim 0, blocks=2).
    bias = torch.randn(16)
    pieces = [layers.shard_from_full(bias, 0, r, blocks=2) for r in range(tp)]
    layouts = [(_layout(0, r, tp, blocks=2), p, None) for r, p in enumerate(pieces)]
    assert torch.equal(reassemble_tensor(layouts), bias)


def test_reassemble_tensor_orders_pieces_by_rank():
    full = torch.randn(6, 4)
    a, b, c = full.chunk(3, 0)
    pieces = [(_layout(0, 2, 3), c, None), (_layout(0, 0, 3), a, None), (_layout(0, 1, 3), b, None)]
    assert torch.equal(reassemble_tensor(pieces), full)
    whole = torch.randn(3)
    assert torch.equal(reassemble_tensor([(_layout(), whole, None)]), whole)


def test_per_shard_state_is_stacked_one_row_per_rank(tmp_path):
    histories = [torch.rand(16), torch.rand(16)]  # e.g. each shard's own amax history
    scales = [torch.tensor(2.0), torch.tensor(4.0)]
    for r in range(2):
        write_tensors(
            tmp_path / f"model_tp{r}.safetensors",
            {"fc.fp8_weight.amax_history": histories[r], "fc.fp8_weight.scale": scales[r]},
            {
                "fc.fp8_weight.amax_history": _layout(rank=r, size=2, per_shard=True),
                "fc.fp8_weight.scale": _layout(rank=r, size=2, per_shard=True),
            },
        )
    out = reassemble(tmp_path)
    assert torch.equal(out["fc.fp8_weight.amax_history"], torch.stack(histories))
    assert torch.equal(out["fc.fp8_weight.scale"], torch.tensor([2.0, 4.0]))
    # At TP=1 the same state is the tensor itself, not a stack of one.
    single = [(_layout(per_shard=True), histories[0], None)]
    assert torch.equal(reassemble_tensor(single), histories[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn], ids=["fp16", "fp8"])
def test_scale_inv_dequantizes_each_shard_with_its_own_scale(tmp_path, dtype):
    """O1/O2 store FP16 weights, O3 FP8 ones, each shard with its own power-of-two scale."""
    full = torch.randn(8, 6)
    full[4:] *= 100  # the second shard needs another scale than the first
    limit = torch.finfo(dtype).max
    datas, scales = [], []
    for shard in full.chunk(2, 0):
        scale_inv = 2.0 ** torch.ceil(torch.log2(shard.abs().max() / limit))
        datas.append((shard / scale_inv).to(dtype))
        scales.append(scale_inv)
    assert scales[0] != scales[1]
    for r in range(2):
        write_tensors(
            tmp_path / f"model_tp{r}.safetensors",
            {"fc.weight": datas[r], "fc.weight_scale_inv": scales[r]},
            {
                "fc.weight": _layout(0, r, 2, scale="fc.weight_scale_inv"),
                "fc.weight_scale_inv": _layout(rank=r, size=2, per_shard=True),
            },
        )
    out = reassemble(tmp_path)
    expected = torch.cat([d.float() * s for d, s in zip(datas, scales)], 0)
    assert out["fc.weight"].dtype == torch.float32
    assert torch.equal(out["fc.weight"], expected)
    assert torch.equal(out["fc.weight_scale_inv"], torch.stack(scales))  # as stored
    rel = 2**-10 if dtype == torch.float16 else 2**-3  # half an ulp, with margin
    assert torch.allclose(out["fc.weight"], full, rtol=rel, atol=0)
    assert read_layouts(tmp_path / "model_tp0.safetensors")["fc.weight"]["dtype"] == str(
        dtype
    ).removeprefix("torch.")


def test_pipeline_copies_are_skipped(tmp_path):
    """A tied embedding lives on the first and the last stage; the last one's is a copy."""
    full = torch.randn(8, 4)
    for r, shard in enumerate(full.chunk(2, 0)):
        for stage, copy in ((1, True), (0, False)):  # the copy's file first: order is no cue
            value = torch.zeros_like(shard) if copy else shard  # a copy that differs would show
            write_tensors(
                tmp_path / f"model_tp{r}_pp{stage}.safetensors",
                {"word_embeddings.weight": value},
                {"word_embeddings.weight": _layout(0, r, 2, copy=copy)},
            )
    assert torch.equal(reassemble(tmp_path)["word_embeddings.weight"], full)


def test_data_parallel_copies_of_a_shard_are_kept_once(tmp_path):
    full = torch.randn(4, 6)
    for dp in range(2):  # e.g. the FP8 scaling state every replica writes
        _write_shards(tmp_path, f"model_dp{dp}", "w", full.chunk(2, 1), 1)
    assert torch.equal(reassemble(tmp_path)["w"], full)


def test_a_missing_shard_raises(tmp_path):
    full = torch.randn(4, 6)
    _write_shards(tmp_path, "model", "w", full.chunk(2, 0), 0)
    (tmp_path / "model_tp1.safetensors").unlink()
    with pytest.raises(ValueError, match="1 of 2 tensor-parallel shards present"):
        reassemble(tmp_path)


def test_a_missing_per_shard_row_raises():
    piece = (_layout(rank=0, size=2, per_shard=True), torch.rand(16), None)
    with pytest.raises(ValueError, match="1 of 2"):
        reassemble_tensor([piece])


def test_files_kinds_and_damage(tmp_path):
    write_tensors(tmp_path / "model.safetensors", {"w": torch.ones(2)}, {})
    write_tensors(tmp_path / "optimizer.safetensors", {"w:exp_avg": torch.zeros(2)}, {})
    save_file({"x": torch.ones(1)}, str(tmp_path / "fp8_scaling_dp0.safetensors"))
    assert set(reassemble(tmp_path, "model")) == {"w"}  # model* files only
    assert set(reassemble(tmp_path, "optimizer")) == {"w:exp_avg"}
    with pytest.raises(FileNotFoundError, match="no model"):
        reassemble(tmp_path / "elsewhere")
    save_file({"w": torch.ones(2)}, str(tmp_path / "model_old.safetensors"))  # no layouts
    with pytest.raises(ValueError, match="model_old.safetensors.*not a format-2"):
        reassemble(tmp_path)


def test_optimizer_layouts_follow_their_parameters(tmp_path):
    """A state of the parameter's shape is split like it (and dequantized with its own scale,
    never the weight's); a split parameter's state scales are per shard; a step is whole."""
    full_m = torch.randn(8, 4)
    norm_m = torch.randn(4)
    for r in range(2):
        w_layout = _layout(0, r, 2, scale="w_scale_inv")  # an O2 weight
        params = {"w": w_layout, "norm": _layout(rank=r, size=2)}
        m_scale = torch.tensor(2.0 ** -(r + 3))  # an FP8 exp_avg with its per-shard scale
        tensors = {
            "w:exp_avg": (full_m.chunk(2, 0)[r] / m_scale).to(torch.float8_e4m3fn),
            "w:exp_avg_scale_inv": m_scale,
            "w:exp_avg_sq": torch.rand(4, 4),
            "w:step": torch.tensor(3.0),
            "norm:exp_avg": norm_m,
            "norm:step": torch.tensor(3.0),
        }
        layouts = optimizer_layouts(tensors, params, {"w": (4, 4), "norm": (4,)})
        assert layouts["w:exp_avg"] == {**_layout(0, r, 2), "scale_inv": "w:exp_avg_scale_inv"}
        assert layouts["w:exp_avg_sq"] == _layout(0, r, 2)  # not the weight's scale
        assert layouts["w:exp_avg_scale_inv"] == _layout(rank=r, size=2, per_shard=True)
        assert layouts["w:step"] == _layout(rank=r, size=2)
        assert layouts["norm:exp_avg"] == layouts["norm:step"] == _layout(rank=r, size=2)
        write_tensors(tmp_path / f"optimizer_tp{r}.safetensors", tensors, layouts)
    out = reassemble(tmp_path, "optimizer")
    assert out["w:exp_avg"].shape == (8, 4) and out["w:exp_avg"].dtype == torch.float32
    assert torch.allclose(out["w:exp_avg"], full_m, rtol=2**-3, atol=2**-9)
    assert torch.equal(out["w:step"], torch.tensor(3.0))  # the same on every shard: whole
    assert torch.equal(out["norm:exp_avg"], norm_m) and out["norm:step"].shape == ()


# ---------------------------------------------------------------------------------------------
# Real checkpoints: TP=2 x PP=2 against one process (fp32), TP=2 against TP=1 (O2)

STEPS = 3
# 4 layers (2 per stage), 4 heads in 2 key/value groups, SwiGLU with biases, tied embedding.
MODEL = {
    "model.num_layers": 4,
    "model.num_attention_heads": 4,
    "model.num_query_groups": 2,
    "model.activation": "swiglu",
}
RUN = {
    "training.train_iters": STEPS,
    "training.eval_interval": STEPS,
    "checkpoint.save_interval": STEPS,
    "logging.tensorboard": "false",
    "logging.peak_tflops": 1,  # skip measuring the CPU's matmul rate
}
TP2, PP2 = {"parallel.tensor": 2}, {"parallel.pipeline": 2}
# name -> (ranks, level, layout)
RUNS = {
    "fp32_tp1": (1, "fp32", {}),
    "fp32_tp2_pp2": (4, "fp32", {**TP2, **PP2}),
    "O2_tp1": (1, "O2", {}),
    "O2_tp2": (2, "O2", TP2),
}
# Model code the reader must not import (it is also checked to load nothing else of ours).
MODEL_CODE = ("models", "families", "parallel", "fp8train", "training.loop", "training.setup")
FP32_BAR = 1e-5
KEY_BIAS_NOISE = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tiny_data, tmp_path_factory):
    """``checkpoint(name)``: the final checkpoint of run ``name`` of ``RUNS``, trained once.
    Single-process runs train in this process, the others in forked ranks
    (``multiproc.pretrain_ranks``)."""
    done = {}

    def get(name):
        if name not in done:
            ranks, level, layout = RUNS[name]
            run_dir = tmp_path_factory.mktemp(name)
            overrides = tiny_overrides(tiny_data, run_dir, level, **MODEL, **RUN, **layout)
            if ranks == 1:
                from training.config import load_config
                from training.loop import pretrain

                pretrain(load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides))
            else:
                pretrain_ranks(ranks, [(str(REPO / "configs/gpt_tiny.yaml"), overrides)])
            done[name] = run_dir / "checkpoints" / f"iter_{STEPS:07d}"
        return done[name]

    return get


_CLEAN_READER = """
import json, sys
from pathlib import Path
from safetensors.torch import save_file
from checkpoint.format import reassemble
out = Path(sys.argv[1])
for i, path in enumerate(sys.argv[2:]):
    for kind in ("model", "optimizer"):
        tensors = {k: v.contiguous() for k, v in reassemble(path, kind).items()}
        save_file(tensors, str(out / f"{i}_{kind}.safetensors"))
print(json.dumps(sorted(sys.modules)))
"""


def _project_modules(modules: list[str]) -> set[str]:
    packages = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists()}
    packages |= {p.stem for p in REPO.glob("*.py")}
    return {m for m in modules if m.split(".")[0] in packages}


@pytest.fixture(scope="module")
def fp32_runs(checkpoint, tmp_path_factory):
    """Both fp32 checkpoints reassembled in a fresh interpreter, and the project modules that
    interpreter had loaded."""
    paths = [checkpoint("fp32_tp2_pp2"), checkpoint("fp32_tp1")]
    out = tmp_path_factory.mktemp("reassembled")
    proc = subprocess.run(
        [sys.executable, "-c", _CLEAN_READER, str(out), *map(str, paths)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = _project_modules(json.loads(proc.stdout.splitlines()[-1]))
    runs = [
        {kind: load_file(str(out / f"{i}_{kind}.safetensors")) for kind in ("model", "optimizer")}
        for i in range(len(paths))
    ]
    return paths, runs, modules


def _per_shard(path, kind) -> set[str]:
    return {
        name
        for file in path.glob(f"{kind}*.safetensors")
        for name, layout in read_layouts(file).items()
        if layout["per_shard"]
    }


def _key_bias(name: str, value: torch.Tensor, structure: dict) -> torch.Tensor:
    """Mask of the key entries of a ``qkv.bias`` (or of its optimizer state): rows
    ``[groups, heads/group + 2, head_dim]`` with the key at index heads/group."""
    mask = torch.zeros(value.shape, dtype=torch.bool)
    if name.partition(":")[0].endswith("attention.qkv.bias") and value.dim() == 1:
        qkv = structure["fused"]["layers.*.attention.qkv"]
        r = qkv["heads_per_group"]
        mask.view(qkv["query_groups"], r + 2, qkv["head_dim"])[:, r] = True
    return mask


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _compare(got, ref, per_shard, tp, structure=None):
    """Per tensor: relative L2 error of ``got`` against ``ref`` (each row of a per-shard
    stack against the single-process tensor; the key entries of ``qkv.bias`` masked when
    ``structure`` is given), and the largest key-bias magnitude in either run."""
    errors, key_bias = {}, 0.0
    for name, r in ref.items():
        g = got[name]
        if name in per_shard and g.shape != r.shape:
            assert g.shape == (tp, *r.shape), name
            errors[name] = max(_rel(row, r) for row in g)
            continue
        assert g.shape == r.shape, name
        mask = _key_bias(name, r, structure) if structure else torch.zeros(r.shape, dtype=bool)
        errors[name] = _rel(g[~mask], r[~mask])
        if mask.any():
            key_bias = max(key_bias, g[mask].abs().max().item(), r[mask].abs().max().item())
    return errors, key_bias


def test_reader_imports_no_model_code(fp32_runs):
    _, _, modules = fp32_runs
    assert not [m for m in modules if m.startswith(tuple(f"{p}." for p in MODEL_CODE))]
    assert not set(MODEL_CODE) & modules
    # Only the reader itself (and its empty package) from the whole project.
    assert modules == {"checkpoint", "checkpoint.format"}


def test_tp2_pp2_reassembles_to_the_single_process_checkpoint(fp32_runs):
    (sharded_path, single_path), (sharded, single), _ = fp32_runs
    meta = [json.loads((p / "metadata.json").read_text()) for p in (sharded_path, single_path)]
    assert meta[0]["model_structure"] == meta[1]["model_structure"]
    structure = meta[1]["model_structure"]
    assert structure["fused"]["layers.*.mlp.fc1"] == {"kind": "gate_up", "blocks": 2}
    files = {p.name for p in sharded_path.glob("*.safetensors")}
    for t in range(2):
        for s in range(2):
            assert {f"model_tp{t}_pp{s}.safetensors", f"optimizer_tp{t}_pp{s}.safetensors"} <= files

    # The layouts the checkpoint exercises: column and row splits, SwiGLU blocks, a pipeline
    # copy of the tied embedding, per-shard optimizer state.
    layouts = {}
    for file in sorted(sharded_path.glob("*.safetensors")):
        if not file.name.startswith("rng"):
            for name, layout in read_layouts(file).items():
                layouts.setdefault(name, []).append(layout)

    def values(name, key):
        return sorted(entry[key] for entry in layouts[name])

    assert values("layers.0.attention.qkv.weight", "partition_dim") == [0, 0]
    assert values("layers.3.mlp.fc2.weight", "partition_dim") == [1, 1]
    for name in (
        "layers.1.mlp.fc1.weight",
        "layers.2.mlp.fc1.bias",
        "layers.2.mlp.fc1.bias:exp_avg",
    ):
        assert values(name, "blocks") == [2, 2], name
    assert values("word_embeddings.weight", "pipeline_copy") == [False, False, True, True]
    for t in range(2):  # the skipped copy is the counted one, bit for bit (weights stay tied)
        stages = [load_file(str(sharded_path / f"model_tp{t}_pp{s}.safetensors")) for s in (0, 1)]
        assert torch.equal(*(st["word_embeddings.weight"] for st in stages))

    for kind in ("model", "optimizer"):
        assert sorted(sharded[kind]) == sorted(single[kind]), kind
        assert all(v.dtype == torch.float32 for v in sharded[kind].values())
    # Every parameter has its Adam state under its own name.
    params = {n.partition(":")[0] for n in single["optimizer"]}
    assert params == set(single["model"])
    assert len(single["optimizer"]) == 3 * len(params)  # exp_avg, exp_avg_sq, step

    for kind in ("model", "optimizer"):
        per_shard = _per_shard(sharded_path, kind)
        assert per_shard == set(), kind
        errors, key_bias = _compare(sharded[kind], single[kind], per_shard, 2, structure)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= FP32_BAR, (kind, worst, errors[worst])
        assert key_bias < KEY_BIAS_NOISE, (kind, key_bias)  # noise-sized in both runs
    steps = [n for n in sharded["optimizer"] if n.endswith(":step")]
    assert all(torch.all(sharded["optimizer"][n] == STEPS) for n in steps)


def test_o2_tp2_reassembles_close_to_tp1(checkpoint):
    paths = {name: checkpoint(name) for name in ("O2_tp2", "O2_tp1", "fp32_tp1")}
    runs = {
        name: {kind: reassemble(path, kind) for kind in ("model", "optimizer")}
        for name, path in paths.items()
    }
    sharded, single, fp32 = runs["O2_tp2"], runs["O2_tp1"], runs["fp32_tp1"]

    # The linear weights are stored as FP16 shards with per-shard scales, read back as FP32.
    weight = "layers.0.mlp.fc2.weight"
    stored = read_layouts(paths["O2_tp2"] / "model_tp1.safetensors")[weight]
    assert stored["dtype"] == "float16" and stored["scale_inv"] == f"{weight}_scale_inv"
    scale_of = {n: n.removesuffix("weight") + "weight_scale_inv" for n in single["model"]}
    linear = [
        n for n in single["model"] if n.endswith(".weight") and scale_of[n] in single["model"]
    ]
    assert len(linear) == 16  # 4 layers x (qkv, proj, fc1, fc2)
    scales = [sharded["model"][scale_of[n]] for n in linear]
    assert all(torch.equal(s, 2.0 ** s.log2().round()) for s in scales)  # powers of two
    # Some shards of one weight have different scales: dequantization per shard is exercised.
    assert any(s[0] != s[1] for s in scales)

    for kind in ("model", "optimizer"):
        assert sorted(sharded[kind]) == sorted(single[kind]), kind
        per_shard = _per_shard(paths["O2_tp2"], kind)
        for name in per_shard:  # FP8 scaling state, weight scales, optimizer scales
            assert ".fp8_" in name or name.endswith("scale_inv"), name
            assert sharded[kind][name].shape == (2, *single[kind][name].shape), name
        errors, _ = _compare(sharded[kind], single[kind], per_shard, 2)
        for name, error in errors.items():
            if name in per_shard or name not in fp32[kind] or name.endswith(":step"):
                continue
            noise = _rel(single[kind][name], fp32[kind][name])  # FP8's own effect in 3 steps
            assert error <= 2.5 * noise, (kind, name, error, noise)
        if kind == "model":
            worst = max(linear, key=errors.get)
            assert errors[worst] <= 0.03, (worst, errors[worst])

    for name in single["model"]:
        if name.endswith("fp8_weight.amax_history"):
            full_amax = sharded["model"][name].amax(0)  # the largest of the shards' amaxes
            assert (full_amax - single["model"][name]).abs().max() <= 3.5e-3, name


def test_an_incomplete_checkpoint_is_refused(tmp_path):
    """With metadata.json beside them, every slice's file must be present: a missing stage or
    tensor-parallel rank is named instead of leaving its tensors silently out."""
    meta = {"config": {"parallel": {"tensor": 2, "pipeline": 1}, "optimizer": {}}}
    (tmp_path / "metadata.json").write_text(json.dumps(meta))
    _write_shards(tmp_path, "model", "w", torch.rand(4, 2).chunk(2, 0), 0)
    assert reassemble(tmp_path)["w"].shape == (4, 2)
    (tmp_path / "model_tp1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="incomplete: model_tp1.safetensors is missing"):
        reassemble(tmp_path)

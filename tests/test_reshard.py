"""Resharding: a checkpoint written by one layout resumes on another and continues the run.

The source run trains the tiny GPT at TP=2 x PP=2 x DP=2 with the distributed optimizer (8
gloo ranks) for 4 steps and saves at 2. From that step-2 checkpoint, runs at TP=1 x PP=1 x
DP=4 and at TP=4 (4 ranks each) resume to 4; their losses at steps 3-4 must be the source
run's (dropout off: the RNG streams belong to the ranks that wrote them). Bars:

fp32: 1e-5 relative. The layouts sum the same values in other groupings (TP's sharded GEMMs,
gradient accumulation over 2 micro-batches per replica against 1): FP32 rounding only.

O2: 2e-3 relative, the bar tests/test_tp_training.py justifies for TP against one process:
every weight shard keeps its own FP8 scales, so a layout with other shards casts other
values to E4M3 (half an E4M3 ulp per element), and joined shards take merged scaling state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import end_worker, rank_env, run_ranks

from checkpoint.format import reassemble
from checkpoint.reshard import _join, _sub_shard, merge_per_shard, requantize
from training.conversion import Layout, convert_native

LEVELS = ("fp32", "O2")
COMMON = {
    "model.num_layers": 4,
    "model.num_attention_heads": 4,
    "model.hidden_dropout": 0.0,
    "model.attention_dropout": 0.0,
    "training.micro_batch_size": 2,
    "training.global_batch_size": 8,
    "optimizer.distributed": "true",
}
STEPS = {"training.train_iters": 4, "checkpoint.save_interval": 2}  # all but the finetune
SOURCE = {"parallel.tensor": 2, "parallel.pipeline": 2}
TARGETS = {"tp1_dp4": {}, "tp4": {"parallel.tensor": 4}}
BARS = {"fp32": 1e-5, "O2": 2e-3}


def _worker(rank: int, world: int, port: int, jobs: list) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from training.config import load_config
    from training.loop import pretrain

    for overrides in jobs:  # later runs reuse the process group and add their groups
        pretrain(load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides))
    end_worker()


def _losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["iteration"]: r["lm loss"] for r in records}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    root = tmp_path_factory.mktemp("reshard")
    source = [
        tiny_overrides(tiny_data, root / f"source_{lv}", lv, **COMMON, **STEPS, **SOURCE)
        for lv in LEVELS
    ]
    run_ranks(_worker, 8, (source,), timeout=600, start_method="fork")
    # The same step-2 checkpoint converted offline to the TP=4 layout (training/conversion.py).
    convert_native(
        root / "source_O2" / "checkpoints" / "iter_0000002", root / "converted_tp4",
        Layout(tensor=4, distributed=True), progress=lambda _line: None,
    )  # fmt: skip
    resumed = [
        tiny_overrides(
            tiny_data, root / "tp4_converted_O2", "O2", **COMMON, **STEPS,
            **TARGETS["tp4"], **{"checkpoint.load": str(root / "converted_tp4")},
        ),
        # Weights only, fp32 -> O2, TP=2 x PP=2 x DP=2 -> TP=2 x DP=2, learning rate 0: one step
        # saves the loaded weights back in O2's storage.
        tiny_overrides(
            tiny_data, root / "finetune_O2", "O2", **COMMON, **{"parallel.tensor": 2},
            **{"checkpoint.load": str(root / "source_fp32" / "checkpoints"),
               "checkpoint.finetune": "true", "training.train_iters": 1,
               "checkpoint.save_interval": 1, "optimizer.lr": 0.0, "optimizer.min_lr": 0.0,
               "optimizer.lr_warmup_iters": 0},
        ),
    ]  # fmt: skip
    # The same fp32 weights into O3 (FP8 weights, FP16 masters with the distributed optimizer).
    resumed.append(
        tiny_overrides(
            tiny_data, root / "finetune_O3", "O3", **COMMON, **{"parallel.tensor": 2},
            **{"checkpoint.load": str(root / "source_fp32" / "checkpoints"),
               "checkpoint.finetune": "true", "training.train_iters": 1,
               "checkpoint.save_interval": 1, "optimizer.lr": 0.0, "optimizer.min_lr": 0.0,
               "optimizer.lr_warmup_iters": 0},
        )
    )  # fmt: skip
    for name, extra in TARGETS.items():
        for lv in LEVELS:
            load = root / f"source_{lv}" / "checkpoints" / "iter_0000002"
            resumed.append(
                tiny_overrides(
                    tiny_data,
                    root / f"{name}_{lv}",
                    lv,
                    **COMMON,
                    **STEPS,
                    **extra,
                    **{"checkpoint.load": str(load)},
                )  # fmt: skip
            )
    run_ranks(_worker, 4, (resumed,), timeout=600, start_method="fork")
    return root


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("target", list(TARGETS))
def test_resharded_resume_continues_the_run(runs, target, level):
    source = _losses(runs / f"source_{level}")
    resumed = _losses(runs / f"{target}_{level}")
    assert sorted(resumed) == [3, 4]
    for step, loss in resumed.items():
        assert abs(loss - source[step]) / source[step] <= BARS[level], (step, loss, source[step])


def test_offline_conversion_equals_resharding_on_load(runs):
    """tools/convert_checkpoint.py's TP=4 checkpoint resumes with bitwise the losses of the
    run that resharded the TP=2 x PP=2 x DP=2 checkpoint on load: the same code cut both, and
    splitting 2 -> 4 shards keeps every FP16 weight's bytes and scale."""
    assert _losses(runs / "tp4_converted_O2") == _losses(runs / "tp4_O2")
    source = reassemble(runs / "source_O2" / "checkpoints" / "iter_0000002")
    converted = reassemble(runs / "converted_tp4" / "iter_0000002")
    for name, value in source.items():
        if value.shape == converted[name].shape:  # per-shard state is stacked per shard
            assert torch.equal(converted[name], value), name


def test_finetune_loads_weights_across_levels_and_layouts(runs):
    """fp32 weights of a TP=2 x PP=2 x DP=2 run, loaded weights-only into an O2 run at TP=2 x
    DP=2: every parameter comes back, the linear weights rounded once to their scaled FP16
    storage (relative error <= 2**-11), everything else exact; the run starts at iteration 1."""
    assert sorted(_losses(runs / "finetune_O2")) == [1]
    want = reassemble(runs / "source_fp32" / "checkpoints" / "iter_0000004")
    got = reassemble(runs / "finetune_O2" / "checkpoints" / "iter_0000001")
    for name, value in want.items():
        if name.endswith(".weight") and name.startswith("layers.") and value.ndim == 2:
            err = ((got[name] - value).abs() / value.abs().clamp(min=1e-30)).max().item()
            assert err <= 2.0**-11, (name, err)
        else:
            assert torch.equal(got[name], value), name


def test_finetune_into_o3_starts_the_masters_from_the_finer_weights(runs):
    """fp32 weights loaded weights-only into O3 at TP=2 x DP=2 (distributed optimizer), lr 0:
    each FP16 master is the fp32 weight rounded once to FP16 (relative error <= 2**-11), not
    its FP8 rounding (up to 2**-4: a master on E4M3's grid holds the weight still for the
    first steps, fp8train/param_state.py), and the FP8 weight is within E4M3's rounding."""
    want = reassemble(runs / "source_fp32" / "checkpoints" / "iter_0000004")
    checkpoint = runs / "finetune_O3" / "checkpoints" / "iter_0000001"
    weights, states = reassemble(checkpoint), reassemble(checkpoint, "optimizer")
    linear = [n for n, v in want.items() if n.startswith("layers.") and n.endswith(".weight")
              and v.ndim == 2]  # fmt: skip
    assert linear
    for name in linear:
        value = want[name]
        master = states[f"{name}:master"]
        err = ((master - value).abs() / value.abs().clamp(min=1e-30)).max().item()
        assert err <= 2.0**-11, (name, err)
        err = (weights[name] - value).abs() / value.abs().clamp(min=1e-30)
        assert err[value.abs() > value.abs().max() * 2**-6].max().item() <= 2.0**-4, name


def test_resharded_checkpoint_keeps_every_tensor(runs):
    """The resumed runs' own step-4 checkpoints hold the same tensors as the source's, each
    with its layout's shards (TP=4: four model files, one optimizer file per slice)."""
    files = {p.name for p in (runs / "tp4_O2" / "checkpoints" / "iter_0000004").iterdir()}
    assert {f"model_tp{t}.safetensors" for t in range(4)} <= files
    for kind in ("model", "optimizer"):
        names = set(reassemble(runs / "source_O2" / "checkpoints" / "iter_0000004", kind))
        for target in TARGETS:
            got = reassemble(runs / f"{target}_O2" / "checkpoints" / "iter_0000004", kind)
            # Per-shard scaling state is stacked per shard, so only names are compared here.
            assert set(got) == names, (kind, target, sorted(set(got) ^ names)[:5])


# ---- the rules, one tensor at a time --------------------------------------------------------


@pytest.mark.parametrize("blocks", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_sub_shards_join_back_to_the_tensor(blocks, dim):
    x = torch.arange(12 * 12, dtype=torch.float32).reshape(12, 12)
    for parts in (1, 2, 4):
        if (12 // blocks) % parts:
            continue
        pieces = [_sub_shard(x, dim, blocks, parts, i) for i in range(parts)]
        assert torch.equal(_join(pieces, dim, blocks), x)
        # two levels of splitting equal one: shard 1 of 2, then piece 1 of 2 = piece 3 of 4
        if parts == 4:
            half = _sub_shard(x, dim, blocks, 2, 1)
            assert torch.equal(_sub_shard(half, dim, blocks, 2, 1), pieces[3])


def test_requantize_pow2_is_exact_for_joined_shards():
    """Two FP16 shards with different power-of-two scales join into one scale; every value
    that stays normal in the joint scale is exact."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, generator=g) * 4.0
    b = torch.randn(64, generator=g) * 0.01
    parts = [requantize(v, torch.float16, "w") for v in (a, b)]
    values = torch.cat([d.float() * s for d, s in parts])
    data, scale = requantize(values, torch.float16, "w")
    assert data.dtype == torch.float16 and scale.item() == 2.0 ** round(scale.log2().item())
    assert torch.equal(data.float() * scale, values)


def test_requantize_first_moment_uses_the_full_e4m3_range():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(256, generator=g) * 1e-3
    data, scale = requantize(m, torch.float8_e4m3fn, "layers.0.mlp.fc1.weight:exp_avg")
    assert data.float().abs().max().item() == 448.0
    back = data.float() * scale
    normal = m.abs() >= 2.0**-6 * scale
    rel = ((back - m).abs() / m.abs())[normal]
    assert rel.max().item() <= 2.0**-4


def test_per_shard_state_merges_as_one_process_would_keep_it():
    hist = [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])]
    assert torch.equal(merge_per_shard("x.fp8_input.amax_history", hist), torch.tensor([3.0, 5.0]))
    scales = [torch.tensor(8.0), torch.tensor(2.0)]
    assert merge_per_shard("x.fp8_input.scale", scales).item() == 2.0
    flags = [torch.tensor(False), torch.tensor(True)]
    assert merge_per_shard("x.fp8_input.recover", flags).item() is True

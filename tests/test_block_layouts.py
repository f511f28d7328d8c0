"""Block-wise FP8 scaling (``precision.fp8_granularity=block``) through ``pretrain``: TP=2
(with and without sequence parallelism), PP=2 and DP=2 with the distributed optimizer at te,
DP=2 at O1, DP=2 with the distributed optimizer at O2 and O3, TP=2 at O3, each against the
single-process run of its level; resume and recompute bit for bit; TP=2 <-> TP=1 checkpoints
resumed (te, O3). Forked ranks shared between the tests.

The tiny GPT is widened to hidden 256 with 2 heads so that TP=2 cuts every weight on a block
boundary (MLP 1024 -> 512 per rank, attention 256 -> 128): each rank then casts the same tiles
as the single process, and the layouts differ only in the order FP32 partial sums are added
(TP's all-reduce, DP's gradient reduce-scatter, PP's stage boundary). Such a difference can flip
an E4M3 rounding of a later step's weight or activation by one ulp (2**-4 relative); the loss
bar is test_tp_training.py's FP8 one, 2e-3, set by the same mechanism.
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, tiny_overrides
from multiproc import pretrain_ranks

TINY = str(REPO / "configs/gpt_tiny.yaml")
BLOCK = {
    "model.hidden_size": 256,
    "precision.fp8_granularity": "block",
    "precision.fp8_recipe": "current",
}
LAYOUTS = {  # name: (level, ranks, overrides), each against the one-process run of its level
    "tp2": ("te", 2, {"parallel.tensor": 2}),
    # Sequence parallelism: FP8 rows and their scales gathered; xᵀ re-cast from the gathered
    # values (a second E4M3 rounding of the weight gradient's input, within the FP8 bar).
    "tp2_sp": ("te", 2, {"parallel.tensor": 2, "parallel.sequence_parallel": "true"}),
    "pp2": ("te", 2, {"parallel.pipeline": 2}),
    "dp2_dist_opt": ("te", 2, {"optimizer.distributed": "true"}),
    # O1/O2: FP16 masters read through block casts; FP8 gradient slots with 128x128 block
    # scales, averaged by the FP8 all-reduce (O1) or reduce-scatter (O2, distributed optimizer)
    # with one shared scale per block.
    "O1_dp2": ("O1", 2, {}),
    "O2_dp2_dist_opt": ("O2", 2, {"optimizer.distributed": "true"}),
    # O3: FP8 weights stored in 128x128 blocks, each shard its own blocks' scales (TP), and
    # the owners' updated weights all-gathered with their scale grids (distributed optimizer).
    "O3_tp2": ("O3", 2, {"parallel.tensor": 2}),
    "O3_dp2_dist_opt": ("O3", 2, {"optimizer.distributed": "true"}),
}


# Every run: 4 steps, a checkpoint at 2 and at 4; the resumed runs continue from 2.
SAVE = 2
STEPS = {"training.train_iters": 4, "checkpoint.save_interval": SAVE}


def _losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["lm loss"] for x in lines]


@pytest.fixture(scope="module")
def block_runs(tiny_data, tmp_path_factory):
    """The single-process run of each level, every layout of ``LAYOUTS``, the runs resumed at
    iteration ``SAVE`` from a checkpoint of another run (``checkpoint.load``: the same layout,
    TP=1 -> TP=2, TP=2 -> TP=1), and a recomputing run: one fork per world size and phase,
    each running its jobs one after the other."""
    root = tmp_path_factory.mktemp("block_runs")

    def job(name, level, **extra):
        return (TINY, tiny_overrides(tiny_data, root / name, level, **BLOCK, **STEPS, **extra))

    def load(run):  # a run's own checkpoint at SAVE (it keeps both of its checkpoints)
        return {"checkpoint.load": root / run / "checkpoints" / f"iter_{SAVE:07d}"}

    pretrain_ranks(1, [
        job("ref", "te"),
        job("resumed", "te", **load("ref")),
        job("recompute", "te", **{"model.recompute": "full"}),
        job("ref_O1", "O1"),
        job("ref_O2", "O2"),
        job("ref_O3", "O3"),
        job("resumed_O3", "O3", **load("ref_O3")),
    ], timeout=400)  # fmt: skip
    # The one-process O3 checkpoint resumed on TP=2: each shard takes its rows or columns of
    # the stored FP8 bytes and of the block-scale grid (resharding's exact path).
    by_world = {2: [job("O3_tp1_to_tp2", "O3", **load("ref_O3"), **{"parallel.tensor": 2})]}
    for name, (level, world, extra) in LAYOUTS.items():
        by_world.setdefault(world, []).append(job(name, level, **extra))
    for world, jobs in sorted(by_world.items()):
        pretrain_ranks(world, jobs, timeout=600)
    pretrain_ranks(1, [
        # The TP=2 run's checkpoint resharded onto one process (te: FP32 weights).
        job("tp2_to_tp1", "te", **load("tp2")),
        # O3's TP=2 checkpoint joined onto one process: its FP8 blocks re-quantised block by
        # block.
        job("O3_tp2_to_tp1", "O3", **load("O3_tp2")),
    ])  # fmt: skip
    return root


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_process(block_runs, layout):
    level = LAYOUTS[layout][0]
    reference = _losses(block_runs / ("ref" if level == "te" else f"ref_{level}"))
    assert len(reference) == 4
    assert _losses(block_runs / layout) == pytest.approx(reference, rel=2e-3)


def test_recompute_is_bitwise(block_runs):
    # Current block scales: the recomputed forward casts the same tensors to the same bytes.
    assert _losses(block_runs / "recompute") == _losses(block_runs / "ref")


def test_tp2_checkpoint_resumes_on_one_process(block_runs):
    # Resharding TP=2 -> TP=1 moves FP32 weights (te stores no FP8 state: every scale is
    # recomputed each step); the resumed run continues the TP=2 run within the layout bar.
    tp2 = _losses(block_runs / "tp2")
    resumed = _losses(block_runs / "tp2_to_tp1")
    assert len(resumed) == 2 and resumed == pytest.approx(tp2[SAVE:], rel=2e-3)


def test_resume_is_bitwise(block_runs):
    # Same operations in the same order on the same shapes after the checkpoint: the block
    # scales are recomputed from the same tensors, so the losses are equal to the last bit.
    reference = _losses(block_runs / "ref")
    resumed = _losses(block_runs / "resumed")
    assert len(resumed) == 2 and resumed == reference[SAVE:]
    meta = json.loads((block_runs / "ref/checkpoints/iter_0000004/metadata.json").read_text())
    assert meta["config"]["precision"]["fp8_granularity"] == "block"


def test_o3_block_resume_is_bitwise(block_runs):
    # The FP8 weights, their block-scale grids and the FP16 masters all come back from the
    # checkpoint as stored: the same operations follow, so the same bits.
    reference = _losses(block_runs / "ref_O3")
    assert _losses(block_runs / "resumed_O3") == reference[SAVE:]
    layouts = _weight_layouts(block_runs / "ref_O3/checkpoints/iter_0000002")
    qkv = layouts["layers.0.attention.qkv.weight"]
    assert qkv["scale_block"] == [128, 128] and qkv["dtype"] == "float8_e4m3fn"


@pytest.mark.parametrize(
    ("run", "source"), [("O3_tp1_to_tp2", "ref_O3"), ("O3_tp2_to_tp1", "O3_tp2")]
)
def test_o3_block_checkpoint_reshards(block_runs, run, source):
    # TP=1 -> TP=2 cuts the bytes and the scale grid along the blocks; TP=2 -> TP=1 joins and
    # re-quantises per block. Either run continues its source within the layout bar.
    resumed = _losses(block_runs / run)
    assert len(resumed) == 2
    assert resumed == pytest.approx(_losses(block_runs / source)[SAVE:], rel=2e-3)


def test_o3_block_weights_reshard_exactly(block_runs, tmp_path):
    # Values, not losses: the one-process O3 checkpoint converted to TP=2 and read back as full
    # tensors gives every weight bit for bit (slices of bytes and scale grids, no rounding).
    import torch
    from test_convert_checkpoint import _convert

    from checkpoint.format import reassemble

    source = block_runs / "ref_O3" / "checkpoints" / "iter_0000002"
    _convert("--input", str(source), "--output", str(tmp_path / "tp2"), "--format", "native",
             "--tensor", "2")  # fmt: skip
    (converted,) = (tmp_path / "tp2").glob("iter_*")
    assert _weight_layouts(converted, rank=1)["layers.0.mlp.fc2.weight"]["tp_size"] == 2
    before, after = reassemble(source), reassemble(converted)
    weights = [n for n in before if n.endswith("weight") and "layers." in n]
    assert weights
    for name in weights:
        assert torch.equal(before[name], after[name]), name


def _weight_layouts(checkpoint, rank: int = 0) -> dict:
    from checkpoint.format import read_layouts

    files = sorted(checkpoint.glob("model*.safetensors"))
    return read_layouts(files[rank])


def test_block_health_reaches_tensorboard(block_runs):
    # At block granularity there is no per-tensor state: the tracked pass's amax, smallest
    # block scale and scale spread are logged in its place, next to underflow and saturation.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(block_runs / "ref" / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for what in ("amax", "scale", "scale_spread", "underflow", "saturated"):
        assert f"fp8/layers.0.mlp.fc1/grad_output_{what}" in tags, what
    spreads = [e.value for e in acc.Scalars("fp8/layers.0.mlp.fc1/input_scale_spread")]
    assert spreads and all(s >= 0 for s in spreads)


def test_fp8_health_report_reads_the_runs(block_runs, tmp_path, capsys):
    # tools/fp8_health_report.py on real event files: the worst (layer, role) pairs of each run
    # and the per-role means side by side; a directory without TensorBoard is one error line.
    from tools.fp8_health_report import main, read_health

    runs = [str(block_runs / "ref"), str(block_runs / "ref_O2")]
    assert main([*runs, "--top", "3", "--write", str(tmp_path / "r.md")]) == 0
    out = capsys.readouterr().out
    assert "**ref**: the 3 (layer, role) pairs" in out and "**ref_O2**" in out
    assert "| grad_output | underflow |" in out and out == (tmp_path / "r.md").read_text()
    health = read_health(block_runs / "ref", last=2)
    assert ("layers.0.mlp.fc1", "grad_output") in health
    assert set(health["layers.0.mlp.fc1", "grad_output"]) == {
        "underflow", "saturated", "scale_spread"
    }  # fmt: skip
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1

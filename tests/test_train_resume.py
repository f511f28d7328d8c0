"""End to end in one process: the real loop on real data, and resume equality.

N steps straight and k steps + resume to N must log identical losses: the data order, RNG,
optimizer, scheduler, loss scaler and FP8 scaling state all come back from the checkpoint.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides

from training.config import ConfigError, load_config
from training.loop import pretrain
from training.preflight import preflight
from training.resume_check import FINETUNED_FROM, resume_plan, set_aside


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["iteration"], r["lm loss"]) for r in records]


def _config(data, run_dir, level, **extra):
    return load_config(
        str(REPO / "configs/gpt_tiny.yaml"), tiny_overrides(data, run_dir, level, **extra)
    )


def _train(data, run_dir, level, **extra):
    return pretrain(_config(data, run_dir, level, **extra))


@pytest.mark.parametrize("level", ["te", "bf16", "fp16", "O1", "O2", "O3", "te:bf16", "O3:bf16"])
def test_resume_gives_identical_losses(tiny_data, tmp_path, level):
    straight = tmp_path / "straight"
    _train(tiny_data, straight, level)
    resumed = tmp_path / "resumed"
    _train(tiny_data, resumed, level, **{"training.exit_interval": 3})
    assert [i for i, _ in _losses(resumed)] == [1, 2, 3]
    _train(tiny_data, resumed, level)  # picks up checkpoints/latest = iter 3
    assert _losses(resumed) == _losses(straight)
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "iter_0000006"


def _saved_level(checkpoint: Path) -> tuple[str, int]:
    meta = json.loads((checkpoint / "metadata.json").read_text())
    return meta["config"]["precision"]["level"], meta["iteration"]


_ITERS = ["iter_0000002", "iter_0000004"]


def test_finetune_switches_a_runs_level_in_place(tiny_data, tmp_path, capsys):
    """A te run continued at O2 is refused, naming checkpoint.finetune=true; the same command
    with that hint added, as printed, fine-tunes from the run's own checkpoint (one line says
    so): the te checkpoints move, intact, into checkpoints/te, out of the way of the
    fine-tune's own, which count from 0; the same command again continues the fine-tune."""
    run, steps = tmp_path / "run", {"training.train_iters": 4, "checkpoint.save_interval": 2}
    ck = run / "checkpoints"
    _train(tiny_data, run, "te", **steps)
    te_meta = (ck / "iter_0000004" / "metadata.json").read_text()
    source = tmp_path / "te_checkpoints"  # as the te run left them, for the restarts below
    shutil.copytree(ck, source, ignore=shutil.ignore_patterns(".lock"))
    with pytest.raises(ConfigError) as err:  # what the entry point's pre-flight says
        preflight(_config(tiny_data, run, "O2", **steps), 1)
    key, value = re.search(r"with (checkpoint\.\w+)=(\w+)", str(err.value)).groups()
    capsys.readouterr()
    _train(tiny_data, run, "O2", **steps, **{key: value})
    out = capsys.readouterr().out
    assert (
        f"> checkpoint.finetune: checkpoint.dir held te checkpoints; moved them to {ck / 'te'} "
        "(checkpoint.load reads it) to fine-tune at O2 from its iter_0000004\n"
    ) in out
    moved = ck / "te" / "iter_0000004"
    assert f"loaded the weights of {moved}: fine-tuning from iteration 0" in out
    assert sorted(p.name for p in (ck / "te").iterdir()) == [*_ITERS, "latest"]
    assert (moved / "metadata.json").read_text() == te_meta
    assert _saved_level(ck / "iter_0000004") == ("O2", 4)
    assert [i for i, _ in _losses(run)] == [1, 2, 3, 4]
    _train(tiny_data, run, "O2", **{**steps, "training.train_iters": 6, key: value})
    assert f"resumed from {ck / 'iter_0000004'} at iteration 4" in capsys.readouterr().out

    # A restart before the fine-tune's first save, or one that stopped the move part way,
    # fine-tunes from the same checkpoint (checkpoints/finetuned_from names it).
    for state in ("moved", "marked", "latest_gone"):
        directory = tmp_path / state
        shutil.copytree(source, directory)
        if state == "moved":
            set_aside(directory, "te", "iter_0000004")
        else:
            (directory / FINETUNED_FROM).write_text("te/iter_0000004\n")
        if state == "latest_gone":
            (directory / "latest").unlink()
        plan = resume_plan(
            _config(tiny_data, run, "O2", **{key: value, "checkpoint.dir": directory})
        )
        where = directory / "te" if state == "moved" else directory
        assert (plan.path, plan.weights_only) == (where / "iter_0000004", True), state
        assert plan.set_aside == (None if state == "moved" else "te"), state


def test_metrics_and_checkpoint_contents(tiny_data, tmp_path):
    summary = _train(tiny_data, tmp_path, "te")
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    required = {
        "iteration",
        "lm loss",
        "learning-rate",
        "grad-norm",
        "loss-scale",
        "iteration-time",
        "throughput",
        "mfu",
        "bytes-per-param",
    }
    assert all(required <= set(r) for r in records)
    assert summary["iteration"] == 6
    # te keeps FP32 weights, FP32 grads and two FP32 Adam moments: 16 bytes per parameter.
    assert records[-1]["bytes-per-param"] == pytest.approx(16.0)
    assert "lm loss validation" in records[2] and "lm loss validation ppl" in records[2]
    ckpt = tmp_path / "checkpoints" / "iter_0000006"
    assert {p.name for p in ckpt.iterdir()} == {
        "model.safetensors",
        "optimizer.safetensors",
        "rng_rank0.safetensors",
        "metadata.json",
    }
    meta = json.loads((ckpt / "metadata.json").read_text())
    assert meta["iteration"] == 6 and meta["consumed_samples"] == 24
    assert meta["config"]["precision"]["level"] == "te"
    assert not list((tmp_path / "checkpoints").glob(".tmp_*"))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {
        "fp8/layers.0.attention.qkv/input_amax",
        "fp8/layers.1.mlp.fc2/grad_output_scale",
        "bytes-per-param/all/weights",
    } <= tags
    amax = [e.value for e in acc.Scalars("fp8/layers.0.attention.qkv/input_amax")]
    assert len(amax) == 6 and all(a > 0 for a in amax)
    # Cast health: fractions in [0, 1]; gradients in E5M2 with a per-tensor scale lose a little
    # to underflow, and delayed scaling saturates at most a sliver of the input.
    for role in ("input", "weight", "grad_output"):
        for what in ("underflow", "saturated"):
            values = [e.value for e in acc.Scalars(f"fp8/layers.0.mlp.fc1/{role}_{what}")]
            assert len(values) == 6 and all(0.0 <= v <= 1.0 for v in values), (role, what)
    under = acc.Scalars("fp8/layers.0.mlp.fc1/grad_output_underflow")[-1].value
    assert under < 0.5


def test_fp8_health_interval(tiny_data, tmp_path):
    _train(tiny_data, tmp_path, "O2", **{"logging.fp8_stats_interval": 3})
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    steps = [e.step for e in acc.Scalars("fp8/layers.1.attention.proj/input_saturated")]
    assert steps == [3, 6]


def test_bf16_bytes_per_param(tiny_data, tmp_path):
    _train(
        tiny_data, tmp_path, "bf16", **{"training.train_iters": 1, "optimizer.lr_warmup_iters": 0}
    )
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    # BF16 weights (2) + FP32 main grads (4) + FP32 masters (4) + Adam m, v (8).
    assert rec["bytes-per-param"] == pytest.approx(18.0)


@pytest.mark.parametrize(("level", "linear_bytes"), [("O1", 11.0), ("O2", 6.0), ("O3", 7.0)])
def test_low_bit_levels_bytes_per_linear_param(tiny_data, tmp_path, level, linear_bytes):
    _train(
        tiny_data, tmp_path, level, **{"training.train_iters": 1, "optimizer.lr_warmup_iters": 0}
    )
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    roles = rec["bytes-per-param-by-role"]
    # Measured from the live tensors: weight + FP8 grad + master + Adam moments, plus the
    # per-tensor scales (O3: 4 bytes each for the weight, master and both moments, and 8 for
    # the gradient slot's scale and amax: 24 bytes per weight tensor of 4096-16384 elements,
    # 0.002 bytes per parameter here).
    assert roles["linear/total"] == pytest.approx(linear_bytes, abs=3e-3)
    assert roles["other/total"] == pytest.approx(16.0, abs=1e-3)  # FP32 embeddings/norms/biases


def test_resume_with_dropout_is_identical(tiny_data, tmp_path):
    """Dropout draws from the default stream: nothing else may draw from it (or resume would
    shift the masks), and its state must come back from the checkpoint."""
    drop = {"model.hidden_dropout": 0.1, "model.attention_dropout": 0.1}
    _train(tiny_data, tmp_path / "straight", "te", **drop)
    _train(tiny_data, tmp_path / "resumed", "te", **drop, **{"training.exit_interval": 3})
    _train(tiny_data, tmp_path / "resumed", "te", **drop)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")

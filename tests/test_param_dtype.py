"""``precision.param_dtype=bf16``: the FP8 levels on BF16 parameters with FP32 masters.

What the FP8 levels keep in higher precision (embeddings, norms, biases; te's linear weights)
becomes BF16 with an FP32 master in the optimizer, so the activations between the GEMMs are
BF16, as Transformer Engine runs FP8 models; the low-bit linear weights of O1-O3 keep their
own storage and masters. Parallel layouts are checked where the other levels are
(test_tp_training, test_train_resume, test_distributed_optimizer use ``level:bf16``); here:
the recipes, the one-line errors, the model-state bytes, the resume rule, and a pipeline.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import pretrain_ranks

from fp8train.precision import get_recipe
from tools.convert_checkpoint import main as convert_main
from training.config import ConfigError, load_config
from training.loop import pretrain
from training.resume_check import resumed_param_dtype, saved_param_dtype
from training.run_plan import ResumePlan

CONFIG = str(REPO / "configs/gpt_tiny.yaml")


def test_recipes():
    te = get_recipe("te", "bf16")
    assert (te.gemm, te.weight, te.master_weight, te.other_params) == (
        "fp8",
        "bf16",
        "fp32",
        "bf16",
    )
    o3 = get_recipe("O3", "bf16")
    assert (o3.weight, o3.master_weight, o3.adam_m, o3.other_params) == (
        "fp8",
        "fp16",
        "fp8",
        "bf16",
    )
    for recipe in (te, o3, get_recipe("bf16")):
        assert recipe.param_dtype.is_floating_point and recipe.has_fp32_master
    # "auto" and the level's own dtype are the table's rows.
    assert get_recipe("te", "fp32") == get_recipe("te", "auto") == get_recipe("te")
    assert get_recipe("bf16", "bf16") == get_recipe("bf16")


@pytest.mark.parametrize(("level", "dtype"), [("fp32", "bf16"), ("fp16", "bf16"), ("bf16", "fp32")])
def test_impossible_combinations_are_one_line_config_errors(tiny_data, tmp_path, level, dtype):
    overrides = tiny_overrides(tiny_data, tmp_path, level, **{"precision.param_dtype": dtype})
    with pytest.raises(ConfigError) as err:
        load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
    message = str(err.value)
    assert message.startswith("config: precision.param_dtype=") and "\n" not in message
    assert f"precision.level={level}" in message


def _train(data, run_dir, level, **extra):
    cfg = load_config(
        str(REPO / "configs/gpt_tiny.yaml"), tiny_overrides(data, run_dir, level, **extra)
    )
    return pretrain(cfg)


@pytest.mark.parametrize(
    ("level", "linear", "other"), [("te:bf16", 18.0, 18.0), ("O2:bf16", 6.0, 18.0)]
)
def test_model_state_bytes(tiny_data, tmp_path, level, linear, other):
    """BF16 weight + FP32 master + FP32 grad + Adam m, v = 18 bytes where the level kept FP32
    (16); O2's linear weights keep their 6."""
    _train(tiny_data, tmp_path, level, **{"training.train_iters": 3})
    roles = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])[
        "bytes-per-param-by-role"
    ]
    # Measured from the live tensors, per-tensor scales included (O2: 4 bytes each for the
    # weight and both moments, 8 for the gradient slot's scale and amax, over 4096-16384
    # elements per tensor: under 0.002 bytes per parameter here).
    assert roles["linear/total"] == pytest.approx(linear, abs=3e-3)
    assert roles["other/total"] == pytest.approx(other, abs=1e-3)


def _saved_param_dtype(run_dir):
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    meta = json.loads((run_dir / "checkpoints" / latest / "metadata.json").read_text())
    return meta["config"]["precision"]["param_dtype"]


def test_resume_refuses_another_param_dtype_but_finetune_takes_the_weights(
    tiny_data, tmp_path, capsys
):
    """The checkpoint records what "auto" resolved to (FP32 on the CPU at te) and the
    start-up line says it; a value set otherwise is one line naming the key and what to set."""
    _train(tiny_data, tmp_path / "a", "te:auto", **{"training.train_iters": 3})
    assert "| param_dtype=fp32 (auto on cpu) |" in capsys.readouterr().out
    assert _saved_param_dtype(tmp_path / "a") == "fp32"
    with pytest.raises(ConfigError) as err:
        _train(tiny_data, tmp_path / "b", "te:bf16",
               **{"checkpoint.load": str(tmp_path / "a" / "checkpoints")})  # fmt: skip
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "config: precision.param_dtype=bf16 but checkpoint "
    )
    assert "trained with fp32 parameters: set precision.param_dtype=fp32 (or auto" in message
    assert "checkpoint.finetune=true" in message
    summary = _train(tiny_data, tmp_path / "c", "te:bf16",
                     **{"checkpoint.load": str(tmp_path / "a" / "checkpoints"),
                        "checkpoint.finetune": "true", "training.train_iters": 3})  # fmt: skip
    assert summary["iteration"] == 3
    assert "| param_dtype=bf16 (set) |" in capsys.readouterr().out


def test_the_param_dtype_a_checkpoint_fixes():
    """What a checkpoint was trained with: its recorded value; "auto" or no key (checkpoints
    from before "auto" depended on the device) the level's own. Only a run that continues it
    at its level with "auto" takes it over."""

    def meta(level, **precision):
        return {"config": {"precision": {"level": level, **precision}}}

    assert saved_param_dtype(meta("te")) == "fp32"
    assert saved_param_dtype(meta("te", param_dtype="auto")) == "fp32"
    assert saved_param_dtype(meta("bf16")) == "bf16"
    assert saved_param_dtype(meta("O2", param_dtype="bf16")) == "bf16"
    assert saved_param_dtype(meta("O2", param_dtype="fp32")) == "fp32"
    resume = ResumePlan(Path("iter_0000003"), False, meta("te", param_dtype="bf16"))
    te = load_config(CONFIG, ["precision.level=te"])
    assert resumed_param_dtype(te, resume) == "bf16"
    assert resumed_param_dtype(te, None) is None
    assert resumed_param_dtype(te, replace(resume, weights_only=True)) is None  # a fine-tune
    for other in (["precision.level=O2"], ["precision.level=te", "precision.param_dtype=fp32"]):
        assert resumed_param_dtype(load_config(CONFIG, other), resume) is None


def test_auto_resumes_a_bf16_checkpoint_as_it_trained(tiny_data, tmp_path, capsys):
    """A te checkpoint of BF16 parameters, what a CUDA run with "auto" writes (recorded as
    bf16), resumed with "auto" on the CPU, whose own "auto" is FP32: the run continues as it
    trained, the same losses as straight through, and says so at start-up."""
    straight = tmp_path / "straight"
    _train(tiny_data, straight, "te:bf16")
    resumed = tmp_path / "resumed"
    _train(tiny_data, resumed, "te:bf16", **{"training.exit_interval": 3})
    assert _saved_param_dtype(resumed) == "bf16"
    capsys.readouterr()
    _train(tiny_data, resumed, "te:auto")  # from iter_0000003
    assert "| param_dtype=bf16 (auto: as its checkpoint trained) |" in capsys.readouterr().out
    assert _saved_param_dtype(resumed) == "bf16"

    def losses(run_dir):
        return [
            json.loads(x)["lm loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]

    assert losses(resumed) == losses(straight)


def test_pipeline_sends_the_bf16_stream_and_matches_one_process(tiny_data, tmp_path):
    """PP=2: the stages exchange BF16 activations. The first loss is the single process's bit
    for bit (same weights, the same layers on the same shapes, the BF16 stream sent as is);
    from the first update on, the tied embedding's gradient, summed over the two stages in
    another order, differs in FP32 rounding, which can flip a BF16 rounding of a weight
    (2**-8 relative): measured 4.3e-5 relative over 6 steps, bar 1e-3 (bf16's own TP bar is
    2e-2). (The second loss was equal too on the CPUs tried: Adam's first step is nearly
    sign(g) * lr, blind to rounding, except for gradient elements near eps in size.)
    On the CPU wherever it runs, the single process too (tests/conftest.py)."""
    single = tmp_path / "single"
    _train(tiny_data, single, "te:bf16")
    staged = tmp_path / "pp2"
    overrides = tiny_overrides(tiny_data, staged, "te:bf16", **{"parallel.pipeline": 2})
    pretrain_ranks(2, [(CONFIG, overrides)])

    def losses(run_dir):
        return [
            json.loads(x)["lm loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]

    assert losses(staged)[:1] == losses(single)[:1]
    assert losses(staged) == pytest.approx(losses(single), rel=1e-3)


def test_a_checkpoint_converts_to_tp2_and_continues(tiny_data, tmp_path):
    """FP32 masters are optimizer state like any other: a te:bf16 checkpoint written by one
    process, converted offline to TP=2 (tools/convert_checkpoint.py), resumes on 2 ranks and
    continues the single process's losses within bf16's TP bar (2e-2). On the CPU wherever it
    runs, the single process too (tests/conftest.py)."""
    straight = tmp_path / "straight"
    _train(tiny_data, straight, "te:bf16")
    first = tmp_path / "first"
    _train(tiny_data, first, "te:bf16", **{"training.exit_interval": 3})
    converted = tmp_path / "tp2_ckpt"
    # The tool's main and the workers' pretrain, in this process and in forked ranks: what
    # the command lines run (tests/test_convert_checkpoint.py and the entry-point tests run
    # those), without fresh interpreters.
    tool = ["--input", str(first / "checkpoints"), "--output", str(converted),
            "--format", "native", "--tensor", "2", "--quiet"]  # fmt: skip
    assert convert_main(tool) == 0
    resumed = tmp_path / "tp2"
    overrides = tiny_overrides(
        tiny_data, resumed, "te:bf16", **{"parallel.tensor": 2, "checkpoint.load": str(converted)}
    )
    pretrain_ranks(2, [(CONFIG, overrides)])

    def losses(run_dir):
        records = (run_dir / "metrics.jsonl").read_text().splitlines()
        return {r["iteration"]: r["lm loss"] for r in map(json.loads, records)}

    after = losses(resumed)
    assert sorted(after) == [4, 5, 6]
    assert [after[i] for i in (4, 5, 6)] == pytest.approx(
        [losses(straight)[i] for i in (4, 5, 6)], rel=2e-2
    )


def test_bf16_layer_norm_sums_its_parameter_gradients_in_fp32():
    # models.transformer.LayerNorm at bf16 on the CPU: computed in float32, so the weight and
    # bias gradients (sums over the 1024 tokens) are the float64 sums of the same BF16 inputs
    # rounded once to BF16 (2**-8 relative, BF16's unit roundoff; float32's own summing error
    # is ~1e-7). torch's BF16 kernel on the CPU sums in BF16: ~3% off here.
    from models.transformer import LayerNorm

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1024, 256, generator=gen).to(torch.bfloat16)
    g = torch.randn(1024, 256, generator=gen).to(torch.bfloat16)
    norm = LayerNorm(256).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.1, generator=gen)
        norm.bias.normal_(0.0, 0.1, generator=gen)
    y = norm(x.requires_grad_())
    assert y.dtype == torch.bfloat16
    y.backward(g)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, norm.weight, norm.bias))
    torch.nn.functional.layer_norm(x64, (256,), w64, b64, norm.eps).backward(g.double())
    xhat = torch.nn.functional.layer_norm(x.detach().double(), (256,), eps=norm.eps)
    # Float32 summing and normalising error: ~1e-7 of the sum of the terms' magnitudes.
    slack = 1e-6 * torch.stack([g.double().abs() * xhat.abs(), g.double().abs()]).sum(1)
    for got, want, extra in (
        (norm.weight.grad, w64.grad, slack[0]),
        (norm.bias.grad, b64.grad, slack[1]),
    ):
        err = (got.double() - want).abs()
        assert torch.all(err <= 2.0**-8 * want.abs() + extra)

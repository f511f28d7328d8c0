"""Pipeline parallelism end to end on CPU/gloo: every layout against the single-process run.

Layouts: PP=2, PP=4, PP=2 x virtual 2, TP2 x PP2 (4 ranks), TP2 x PP2 x DP2 (8 ranks). Each
trains the tiny GPT (4 layers, 4 micro-batches of 2 per step; 2 per replica under DP, on the
same samples) for 3 steps at fp32 and at O2 in spawned ranks. A ``grad_hook`` snapshots every
gradient once it is final (tied copies summed, replicas averaged, unscaled) under its global
name, tensor-parallel shards gathered to full tensors. The merged stages must give exactly the
single-process model's parameters, every copy of a parameter (tied embedding on the first and
last stage, TP ranks, DP replicas) must hold bitwise the same gradient, and losses and
gradients (relative L2 error per tensor, every step) must match:

fp32: 1e-5. Measured: 4.3e-7 (pipeline only), 4.6e-7 (with TP), losses bitwise equal. A
pipeline changes one sum: the tied embedding's gradient is the first stage's copy (lookups of
all micro-batches) plus the last stage's (head of all micro-batches), where one process adds
head and lookup micro-batch by micro-batch. Every other gradient is the same sum in the same
order (``parallel/pipeline/schedules.py``: a chunk's backward passes run in micro-batch order),
so at the first step, on identical weights, every other gradient is bitwise equal (asserted,
both levels) and the embedding's within FP32 rounding (measured 6e-8). Later steps start from
weights an FP32 ulp apart, and TP sums sharded GEMMs in other groupings.

O2 against the run that differs only in the pipeline (the single process for pipeline-only
layouts; TP=2, or TP=2 x DP=2, without a pipeline for the others): 1e-5 as well, losses 1e-6.
The FP8 weight gradients get no slack: both runs cast the same values with the same delayed-
scaling history in the same accumulation order, and all 48 FP8 weight gradients (16 per step)
were bitwise equal in every layout; the FP32 gradients of embeddings, norms and biases differ
as at fp32 (measured 1.1e-7, losses 7.7e-8 pipeline only, bitwise equal with TP). This bar is
what checks the accumulation order: an FP8 slot rounds after every micro-batch, so another
order moves FP8 gradients by ~1e-2. It holds while the embedding's FP32-ulp differences never
push a value across an E4M3 rounding boundary (Adam turns them into ~1e-9 relative weight
changes, so flips are rare); one flip would move its tensor by ~1e-3 (2**-3 on one element).

O2 under TP against the single process: every weight shard has its own FP8 scales
(tests/test_tp_model_grads.py), so FP8 gradients differ by up to half an E4M3 ulp per element
from step 1 on: 0.2 per tensor, that file's bar (measured 0.133 for TP2xPP2 and TP2xPP2xDP2,
identical to TP2 and TP2xDP2 without a pipeline); losses 1e-3 (measured 2.6e-5 and 6.2e-5 in 3
steps; tests/test_tp_training.py allows 2e-3 over 6).

Through the real entry point (torchrun): a PP=2 run stopped at 3 and resumed equals the
straight run, with per-stage checkpoint files and per-stage memory records; impossible layouts
exit 2 with one line naming the config key.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import (
    RunsByWorld,
    full_tensors,
    grad_value,
    pretrain_ranks,
    rank_env,
    torchrun,
)

STEPS = 3
LEVELS = ("fp32", "O2")
# Shared by every run: 4 layers (4 stages, or 2 stages x 2 chunks) and a global batch of 8 in
# micro-batches of 2: 4 per step (2 per replica under data parallelism, on the same samples).
COMMON = {"model.num_layers": 4, "training.micro_batch_size": 2, "training.global_batch_size": 8}
PP2, TP2 = {"parallel.pipeline": 2}, {"parallel.tensor": 2}
# name -> (world size, overrides); runs of one world size share a spawn.
RUNS = {
    "single": (1, {}),
    "pp2": (2, PP2),
    "pp2_v2": (2, {**PP2, "parallel.virtual_pipeline": 2}),
    "tp2": (2, TP2),
    "pp4": (4, {"parallel.pipeline": 4}),
    "tp2_pp2": (4, {**TP2, **PP2}),
    "tp2_dp2": (4, TP2),
    "tp2_pp2_dp2": (8, {**TP2, **PP2}),
}
# layout -> the run that differs from it only in the pipeline
SAME_BUT_PIPELINE = {
    "pp2": "single",
    "pp4": "single",
    "pp2_v2": "single",
    "tp2_pp2": "tp2",
    "tp2_pp2_dp2": "tp2_dp2",
}
TIED = "word_embeddings.weight"


def _worker(rank: int, world: int, port: int, runs: dict, out_dir: str) -> None:
    """One rank of every run in ``runs`` ((name, level) -> overrides): 3 training steps each;
    writes each step's final gradients (safetensors) and the step losses (JSON)."""
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from data.sampler import micro_batches
    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.setup import build_run
    from training.step import train_step

    for (name, level), overrides in runs.items():
        cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
        state = build_run(cfg)  # later runs reuse the process group and add their groups
        topo = state.groups.topology
        n_micro = state.plan.micro_batches
        data = micro_batches(
            state.train_ds, 0, cfg.training.micro_batch_size, topo.dp_rank, topo.data
        )
        grads, losses = {}, []
        for step in range(STEPS):

            def hook(s, step=step, grads=grads):
                full = full_tensors(s.model, grad_value)
                grads.update({f"{step}/{k}": v for k, v in full.items()})

            losses.append(train_step(state, data, n_micro, grad_hook=hook).loss)
        stem = Path(out_dir, f"{name}_{level}_rank{rank}")
        save_file(grads, f"{stem}.safetensors")
        Path(f"{stem}.json").write_text(json.dumps({"losses": losses}))
        del state
    destroy_distributed()


@pytest.fixture(scope="module")
def results(tiny_data, tmp_path_factory):
    """``results(name, level)`` -> per rank ``(grads, losses)``; forks each world size's runs
    once, on first use."""
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    def make_runs(world, tmp):
        return {
            (n, lv): tiny_overrides(tiny_data, tmp / n / lv, lv, **COMMON, **extra)
            for n, (w, extra) in RUNS.items()
            if w == world
            for lv in LEVELS
        }

    runs = RunsByWorld(_worker, make_runs, tmp_path_factory, "pp", timeout=400,
                       start_method="fork")  # fmt: skip
    return lambda name, level: [
        (grads, record["losses"]) for grads, record in runs(RUNS[name][0], name, level)
    ]


def _merged(ranks) -> dict[str, torch.Tensor]:
    """One gradient per name over all ranks, checking every copy (tied embedding on two
    stages, TP ranks after the gather, DP replicas) holds bitwise the same."""
    out = {}
    for grads, _ in ranks:
        for key, g in grads.items():
            if key in out:
                assert torch.equal(out[key], g), f"copies of {key} differ"
            else:
                out[key] = g
    return out


def _errors(ranks, ref_ranks) -> tuple[dict[str, float], float]:
    """(relative L2 error of every gradient by 'step/name', worst relative loss error)."""
    grads, ref = _merged(ranks), _merged(ref_ranks)
    assert sorted(grads) == sorted(ref)  # every parameter, every step, nothing extra
    errors = {k: ((grads[k] - r).norm() / r.norm().clamp(min=1e-30)).item() for k, r in ref.items()}
    losses, ref_losses = ranks[-1][1], ref_ranks[0][1]
    assert all(r[1] == losses for r in ranks)  # every rank reports the step's loss
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    return errors, loss


LAYOUTS = list(SAME_BUT_PIPELINE)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(results, layout, level):
    errors, loss = _errors(results(layout, level), results("single", level))
    worst = max(errors.values())
    if level == "fp32" or "tp2" not in layout:
        assert worst < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
        assert loss < (1e-5 if level == "fp32" else 1e-6), loss
    else:  # O2 under TP: per-shard FP8 scales (module docstring)
        assert worst < 0.2, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
        assert loss < 1e-3, loss


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipeline_changes_only_the_tied_embedding_sum(results, layout, level):
    """Against the same run without a pipeline: at the first step (identical weights) every
    gradient but the tied embedding's is bitwise equal, that one within FP32 rounding; after
    that, everything within 1e-5 at O2 too (module docstring)."""
    errors, loss = _errors(results(layout, level), results(SAME_BUT_PIPELINE[layout], level))
    first = {k: e for k, e in errors.items() if k.startswith("0/")}
    assert first.pop(f"0/{TIED}") < 1e-6
    assert max(first.values()) == 0.0, {k: e for k, e in first.items() if e}
    assert max(errors.values()) < 1e-5, sorted(errors.items(), key=lambda kv: -kv[1])[:5]
    assert loss < (1e-5 if level == "fp32" else 1e-6), loss


# ---------------------------------------------------------------------------------------------
# Through the real entry point.


def _torchrun(nproc, overrides, timeout=300, config="configs/gpt_tiny.yaml"):
    return torchrun(nproc, ["--config", config, *overrides], timeout=timeout)


def _records(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_pp2_entry_point_resume_checkpoint_and_stage_memory(tiny_data, tmp_path):
    straight = tmp_path / "straight"
    proc = _torchrun(2, tiny_overrides(tiny_data, straight, "O2", **PP2))
    assert "world 2 (tp 1 pp 2 dp 1)" in proc.stdout
    records = _records(straight)
    assert [r["iteration"] for r in records] == [1, 2, 3, 4, 5, 6]
    # Stage 0: embeddings and layer 0; stage 1: layer 1, final norm and the tied head's copy.
    from models.context import BuildContext
    from models.gpt import GPTConfig, GPTModel, pad_vocab_size

    hidden, vocab = 64, pad_vocab_size(tiny_data.vocab_size)  # tiny_overrides' model
    shape = {"num_layers": 2, "hidden_size": hidden, "num_attention_heads": 2, "seq_length": 64}
    whole = GPTModel(
        GPTConfig(**shape, vocab_size=vocab), BuildContext(device="meta")
    ).num_parameters()
    for record in records:
        stages = record["mem-stage0/num-parameters"], record["mem-stage1/num-parameters"]
        assert min(stages) > 0 and sum(stages) == whole + vocab * hidden, stages
    files = {p.name for p in (straight / "checkpoints" / "iter_0000006").iterdir()}
    assert {"model_pp0.safetensors", "model_pp1.safetensors"} <= files
    assert {"optimizer_pp0.safetensors", "optimizer_pp1.safetensors"} <= files

    # Resumed in forked ranks: the straight run above is the entry point's test.
    resumed, config = tmp_path / "resumed", str(REPO / "configs/gpt_tiny.yaml")
    stop = {**PP2, "training.exit_interval": 3}
    pretrain_ranks(2, [(config, tiny_overrides(tiny_data, resumed, "O2", **stop))])
    first = _records(resumed)
    assert len(first) == 3
    pretrain_ranks(2, [(config, tiny_overrides(tiny_data, resumed, "O2", **PP2))])
    # Resumed, not started over: iterations 1-3 keep the first attempt's records (times too).
    assert _records(resumed)[:3] == first
    # Both stages' weights, FP8 scaling state, optimizer and RNG come back exactly.
    assert [r["lm loss"] for r in _records(resumed)] == [r["lm loss"] for r in records]


def _ranks_of_the_entry_point(world, overrides, monkeypatch, capfd):
    """``pretrain_gpt.py``'s ``main`` once per rank of ``world`` with torchrun's environment,
    in this process: ``(exit code, stdout, stderr)`` per rank. Its pre-flight runs before any
    process group (every rank checks alone), so each rank's output is its own; the script as
    a process, its exit status and stderr, is tests/test_entry_point.py's."""
    from training.entry_point import main

    ranks = []
    for rank in range(world):
        env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "MASTER_ADDR": "127.0.0.1"}
        for key, value in env.items():
            monkeypatch.setenv(key, str(value))
        capfd.readouterr()
        code = main("gpt", ["--config", str(REPO / "configs/gpt_tiny.yaml"), *overrides])
        ranks.append((code, *capfd.readouterr()))
    return ranks


@pytest.mark.parametrize(
    ("world", "overrides", "needle"),
    [
        # 2 stages x 2 chunks, but a step of 1 micro-batch: interleaving needs a multiple of 2.
        # Found at launch (it depends on the data-parallel size): 2 ranks.
        (
            2,
            {"parallel.virtual_pipeline": 2, "model.num_layers": 4,
             "training.micro_batch_size": 2, "training.global_batch_size": 2},
            "parallel.virtual_pipeline",
        ),
        # 3 layers over 2 stages: the config itself is impossible, found before any launch.
        (1, {"model.num_layers": 3}, "model.num_layers"),
    ],
)  # fmt: skip
def test_impossible_pipeline_layout_exits_2_with_one_line(
    tmp_path, monkeypatch, capfd, world, overrides, needle
):
    run_dir = tmp_path / "run"
    args = [f"{k}={v}" for k, v in {**PP2, **overrides, "logging.dir": run_dir}.items()]
    ranks = _ranks_of_the_entry_point(world, args, monkeypatch, capfd)
    for code, _, err in ranks:
        assert code == 2, err
    lines = [x for x in ranks[0][2].splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert all(not err.strip() for _, _, err in ranks[1:])  # one line, from rank 0 only
    assert not run_dir.exists()


def test_shipped_3d_config_trains(tiny_data, tmp_path):
    """configs/gpt_tiny_3d.yaml as shipped (TP2 x PP2 interleaved x DP2, SP, O2) on 8 forked
    ranks; only the data, the size and the length shrink so it takes seconds. (The entry point
    under torchrun is tested above; 8 fresh interpreters would cost more than the run.)"""
    run_dir = tmp_path / "3d"
    overrides = tiny_overrides(
        tiny_data, run_dir, "O2",
        **{"model.num_layers": 4, "training.train_iters": 4, "training.global_batch_size": 8},
    )  # fmt: skip
    pretrain_ranks(8, [(str(REPO / "configs/gpt_tiny_3d.yaml"), overrides)])
    losses = [r["lm loss"] for r in _records(run_dir)]
    assert len(losses) == 4 and all(map(math.isfinite, losses)) and losses[-1] < losses[0]
    files = {p.name for p in (run_dir / "checkpoints" / "iter_0000004").iterdir()}
    assert {f"model_tp{t}_pp{p}.safetensors" for t in (0, 1) for p in (0, 1)} <= files

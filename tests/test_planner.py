"""The planner (training/planning/: rank_plan.py, layout_plan.py; tools/plan.py): the step it
executes on meta tensors against the same step really run, its extension over micro-batches
against the full step, its FLOPs against the family's formula, and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.multiproc import REPO
from training.config import load_config
from training.planning.layout_plan import micro_batch_steps, plan_stage
from training.planning.rank_plan import measure_rank, plan_rank
from training.run_plan import plan_parallel

TINY = str(REPO / "configs" / "gpt_tiny.yaml")


def _cfg(*overrides: str):
    return load_config(TINY, ["precision.fp8_gemm_backend=scaled_mm", *overrides])


@pytest.mark.parametrize("level", ["bf16", "te", "O1", "O2", "O3"])
def test_plan_matches_the_real_step(level):
    """One process, the tiny GPT: the plan's peak and every category at it within 2% of the
    same accounting of the real step on CPU, and the same FLOPs. te keeps 256 tokens, where
    its peak falls in backward (activations and gradients); the others run 64 (bf16's CPU
    backward takes 20 s at 256), where O1-O3 peak in the low-bit optimizer's update, which
    the real step takes on the accelerator's path (``measure_rank``), as the plan does."""
    short = [] if level == "te" else ["model.seq_length=64"]
    cfg = _cfg(f"precision.level={level}", *short)
    plan = plan_parallel(cfg, 1)
    planned, real = plan_rank(cfg, plan, 0), measure_rank(cfg, plan)
    assert planned.memory.peak == pytest.approx(real.memory.peak, rel=0.02)
    assert planned.memory.peak_phase == real.memory.peak_phase
    for category, nbytes in real.memory.at_peak.items():
        assert planned.memory.at_peak[category] == pytest.approx(
            nbytes, rel=0.02, abs=0.002 * real.memory.peak
        ), category
    assert planned.flops == real.flops  # the same GEMMs on the same shapes
    assert planned.traffic == pytest.approx(real.traffic, rel=0.02)
    # The meta step answers host reads: torch's foreach AdamW reads whether to skip (bf16, te);
    # LowBitAdamW decides on the device (O1-O3). The real step on the accelerator's path none.
    assert (planned.host_reads > 0) == (level in ("bf16", "te")) and real.host_reads == 0


def test_flops_match_the_family_formula():
    """Executed GEMM FLOPs of one step (no recompute) against Megatron's formula: the formula
    counts the same GEMMs, attention halved under the causal mask."""
    cfg = _cfg("precision.level=bf16")
    plan = plan_parallel(cfg, 1)
    from families.base import get_family

    family = get_family(cfg.family)
    formula = family.flops_per_step(
        family.planned_model_config(cfg, 1), cfg.training.global_batch_size
    )
    executed = sum(plan_rank(cfg, plan, 0).flops.values())
    assert executed == pytest.approx(formula, rel=0.02)


def test_extension_over_micro_batches_matches_the_full_step():
    """Pipeline 2 x data 2, 8 micro-batches: the plan from steps of 3, 4 and 5 micro-batches
    extended to 8 against the step of all 8: FLOPs and bytes sent exactly (each micro-batch
    runs the same GEMMs and collectives), memory within the line tolerance."""
    cfg = _cfg(
        "precision.level=O3", "parallel.pipeline=2", "optimizer.distributed=true",
        "training.global_batch_size=64",
    )  # fmt: skip
    plan = plan_parallel(cfg, 4)
    assert plan.micro_batches == 8 and micro_batch_steps(plan) == (3, 4, 5)
    for rank in (0, 3):
        extended = plan_stage(cfg, plan, rank)
        exact = plan_stage(cfg, plan, rank, exact=True)
        assert extended.executed == (3, 4, 5) and exact.executed == (8,)
        a, b = extended.result, exact.result
        assert (a.flops, a.comm, a.comm_groups) == (b.flops, b.comm, b.comm_groups)
        # Traffic: a few scalar ops of the schedule's edges are not per micro-batch.
        assert a.traffic == pytest.approx(b.traffic, rel=1e-6)
        assert a.memory.peak == pytest.approx(b.memory.peak, rel=1e-4)
        assert a.memory.at_peak == pytest.approx(b.memory.at_peak, rel=1e-4, abs=64)


def _synthetic_run(n: int, optimizer: int, backward: int):
    """A planned step of ``n`` micro-batches whose optimizer phase peaks at ``optimizer``
    bytes and backward phase at ``backward`` (weights 1000 of them, the rest activations
    or comm), the optimizer phase the higher."""
    from training.planning.rank_plan import RankPlan
    from training.planning.step_account import CATEGORIES, MemoryReport

    def split(total: int, grows: str) -> dict[str, int]:
        return {**dict.fromkeys(CATEGORIES, 0), "weights": 1000, grows: total - 1000}

    phase_at_peak = {
        "forward": split(1500, "activations"),
        "backward": split(backward, "activations"),
        "optimizer": split(optimizer, "comm"),
    }
    peaks = {phase: sum(c.values()) for phase, c in phase_at_peak.items()}
    phase = max(peaks, key=peaks.__getitem__)
    memory = MemoryReport(peaks[phase], phase_at_peak[phase], {}, phase, peaks, phase_at_peak)
    return RankPlan(
        rank=0, stage=0, tp_rank=0, dp_rank=0, parameters=1, micro_batches=n, memory=memory,
        flops={"float8": 10.0 * n}, traffic=7 * n, comm={}, comm_groups={}, wire={},
        host_reads=0, build_seconds=1.0, step_seconds=1.0,
    )  # fmt: skip


def test_extension_takes_the_phase_whose_line_is_highest_at_n():
    """Every phase's peak is extended on its own line: a phase below the short steps' peak
    that grows faster passes it later (GPT-175B's last stage at ce0d5ed: 25.90 GB reported
    in the optimizer phase, its own backward phase 28.49 GB at 256 micro-batches)."""
    from training.planning.layout_plan import _extend, _is_line

    # Optimizer phase: 3000 + 10 per micro-batch; backward: 2500 + 50 per micro-batch.
    runs = [_synthetic_run(n, 3000 + 10 * n, 2500 + 50 * n) for n in (5, 6, 7)]
    assert {r.memory.peak_phase for r in runs} == {"optimizer"}
    assert _is_line(runs, 256)
    late = _extend(runs, 256).memory
    assert late.peak_phase == "backward" and late.peak == 2500 + 50 * 256
    assert late.phase_peaks == {"forward": 1500, "backward": 15300, "optimizer": 5560}
    assert late.at_peak == late.phase_at_peak["backward"]
    assert late.at_peak["activations"] == 15300 - 1000 and sum(late.at_peak.values()) == 15300
    early = _extend(runs, 10).memory  # before the lines cross: still the optimizer's peak
    assert early.peak_phase == "optimizer" and early.peak == 3100
    assert early.at_peak["comm"] == 2100 and early.at_peak["activations"] == 0
    assert _extend(runs, 256).flops == {"float8": 2560.0}
    # A phase off its line (here backward) means a full step, whichever phase peaks.
    bent = [_synthetic_run(n, 3000 + 10 * n, 2500 + 5 * n * n) for n in (5, 6, 7)]
    assert not _is_line(bent, 256)


def _plan_cli(*args: str, tmp_path=None):
    return subprocess.run(
        [sys.executable, str(REPO / "tools" / "plan.py"), *args],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )  # fmt: skip


def test_cli_prints_the_per_stage_table_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    done = _plan_cli(
        "--config", TINY, "--world-size", "8", "parallel.tensor=2", "parallel.pipeline=2",
        "precision.level=O3", "optimizer.distributed=true", "--json", str(out), "--jobs", "1",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "memory at the step's peak" in done.stdout and "H100 lower bound" in done.stdout
    # Readable in a terminal: the collectives (rows) by rank (columns), every line narrow.
    assert max(len(line) for line in done.stdout.splitlines()) <= 100
    assert any(line.startswith("reduce_scatter_fp8 ") for line in done.stdout.splitlines())
    # Progress on stderr as each rank is built and stepped, and when each is done.
    progress = done.stderr.splitlines()
    assert all(line.startswith("plan: ") for line in progress), done.stderr
    assert any("rank 4: building" in line for line in progress)
    assert any("(2 of 2 done" in line for line in progress)
    plan = json.loads(out.read_text())
    assert [r["stage"] for r in plan["ranks"]] == [0, 1]
    for r in plan["ranks"]:
        memory = r["memory"]
        assert sum(memory["at_peak"].values()) == memory["peak"]  # the same storages
        assert r["comm"]["reduce_scatter_fp8"] > 0  # the FP8 gradients over data parallelism


def test_cli_help_is_whole_and_every_option_does_something(capsys):
    """--help prints the whole description (not its first line cut mid-sentence); the
    default already plans each stage's most loaded rank, so there is no --all-stages."""
    from tools import plan

    with pytest.raises(SystemExit) as stop:
        plan.main(["--help"])
    assert stop.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert " ".join(plan.__doc__.split()) in shown
    assert "--all-stages" not in shown and "--quiet" in shown
    with pytest.raises(SystemExit) as stop:
        plan.main(["--config", TINY, "--all-stages"])
    assert stop.value.code == 2


def test_peak_inside_an_autograd_function_forward_is_forward():
    """An FP8 GEMM's own autograd.Function runs its forward with grad off: its allocations
    are the forward's all the same (phases by where the step is: forward, backward, after
    backward, optimizer)."""
    import torch

    from training.planning.step_account import PHASES, StepAccount

    class Wide(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            wide = x.new_zeros(1 << 20)  # 4 MB, freed before the function returns
            return x * 2 + wide[0]

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    class Layer(torch.nn.Linear):
        def forward(self, x):
            return Wide.apply(super().forward(x))

    layer = Layer(8, 8)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with StepAccount() as account:
        x = torch.ones(4, 8)
        account.start_step()
        with account.saving():
            layer(x).sum().backward()
            with torch.no_grad():
                layer.weight.grad.copy_(layer.weight.grad * 0.5)  # clipping: after backward
                opt.step()
    memory = account.memory()
    assert memory.peak_phase == "forward"
    assert memory.peak >= 4 << 20
    assert {"forward", "backward", "after backward", "optimizer"} <= set(memory.phase_peaks)
    assert set(memory.phase_peaks) <= set(PHASES)
    assert set(memory.phase_at_peak) == set(memory.phase_peaks)
    for phase, nbytes in memory.phase_peaks.items():  # each phase's peak, by category
        assert sum(memory.phase_at_peak[phase].values()) == nbytes, phase
    assert memory.phase_at_peak["forward"] == memory.at_peak


def test_cli_refuses_a_layout_in_one_line_like_the_preflight():
    from training.preflight import preflight

    with pytest.raises(Exception) as refused:
        preflight(load_config(TINY, ["parallel.tensor=2"]), 3)
    done = _plan_cli("--config", TINY, "--world-size", "3", "parallel.tensor=2")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {refused.value}"]

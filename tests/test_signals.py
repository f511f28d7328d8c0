"""A signal mid-run saves a checkpoint and exits 0; resuming continues the run exactly; a
killed rank under --max-restarts restarts and the run ends as if uninterrupted.

The launcher (``python -m training.launcher``, what ``make train`` runs: torchrun ending with
one line) runs 2 ranks of the tiny GPT for 40 steps without periodic saves; once a few steps
are logged it gets SIGTERM (a scheduler) or SIGINT (Ctrl-C). Every rank finishes its step,
they save together, the launcher exits 0 with one line; the same command then resumes and the
per-iteration losses equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, tiny_overrides
from multiproc import logged_losses, metrics_records

STEPS = 40


def _cmd(data, run_dir, level: str = "fp32") -> list[str]:
    overrides = tiny_overrides(
        data, run_dir, level,
        **{"training.train_iters": STEPS, "checkpoint.save_interval": 0,
           "training.eval_interval": 1000, "training.eval_iters": 0},
    )  # fmt: skip
    return [sys.executable, "-m", "training.launcher", "--standalone", "--nproc_per_node", "2",
            "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml", *overrides]  # fmt: skip


def _run(cmd, timeout=300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def straight_runs(tiny_data, tmp_path_factory):
    """level -> the uninterrupted run's losses (each level run once, when first asked)."""
    done = {}

    def losses(level: str) -> dict[int, float]:
        if level not in done:
            run_dir = tmp_path_factory.mktemp(f"straight_{level}")
            proc = _run(_cmd(tiny_data, run_dir, level))
            assert proc.returncode == 0, proc.stderr[-3000:]
            done[level] = logged_losses(run_dir)
        return done[level]

    return losses


@pytest.fixture(scope="module")
def straight(straight_runs):
    return straight_runs("fp32")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_saves_and_resume_continues_the_run(straight, tiny_data, tmp_path, sig):
    cmd = _cmd(tiny_data, tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    saved = [x for x in out.splitlines() if x.startswith("received ")]
    # The agent passes the signal on to the workers (SIGINT as SIGINT, SIGTERM as SIGTERM).
    assert len(saved) == 1 and signal.Signals(sig).name in saved[0], saved
    assert out.strip().splitlines()[-1].startswith("fp8train: stopped by"), out[-2000:]
    assert "Traceback" not in err, err[-3000:]
    stopped_at = max(logged_losses(tmp_path))
    assert stopped_at < STEPS
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"iter_{stopped_at:07d}"
    again = _run(cmd)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout
    assert logged_losses(tmp_path) == straight


def _worker_pid(launcher_pid: int, rank: int) -> int | None:
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as fh:
                ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the worker through /proc")
@pytest.mark.parametrize("level", ["fp32", "te"])
def test_a_killed_rank_restarts_and_the_run_ends_as_uninterrupted(
    straight_runs, tiny_data, tmp_path, level
):
    """SIGKILL of rank 1 mid-training under --max-restarts 1: the agent restarts both workers,
    they resume from the latest checkpoint (saved every 5 steps), every iteration's logged
    loss equals the uninterrupted run's, and metrics.jsonl holds each iteration once. te too:
    its FP8 scaling state (amax histories) is restored with the weights."""
    cmd = _cmd(tiny_data, tmp_path, level)
    cmd[cmd.index("--nproc_per_node") : cmd.index("--nproc_per_node")] = ["--max-restarts", "1"]
    cmd.append("checkpoint.save_interval=5")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while not (latest.exists() and (tmp_path / "metrics.jsonl").read_text().count("\n") >= 7):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    victim = _worker_pid(proc.pid, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("resumed from") == 1, out[-3000:]
    assert logged_losses(tmp_path) == straight_runs(level)
    # What the killed attempt logged past its checkpoint was dropped on resume: one record
    # per iteration, in order.
    assert [r["iteration"] for r in metrics_records(tmp_path)] == list(range(1, STEPS + 1))

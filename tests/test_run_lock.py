"""One job per checkpoint directory, and no worker outliving its launcher (issue 14 item 9).

Measured before the fix: torchrun starts each worker in a session of its own, so a SIGKILL of
the launcher left its workers training as orphans, and a relaunch on the same directory ran
beside them. Here, with real processes (``python -m training.launcher``, what ``make train``
runs, 2 gloo ranks of the tiny GPT):

- a second job on a live run's checkpoint directory exits 2 with one line naming the holder
  (pid and host of the first job's rank 0); the first run's log and checkpoints stay its own;
- SIGKILL of the launcher mid-training: the kernel signals its workers, they save at
  their step and exit (none is left in /proc), ``latest`` names a complete checkpoint, and the
  same config on the directory is accepted and resumes from it (the dead job holds nothing);
- SIGKILL of the launcher while its workers are still starting (before they could ask for the
  parent-death signal): they notice the agent is gone and stop too;
- the lock itself: a process forked by the holder (a data-loader worker) does not keep it
  after the holder dies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, tiny_overrides
from multiproc import pretrain_ranks

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="parent-death signal and /proc are Linux's"
)

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def _cmd(data, run_dir, *extra: str) -> list[str]:
    """A run far longer than any test waits (it is always stopped), saving every 3 steps."""
    overrides = tiny_overrides(
        data, run_dir, "fp32",
        **{"training.train_iters": 100000, "checkpoint.save_interval": 3,
           "training.eval_interval": 100000, "training.eval_iters": 0},
    )  # fmt: skip
    return [sys.executable, "-m", "training.launcher", "--standalone", "--nproc_per_node", "2",
            "pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml", *overrides, *extra]  # fmt: skip


def _stat(pid: int) -> tuple[int, str, int] | None:
    """``(parent pid, state, start time)`` of a process, None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), fields[0], int(fields[19])


def _workers(launcher_pid: int) -> dict[int, tuple[int, int]]:
    """``{rank: (pid, start time)}`` of the launcher's worker processes (those that have
    exec'ed with torchrun's RANK variable)."""
    found = {}
    for name in os.listdir("/proc"):
        stat = _stat(int(name)) if name.isdigit() else None
        if stat is None or stat[0] != launcher_pid:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = dict(x.split(b"=", 1) for x in fh.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            found[int(env[b"RANK"])] = (int(name), stat[2])
    return found


def _alive(pid: int, start: int) -> bool:
    """The same process (pid and start time), not exited (a zombie has exited)."""
    stat = _stat(pid)
    return stat is not None and stat[2] == start and stat[1] != "Z"


def _wait_until(condition, seconds: float, what: str, proc=None) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the job ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {seconds} s")
        time.sleep(0.05)


def _stop(launcher: subprocess.Popen, workers: dict[int, tuple[int, int]]) -> None:
    """A failed test must not leave its launcher or workers training on a shared machine."""
    if launcher.poll() is None:
        launcher.kill()
    for pid, start in workers.values():
        if _alive(pid, start):
            os.kill(pid, signal.SIGKILL)


def _logged_iterations(run_dir: Path) -> list[int]:
    text = (run_dir / "metrics.jsonl").read_text() if (run_dir / "metrics.jsonl").exists() else ""
    return [json.loads(line)["iteration"] for line in text.splitlines()]


def _assert_complete(checkpoints: Path, iteration: int) -> None:
    """``latest`` names ``iter_{iteration}`` and every file of it is there and readable."""
    from checkpoint.format import reassemble
    from checkpoint.store import latest_checkpoint, read_metadata

    path = latest_checkpoint(checkpoints)
    assert path is not None and path.name == f"iter_{iteration:07d}", path
    assert read_metadata(path)["iteration"] == iteration
    assert reassemble(path, "model") and reassemble(path, "optimizer")  # raise if incomplete
    assert all((path / f"rng_rank{r}.safetensors").exists() for r in range(2))


def test_second_job_refused_and_a_killed_launcher_leaves_no_worker(tiny_data, tmp_path):
    cmd = _cmd(tiny_data, tmp_path)
    first = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    workers = {}
    try:
        _wait_until(lambda: len(_logged_iterations(tmp_path)) >= 2, 240, "training", first)
        workers = _workers(first.pid)
        assert sorted(workers) == [0, 1], workers

        # A second job on the live run's directory: refused in one line naming the holder.
        second = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True,
                                timeout=240)  # fmt: skip
        lines = [x for x in (second.stdout + second.stderr).splitlines() if x.strip()]
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-3000:]
        assert len(lines) == 1, lines
        holder = f"pid {workers[0][0]} on {socket.gethostname()} since "
        assert lines[0].startswith("error: checkpoint.dir=") and holder in lines[0], lines[0]
        assert first.poll() is None, "the first job ended before the second was refused"

        _wait_until(lambda: (tmp_path / "checkpoints" / "latest").exists(), 240, "checkpoint")
        # SIGKILL of the launcher (an OOM kill, kill -9): its workers get the parent-death
        # signal from the kernel (twice: see training/run_lock.py), finish their step, save
        # together and exit.
        first.kill()
        out, err = first.communicate(timeout=120)  # EOF once every worker has closed stdout
        for pid, start in workers.values():
            _wait_until(lambda p=pid, s=start: not _alive(p, s), 60, f"exit of worker {pid}")
    finally:
        _stop(first, workers)
    saved = [
        x
        for x in out.splitlines()
        if x.startswith("received SIGUSR2 (the launcher died): saved checkpoint")
    ]
    assert len(saved) == 1, out[-3000:] + err[-3000:]
    iteration = int(saved[0].split("iteration ")[1].split()[0])

    # Everything the directory holds is the first job's: each iteration logged once, in
    # order, and the checkpoint its workers saved on the way out is complete.
    assert _logged_iterations(tmp_path) == list(range(1, iteration + 1))
    _assert_complete(tmp_path / "checkpoints", iteration)

    # The dead job holds nothing: the same config on the directory takes the lock and resumes
    # (one step, then it stops and saves): iteration + 1 logged once after the first job's,
    # where starting over would log iteration 1 again. In forked ranks: the lock is the
    # workers', and the launcher has been seen above.
    overrides = [*cmd[cmd.index("--config") + 2 :], "training.exit_interval=1"]
    pretrain_ranks(2, [(str(REPO / "configs/gpt_tiny.yaml"), overrides)])
    assert _logged_iterations(tmp_path) == list(range(1, iteration + 2))
    _assert_complete(tmp_path / "checkpoints", iteration + 1)


def test_launcher_killed_while_workers_start(tiny_data, tmp_path):
    """The kill lands while the workers are still importing, before they ask for the
    parent-death signal: they find their agent gone when they do, and stop."""
    proc = subprocess.Popen(_cmd(tiny_data, tmp_path), cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    workers = {}
    try:

        def started() -> bool:
            workers.update(_workers(proc.pid))
            return len(workers) == 2

        _wait_until(started, 120, "worker processes", proc)
        proc.kill()
        proc.wait()
        for pid, start in workers.values():
            _wait_until(lambda p=pid, s=start: not _alive(p, s), 120, f"exit of worker {pid}")
    finally:
        _stop(proc, workers)
        proc.stderr.close()
    assert not (tmp_path / "checkpoints" / "latest").exists()


_HOLDER = """
import os, sys, time
import torch
from training.run_lock import acquire_run_lock
lock = acquire_run_lock(sys.argv[1], 0, torch.device("cpu"))
child = os.fork()  # what a data-loader worker is: a fork holding copies of every descriptor
if child == 0:
    time.sleep(300)
    os._exit(0)
print(child, flush=True)
time.sleep(300)
"""


def test_lock_refuses_a_live_holder_and_not_a_dead_one(tmp_path):
    from checkpoint.store import CheckpointError
    from training.run_lock import acquire_run_lock, run_lock_problem

    assert run_lock_problem(tmp_path / "never_run") is None  # and nothing is created
    assert not (tmp_path / "never_run").exists()
    cpu = __import__("torch").device("cpu")
    directory = tmp_path / "checkpoints"
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(directory)], cwd=REPO,
                              env=ENV, stdout=subprocess.PIPE, text=True)  # fmt: skip
    child = None
    try:
        child = int(holder.stdout.readline())
        with pytest.raises(CheckpointError) as refused:
            acquire_run_lock(directory, 0, cpu)
        message = str(refused.value)
        assert f"pid {holder.pid} on {socket.gethostname()}" in message, message
        assert str(directory) in message and "\n" not in message
        assert run_lock_problem(directory) == message  # the pre-flight's probe says the same
        holder.kill()
        holder.wait()
        assert _stat(child) is not None  # its fork lives on, and must not keep the lock
        assert run_lock_problem(directory) is None
        lock = acquire_run_lock(directory, 0, cpu)
        # Read through the lock's own descriptor: closing any other descriptor of the file
        # would drop a POSIX lock (training/run_lock.py).
        assert os.pread(lock.fd, 200, 0).decode().startswith(f"pid {os.getpid()} on ")
        lock.release()
        acquire_run_lock(directory, 0, cpu).release()  # released: free again
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.stdout.close()
        if child is not None and _stat(child) is not None:
            os.kill(child, signal.SIGKILL)

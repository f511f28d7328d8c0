"""Two nodes train exactly like one (issue 14 item 10).

Two torchrun agents on this machine (``python -m training.launcher``, what ``make train``
runs), each with 2 workers, join by c10d rendezvous on 127.0.0.1: a 2 nodes x 2 processes
world. The same config on one node of 4 processes is the reference: same seed, same data, the
same global ranks doing the same work, so every logged loss and every tensor of the final
checkpoint must be bitwise equal. The node that hosts the rendezvous store
is named explicitly (``is_host``), as on a cluster where the endpoint is the first node.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, tiny_overrides
from multiproc import free_port, metrics_records, pretrain_ranks

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
LAUNCHER = [sys.executable, "-m", "training.launcher"]
ENTRY = ["pretrain_gpt.py", "--config", "configs/gpt_tiny.yaml"]


def _overrides(data, run_dir) -> list[str]:
    # DP=2 x TP=2 over the 4 ranks: both a data-parallel and a tensor-parallel group span
    # the two nodes' workers, and a checkpoint is saved and resumed nowhere (one run each).
    return tiny_overrides(
        data, run_dir, "fp32",
        **{"parallel.tensor": 2, "training.train_iters": 6, "checkpoint.save_interval": 0,
           "training.eval_interval": 3, "training.eval_iters": 1},
    )  # fmt: skip


def _checkpoint_tensors(run_dir) -> dict[str, torch.Tensor]:
    from checkpoint.format import reassemble
    from checkpoint.store import latest_checkpoint

    path = latest_checkpoint(run_dir / "checkpoints")
    assert path is not None and path.name == "iter_0000006", path
    return {**reassemble(path, "model"), **reassemble(path, "optimizer")}


@pytest.fixture(scope="module")
def one_node(tiny_data, tmp_path_factory):
    """The reference: the 4 ranks of one node, forked (the workers' own ``pretrain``, without
    four fresh interpreters); the launcher is what the two-node run exercises."""
    run_dir = tmp_path_factory.mktemp("one_node")
    pretrain_ranks(4, [(str(REPO / ENTRY[2]), _overrides(tiny_data, run_dir))])
    return run_dir


@pytest.fixture(scope="module")
def two_nodes(tiny_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two_nodes")
    port = free_port()
    procs = []
    for is_host in (1, 0):
        cmd = [*LAUNCHER, "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "fp8train-two-nodes",
               "--rdzv_conf", f"is_host={is_host}", "--local_addr", "127.0.0.1",
               *ENTRY, *_overrides(tiny_data, run_dir)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outputs = []
    try:
        for proc in procs:
            outputs.append((*proc.communicate(timeout=600), proc.returncode))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node, (out, err, code) in enumerate(outputs):
        assert code == 0, f"node {node}: " + out[-2000:] + err[-3000:]
    return run_dir, outputs


def test_two_nodes_log_the_losses_of_one_node(one_node, two_nodes):
    run_dir, outputs = two_nodes
    one, two = metrics_records(one_node), metrics_records(run_dir)
    assert [r["iteration"] for r in two] == list(range(1, 7))
    keys = ["lm loss", "grad-norm", "learning-rate", "consumed-samples"]
    assert sum("lm loss validation" in r for r in two) == 2  # at iterations 3 and 6
    for a, b in zip(one, two, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, (a, b)
        assert a.get("lm loss validation") == b.get("lm loss validation")
    # One node logs (the one with the last global rank), and both ended normally.
    logged = [i for i, (out, _, _) in enumerate(outputs) if " iteration " in out]
    assert len(logged) == 1, [out[-500:] for out, _, _ in outputs]


def test_two_nodes_save_the_checkpoint_of_one_node(one_node, two_nodes):
    ref, got = _checkpoint_tensors(one_node), _checkpoint_tensors(two_nodes[0])
    assert ref.keys() == got.keys()
    different = [k for k in ref if not torch.equal(ref[k], got[k])]
    assert not different, different[:5]

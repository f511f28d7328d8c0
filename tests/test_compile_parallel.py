"""Compiled layers under the parallel layouts (``training.compile``): tensor parallelism with
sequence parallelism, and the pipeline, on 2 gloo ranks each, train bit for bit like eager.

The ``aot_eager`` backend runs the ATen operations the graph traced, in the traced order, on
the same shapes as eager mode (tests/test_compile.py), so every loss and every weight of the
compiled run must equal the eager run's: a collective lost, duplicated or reordered at a TP
layer's graph breaks (its autograd collectives split the graph: ``fullgraph=False``), or a
pipeline stage whose compiled chunk misses its recv/send, would show here. Every run shares
one process group (later runs add their groups); one step of two micro-batches, so delayed
scaling moves and the kept weight casts are read again. TP takes the cuBLASLt backend's path
(ATen's reference kernel here: the casts write the transposed layouts), PP the emulation's.
"""

from __future__ import annotations

import json

from conftest import REPO, tiny_overrides

from tests.multiproc import end_worker, rank_env, run_ranks

LAYOUTS = {
    "te": [
        "parallel.tensor=2",
        "parallel.sequence_parallel=true",
        "precision.fp8_gemm_backend=scaled_mm",
    ],
    "O2": ["parallel.pipeline=2", "precision.fp8_gemm_backend=emulated"],
}


def _worker(rank: int, world: int, port: int, jobs: list[list[str]], out: str) -> None:
    rank_env(rank, world, port)
    import torch

    from training.config import load_config

    torch.set_num_threads(1)
    for job, overrides in enumerate(jobs):
        cfg = load_config(str(REPO / "configs/gpt_tiny.yaml"), overrides)
        _compare(cfg, rank, f"{out}/job{job}_rank{rank}.json")
    end_worker()


def _compare(cfg, rank: int, path: str) -> None:
    import torch
    import torch._dynamo as dynamo

    from data.sampler import micro_batches
    from training.compile import compile_layers
    from training.setup import build_run
    from training.step import train_step

    results = []
    for compiled in (False, True):
        state = build_run(cfg)
        if compiled:
            dynamo.reset()
            tp = state.groups.tensor is not None
            assert compile_layers(state.model, tensor_parallel=tp, backend="aot_eager") > 0
        data = micro_batches(state.train_ds, 0, cfg.training.micro_batch_size, 0, 1)
        losses = [train_step(state, data, state.plan.micro_batches).loss for _ in range(1)]
        weights = {
            name: t.detach().view(torch.uint8).clone() if t.element_size() == 1 else t.detach()
            for name, t in state.model.state_dict().items()
            if isinstance(t, torch.Tensor)
        }
        results.append((losses, weights))
    (eager_losses, eager), (compiled_losses, compiled) = results
    assert compiled_losses == eager_losses, (compiled_losses, eager_losses)
    differ = [n for n in eager if not torch.equal(eager[n], compiled[n])]
    assert not differ, differ
    with open(path, "w") as f:
        json.dump({"losses": eager_losses, "tensors": len(eager)}, f)


def test_compiled_layers_train_like_eager_under_tp_sp_and_pp(tiny_data, tmp_path):
    jobs = [
        tiny_overrides(tiny_data, tmp_path / level, level) + layout
        for level, layout in LAYOUTS.items()
    ]
    run_ranks(_worker, 2, (jobs, str(tmp_path)), timeout=400, start_method="fork")
    for job in range(len(jobs)):
        for rank in range(2):
            done = json.loads((tmp_path / f"job{job}_rank{rank}.json").read_text())
            assert done["tensors"] > 0 and len(done["losses"]) == 1

"""Sequence parallelism's input all-gather in FP8: bit-identical to gathering FP32 and casting
afterwards (the scale is agreed over the group first), at a quarter of the bytes."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiproc import end_worker

from fp8train.param_state import fp8_grad_slot

LEVELS = ("te", "O2", "O3")


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    from fp8train.convert import lower_linear_weights
    from fp8train.precision import get_recipe
    from models.context import BuildContext
    from models.gpt import GPTConfig, GPTModel
    from parallel.comm_meter import CommMeter
    from parallel.tensor_parallel.layers import ColumnParallelLinear

    cfg = GPTConfig(
        num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=8, vocab_size=64,
        hidden_dropout=0.0, attention_dropout=0.0,
    )  # fmt: skip
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    results = {}
    for level in LEVELS:
        runs = []
        for fp8_gather in (False, True):
            ColumnParallelLinear.fp8_gather = fp8_gather
            torch.manual_seed(0)
            ctx = BuildContext(get_recipe(level), tp_group=dist.group.WORLD, sequence_parallel=True)
            model = GPTModel(cfg, ctx)
            lower_linear_weights(model)
            meter = CommMeter()
            for m in model.modules():
                if isinstance(m, ColumnParallelLinear):
                    m.meter = meter
            for _ in range(2):  # two micro-batches: delayed scaling histories advance
                loss = model(tokens, labels=tokens).mean()
                loss.backward()
            grads = [
                fp8_grad_slot(p).dequantize() if p.grad is None else p.grad
                for p in model.parameters()
            ]
            forward_gather = {
                dtype: n for (name, _, dtype), n in meter.step_detail().items()
                if name == "tp_all_gather"
            }  # fmt: skip
            runs.append((loss.item(), grads, forward_gather))
        same = runs[0][0] == runs[1][0] and all(
            torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1])
        )
        results[level] = {"identical": same, "fp32": runs[0][2], "fp8": runs[1][2]}
    ColumnParallelLinear.fp8_gather = True
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    end_worker()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8_gather")
    mp.start_processes(
        _worker, args=(str(out / "init"), str(out)), nprocs=2, start_method="fork"
    )  # forked: inherits the imports
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("level", LEVELS)
def test_fp8_gather_is_exact_and_one_byte_per_element(results, level):
    r = results[level]
    assert r["identical"]
    # Only the column layers carry the meter here: their input gathers move FP32 bytes in one
    # path and FP8 bytes (uint8 on the wire), a quarter as many, in the other.
    assert "float32" not in r["fp8"]
    assert r["fp8"]["uint8"] * 4 == r["fp32"]["float32"]

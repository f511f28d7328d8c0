"""A skipped step under the distributed optimizer (ZeRO-1, 2 gloo ranks): one rank's
non-finite gradient makes every rank skip (the norm is summed over the ranks' owned gradients)
and no rank changes a bit of its weights (all-gathered or not), masters, moments, scales or
step counters; the first non-finite gradient is named with its rank. The single-process
cases are in tests/test_skipped_step.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from conftest import tiny_overrides

from tests.multiproc import REPO, rank_env, run_ranks

CONFIG = str(REPO / "configs/gpt_tiny.yaml")
# (level, fused): te with the CPU's foreach AdamW and bf16 (FP32 masters) with the fused one
# a CUDA run builds; O2 and O3 with LowBitAdamW.
CASES = [("te", False), ("bf16", True), ("O2", False), ("O3", False)]


def _worker(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    import training.optimizer
    from data.sampler import micro_batches
    from fp8train.param_state import fp8_grad_slot
    from parallel.topology import destroy_distributed
    from tests.test_skipped_step import _state_bits
    from training.config import load_config
    from training.setup import build_run
    from training.step import _nonfinite_name, train_step

    fused_adamw = training.optimizer._fused_adamw
    out = {}
    for level, fused, overrides in cases:
        training.optimizer._fused_adamw = (lambda params: True) if fused else fused_adamw
        state = build_run(load_config(CONFIG, overrides))
        opt, topo = state.optimizer, state.groups.topology
        data = micro_batches(state.train_ds, 0, 2, topo.dp_rank, topo.data)
        train_step(state, data, state.plan.micro_batches)  # the states exist from here
        before = _state_bits(state)
        names = opt.stepped_names()
        plain = [n for n, p in zip(names, opt.step_params) if fp8_grad_slot(p) is None]
        poisoned = [plain[-1]] if rank == 0 else []

        def hook(s):
            if rank == 0:  # this rank's last owned FP32 gradient
                s.optimizer.grads()[-1].view(-1)[0] = math.inf

        stats = train_step(state, data, state.plan.micro_batches, grad_hook=hook)
        after = _state_bits(state)
        first = int(stats.first_nonfinite)
        out[f"{level}{'-fused' * fused}"] = {
            "distributed": opt.distributed,
            "skips_on_device": opt.skips_on_device,
            "skipped": stats.skipped,
            "changed": [k for k in before if not torch.equal(before[k], after[k])],
            "steps": sum(k.endswith(":step") for k in before),
            "first": names[first] if first >= 0 else None,
            "poisoned": poisoned,
            "named": _nonfinite_name(state, first),
            "next_skipped": train_step(state, data, state.plan.micro_batches).skipped,
        }
        del state
    training.optimizer._fused_adamw = fused_adamw
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    destroy_distributed()


def test_one_ranks_nonfinite_gradient_skips_every_rank_bit_for_bit(tiny_data, tmp_path):
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    cases = [
        (level, fused, tiny_overrides(tiny_data, tmp_path / f"{level}{fused}", level,
                                      **{"optimizer.distributed": "true"}))
        for level, fused in CASES
    ]  # fmt: skip
    run_ranks(_worker, 2, (cases, str(tmp_path)), start_method="fork")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(CASES)
    for case in ranks[0]:
        r0, r1 = ranks[0][case], ranks[1][case]
        assert r0["distributed"] and r1["distributed"], case
        assert r0["skips_on_device"] == (case != "te"), case
        assert r0["skipped"] and r1["skipped"], case
        assert not r0["changed"] and not r1["changed"], (case, r0["changed"], r1["changed"])
        assert r0["steps"] and r1["steps"], case  # each rank holds (and kept) step counters
        assert r0["first"] == r0["poisoned"][0] and r1["first"] is None, case
        assert r0["named"] == r1["named"] == f"{r0['poisoned'][0]} (rank 0)", case
        assert not r0["next_skipped"] and not r1["next_skipped"], case

"""The whole GPT under tensor (and sequence) parallelism against the single-rank model:
logits, loss and every parameter gradient, gathered from the shards, at fp32 (to FP32
rounding), on 2 real gloo ranks. Swiglu + GQA + RoPE + untied head and GPT-2 style both."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = {
    "gpt2": dict(position_embedding_type="learned_absolute"),
    "llama": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        add_bias_linear=False,
    ),
}


def _config(case):
    from models.gpt import GPTConfig

    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=8,
        vocab_size=64,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return GPTConfig(**base, **CASES[case])


def _full_grads(model) -> dict[str, torch.Tensor]:
    """Every gradient as the single-rank model would have it, gathered from the shards."""
    from parallel.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        gather_full,
    )

    out = {}
    group = model.tp_group
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            w = module.weight.grad
            out[f"{name}.weight"] = gather_full(w, module.partition_dim, group, module.blocks)
            if module.bias is not None:
                b = module.bias.grad
                if isinstance(module, ColumnParallelLinear):
                    b = gather_full(b, 0, group, module.blocks)
                out[f"{name}.bias"] = b
        elif isinstance(module, VocabParallelEmbedding):
            out[f"{name}.weight"] = gather_full(module.weight.grad, 0, group)
    for name, p in model.named_parameters():
        key = name.replace(".linear.weight", ".weight")
        if key not in out:
            out[key] = p.grad
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
        timeout=timedelta(seconds=60),
    )  # fmt: skip
    from fp8train.precision import get_recipe
    from models.gpt import GPTModel

    results = {}
    for case in CASES:
        cfg = _config(case)
        tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
        torch.manual_seed(0)
        ref = GPTModel(cfg, get_recipe("fp32"))
        ref_logits = ref(tokens)
        ref(tokens, labels=tokens).mean().backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}
        for sp in (False, True):
            torch.manual_seed(0)
            model = GPTModel(
                cfg, get_recipe("fp32"), tp_group=dist.group.WORLD, sequence_parallel=sp
            )
            logits = model(tokens)
            model(tokens, labels=tokens).mean().backward()
            grads = _full_grads(model)
            worst = max(
                ((grads[n] - g).norm() / g.norm().clamp(min=1e-12)).item()
                for n, g in ref_grads.items()
            )
            results[f"{case}/sp={sp}"] = {
                "logits": ((logits - ref_logits).abs().max() / ref_logits.abs().max()).item(),
                "grads": worst,
                "names": sorted(grads) == sorted(ref_grads),
            }
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_grads")
    mp.spawn(_worker, args=(str(out / "init"), str(out)), nprocs=2, join=True)
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("case", [f"{c}/sp={sp}" for c in CASES for sp in (False, True)])
def test_tp2_logits_and_every_gradient_equal_tp1(results, case):
    r = results[case]
    assert r["names"]  # every parameter of the single-rank model is accounted for
    assert r["logits"] < 1e-5
    assert r["grads"] < 1e-5

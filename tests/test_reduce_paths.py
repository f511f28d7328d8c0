"""The distributed optimizer's two FP32 gradient reduce-scatters and its weight gather, on 3
real gloo ranks.

- ``GradBuffers(native=False)`` (gloo's default): all-to-all, then an FP32 sum in rank order,
  so each owned gradient is bitwise ``((g0 + g1) + g2) / 3`` computed the same way here.
- ``GradBuffers(native=True)`` (nccl's default, forced here on gloo, which has a reduce-scatter
  since torch 2.13): the backend's reduce-scatter in place in the buffer; equal owner ranges
  take the single-tensor form, uneven ones the list form. The backend adds in its own order,
  so the bar is the FP32 rounding of a 3-term sum: 2 ulps of the largest term, relative to the
  float64 mean.
- ``ParamGather``: after it, every rank holds every owner's weights bitwise, FP32 and FP8 with
  their ``scale_inv``; its meter records the broadcast byte model per storage dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.multiproc import end_worker, rank_env, run_ranks

WORLD = 3
# Parameter sizes and owners: rank 0 owns 7 + 5, rank 1 owns 9, rank 2 owns 3 + 2 elements
# (uneven), or every rank owns 6 (equal).
LAYOUTS = {
    "uneven": ([7, 9, 3, 5, 2], [0, 1, 2, 0, 2]),
    "equal": ([6, 6, 4, 2], [0, 1, 2, 2]),
}


def _grads(rank: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(n, generator=gen) * (1 + 10 * i) for i, n in enumerate(sizes)]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from parallel.comm_meter import CommMeter
    from parallel.distributed_optimizer import ParamGather
    from parallel.grad_buffer import GradBuffers

    rank_env(rank, world, port)
    dist.init_process_group("gloo")
    results = {}
    for name, (sizes, owners) in LAYOUTS.items():
        for native in (False, True):
            params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
            buffers = GradBuffers(params, dist.group.WORLD, owners=owners, native=native)
            buffers.start_step(1)
            for p, g in zip(params, _grads(rank, sizes)):
                (p * g).sum().backward()  # the buffers' hook moves p.grad = g into main_grad
            buffers.finish()
            mine = {i: p.main_grad.tolist() for i, p in enumerate(params) if owners[i] == rank}
            results[f"{name}_native{native}"] = mine
    # The weight gather: FP32 and FP8 (with scale_inv) parameters, each rank filling its own.
    from fp8train.param_state import scale_inv_of, set_scale_inv

    sizes, owners = LAYOUTS["uneven"]
    params = []
    for i, n in enumerate(sizes):
        dtype = torch.float8_e4m3fn if i % 2 else torch.float32
        p = torch.nn.Parameter(torch.zeros(n).to(dtype), requires_grad=False)
        if i % 2:
            set_scale_inv(p, torch.ones(()))
        params.append(p)
    for i, p in enumerate(params):
        if owners[i] == rank:
            p.data.copy_((torch.arange(sizes[i]) + 10.0 * i).to(p.dtype))
            if scale_inv_of(p) is not None:
                scale_inv_of(p).fill_(0.5 + i)
    meter = CommMeter()
    ParamGather(params, owners, dist.group.WORLD, meter).gather()
    results["gathered"] = [p.float().tolist() for p in params]
    results["scale_inv"] = {i: scale_inv_of(p).item() for i, p in enumerate(params) if i % 2}
    results["meter"] = meter.step_summary()
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    end_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("reduce_paths")
    run_ranks(_worker, WORLD, (str(out),), timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gloo_path_is_the_rank_order_sum_bitwise(ranks, layout):
    """Same operations in the same order as the reference (FP32 adds in rank order, one
    division): bitwise."""
    sizes, owners = LAYOUTS[layout]
    grads = [_grads(r, sizes) for r in range(WORLD)]
    for i, owner in enumerate(owners):
        want = ((grads[0][i] + grads[1][i]) + grads[2][i]) / WORLD
        got = torch.tensor(ranks[owner][f"{layout}_nativeFalse"][str(i)])
        assert torch.equal(got, want), (layout, i)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_native_path_matches_the_float64_mean(ranks, layout):
    sizes, owners = LAYOUTS[layout]
    grads = [_grads(r, sizes) for r in range(WORLD)]
    for i, owner in enumerate(owners):
        terms = torch.stack([g[i].double() for g in grads])
        want = terms.mean(0)
        bar = 2 * torch.finfo(torch.float32).eps * terms.abs().max(0).values
        got = torch.tensor(ranks[owner][f"{layout}_nativeTrue"][str(i)], dtype=torch.float64)
        assert ((got - want).abs() <= bar).all(), (layout, i, (got - want).abs().max())


def test_gather_gives_every_rank_every_owners_weights(ranks):
    sizes, owners = LAYOUTS["uneven"]
    for rank in range(WORLD):
        for i, n in enumerate(sizes):
            want = (torch.arange(n) + 10.0 * i).to(
                torch.float8_e4m3fn if i % 2 else torch.float32
            ).float()  # fmt: skip
            assert torch.equal(torch.tensor(ranks[rank]["gathered"][i]), want), (rank, i)
        assert ranks[rank]["scale_inv"] == {"1": 1.5, "3": 3.5}


def _broadcast_bytes(n: int) -> int:
    return ((WORLD - 1) * n + WORLD // 2) // WORLD  # (W-1)/W of n, half rounded up


def test_gather_meter_is_the_broadcast_model(ranks):
    """Per rank (W-1)/W of each owner's bytes: FP32 pieces 4 bytes per element, FP8 1 byte
    plus 4 per scale, rounded per owner and dtype as the meter records them."""
    sizes, owners = LAYOUTS["uneven"]
    want: dict[str, int] = {"all_gather_params_float32": 0, "all_gather_params_fp8": 0}
    for r in range(WORLD):
        for fp8 in (False, True):
            mine = [i for i, o in enumerate(owners) if o == r and bool(i % 2) == fp8]
            if not mine:
                continue
            nbytes = sum(sizes[i] * (1 if fp8 else 4) for i in mine)
            name = "all_gather_params_" + ("fp8" if fp8 else "float32")
            want[name] += _broadcast_bytes(nbytes)
            if fp8:
                want[name] += _broadcast_bytes(4 * len(mine))
    for rank in range(WORLD):
        assert ranks[rank]["meter"] == want, rank

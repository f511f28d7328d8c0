"""The tensor-parallel RNG tracker: (1) over two real gloo ranks, dropout masks drawn inside
``fork()`` differ across TP ranks while masks outside agree; (2) a fork block leaves the
default stream exactly as if it never ran; (3) ``get_states``/``set_states`` (through a real
safetensors file) resume the tracked stream bit for bit; (4) consecutive forks continue the
tracked stream instead of restarting it. Plus the guards: unknown names, duplicate seeds,
re-entrant forks, restore on error.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from multiproc import end_worker
from safetensors.torch import load_file, save_file

from parallel.tensor_parallel.random import (
    MODEL_PARALLEL_RNG,
    TP_SEED_OFFSET,
    RNGStatesTracker,
    get_tracker,
    model_parallel_seed,
)

SEED, SHAPE = 1234, (32, 64)


def _mask() -> torch.Tensor:
    """A dropout mask from the default generator, as a model's dropout would draw it."""
    return F.dropout(torch.ones(SHAPE), p=0.5, training=True) != 0


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    tracker = model_parallel_seed(SEED, rank, "cpu", tracker=RNGStatesTracker())
    # replicated -> sharded (e.g. attention on local heads) -> replicated again
    masks = {"before": _mask()}
    with tracker.fork():
        masks["inside"] = _mask()
    masks["after"] = _mask()
    with tracker.fork():
        masks["inside2"] = _mask()
    gathered = {}
    for key, mask in masks.items():
        parts = [torch.empty_like(mask, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(parts, mask.to(torch.uint8))  # gloo: no bool all_gather
        gathered[key] = [p.bool() for p in parts]
    if rank == 0:
        torch.save(gathered, os.path.join(out_dir, "masks.pt"))
    end_worker()


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp_random")
    t0 = time.perf_counter()
    mp.start_processes(
        _worker, args=(2, str(out / "init"), str(out)), nprocs=2, start_method="fork"
    )  # forked: inherits the imports
    print(f"\nTP=2 dropout masks: spawn + draws {time.perf_counter() - t0:.1f} s")
    return torch.load(out / "masks.pt")


@pytest.mark.parametrize("key", ["before", "after"])
def test_replicated_dropout_is_identical_across_tp_ranks(masks, key):
    m0, m1 = masks[key]
    assert torch.equal(m0, m1)
    assert 0.3 < m0.float().mean() < 0.7  # a real p=0.5 mask, not all-kept


@pytest.mark.parametrize("key", ["inside", "inside2"])
def test_sharded_dropout_differs_across_tp_ranks(masks, key):
    m0, m1 = masks[key]
    # Independent p=0.5 masks agree on about half the entries; equal ones would agree on all.
    assert 0.3 < (m0 == m1).float().mean() < 0.7


def test_fork_does_not_perturb_default_stream():
    tracker = RNGStatesTracker()
    tracker.add("tp", 7)
    torch.manual_seed(0)
    want = [_mask(), _mask()]
    torch.manual_seed(0)
    got = [_mask()]
    with tracker.fork("tp"):
        inside = _mask()
        torch.randn(1000)  # more draws in the block must not matter either
    got.append(_mask())
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert not torch.equal(inside, want[1])


def test_fork_restores_default_stream_on_error():
    tracker = RNGStatesTracker()
    tracker.add("tp", 7)
    torch.manual_seed(0)
    want = torch.rand(8)
    torch.manual_seed(0)
    with pytest.raises(ZeroDivisionError), tracker.fork("tp"):
        torch.rand(8)
        _ = 1 / 0
    assert torch.equal(torch.rand(8), want)


def test_consecutive_forks_continue_the_stream():
    tracker = model_parallel_seed(SEED, 1, tracker=RNGStatesTracker())
    with tracker.fork():
        a = torch.rand(16)
    torch.rand(5)  # default-stream draws between forks do not leak into the tracked one
    with tracker.fork():
        b = torch.rand(16)
    ref = torch.Generator().manual_seed(SEED + TP_SEED_OFFSET + 1)
    assert torch.equal(torch.cat([a, b]), torch.rand(32, generator=ref))


def test_states_round_trip_through_safetensors(tmp_path):
    tracker = model_parallel_seed(SEED, 0, tracker=RNGStatesTracker())
    with tracker.fork():
        torch.rand(10)  # advance past the seed: resume must not mean restart
    states = tracker.get_states()
    assert all(v.dtype == torch.uint8 and v.device.type == "cpu" for v in states.values())
    save_file(states, str(tmp_path / "rng.safetensors"))
    with tracker.fork():
        want = [_mask(), torch.rand(4)]

    resumed = RNGStatesTracker()
    resumed.set_states(load_file(str(tmp_path / "rng.safetensors")))
    assert resumed.names() == [MODEL_PARALLEL_RNG]
    with resumed.fork():
        got = [_mask(), torch.rand(4)]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_get_states_returns_copies():
    tracker = RNGStatesTracker()
    tracker.add("tp", 3)
    states = tracker.get_states()
    with tracker.fork("tp"):
        torch.rand(4)
    assert not torch.equal(states["tp.cpu"], tracker.get_states()["tp.cpu"])


def test_model_parallel_seed_seeds_default_generator():
    model_parallel_seed(SEED, 3, tracker=RNGStatesTracker())
    assert torch.equal(torch.rand(8), torch.rand(8, generator=torch.Generator().manual_seed(SEED)))


def test_guards():
    tracker = RNGStatesTracker()
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)
    with pytest.raises(ValueError, match="seed 1"):
        tracker.add("b", 1)
    with pytest.raises(KeyError), tracker.fork("missing"):
        pass
    with pytest.raises(RuntimeError, match="already forked"), tracker.fork("a"):
        with tracker.fork("a"):
            pass
    with pytest.raises(ValueError, match="not RNG tracker keys"):
        tracker.set_states({"a": torch.get_rng_state()})
    with pytest.raises(ValueError, match="uint8"):
        tracker.set_states({"a.cpu": torch.zeros(5056)})
    tracker.reset()
    assert tracker.names() == []
    tracker.add("a", 1)  # reset forgets seeds as well


def test_default_tracker_is_shared():
    assert get_tracker() is get_tracker()
    tracker = model_parallel_seed(SEED, 0)
    assert tracker is get_tracker() and tracker.names() == [MODEL_PARALLEL_RNG]
    get_tracker().reset()  # leave the process-wide instance as found

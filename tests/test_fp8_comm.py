"""FP8 gradient averaging over real gloo groups (2 and 4 ranks), checked against references.

One spawn per world size runs every case and saves each rank's inputs and outputs; the tests
then check them in this process in float64 and with ml_dtypes, independently of the code under
test: (i) the FP32 intermediate is the float64 average to FP32 rounding, (ii) the FP8 result
is bitwise the E4M3 rounding of it with the max-amax scale, identical on every rank, (iii) wire
bytes per element, (iv) NaN/inf on one rank reaches every rank, (v) odd shapes and totals,
(vi) the FP32 path.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiproc import end_worker

from fp8train.formats import E4M3
from fp8train.low_precision import Fp8GradSlot
from fp8train.scaling import compute_scale
from parallel.comm_meter import CommMeter, wire_bytes
from parallel.fp8_comm import (
    _layout,
    allreduce_fp8_grads,
    allreduce_fp32_grads,
    reduce_scatter_fp8,
)

# Total 169: odd, so never a multiple of W; (1,) is smaller than any chunk.
MIXED = [(3, 5), (7,), (1,), (13, 11), (3,)]
# ~1M elements, shaped like a small transformer layer's weights.
BIG = [(1024, 768), (768, 256), (768, 8), (333,)]
FP32_SHAPES = [(5, 3), (17,), (4, 4, 2)]
# Block-scaled slots (row/block FP8 granularity) beside a per-tensor one: 128x128 blocks with
# partial last blocks, per-row scales, and a grid of one block row.
BLOCKED = [(300, 200), (7,), (13, 11), (130, 5)]
FP8_CASES = {"mixed": MIXED, "big": BIG, "overflow": MIXED, "blocked": BLOCKED}
BLOCKS = {"blocked": [(128, 128), None, (1, 11), (128, 128)]}


def _blocks(case: str) -> list:
    return BLOCKS.get(case, [None] * len(FP8_CASES[case]))


def _specs(case: str) -> tuple:
    """The layout's view of a case's slots (parallel.fp8_comm.SlotSpec)."""
    out = []
    for shape, block in zip(FP8_CASES[case], _blocks(case)):
        n = int(np.prod(shape))
        out.append((n, 0, 0, 0, 0) if block is None else (n, *shape, *block))
    return tuple(out)


def _grads(case: str, shapes, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + len(case))
    out = []
    for i, shape in enumerate(shapes):
        # Magnitudes differ across tensors *and* ranks, so the senders' scales all differ.
        mag = 1e-3 if case == "big" else 2.0 ** (2 * i - 3 * rank)
        grad = torch.randn(shape, generator=gen) * mag
        if case == "blocked" and len(shape) == 2:  # rows 2**0 .. 2**-12 apart: blocks matter
            grad *= 2.0 ** -(torch.arange(shape[0]) % 13).float()[:, None]
        out.append(grad)
    return out


def _slots(case: str, rank: int, world: int) -> list[Fp8GradSlot]:
    slots = [Fp8GradSlot(shape, block=b) for shape, b in zip(FP8_CASES[case], _blocks(case))]
    for i, (slot, grad) in enumerate(zip(slots, _grads(case, FP8_CASES[case], rank))):
        if case == "mixed" and i == 2 and rank == 0:
            continue  # an untouched slot: zeros, scale_inv 1, amax 0
        if case == "overflow" and i == 3 and rank == world - 1:
            grad.view(-1)[5] = float("nan")
        if case == "overflow" and i == 0 and rank == 0:
            grad.view(-1)[0] = float("inf")
        slot.accumulate(grad)
        slot.accumulate(grad * 0.5)  # two micro-batches, as in training
    return slots


def _snapshot(slots) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Flat FP8 bytes, scale_inv and amax (one per scale unit) of each slot."""
    out = []
    for s in slots:
        assert s.data.dtype == torch.float8_e4m3fn
        flat = [s.data.view(torch.uint8), s.scale_inv, s.amax]
        out.append(tuple(t.reshape(-1).numpy().copy() for t in flat))
    return out


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    group = dist.group.WORLD
    results = {}
    for case in FP8_CASES:
        slots = _slots(case, rank, world)
        inputs = _snapshot(slots)
        rs = reduce_scatter_fp8(slots, group)  # the FP32 intermediate alone; slots untouched
        meter = CommMeter()
        t0 = time.perf_counter()
        found_inf = allreduce_fp8_grads(slots, group, meter)
        results[case] = {
            "inputs": inputs,
            "chunk": rs.chunk.numpy().copy(),
            "start": rs.start,
            "outputs": _snapshot(slots),
            "shapes": [tuple(sl.shape) for sl in slots],
            "found_inf": bool(found_inf),
            "meter": meter.step_summary(),
            "seconds": time.perf_counter() - t0,
        }
    tensors = _grads("fp32", FP32_SHAPES, rank)
    inputs = [t.numpy().copy() for t in tensors]
    meter = CommMeter()
    allreduce_fp32_grads(tensors, group, meter)
    results["fp32"] = {
        "inputs": inputs,
        "outputs": [t.numpy().copy() for t in tensors],
        "meter": meter.step_summary(),
    }
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_worker()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"W{w}")
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"fp8_comm_w{world}")
    t0 = time.perf_counter()
    mp.start_processes(
        _worker, args=(world, str(out / "init"), str(out)), nprocs=world, start_method="fork"
    )  # forked: inherits the imports
    seconds = time.perf_counter() - t0
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
    print(f"\nW={world}: spawn + all cases {seconds:.1f} s")
    return world, ranks


def _per_element(case: str, per_unit: np.ndarray) -> np.ndarray:
    return per_unit[np.array(_unit_of_each_element(_specs(case)), dtype=np.int64)]


def _dequant64(case: str, inputs) -> np.ndarray:
    """One rank's slots as a flat float64 vector (exact: 4-bit x 24-bit mantissas fit)."""
    data = np.concatenate([d.view(ml_dtypes.float8_e4m3fn) for d, _, _ in inputs])
    sinv = np.concatenate([s for _, s, _ in inputs]).astype(np.float32).astype(np.float64)
    return data.astype(np.float64) * _per_element(case, sinv)


def _reference_scale(amax: np.ndarray) -> np.ndarray:
    """The project's compute_scale (unit-tested on its own) of the numpy max-over-ranks amax.

    Not re-derived here: the scale's formula is not what is under test.
    """
    return compute_scale(torch.from_numpy(amax), E4M3).numpy()


def _check_average(world, ranks, case):
    """(i) and (ii) for one case; returns the float64 average."""
    terms = np.stack([_dequant64(case, r[case]["inputs"]) for r in ranks])  # [W, N]
    avg = terms.mean(axis=0)
    mag = np.abs(terms).mean(axis=0)
    n = avg.size

    # (i) FP32 chunk of each rank == float64 average, to FP32 rounding of the W terms.
    chunks = []
    for r in ranks:
        chunk, start = r[case]["chunk"], r[case]["start"]
        assert chunk.dtype == np.float32
        ref = np.zeros(chunk.size)
        valid = max(0, min(n - start, chunk.size))
        ref[:valid] = avg[start : start + valid]
        tol = 1e-6 * np.concatenate([mag[start : start + valid], np.zeros(chunk.size - valid)])
        finite = np.isfinite(ref)
        assert np.all(np.abs(chunk[finite] - ref[finite]) <= tol[finite] + 1e-30)
        chunks.append(chunk)
    full_chunk = np.concatenate(chunks)[:n]

    # (ii) final bytes == E4M3(clip(chunk * scale)) with the shared max-over-ranks amax.
    # One amax and scale per unit: per tensor, or per block of a block-scaled slot.
    amax_all = np.array(
        [np.concatenate([a for _, _, a in r[case]["inputs"]]) for r in ranks], dtype=np.float32
    )
    amax_all = np.where(np.isnan(amax_all), np.float32(np.inf), amax_all)
    amax = amax_all.max(axis=0)
    scale = _reference_scale(amax)
    scaled = np.clip(full_chunk * _per_element(case, scale), -448.0, 448.0).astype(np.float32)
    expected = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    for r in ranks:
        out = r[case]["outputs"]
        got = np.concatenate([data for data, _, _ in out])
        assert np.array_equal(got, expected), f"{(got != expected).sum()} bytes differ"
        want_sinv = (1.0 / torch.from_numpy(scale)).numpy()
        np.testing.assert_array_equal(np.concatenate([s for _, s, _ in out]), want_sinv)
        np.testing.assert_array_equal(np.concatenate([a for _, _, a in out]), amax)
    return avg, amax


def test_fp32_intermediate_and_fp8_result_match_references(run):
    world, ranks = run
    # (i), (ii), (v): odd total, a 1-element and a zero slot; block-scaled slots.
    for case in ("mixed", "big", "blocked"):
        avg, amax = _check_average(world, ranks, case)
        assert np.isfinite(amax).all()
        assert not any(r[case]["found_inf"] for r in ranks)
        # One E4M3 rounding in total: within half an ulp (2**-4 relative) of the exact average.
        out = ranks[0][case]["outputs"]
        deq = _dequant64(case, out)
        sinv = _per_element(case, np.concatenate([s for _, s, _ in out]).astype(np.float64))
        err = np.abs(deq - avg)
        assert np.all(err <= 2.0**-4 * np.abs(avg) + 2.0**-10 * sinv + 1e-6 * np.abs(avg))


def test_wire_bytes_per_element(run):
    world, ranks = run
    n = sum(int(np.prod(s)) for s in BIG)
    padded = -(-n // world) * world
    for r in ranks:
        meter = r["big"]["meter"]
        # The reduce-scatter carries its scale/amax all-gather (8 bytes per tensor) as overhead.
        meta = (world - 1) * 8 * len(BIG)
        assert meter["reduce_scatter_fp8"] == (world - 1) * padded // world + meta
        assert meter["all_gather_fp8"] == (world - 1) * padded // world
        # 2 (W-1)/W bytes: 1.0 at W=2, 1.5 at W=4 (FP32 all-reduce: 4.0 and 6.0).
        assert sum(meter.values()) / n <= 2 * (world - 1) / world + 0.02
    per_element = sum(ranks[0]["big"]["meter"].values()) / n
    slowest = max(r["big"]["seconds"] for r in ranks)
    print(f"W={world}: {per_element:.6f} wire bytes/element, {slowest * 1e3:.0f} ms for {n}")


def test_overflow_on_one_rank_reaches_every_rank(run):
    world, ranks = run
    _, amax = _check_average(world, ranks, "overflow")  # the finite tensors stay exact
    assert np.isinf(amax[0]) and np.isinf(amax[3])  # inf on rank 0, NaN on rank W-1
    assert np.isfinite(np.delete(amax, [0, 3])).all()
    for r in ranks:
        assert r["overflow"]["found_inf"]
        out_amax = [a.item() for _, _, a in r["overflow"]["outputs"]]
        assert out_amax[0] == float("inf") and out_amax[3] == float("inf")


def test_fp32_path_averages(run):
    world, ranks = run
    ref = [
        np.mean([r["fp32"]["inputs"][i].astype(np.float64) for r in ranks], axis=0)
        for i in range(len(FP32_SHAPES))
    ]
    for r in ranks:
        for got, want in zip(r["fp32"]["outputs"], ref):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        n = sum(int(np.prod(s)) for s in FP32_SHAPES)
        assert r["fp32"]["meter"] == {"all_reduce_fp32": wire_bytes("all_reduce", 4 * n, world)}
    for i in range(len(FP32_SHAPES)):  # identical on every rank
        for r in ranks[1:]:
            np.testing.assert_array_equal(r["fp32"]["outputs"][i], ranks[0]["fp32"]["outputs"][i])


# ---- single-process units ---------------------------------------------------------------


def test_wire_byte_model():
    assert wire_bytes("all_reduce", 1000, 4) == 1500
    assert wire_bytes("all_to_all", 1000, 4) == 750
    assert wire_bytes("all_gather", 1000, 2) == 500
    assert wire_bytes("reduce_scatter", 1000, 1) == 0
    with pytest.raises(ValueError):
        wire_bytes("gossip", 10, 2)


def test_comm_meter_steps_and_totals():
    meter = CommMeter()
    meter.record("reduce_scatter_fp8", "data", torch.uint8, 100)
    meter.record_collective("all_gather_fp8", "all_gather", "data", torch.uint8, 200, 2)
    meter.record("reduce_scatter_fp8", "data", torch.uint8, 50)
    assert meter.step_summary() == {"reduce_scatter_fp8": 150, "all_gather_fp8": 100}
    assert meter.step_calls() == {"reduce_scatter_fp8": 2, "all_gather_fp8": 1}
    assert meter.wire_bytes_per_grad_element(250) == 1.0
    assert meter.wire_bytes_per_grad_element(250, names=["all_gather_fp8"]) == 0.4
    meter.reset_step()
    assert meter.step_summary() == {} and meter.step_bytes == 0
    assert meter.total_bytes == 250
    assert meter.totals()[("reduce_scatter_fp8", "data", "uint8")] == 150


def _unit_of_each_element(specs) -> list[int]:
    """The scale unit of every element of the flat buffer, element by element (the rule the
    layout's runs must reproduce): one unit per slot, or (r // br) * ceil(C/bc) + c // bc."""
    units, base = [], 0
    for n, rows, cols, br, bc in specs:
        if br == 0:
            units += [base] * n
            base += 1
            continue
        cb = -(-cols // bc)
        units += [base + (r // br) * cb + c // bc for r in range(rows) for c in range(cols)]
        base += -(-rows // br) * cb
    return units


def test_layout_segments_cover_each_chunk():
    # Per-tensor slots and block-scaled ones (partial blocks, per-row blocks) mixed, cut into
    # equal chunks for several world sizes: every element gets its own unit, padding the last.
    specs = (
        (15, 0, 0, 0, 0),
        (35, 5, 7, 2, 3),
        (1, 0, 0, 0, 0),
        (143, 11, 13, 1, 13),
        (3, 0, 0, 0, 0),
        (260, 20, 13, 16, 8),
    )
    want = _unit_of_each_element(specs)
    units = max(want) + 1
    for world in (1, 2, 3, 4, 7):
        covered = []
        for rank in range(world):
            lay = _layout(specs, world, rank)
            assert lay.units == units
            assert int(lay.seg_lengths.sum()) == lay.chunk
            covered.append(lay.per_element(torch.arange(units + 1).float()))
        flat = torch.cat(covered)
        assert flat[: len(want)].tolist() == want
        assert torch.all(flat[len(want) :] == units)  # padding


def test_no_group_is_a_noop():
    slots = _slots("mixed", 1, 2)
    before = _snapshot(slots)
    found_inf = allreduce_fp8_grads(slots, None)
    assert not bool(found_inf)
    for (d0, s0, a0), (d1, s1, a1) in zip(before, _snapshot(slots)):
        assert np.array_equal(d0, d1) and np.array_equal(s0, s1) and np.array_equal(a0, a1)
    tensors = [torch.ones(3)]
    allreduce_fp32_grads(tensors, None)
    assert torch.equal(tensors[0], torch.ones(3))

"""FP8 GEMM backends against float64 and against each other; backend selection."""

from __future__ import annotations

import pytest
import torch

from fp8train import gemm_backend
from fp8train.formats import E4M3, E5M2
from fp8train.gemm import BACKENDS, fp8_gemm, scaled_mm_available
from fp8train.gemm_backend import measure_gemm_backends, select_gemm_backend, set_gemm_backend
from fp8train.tensor import Float8Tensor

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh_selection(monkeypatch, tmp_path):
    monkeypatch.delenv(gemm_backend.ENV_VAR, raising=False)
    # A private per-machine cache: "auto" races once per machine and stores the pick there.
    monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(tmp_path / "machine_cache"))
    monkeypatch.setattr(gemm_backend, "_auto_choice", {})
    set_gemm_backend(None)
    yield
    set_gemm_backend(None)


def operand(shape, fmt, seed, scale) -> Float8Tensor:
    gen = torch.Generator().manual_seed(seed)
    return Float8Tensor.quantize(torch.randn(*shape, generator=gen), fmt, scale)


def ref64(a: Float8Tensor, b: Float8Tensor) -> torch.Tensor:
    """float64 product of the exact FP8 values times both scale_inv."""
    a64 = a.data.double() * a.scale_inv.double()
    b64 = b.data.double() * b.scale_inv.double()
    return a64 @ b64.t()


SHAPES = [(64, 128, 32), (37, 50, 23), (1, 16, 16), (130, 7, 3)]  # aligned and not
FORMAT_PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]


def backends():
    return [b for b in BACKENDS if b != "scaled_mm" or scaled_mm_available(CPU)]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fa,fb", FORMAT_PAIRS, ids=lambda f: f.name)
def test_matches_float64(backend, m, k, n, fa, fb):
    a = operand((m, k), fa, 0, 40.0)
    b = operand((n, k), fb, 1, 3.3)
    got = fp8_gemm(a, b, backend=backend)
    assert got.shape == (m, n) and got.dtype == torch.float32
    ref = ref64(a, b)
    # fp32 accumulation of k exact products: error ~ k * eps32 * sum|terms|.
    bound = k * 2**-23 * (a.dequantize().double().abs() @ b.dequantize().double().abs().t())
    assert ((got.double() - ref).abs() <= bound + 1e-30).all()


@pytest.mark.skipif(not scaled_mm_available(CPU), reason="torch._scaled_mm missing on CPU")
@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("fa,fb", FORMAT_PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_backends_agree(m, k, n, fa, fb, out_dtype):
    a = operand((m, k), fa, 2, 17.0)
    b = operand((n, k), fb, 3, 0.7)
    x = fp8_gemm(a, b, out_dtype, backend="scaled_mm").double()
    y = fp8_gemm(a, b, out_dtype, backend="emulated").double()
    # Same exact products, different order of the final scale multiplies: a few ulps.
    eps = 2**-23 if out_dtype == torch.float32 else 2**-8
    scale = ref64(a, b).abs().max()
    torch.testing.assert_close(x, y, rtol=4 * eps, atol=4 * eps * scale.item())


@pytest.mark.parametrize("backend", backends())
def test_transposed_views_as_in_backward(backend):
    # dW = gᵀ·x arrives as two transposed (non-contiguous) views.
    g = operand((48, 32), E5M2, 4, 1000.0)
    x = operand((48, 64), E4M3, 5, 100.0)
    got = fp8_gemm(g.t(), x.t(), backend=backend)
    assert got.shape == (32, 64)
    torch.testing.assert_close(got.double(), ref64(g.t(), x.t()), rtol=1e-5, atol=1e-5)


def test_e5m2_pair_falls_back():
    a, b = operand((16, 32), E5M2, 6, 1.0), operand((16, 32), E5M2, 7, 1.0)
    got = fp8_gemm(a, b, backend="scaled_mm")
    torch.testing.assert_close(got.double(), ref64(a, b), rtol=1e-5, atol=1e-5)


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        fp8_gemm(operand((4, 8), E4M3, 0, 1.0), operand((4, 9), E4M3, 0, 1.0))


def test_no_backend_given_is_the_emulation_whatever_is_pinned(monkeypatch):
    """fp8_gemm reads no global and no environment: the choice is bound by its caller."""
    a, b = operand((32, 64), E4M3, 8, 5.0), operand((16, 64), E4M3, 9, 0.5)
    want = fp8_gemm(a, b, backend="emulated")
    set_gemm_backend("emulated" if not scaled_mm_available(CPU) else "scaled_mm")
    monkeypatch.setenv(gemm_backend.ENV_VAR, "scaled_mm")
    assert torch.equal(fp8_gemm(a, b), want)


def test_forced_backend_and_env_var(monkeypatch):
    set_gemm_backend("emulated")
    assert select_gemm_backend(CPU) == "emulated"
    assert select_gemm_backend(CPU, "emulated") == "emulated"
    set_gemm_backend("auto")
    monkeypatch.setenv(gemm_backend.ENV_VAR, "emulated")
    assert select_gemm_backend(CPU) == "emulated"
    with pytest.raises(ValueError):
        set_gemm_backend("cublas")
    with pytest.raises(ValueError):
        select_gemm_backend(CPU, "fast")


def test_auto_picks_the_faster_once(monkeypatch, tmp_path):
    calls = []

    def fake(device, *args, **kwargs):
        calls.append(device)
        return {"emulated": 11.0, "scaled_mm": 15.0}, {}

    monkeypatch.setattr(gemm_backend, "race_gemm_backends", fake)
    assert select_gemm_backend(CPU) == "emulated"
    assert select_gemm_backend("cpu") == "emulated"
    monkeypatch.setattr(gemm_backend, "_auto_choice", {})  # a new process on the same machine
    assert select_gemm_backend(CPU) == "emulated"
    assert len(calls) == 1  # raced once per machine, then read from the machine cache

    for i, (timings, want) in enumerate([((2.0, 1.0), "scaled_mm"), ((1.0, 0.95), "emulated")]):
        # A near-tie goes to emulated, so that the choice does not flip between processes.
        times = dict(zip(("emulated", "scaled_mm"), timings))
        monkeypatch.setattr(gemm_backend, "_auto_choice", {})
        monkeypatch.setenv("FP8TRAIN_CACHE_DIR", str(tmp_path / f"machine_{i}"))
        monkeypatch.setattr(gemm_backend, "race_gemm_backends", lambda *a, t=times, **k: (t, {}))
        assert select_gemm_backend(CPU) == want


class _Clock:
    """The race's clock (``gemm_backend.time.perf_counter``), moved only by the stand-in
    backends: the race's decisions are checked without timing anything (under a loaded CPU,
    two equally fast real kernels can differ 3x in one timing and one would leave at the
    probe)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(gemm_backend, "time", fake)
    return fake


class _Recorded:
    """A backend that records the shape of every call and takes ``factor`` times the time of
    an ordinary one (1 ns per multiply-add) when ``slow_from`` <= M: with factor 1 an ordinary
    kernel, with 100 a stand-in for a pathological one."""

    def __init__(self, clock: _Clock, factor: int = 1, slow_from: int = 0):
        self.clock, self.factor, self.slow_from, self.shapes = clock, factor, slow_from, []

    def __call__(self, a, b, out_dtype):
        m, k, n = a.shape[0], a.shape[1], b.shape[0]
        self.shapes.append((m, k, n))
        self.clock.now += m * k * n * 1e-9 * (self.factor if m >= self.slow_from else 1)


def test_auto_drops_a_100x_slower_backend_before_full_size(clock):
    """A kernel 100x slower than emulation at every size: the probe finds it, and it never
    runs at the full shape."""
    slow = _Recorded(clock, 100)
    full = gemm_backend._AUTO_SHAPE["cpu"]
    times, left = gemm_backend.race_gemm_backends(
        CPU, backends={"emulated": _Recorded(clock), "slow": slow}
    )
    assert set(times) == {"emulated"} and "slow" in left, (times, left)
    assert full not in slow.shapes and len(slow.shapes) == 2  # the two probe rounds


def test_auto_calls_a_backend_slow_only_at_full_size_once(clock):
    """A kernel fine at the probe but 100x slower at the full shape runs there once."""
    full = gemm_backend._AUTO_SHAPE["cpu"]
    slow = _Recorded(clock, 100, slow_from=full[0])
    times, left = gemm_backend.race_gemm_backends(
        CPU, backends={"emulated": _Recorded(clock), "slow": slow}
    )
    assert set(times) == {"emulated"} and "slow" in left, (times, left)
    assert slow.shapes.count(full) == 1, slow.shapes
    # The one it drops is the slower one, whichever order they run in.
    times, left = gemm_backend.race_gemm_backends(
        CPU,
        backends={"slow": _Recorded(clock, 100, slow_from=full[0]), "emulated": _Recorded(clock)},
    )
    assert set(times) == {"emulated"}


def _select_in_a_process(rank, world, port, cache, marks):
    """One process of a run: a slowed-down race (so that the processes overlap) that leaves a
    mark when it runs, then the pick written out."""
    import os
    import time
    from pathlib import Path

    from fp8train import gemm_backend as g

    os.environ["FP8TRAIN_CACHE_DIR"] = cache
    race = g.race_gemm_backends

    def marked(*args, **kwargs):
        with open(Path(marks) / "races", "a") as f:
            f.write(f"{rank}\n")
        time.sleep(0.5)
        return race(*args, **kwargs)

    g.race_gemm_backends = marked
    g._auto_choice.clear()
    g.set_gemm_backend(None)
    os.environ.pop(g.ENV_VAR, None)
    (Path(marks) / f"pick{rank}").write_text(g.select_gemm_backend("cpu"))


def test_the_processes_of_a_run_race_once_between_them(tmp_path):
    """Three processes that start together (the ranks of a run, the workers of a test suite)
    with one machine cache: one races, the others wait for its pick and use it."""
    from multiproc import run_ranks

    cache = tmp_path / "cache"
    run_ranks(_select_in_a_process, 3, (str(cache), str(tmp_path)), timeout=120,
              start_method="fork")  # fmt: skip
    assert (tmp_path / "races").read_text().split() in (["0"], ["1"], ["2"])
    picks = {(tmp_path / f"pick{r}").read_text() for r in range(3)}
    assert len(picks) == 1 and picks <= set(BACKENDS)


def test_measure_returns_timings():
    times = measure_gemm_backends(CPU, (32, 32, 32), reps=1)
    assert set(times) == set(backends()) and all(t > 0 for t in times.values())

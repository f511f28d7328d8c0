"""Shared fixtures: a small real corpus (40 stdlib files, 512-token SentencePiece model) built
once per session, and tiny-GPT configs that train in well under a second per step on CPU;
every test module that starts ranks runs on the CPU, in its own process too
(``_ranks_and_their_references_on_cpu``)."""

from __future__ import annotations

import atexit
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Two cores: keep each test process to one intra-op thread so parallel ranks do not fight.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Per-machine measurements (fp8train/machine_cache.py) of test runs stay out of the user's
# cache: one private cache per test session, inherited by every rank and subprocess (and by
# pytest-xdist's workers), removed when the process that made it exits.
if "FP8TRAIN_CACHE_DIR" not in os.environ:
    os.environ["FP8TRAIN_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp8train_cache_")
    atexit.register(shutil.rmtree, os.environ["FP8TRAIN_CACHE_DIR"], ignore_errors=True)


# A call that starts ranks: a helper of tests/multiproc.py (imported at the top or inside a
# test, as ``multiproc`` or ``tests.multiproc``) or torch's own ``start_processes``.
_STARTS_RANKS = re.compile(
    r"\b(run_ranks|pretrain_ranks|torchrun|launch|RunsByWorld|start_processes)\("
)


@pytest.fixture(scope="module")
def inductor_cache_per_isa():
    """Inductor's on-disk cache in a directory of its own per vector ISA, for a module that
    compiles with inductor: torch 2.13's FX graph cache key leaves the ISA out, so code
    cached under one ``ATEN_CPU_CAPABILITY`` (or by a CPU with other vector units sharing the
    directory) would be reused, wrong, under another (tests/test_fused_adam.py says more)."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    isa = "_".join(str(pick_vec_isa()).split())  # e.g. avx2, INVALID_VEC_ISA (scalar code)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"isa-{isa}"))
        yield


@pytest.fixture(scope="module", autouse=True)
def _ranks_and_their_references_on_cpu(request):
    """A test module that starts ranks runs wholly on the CPU, CUDA machine or not: its ranks
    do (tests/multiproc.py), and so does what it runs in its own process, so that a
    single-process reference compared with the ranks, often built by a module-scoped fixture,
    computes on the same device with the same backend (``multiproc.force_cpu``, undone when the
    module ends). Modules that start no ranks keep the machine's device: on a CUDA machine
    their single-process runs exercise the CUDA paths."""
    if not _STARTS_RANKS.search(Path(request.module.__file__).read_text()):
        yield
        return
    from multiproc import force_cpu

    with pytest.MonkeyPatch.context() as patch:
        force_cpu(patch)
        yield


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    from data.corpus import stdlib_documents, stdlib_root
    from data.prepare import prepare_corpus_data

    cache = tmp_path_factory.mktemp("data_cache")
    return prepare_corpus_data(cache, stdlib_documents()[:40], 512, root=stdlib_root(), name="tiny")


def tiny_overrides(data, run_dir, level="te", **extra) -> list[str]:
    """Overrides that shrink configs/gpt_tiny.yaml to a seconds-long job on ``data``.
    ``level``: a precision level, or ``level:dtype`` for ``precision.param_dtype`` too
    ("te:bf16": FP8 GEMMs on BF16 parameters with FP32 masters; "te:auto": the device's
    choice, where a bare "te" pins FP32, what auto is on the CPU)."""
    from fp8train.precision import split_level

    explicit = ":" in level
    level, param_dtype = split_level(level)
    values = {
        "model.num_layers": 2,
        "model.hidden_size": 64,
        "model.num_attention_heads": 2,
        "model.seq_length": 64,
        "data.corpus": "prefix",
        "data.data_prefix": data.data_prefix,
        "data.tokenizer_model": data.tokenizer_model,
        "data.cache_dir": str(Path(run_dir) / "cache"),
        "training.train_iters": 6,
        "training.micro_batch_size": 2,
        "training.global_batch_size": 4,
        "training.eval_interval": 3,
        "training.eval_iters": 1,
        "optimizer.lr_warmup_iters": 2,
        "logging.interval": 1,
        "logging.dir": str(run_dir),
        # Skips measuring the CPU's matmul rate (~0.5 s of both cores per run);
        # tests/test_entry_point.py runs the measured path.
        "logging.peak_tflops": 1.0,
        "checkpoint.save_interval": 3,
        "precision.level": level,
        # "auto" times the backends, and under load the winner can flip between two runs that
        # a test compares; the two agree only to FP32 rounding, so tests pin one.
        "precision.fp8_gemm_backend": "emulated",
    }
    if not explicit and level in ("te", "O1", "O2", "O3"):
        # What "auto" means on the CPU, pinned: on a CUDA machine (the single-process test
        # modules keep the GPU) auto would mean BF16 at these levels, and the tests' byte
        # counts and references are for FP32. Tests of auto itself ask for "level:auto".
        param_dtype = "fp32"
    if param_dtype != "auto":
        values["precision.param_dtype"] = param_dtype
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]

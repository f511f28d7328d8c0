"""Which implementation a collective takes on a process group's backend.

nccl has a native reduce-scatter (in place, any split sizes: uneven ones become grouped
``ncclReduce`` calls inside torch); gloo runs reduce-scatters here as an all-to-all plus a local
FP32 sum in rank order, which is deterministic (the tests compare data parallelism bitwise
with one process) but receives W pieces. The two differ in the buffers they allocate, so a plan
(training/planning/rank_plan.py), whose process group is torch's "fake" one, must say which
backend it stands for: ``fake_group_backend``.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist

__all__ = [
    "all_gather_single", "backend_of", "fake_group_backend", "native_reduce_scatter",
    "reduce_scatter_single",
]  # fmt: skip

# The non-deprecated names where this torch has them (torch >= 2.10 renames the *_tensor ones).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_NATIVE_REDUCE_SCATTER = ("nccl",)
# The backend whose code paths a "fake" process group takes: the accelerator's by default;
# "gloo" while a plan is checked against a gloo run.
_fake_stands_for = ["nccl"]


@contextlib.contextmanager
def fake_group_backend(backend: str):
    """Within: collectives on a "fake" process group choose their implementation as on
    ``backend``."""
    _fake_stands_for.append(backend)
    try:
        yield
    finally:
        _fake_stands_for.pop()


def backend_of(group) -> str:
    """The backend ``group`` runs on, or the one a fake group stands for."""
    backend = dist.get_backend(group)
    return _fake_stands_for[-1] if backend == "fake" else backend


def native_reduce_scatter(group) -> bool:
    """Whether reduce-scatters over ``group`` use the backend's own kernel."""
    return backend_of(group) in _NATIVE_REDUCE_SCATTER

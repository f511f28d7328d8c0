"""Plan a run beyond this machine: one real training step of any config, at any world size,
executed on fake tensors under a fake process group.

Why execute rather than estimate: a formula (Megatron's ``report_theoretical_memory``) knows
what its author remembered; the step knows what the code allocates. Here the project's own
``build_run`` and ``train_step`` run unchanged for one rank of an N-rank job, under
``FakeTensorMode`` (tensors with shapes, dtypes and storages but no memory) and the "fake"
process-group backend (collectives that return at once), so a GPT-175B slice costs seconds.

What the step reads on the host (the loss scale, the overflow check, the gradient norm,
torch's AdamW step count) has no value on a fake tensor: ``HostReads`` answers each such read
with 1 and counts it, so the step takes its normal path (a finite norm, an update).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads", "fake_world"]

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """This process as rank ``rank`` of ``world_size`` under the "fake" backend: every
    collective returns at once, touching nothing; ``init_distributed`` then builds the real
    groups of the topology on it. The environment and the default group are restored after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a plan needs a process without a process group")
    saved = {k: os.environ.get(k) for k in _ENV}
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class HostReads(TorchDispatchMode):
    """Answers every read of a tensor's value on the host (``item()``, ``float(t)``,
    ``bool(t)``) with 1 of its dtype, counting them (``count``): a fake tensor has no value.

    Also gives ``repeat_interleave`` with a known ``output_size`` its output's shape directly:
    its fake kernel otherwise falls back to running the real one on zeros of the full size
    (seconds, and gigabytes, for a GPT-175B gradient buffer's per-element scales).
    """

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size"):
            repeats = args[0]
            return torch.empty(kwargs["output_size"], dtype=repeats.dtype, device=repeats.device)
        return func(*args, **kwargs)


def fake_mode() -> FakeTensorMode:
    return FakeTensorMode(allow_non_fake_inputs=True)

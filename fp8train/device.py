"""The one place that talks to ``torch.cuda``: everything else asks this module.

Keeping CUDA calls here is what lets the same trainer run on a laptop CPU (gloo) and on H100s
(nccl): every other module handles a ``torch.device`` and never branches on CUDA itself.
All functions accept a CPU device and then do the cheap, harmless thing.
"""

from __future__ import annotations

import platform

import torch

__all__ = [
    "cuda_capability",
    "device_count",
    "device_name",
    "empty_cache",
    "dist_backend",
    "get_device",
    "in_host_memory",
    "is_cuda",
    "manual_seed_all",
    "move_module",
    "memory_info",
    "memory_stats",
    "reset_peak_memory",
    "rng_state",
    "set_rng_state",
    "synchronize",
]


def is_cuda() -> bool:
    """Whether a CUDA device is usable in this process."""
    return torch.cuda.is_available()


def device_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return torch.cuda.device_count() if is_cuda() else 0


def get_device(local_rank: int | None = None) -> torch.device:
    """``cuda:local_rank`` when CUDA is available (``cuda:current`` if no rank), else CPU."""
    if not is_cuda():
        return torch.device("cpu")
    index = torch.cuda.current_device() if local_rank is None else local_rank
    torch.cuda.set_device(index)  # NCCL and default-device allocations follow this
    return torch.device("cuda", index)


def _same_device(have: torch.device, want: torch.device) -> bool:
    if have.type != want.type:
        return False
    if want.index is None and want.type == "cuda":  # "cuda": the current device
        want = torch.device("cuda", torch.cuda.current_device())
    return want.index is None or have.index == want.index


def move_module(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``module.to(device)`` unless every parameter and buffer is there already. Moving in
    place swaps tensors, which some tensor subclasses (fake tensors) refuse; a module built
    where it runs needs no move."""
    want = torch.device(device)
    tensors = [*module.parameters(), *module.buffers()]
    if all(_same_device(t.device, want) for t in tensors):
        return module
    return module.to(want)


def in_host_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s values sit in host memory, readable without a sync: a CPU tensor (not
    a CUDA one, nor a meta one of a plan, training/planning/rank_plan.py: shapes without values)."""
    return t.device.type == "cpu"


def dist_backend() -> str:
    return "nccl" if is_cuda() else "gloo"


def _is_cuda_device(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda"


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued work on ``device`` (timers need this; on CPU work is already done)."""
    if _is_cuda_device(device):
        torch.cuda.synchronize(device)


def memory_stats(device: torch.device | str | None = None) -> dict[str, int]:
    """Allocator bytes on a CUDA device: allocated, reserved, max_allocated. On CPU the
    process's peak resident set size (``max_rss``), which includes more than tensors."""
    if not _is_cuda_device(device):
        import resource  # POSIX only; absent on Windows, where no CPU figure is given

        return {"max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    return {
        "allocated": torch.cuda.memory_allocated(device),
        "reserved": torch.cuda.memory_reserved(device),
        "max_allocated": torch.cuda.max_memory_allocated(device),
    }


def memory_info(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """``(free, total)`` bytes of a CUDA device; None for a non-CUDA device."""
    if not _is_cuda_device(device):
        return None
    free, total = torch.cuda.mem_get_info(device)
    return int(free), int(total)


def empty_cache(device: torch.device | str | None = None) -> None:
    """Give the caching allocator's unused blocks back to the device (nothing on CPU)."""
    if _is_cuda_device(device):
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    if _is_cuda_device(device):
        torch.cuda.reset_peak_memory_stats(device)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device | str | None = None) -> str:
    """Human-readable device name, e.g. "NVIDIA H100 80GB HBM3" or the CPU model."""
    if _is_cuda_device(device):
        return torch.cuda.get_device_name(device)
    return _cpu_model()


def cuda_capability(device: torch.device | str | None = None) -> tuple[int, int] | None:
    """Compute capability (e.g. (9, 0) for Hopper); None for a non-CUDA device, or where this
    torch or machine has no CUDA (asking a CPU-only torch would raise)."""
    if not _is_cuda_device(device) or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor)


def rng_state(device: torch.device | str | None = None) -> torch.Tensor | None:
    """The CUDA generator state of ``device`` (for checkpoints); None on CPU."""
    if not _is_cuda_device(device):
        return None
    return torch.cuda.get_rng_state(device)


def set_rng_state(state: torch.Tensor | None, device: torch.device | str | None = None) -> None:
    """Restore a state from ``rng_state``; a no-op on CPU or for a None state."""
    if state is None or not _is_cuda_device(device):
        return
    torch.cuda.set_rng_state(state.cpu(), device)


def manual_seed_all(seed: int) -> None:
    """Seed the CPU generator and, when present, every CUDA generator."""
    torch.manual_seed(seed)  # also seeds CUDA generators lazily in current torch
    if is_cuda():
        torch.cuda.manual_seed_all(seed)

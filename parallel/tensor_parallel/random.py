"""Named RNG streams for tensor parallelism (Megatron's CUDA RNG tracker, on any device).

Under tensor parallelism some activations are replicated on every TP rank (the residual
stream outside the TP region) and some are sharded (each rank's attention heads, each rank's
sequence-parallel slice). Dropout on a replicated tensor must draw the SAME mask on every
rank, or the replicas drift apart; dropout on a shard must draw DIFFERENT masks, or every
rank drops the same positions of different heads/tokens and the model sees correlated noise.

So there are two streams. The default generator, seeded identically on every TP rank, serves
replicated tensors. A tracked state seeded ``seed + 2718 + tp_rank`` serves shards; ``fork``
swaps it into the default generator for the duration of a block, because ``F.dropout`` takes
no generator argument. Only the default generators are touched, so this works unchanged for
CPU (one CPU generator) and CUDA (where dropout draws from the device's generator; the CPU
generator is swapped as well so CPU-side draws inside the block follow the same rule).

Pipeline or data-parallel offsets of ``seed`` (Megatron adds 100 * pp_rank) are the
caller's business: pass the already-offset seed. Not CUDA-graph safe (states are swapped
eagerly, as in Megatron's non-graph tracker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from fp8train import device as devices

__all__ = [
    "MODEL_PARALLEL_RNG",
    "TP_SEED_OFFSET",
    "RNGStatesTracker",
    "get_tracker",
    "model_parallel_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
TP_SEED_OFFSET = 2718  # Megatron's offset: keeps TP streams away from the data-parallel seed

# Checkpoint keys are "<name>.cpu" and "<name>.device", mirroring training/checkpointing's
# "torch_cpu"/"torch_device": one flat dict of uint8 tensors that safetensors stores as is.
_CPU, _ACCEL = ".cpu", ".device"


class _State:
    """One stream: the CPU generator state and, on an accelerator, the device's state."""

    __slots__ = ("accel", "cpu")

    def __init__(self, cpu: torch.Tensor, accel: torch.Tensor | None) -> None:
        self.cpu, self.accel = cpu, accel


class RNGStatesTracker:
    """Named RNG states that ``fork`` swaps into the default generator(s) of ``device``.

    No global state is needed: build one per model and pass it around, or use ``get_tracker``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Forget every stream (the device is kept)."""
        self._states: dict[str, _State] = {}
        self._seeds: set[int] = set()
        self._active: set[str] = set()

    def names(self) -> list[str]:
        return list(self._states)

    def add(self, name: str, seed: int) -> None:
        """Start stream ``name`` at ``seed`` without touching the default generators."""
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        # Two names on one seed would be the same stream: the independence the tracker
        # exists for would silently vanish.
        if seed in self._seeds:
            raise ValueError(f"seed {seed} already used by another RNG state")
        cpu = torch.Generator().manual_seed(seed).get_state()
        accel = None
        if devices.rng_state(self.device) is not None:
            # A fresh generator's state has the default generator's layout, so it can be
            # swapped in later; seeding it leaves the default one untouched.
            accel = torch.Generator(device=self.device).manual_seed(seed).get_state()
        self._states[name] = _State(cpu, accel)
        self._seeds.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default streams resume afterwards
        exactly where they were, and ``name`` continues next time where this block left it."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} is not tracked (known: {self.names()})")
        if name in self._active:
            # The inner block would restart from the outer block's entry state and replay
            # its draws: identical "random" numbers twice.
            raise RuntimeError(f"RNG state {name!r} is already forked")
        state = self._states[name]
        saved_cpu, saved_accel = torch.get_rng_state(), devices.rng_state(self.device)
        torch.set_rng_state(state.cpu)
        devices.set_rng_state(state.accel, self.device)
        self._active.add(name)
        try:
            yield
        finally:
            # Keep the advanced state, then put the default streams back, even on an error.
            state.cpu, state.accel = torch.get_rng_state(), devices.rng_state(self.device)
            torch.set_rng_state(saved_cpu)
            devices.set_rng_state(saved_accel, self.device)
            self._active.discard(name)

    def get_states(self) -> dict[str, torch.Tensor]:
        """Copies of every stream as CPU uint8 tensors: ``<name>.cpu`` (and ``<name>.device``
        on an accelerator)."""
        out = {}
        for name, state in self._states.items():
            out[name + _CPU] = state.cpu.clone()
            if state.accel is not None:
                out[name + _ACCEL] = state.accel.cpu().clone()
        return out

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the tracked streams with those of ``get_states`` (checkpoint resume).

        A missing ``.device`` part (a CPU checkpoint resumed on an accelerator) keeps the
        stream's current device state, like ``restore_rng`` does for the default stream.
        """
        unknown = [k for k in states if not k.endswith((_CPU, _ACCEL))]
        if unknown:
            raise ValueError(f"not RNG tracker keys: {unknown}")
        # Fail here, not at the first fork deep inside a forward pass.
        bad = [k for k, v in states.items() if v.dtype != torch.uint8]
        if bad:
            raise ValueError(f"RNG states must be uint8 tensors: {bad}")
        new = {}
        for key, tensor in states.items():
            if not key.endswith(_CPU):
                continue
            name = key[: -len(_CPU)]
            accel = states.get(name + _ACCEL)
            if devices.rng_state(self.device) is None:
                accel = None  # a device checkpoint resumed on CPU: only the CPU part applies
            elif accel is None:
                if name not in self._states:
                    raise ValueError(f"RNG state {name!r} has no {_ACCEL} part for {self.device}")
                accel = self._states[name].accel
            new[name] = _State(tensor.cpu().clone(), None if accel is None else accel.cpu().clone())
        # The seed set guards `add` only; states now come from the checkpoint, not seeds.
        self._states = new


_DEFAULT = RNGStatesTracker()


def get_tracker() -> RNGStatesTracker:
    """The process-wide tracker, for code that does not thread one through explicitly."""
    return _DEFAULT


def model_parallel_seed(
    seed: int,
    tp_rank: int,
    device: torch.device | str = "cpu",
    tracker: RNGStatesTracker | None = None,
) -> RNGStatesTracker:
    """Seed the default generators with ``seed`` (the same on every TP rank: replicated
    dropout agrees) and (re)start ``tracker``'s "model-parallel-rng" at
    ``seed + 2718 + tp_rank`` (shard dropout differs). Default tracker: ``get_tracker()``."""
    tracker = get_tracker() if tracker is None else tracker
    devices.manual_seed_all(seed)
    tracker.reset()
    tracker.device = torch.device(device)
    tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
    return tracker

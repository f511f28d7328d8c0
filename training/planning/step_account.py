"""What one training step allocates, computes and moves, counted op by op as it runs.

``StepAccount`` is a dispatch mode: every aten op of the step passes through it, on real
tensors (a gloo run on CPU) or on meta tensors (a plan, rank_plan.py), and the same
accounting applies to both, which is what lets a plan be checked against a real run.

Memory is counted per storage (the unit an allocator hands out): each op's new output
storages are added when they appear and subtracted when Python frees them (a weak reference
per storage), giving the live bytes after every op and the step's peak. At the end each
storage that was live at the peak is put in one category, first match wins:

==============  ===================================================================
weights         the model's parameters and buffers (FP8/FP16 weights, their scales)
grads           gradient buffers: FP32 ``main_grad``, FP8 gradient slots, ``.grad``
master          FP32 (bf16 levels) or FP16 (O3) master weights
optimizer       Adam moments and their scales
activations     tensors autograd saved for backward (``saved_tensors_hooks``)
comm            storages whose first use was a collective (gather / receive buffers)
temporaries     everything else live at the peak
==============  ===================================================================

The first four are named by the caller (``assign``) from the run's own objects; the rest
are seen as the step runs. FLOPs come from each GEMM's shapes (``torch.utils.flop_counter``'s
formulas, plus the CPU flash-attention kernel), per dtype; memory traffic is the bytes every
non-GEMM op reads and writes (an in-place op's destination counted as read and written), the
traffic of an unfused eager step. Bytes on the wire are counted from the collectives as they
run (``wire``: per kind, under ``parallel.comm_meter``'s byte model), independently of the
``CommMeter`` the run's own code records into: the two must agree.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from parallel.comm_meter import wire_bytes

__all__ = ["CATEGORIES", "MemoryReport", "PHASES", "StepAccount"]

CATEGORIES = (
    "weights", "grads", "master", "optimizer", "activations", "comm", "temporaries",
)  # fmt: skip
_NAMED = CATEGORIES[:4]  # assigned by the caller from the run's objects

# Where the step is when an op runs, by position, not by autograd's grad mode (an FP8 GEMM's
# own autograd.Function runs its forward with grad off, and is forward all the same):
PHASES = {
    "step start": "before the first forward: the batches moved to the device",
    "forward": "inside a module's forward (its autograd functions included), the loss, and "
    "what runs between a forward and the next backward (pipeline sends)",
    "backward": "while autograd runs a backward (recompute and gradient-reduction hooks included)",
    "after backward": "after a backward, before the optimizer: the gradients' reduction, "
    "unscaling and clipping (and a pipeline's sends of gradients)",
    "optimizer": "from the optimizer's update to the step's end: masters, the weights' "
    "all-gather, the loss scaler, the losses' all-reduce",
}
_aten = torch.ops.aten
_CPU_FLASH = _aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_FLASH_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# Allocation without a write: no traffic.
_NO_TRAFFIC = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
               _aten.new_empty.default, _aten.new_empty_strided.default}  # fmt: skip
# c10d op -> (collective kind, the argument holding the tensors it counts, whether those are
# one rank's share of the full tensor: a gather's input, a reduce-scatter's output).
_c10d = torch.ops.c10d
_WIRE = {
    _c10d.allreduce_.default: ("all_reduce", 0, False),
    _c10d.broadcast_.default: ("broadcast", 0, False),
    _c10d.allgather_.default: ("all_gather", 1, True),
    _c10d._allgather_base_.default: ("all_gather", 1, True),
    _c10d.reduce_scatter_.default: ("reduce_scatter", 0, True),
    _c10d._reduce_scatter_base_.default: ("reduce_scatter", 0, True),
    _c10d.alltoall_base_.default: ("all_to_all", 1, False),
    _c10d.send.default: ("send", 0, False),
}


def _tensors(values, found: list) -> list:
    """The tensors among ``values`` and inside their lists and tuples, two levels deep (what
    aten and c10d ops take and return), appended to ``found``."""
    for v in values:
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            _tensors(v, found)
    return found


def _storage(t: torch.Tensor):
    return t.untyped_storage()


@dataclass
class _Record:
    nbytes: int
    born: int  # event number (allocations and frees) of the allocation
    died: int | None = None  # and of the free
    tag: str | None = None  # "activations" / "comm" as seen; a named category from assign()
    used: bool = False  # some non-view op has read or written it since its allocation
    ref: object = None  # the weak reference (kept so its callback fires)


@dataclass
class MemoryReport:
    """``peak``: the most bytes live at once during the step; ``at_peak``: those bytes by
    category; ``end``: bytes live when the step ended, by category (what stays between
    steps); ``peak_phase``: where in the step the peak fell (``PHASES``); ``phase_peaks``: the
    most bytes live at once within each phase; ``phase_at_peak``: those by category."""

    peak: int
    at_peak: dict[str, int]
    end: dict[str, int]
    peak_phase: str
    phase_peaks: dict[str, int]
    phase_at_peak: dict[str, dict[str, int]] = field(default_factory=dict)


class StepAccount(TorchDispatchMode):
    """Count storages, FLOPs and traffic of every op run under it (see the module doc).

    Use: enter it before the build (so the weights' storages are known), call
    ``start_step()`` where the step begins, run the step inside ``saving()`` (so saved
    activations are seen), ``assign`` the named categories, then read ``memory()``,
    ``flops`` and ``traffic``."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, _Record] = {}
        self._dead: list[_Record] = []
        self.seq = 0
        self.current = 0
        self.peak = 0
        self.peak_seq = 0
        self._peak_phase = "build"
        self._phase_peaks: dict[str, int] = {}
        self._phase_peak_seq: dict[str, int] = {}
        self.flops: dict[str, float] = defaultdict(float)  # GEMM FLOPs by operand dtype
        self.traffic = 0  # bytes read + written by the non-GEMM ops
        self.host_reads = 0  # values read on the host that a meta step answered (MetaStep)
        self.wire: dict[str, int] = defaultdict(int)  # bytes this rank sent, by collective kind
        self.step_started = False
        self._modules = 0  # depth of module forwards now running
        self._last = "step start"  # the phase of the last forward or backward op seen
        self._hooks: list = []

    def __enter__(self):
        # Where the step is (``_phase``): module forwards and optimizer steps are seen by
        # torch's global hooks, held only while this account is active.
        from torch.nn.modules.module import (
            register_module_forward_hook,
            register_module_forward_pre_hook,
        )
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def enter(*_):
            self._modules += 1

        def leave(*_):
            self._modules -= 1

        def optimizing(*_):
            self._last = "optimizer"

        self._hooks = [
            register_module_forward_pre_hook(enter),
            register_module_forward_hook(leave, always_call=True),
            register_optimizer_step_pre_hook(optimizing),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return super().__exit__(*exc)

    # ---- the dispatch hook --------------------------------------------------------------

    def execute(self, func, args, kwargs):
        """Run one op (a subclass may answer it another way)."""
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.execute(func, args, kwargs)
        if func.is_view:
            return out
        collective = func.namespace == "c10d"
        if collective and self.step_started and func in _WIRE:
            self._count_wire(func, args)
        counted = self.step_started and not collective and func not in _NO_TRAFFIC
        gemm = func._overloadpacket in flop_registry or func in (_CPU_FLASH, _CPU_FLASH_BWD)
        moved = 0
        inputs = _tensors(args, [])
        if kwargs:
            _tensors(kwargs.values(), inputs)
        for t in inputs:
            rec = self._live.get(_storage(t)._cdata)
            if rec is not None and not rec.used:
                rec.used = True
                if collective and rec.tag is None:
                    rec.tag = "comm"
            if counted and not gemm:
                moved += t.numel() * t.element_size()
        for t in _tensors((out,), []):
            self._track(t)
            if counted and not gemm:
                moved += t.numel() * t.element_size()
        self.traffic += moved
        if gemm and self.step_started:
            self._count_flops(func, args, kwargs, out)
        return out

    def _track(self, t: torch.Tensor) -> None:
        st = _storage(t)
        key = st._cdata
        if key in self._live:
            return
        self.seq += 1
        rec = _Record(st.nbytes(), self.seq)

        def freed(_ref, key=key, rec=rec):
            self._live.pop(key, None)
            self.seq += 1
            rec.died = self.seq
            self.current -= rec.nbytes
            self._dead.append(rec)

        rec.ref = weakref.ref(st, freed)
        self._live[key] = rec
        self.current += rec.nbytes
        if self.step_started:
            phase = self._phase()
            if self.current > self._phase_peaks.get(phase, 0):
                self._phase_peaks[phase] = self.current
                self._phase_peak_seq[phase] = self.seq
        if self.current > self.peak:
            self.peak, self.peak_seq, self._peak_phase = self.current, self.seq, self._phase()

    def _count_wire(self, func, args) -> None:
        kind, where, share = _WIRE[func]
        group = next(
            a for a in args
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())
        )  # fmt: skip
        group = torch.distributed.ProcessGroup.unbox(group)
        world = group.size()
        nbytes = sum(t.numel() * t.element_size() for t in _tensors((args[where],), []))
        if kind == "send":
            self.wire[kind] += nbytes
        elif kind == "all_to_all":  # all but this rank's own piece leaves (uneven: by splits)
            rows, splits = args[1].shape[0], args[4]
            own = splits[group.rank()] if splits else rows // world
            self.wire[kind] += nbytes - nbytes // rows * own if rows else 0
        else:
            self.wire[kind] += wire_bytes(kind, nbytes * world if share else nbytes, world)

    def _count_flops(self, func, args, kwargs, out) -> None:
        if func in (_CPU_FLASH, _CPU_FLASH_BWD):
            flops = _cpu_flash_flops(func, args, kwargs)
            dtype = args[1 if func is _CPU_FLASH_BWD else 0].dtype
        else:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
            dtype = _tensors(args, [])[0].dtype
        self.flops[str(dtype).removeprefix("torch.")] += flops

    # ---- step boundaries and categories -------------------------------------------------

    def start_step(self) -> None:
        """A step begins: the peak restarts from what is live now (the model states) and the
        per-step counts (FLOPs, traffic, bytes sent, host reads) from zero."""
        self.step_started = True
        self.peak, self.peak_seq, self._peak_phase = self.current, self.seq, "step start"
        self._phase_peaks, self._phase_peak_seq = {}, {}
        self._last = "step start"
        self.flops.clear()
        self.traffic = self.host_reads = 0
        self.wire.clear()

    def _phase(self) -> str:
        """Where the step is now (``PHASES``)."""
        if not self.step_started:
            return "build"
        if torch._C._current_graph_task_id() != -1:
            self._last = "backward"
        elif self._modules > 0 or (
            torch.is_grad_enabled() and self._last in ("forward", "backward")
        ):
            self._last = "forward"  # (outside a module: the loss, between micro-batches)
        elif self._last == "backward":
            return "after backward"
        return self._last

    def saving(self):
        """Tag every tensor autograd saves for backward as an activation."""

        def pack(t: torch.Tensor):
            rec = self._live.get(_storage(t)._cdata)
            if rec is not None and rec.tag not in _NAMED:
                rec.tag = "activations"
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def assign(self, category: str, tensors) -> None:
        """Put the live storages of ``tensors`` in a named category (the first named wins)."""
        if category not in _NAMED:
            raise ValueError(f"category {category!r}: one of {_NAMED}")
        for t in tensors:
            rec = self._live.get(_storage(t)._cdata)
            if rec is not None and rec.tag not in _NAMED:
                rec.tag = category

    def _live_at(self, seq: int) -> dict[str, int]:
        """Bytes live just after event ``seq``, by category."""
        live = dict.fromkeys(CATEGORIES, 0)
        for rec in (*self._live.values(), *self._dead):
            if rec.born <= seq and (rec.died is None or rec.died > seq):
                live[rec.tag or "temporaries"] += rec.nbytes
        return live

    def memory(self) -> MemoryReport:
        end = dict.fromkeys(CATEGORIES, 0)
        for rec in self._live.values():
            end[rec.tag or "temporaries"] += rec.nbytes
        phases = {phase: self._live_at(seq) for phase, seq in self._phase_peak_seq.items()}
        return MemoryReport(
            self.peak, self._live_at(self.peak_seq), end, self._peak_phase,
            dict(self._phase_peaks), phases,
        )  # fmt: skip


def _cpu_flash_flops(func, args, kwargs) -> float:
    """The CPU flash-attention kernel's FLOPs, as the CUDA one's are counted: two GEMMs
    forward, four backward (flop_counter's formulas), halved under a causal mask (the
    masked half is skipped), as the family formulas count attention."""
    if func is _CPU_FLASH:
        q, k, v = args[:3]
        causal = args[4] if len(args) > 4 else kwargs.get("is_causal", False)
        flops = sdpa_flop_count(q.shape, k.shape, v.shape)
    else:
        grad_out, q, k, v = args[:4]
        causal = args[7] if len(args) > 7 else kwargs.get("is_causal", False)
        flops = sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape)
    return flops / 2 if causal else flops

"""Plan a run beyond this machine: one real training step of any config, at any world size,
executed on tensors that allocate nothing, under a fake process group.

Why execute rather than estimate: a formula (Megatron's ``report_theoretical_memory``) knows
what its author remembered; the step knows what the code allocates. Here the project's own
``build_run`` and ``train_step`` run unchanged for one rank of an N-rank job on the ``meta``
device (tensors with shapes, dtypes, strides and storage sizes, but no memory and no values)
and the "fake" process-group backend (collectives that return at once), so a GPT-175B slice
costs seconds. ``training.planning.step_account.StepAccount`` counts what the step allocates,
computes and sends, the same way it does in a real run.

Three things a meta step needs that a real one does not (``MetaStep``):

- values read on the host do not exist: each read is answered with 1 and counted, so the
  step takes its normal path (an update). The step decides a skip on the device, so only
  the paths that still read are counted: torch's foreach AdamW (the CPU's and a plan's, at
  fp32/bf16/fp16/te) reads whether to skip, and its step counts; LowBitAdamW (O1-O3) reads
  nothing;
- speed: many meta kernels are Python (``torch._refs``), 0.1-2 ms an op. Every layer repeats
  the same ops on the same shapes, so the output layout of each functional op is cached by
  its arguments' shapes, strides, dtypes and scalars and later calls allocate it directly;
- attention: SDPA on meta takes the math path (the full score matrix, saved for backward);
  a GPU (and the CPU) runs flash attention, which keeps the output and log-sum-exp only, so
  the plan calls the flash kernel (``flash_attention_on_meta``).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from itertools import repeat

import torch
import torch.distributed as dist
import torch.nn.functional as F

from training.config_schema import Config
from training.planning.step_account import MemoryReport, StepAccount
from training.run_plan import RunPlan

__all__ = [
    "MetaStep", "RankPlan", "accelerator_update", "fake_world", "flash_attention_on_meta",
    "measure_rank", "plan_rank", "plan_steps",
]  # fmt: skip

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
META = torch.device("meta")


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


class _Uncacheable(Exception):
    pass


def _key(x):
    """A hashable description of an op argument; tensors by layout (meta ones only)."""
    if isinstance(x, torch.Tensor):
        if not x.is_meta:
            raise _Uncacheable
        return (x.shape, x.stride(), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_key(v) for v in x)
    if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device)):
        return x
    if isinstance(x, (torch.memory_format, torch.layout)):
        return x
    raise _Uncacheable


def _layout(out):
    if isinstance(out, torch.Tensor):
        return ("t", out.shape, out.stride(), out.dtype)
    if isinstance(out, (list, tuple)):
        return (type(out), tuple(_layout(o) for o in out))
    if out is None or isinstance(out, (bool, int, float)):
        return ("v", out)
    raise _Uncacheable


def _allocate(layout):
    kind = layout[0]
    if kind == "t":
        return torch.empty_strided(layout[1], layout[2], dtype=layout[3], device=META)
    if kind == "v":
        return layout[1]
    return kind(_allocate(x) for x in layout[1])


# In-place ops that change a tensor's size or storage, not only its values.
_RESIZING = {"resize_", "resize_as_", "set_", "as_strided_", "_resize_output_"}


def _same_alias(a, b) -> bool:
    return a is not None and a.before_set == b.before_set


def _first_is_meta(x) -> bool:
    if isinstance(x, torch.Tensor):
        return x.is_meta
    return bool(x) and all(isinstance(t, torch.Tensor) and t.is_meta for t in x)


class MetaStep(StepAccount):
    """The accounting of ``StepAccount`` for a step on meta tensors, which answers host
    reads (counted in ``host_reads``) and caches output layouts (module doc)."""

    def __init__(self):
        super().__init__()
        self._cacheable: dict = {}
        self._inplace: dict = {}
        self._layouts: dict = {}

    def _can_cache(self, func) -> bool:
        ok = self._cacheable.get(func)
        if ok is None:
            schema = func._schema
            ok = (
                func.namespace == "aten"
                and not schema.is_mutable
                and all(r.alias_info is None for r in schema.returns)
                and torch.Tag.nondeterministic_bitwise not in func.tags
                and torch.Tag.data_dependent_output not in func.tags
                and torch.Tag.dynamic_output_shape not in func.tags
            )
            self._cacheable[func] = ok
        return ok

    def _in_place(self, func) -> str | None:
        """ "self" for an aten op that only writes values into its first argument and returns
        it, "none" for one that returns nothing (``_foreach_*_``), else None."""
        if func in self._inplace:
            return self._inplace[func]
        schema, kind = func._schema, None
        first = schema.arguments[0].alias_info if schema.arguments else None
        if (
            func.namespace == "aten"
            and schema.is_mutable
            and first is not None
            and first.is_write
            and torch.Tag.inplace_view not in func.tags
            and schema.name.split("::")[-1] not in _RESIZING
        ):
            if not schema.returns:
                kind = "none"
            elif len(schema.returns) == 1 and _same_alias(schema.returns[0].alias_info, first):
                kind = "self"
        self._inplace[func] = kind
        return kind

    def execute(self, func, args, kwargs):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            self.host_reads += 1
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if not self._can_cache(func):
            # Values written in place: nothing to do on meta but hand back the destination.
            kind = self._in_place(func)
            if kind is not None and _first_is_meta(args[0]):
                return args[0] if kind == "self" else None
            return func(*args, **kwargs)
        try:
            key = (func, _key(args), _key(tuple(kwargs.items())) if kwargs else None)
        except _Uncacheable:
            return func(*args, **kwargs)
        layout = self._layouts.get(key)
        if layout is not None:
            return _allocate(layout)
        out = func(*args, **kwargs)
        try:
            self._layouts[key] = _layout(out)
        except _Uncacheable:
            self._cacheable[func] = False
        return out


@contextlib.contextmanager
def flash_attention_on_meta():
    """``F.scaled_dot_product_attention`` on meta tensors runs the flash kernel (see the
    module doc); on other devices it is untouched. Grouped-query attention repeats k and v
    per query head first (what SDPA's math path does), a little more than a GQA kernel."""
    sdpa = F.scaled_dot_product_attention

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        if not q.is_meta:
            return sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, **kw)
        if kw.get("enable_gqa") and k.shape[1] != q.shape[1]:
            r = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return kernel(q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    F.scaled_dot_product_attention = flash
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


@dataclass
class RankPlan:
    """What one rank of the planned run holds and does in one step."""

    rank: int
    stage: int  # pipeline stage
    tp_rank: int
    dp_rank: int
    parameters: int  # elements of this rank's parameters
    micro_batches: int
    memory: MemoryReport
    flops: dict[str, float]  # executed GEMM FLOPs this step by operand dtype
    traffic: int  # bytes read and written by the non-GEMM ops
    comm: dict[str, int]  # bytes this rank sends per collective this step
    comm_groups: dict[str, int]  # bytes this rank sends per process group this step
    wire: dict[str, int]  # the same bytes seen on the collectives as they ran, per kind
    host_reads: int
    build_seconds: float
    step_seconds: float


def assign_categories(account: StepAccount, state) -> None:
    """Name the run's persistent storages: weights, gradients, masters, optimizer states."""
    model, opt = state.model, state.optimizer
    account.assign("weights", [*model.parameters(), *model.buffers()])
    # Every main_grad and FP8 gradient slot is a view into these flat buffers; .grad is what
    # autograd still holds.
    buffers = opt.buffers
    grads = [buffers.fp32, buffers.fp8, buffers.scale_inv, buffers.amax]
    account.assign("grads", grads + [p.grad for p in opt.model_params if p.grad is not None])
    masters, states = opt.held_tensors()
    account.assign("master", masters)
    account.assign("optimizer", states)


WARM_UP_MICRO_BATCHES = 1


def _account_steps(account: StepAccount, state, steps, rank: int, built: float, say=None):
    """A warm-up step, then one counted training step of ``state`` per micro-batch count in
    ``steps``, on its family's example batch, under ``account`` (``say(line)``: progress,
    before each step). The warm-up is there
    because a first step is not a typical one: the optimizer creates its states in it (torch
    and LowBitAdamW alike, on first use), so a first step's backward runs without them, where
    every later step's holds them."""
    from training.step import train_step

    batch = state.family.example_batch(state.model_config, state.cfg.training.micro_batch_size)
    if say is not None:
        say(f"rank {rank}: built in {built:.1f} s; a warm-up step")
    train_step(state, repeat(batch), WARM_UP_MICRO_BATCHES)
    topo = state.groups.topology
    results = []
    for i, n in enumerate(steps):
        if say is not None:
            say(f"rank {rank}: step {i + 1} of {len(steps)}, {n} micro-batches")
        start = time.perf_counter()
        account.start_step()
        with account.saving():
            stats = train_step(state, repeat(batch), n)
        assign_categories(account, state)
        by_group: dict[str, int] = {}
        for (_, group, _), nbytes in state.meter.step_detail().items():
            by_group[group] = by_group.get(group, 0) + nbytes
        results.append(
            RankPlan(
                rank=rank,
                stage=topo.pp_rank,
                tp_rank=topo.tp_rank,
                dp_rank=topo.dp_rank,
                parameters=sum(p.numel() for p in state.model.parameters()),
                micro_batches=n,
                memory=account.memory(),
                flops=dict(account.flops),
                traffic=account.traffic,
                comm=dict(stats.comm),
                comm_groups=by_group,
                wire=dict(account.wire),
                host_reads=account.host_reads,
                build_seconds=built,
                step_seconds=time.perf_counter() - start,
            )
        )
    return results


def plan_steps(
    cfg: Config,
    plan: RunPlan,
    rank: int,
    steps: tuple[int, ...],
    backend: str = "nccl",
    say=None,
) -> list[RankPlan]:
    """Build rank ``rank`` of ``plan``'s run on meta tensors and, after a warm-up step, run
    one training step of each micro-batch count in ``steps``, counting what each holds,
    computes and sends. Needs a process without a process group (it makes a fake one).
    ``backend``: whose collective implementations the steps take (nccl: a GPU run's; gloo:
    to check a plan against a real CPU run, ``measure_rank``). ``say(line)``: progress."""
    from parallel.collective_paths import fake_group_backend
    from training.setup import build_run  # the heavy imports only when planning

    with (
        fake_world(plan.world_size, rank),
        fake_group_backend(backend),
        flash_attention_on_meta(),
        MetaStep() as account,
    ):
        if say is not None:
            say(f"rank {rank}: building on the meta device")
        start = time.perf_counter()
        state = build_run(cfg, plan, planning=True)
        return _account_steps(account, state, steps, rank, time.perf_counter() - start, say)


def plan_rank(
    cfg: Config,
    plan: RunPlan,
    rank: int,
    micro_batches: int | None = None,
    backend: str = "nccl",
    say=None,
) -> RankPlan:
    """``plan_steps`` of one step of ``micro_batches`` (default: the plan's)."""
    steps = (micro_batches or plan.micro_batches,)
    return plan_steps(cfg, plan, rank, steps, backend, say)[0]


def accelerator_update(state) -> None:
    """Make a real run's optimizer take the update path a GPU takes, and a plan executes
    (``LowBitAdamW.packed_update``): on CPU the packed update forms no FP32 products and so
    needs less memory than the GPU run a plan is of. The same bits either way."""
    if hasattr(state.optimizer.optimizer, "packed_update"):
        state.optimizer.optimizer.packed_update = False


def measure_rank(cfg: Config, plan: RunPlan, micro_batches: int | None = None) -> RankPlan:
    """The same accounting as ``plan_rank`` for a real run of this process's rank (in the
    process group torchrun or a test made): the reference a plan is checked against. The
    optimizer takes the accelerator's update path (``accelerator_update``), as the plan does."""
    from training.setup import build_run

    n = micro_batches or plan.micro_batches
    with StepAccount() as account:
        start = time.perf_counter()
        state = build_run(cfg, plan)
        accelerator_update(state)
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _account_steps(account, state, (n,), rank, time.perf_counter() - start)[0]

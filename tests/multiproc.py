"""Multi-process helpers shared by the training tests: W local gloo ranks, always with a deadline.

- ``run_ranks``: a Python function on W ranks with torchrun's environment (``rank_env``); each
  worker gets ``(rank, world, port, *args)`` and writes its results to files the test reads
  back. A worker's exception fails the calling test with its traceback; ranks that overrun the
  deadline are killed (a hung collective on gloo would otherwise wait 30 minutes).
- ``torchrun``: the real entry point (``entry``, default ``pretrain_gpt.py``) under torchrun;
  asserts exit 0.
- ``launch``: the entry point as W plain processes with torchrun's environment, so each rank's
  own exit code and output are seen (torchrun would add its own traceback).
- Multi-rank tests run on CPU with gloo wherever they run, a CUDA machine included: W ranks
  of one test cannot share one GPU under nccl, and a forked rank cannot use CUDA at all once
  the test process has (every rank of ``run_ranks`` calls ``force_cpu`` first; ``torchrun``
  and ``launch`` hide the GPUs from more than one rank). A test module that starts ranks
  runs on the CPU in its own process too, so that a single-process reference is compared
  like with like: tests/conftest.py applies ``force_cpu`` to the whole module.
- ``full_tensors`` with ``grad_value`` / ``weight_value``: a model's gradients or weights under
  the single-process names, tensor-parallel shards gathered, FP8/FP16 storage dequantized.
- ``end_worker``: how a spawned test worker ends: a barrier, then the process exits at once,
  without the process group's C++ teardown (see its docstring).
- ``RunsByWorld``: many runs batched into one set of processes per world size, started on
  first use; each rank leaves ``{name}_{level}_rank{r}.safetensors`` + ``.json`` behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

__all__ = [
    "REPO",
    "TORCHRUN",
    "RunsByWorld",
    "end_worker",
    "force_cpu",
    "free_port",
    "full_tensors",
    "tensor_parallel_errors",
    "key_bias_mask",
    "ADAM_WEIGHT_BAR",
    "reassembled_errors",
    "grad_value",
    "weight_value",
    "launch",
    "pretrain_ranks",
    "logged_losses",
    "metrics_records",
    "rank_env",
    "run_ranks",
    "torchrun",
]

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def metrics_records(run_dir: str | os.PathLike) -> list[dict]:
    """Every record of a run's metrics.jsonl, in the order written."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def logged_losses(run_dir: str | os.PathLike, metric: str = "lm loss") -> dict[int, float]:
    """Iteration -> the last logged ``metric`` (a resumed run logs again from its checkpoint)."""
    return {r["iteration"]: r[metric] for r in metrics_records(run_dir)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """torchrun's variables for ``rank`` of ``world`` (nothing for a single process)."""
    if world > 1:
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )  # fmt: skip


def end_worker() -> None:
    """End a spawned worker that has written its results: every rank reaches a barrier, then
    exits 0 at once (``os._exit``), skipping interpreter finalisation.

    Why: a CI run saw one rank of a finished two-rank gloo worker die with SIGABRT
    ("terminate called without an active exception") during teardown, after its work was
    done; the test failed although every result was right. Gloo's background threads and the
    process group's destructor race with interpreter shutdown; a worker that has nothing left
    to do need not run that teardown at all.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _import_before_fork() -> None:
    """Import here what every training process imports lazily, so forked ranks inherit it
    instead of importing it each: torch._dynamo (torch.optim's first parameter group loads
    it: about 2 s of CPU) and megatron.core's scheduler and datasets (about 1 s). Neither
    starts a thread."""
    import torch._dynamo  # noqa: F401

    from data.indexed import import_megatron

    for name in ("optimizer_param_scheduler", "datasets.gpt_dataset",
                 "datasets.blended_megatron_dataset_builder"):  # fmt: skip
        import_megatron(f"megatron.core.{name}")


def _no_cuda() -> bool:
    return False


def force_cpu(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """The project's device choice says CPU (so gloo) in this process, CUDA or not: every
    device decision goes through ``fp8train.device.is_cuda`` (the one module that asks
    torch.cuda). ``monkeypatch``: until it is undone (tests/conftest.py: for one test
    module, in the test process); without it for good (a rank, which ends with its test).

    Patched rather than hidden by ``CUDA_VISIBLE_DEVICES``: a forked rank inherits the
    parent's device count, which torch reads once per process and caches, so hiding the GPUs
    after the fork changes nothing (the variable is still set for what a rank starts)."""
    from fp8train import device

    if monkeypatch is not None:
        monkeypatch.setattr(device, "is_cuda", _no_cuda)
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    device.is_cuda = _no_cuda


def _cpu_rank(rank: int, fn, *args) -> None:
    force_cpu()
    fn(rank, *args)


def run_ranks(
    fn, world: int, args: tuple = (), *, timeout: float = 400, start_method: str = "spawn"
) -> None:
    """``fn(rank, world, port, *args)`` in ``world`` processes on the CPU (``force_cpu``);
    returns when all succeeded.

    ``start_method``: "spawn" (a fresh interpreter per rank) or "fork" (no re-import: seconds
    faster per rank; the parent must not have started threads or a process group).
    """
    if start_method == "fork":
        _import_before_fork()
    context = mp.start_processes(
        _cpu_rank,
        args=(fn, world, free_port(), *args),
        nprocs=world,
        join=False,
        start_method=start_method,
    )
    deadline = time.monotonic() + timeout
    while not context.join(timeout=1):  # raises with the worker's traceback if one fails
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"world-size {world} ranks did not finish in {timeout} s")


def _pretrain_worker(rank: int, world: int, port: int, jobs: list) -> None:
    rank_env(rank, world, port)
    torch.set_num_threads(1)
    from parallel.topology import destroy_distributed
    from training.config import load_config
    from training.loop import pretrain

    for config, overrides in jobs:  # later runs reuse the process group and add their groups
        pretrain(load_config(config, overrides))
    destroy_distributed()


def pretrain_ranks(world: int, jobs: list[tuple[str, list[str]]], timeout: float = 300) -> None:
    """``training.loop.pretrain`` of every ``(config path, overrides)`` job, one after the
    other, in ``world`` forked ranks: what ``torchrun`` of the entry point does, without a
    fresh interpreter (and its imports) per rank and job. A job that resumes reads everything
    from its checkpoint, nothing from the process."""
    import training.loop  # noqa: F401  (imported once here, inherited by the forked ranks)

    run_ranks(_pretrain_worker, world, (jobs,), timeout=timeout, start_method="fork")


def _hidden_gpus(world: int) -> dict[str, str]:
    """The environment that keeps a fresh interpreter of a multi-rank run on the CPU."""
    return {"CUDA_VISIBLE_DEVICES": ""} if world > 1 else {}


def torchrun(
    nproc: int, args: list[str], timeout: float = 300, *, entry: str = "pretrain_gpt.py"
) -> subprocess.CompletedProcess:
    """``{entry} *args`` on ``nproc`` ranks under torchrun; asserts it exits 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **_hidden_gpus(nproc))
    cmd = TORCHRUN + ["--nproc_per_node", str(nproc), entry, *args]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def launch(
    world: int, args: list[str], timeout: float = 120, *, entry: str = "pretrain_gpt.py"
) -> list[tuple[int, str, str]]:
    """``{entry} *args`` as ``world`` plain processes with torchrun's environment;
    ``(exit code, stdout, stderr)`` per rank."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            **_hidden_gpus(world),
        )  # fmt: skip
        cmd = [sys.executable, entry, *args]
        procs.append(
            subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # only after a timeout are any still running
            if p.poll() is None:
                p.kill()
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


class RunsByWorld:
    """``runs(world, name, level)`` -> per rank ``(tensors, record)``.

    ``make_runs(world, tmp)`` returns the ``{(name, level): job}`` of one world size; ``worker``
    runs them all in one set of ``world`` processes (``run_ranks(worker, world, (jobs, tmp))``),
    which happens once, on the first request for that world size. A failed start fails every
    later request at once instead of starting again.
    """

    def __init__(self, worker, make_runs, tmp_path_factory, prefix: str, **run_kwargs):
        self.worker, self.make_runs, self.factory = worker, make_runs, tmp_path_factory
        self.prefix, self.run_kwargs = prefix, run_kwargs
        self.done: dict[int, Path | None] = {}

    def __call__(self, world: int, name: str, level: str) -> list[tuple[dict, dict]]:
        from safetensors.torch import load_file

        if world not in self.done:
            tmp = self.factory.mktemp(f"{self.prefix}_world{world}")
            self.done[world] = None
            run_ranks(self.worker, world, (self.make_runs(world, tmp), str(tmp)), **self.run_kwargs)
            self.done[world] = tmp
        if self.done[world] is None:
            pytest.fail(f"the world-size {world} runs failed (see the first failing test)")
        stems = [self.done[world] / f"{name}_{level}_rank{r}" for r in range(world)]
        return [
            (load_file(f"{s}.safetensors"), json.loads(Path(f"{s}.json").read_text()))
            for s in stems
        ]


def grad_value(p) -> torch.Tensor:
    """The gradient a step would use (``fp8train.param_state.grad_value``)."""
    from fp8train.param_state import grad_value as value

    return value(p)


def weight_value(p) -> torch.Tensor:
    """A parameter's value: FP16/FP8 storage times its per-tensor ``scale_inv``."""
    from fp8train.param_state import scale_inv_of

    scale_inv = scale_inv_of(p)
    w = p.detach().float()
    return w if scale_inv is None else w * scale_inv


def full_tensors(model, value_of) -> dict[str, torch.Tensor]:
    """``value_of(param)`` for every parameter of ``model`` (a ``ParallelModel``) under the
    single-process names, tensor-parallel shards gathered to full tensors as the model's
    ``tensor_partitions`` say (a collective over ``model.tp_group``, so every rank of the group
    calls it). Returned as float32 CPU copies."""
    from parallel.tensor_parallel.layers import gather_full

    parts, group = model.tensor_partitions(), model.tp_group
    out = {}
    for name, p in model.named_parameters():
        key = model.canonical_name(name)
        value = value_of(p)
        if key in parts:
            dim, blocks = parts[key]
            value = gather_full(value.float(), dim, group, blocks)
        out[key] = value
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def tensor_parallel_errors(levels, build, loss_of) -> dict[str, dict]:
    """Run on every rank of an initialised 2-rank default group. For each precision level:
    seed 7, ``build(ctx)`` a model in one process, under TP and under TP with sequence
    parallelism, backward ``loss_of(model)``, and compare the loss and every gradient (TP
    shards gathered under the single-process names) with the one-process run. Returns
    ``{"level/tp" | "level/tp_sp": {"loss": relative error, "names": same names, "grads":
    [worst relative L2 error, its tensor]}}``."""
    import torch.distributed as dist

    from fp8train.precision import get_recipe
    from models.context import BuildContext

    results = {}
    for level in levels:
        runs = {}
        for name, extra in (
            ("single", {}),
            ("tp", {"tp_group": dist.group.WORLD}),
            ("tp_sp", {"tp_group": dist.group.WORLD, "sequence_parallel": True}),
        ):
            torch.manual_seed(7)
            model = build(BuildContext(get_recipe(level), **extra))
            loss = loss_of(model)
            loss.backward()
            grads = full_tensors(model, grad_value) if extra else {
                n: p.grad.detach().clone() for n, p in model.named_parameters()
            }  # fmt: skip
            runs[name] = (loss.item(), grads)
        ref_loss, ref_grads = runs["single"]
        for name in ("tp", "tp_sp"):
            loss, grads = runs[name]
            results[f"{level}/{name}"] = {
                "loss": abs(loss - ref_loss) / ref_loss,
                "names": sorted(grads) == sorted(ref_grads),
                "grads": max(
                    (((grads[n] - g).norm() / g.norm().clamp(min=1e-12)).item(), n)
                    for n, g in ref_grads.items()
                ),
            }
    return results


def key_bias_mask(name: str, value: torch.Tensor, structure: dict) -> torch.Tensor:
    """The key entries of a ``qkv.bias``, from a checkpoint's ``model_structure`` (rows
    ``[groups, heads_per_group + 2, head_dim]``, keys at ``heads_per_group``); else none."""
    mask = torch.zeros(value.shape, dtype=torch.bool)
    if name.endswith("attention.qkv.bias"):
        qkv = structure["fused"]["layers.*.attention.qkv"]
        r = qkv["heads_per_group"]
        mask.view(qkv["query_groups"], r + 2, qkv["head_dim"])[:, r] = True
    return mask


# Final weights of two fp32 runs that differ only in FP32 rounding (another layout), after a
# few AdamW steps: relative L2 error per tensor. Not an FP32-rounding bar, because Adam divides
# each gradient element by its own RMS: an element whose gradient is near eps in size turns a
# rounding difference dg into up to dg / (4 eps) of a step (d/dg of g / (|g| + eps) peaks
# there), so a tensor holding such an element moves by far more than its rounding. Seen: one
# row of RoBERTa's position embedding (TP=2 + SP, binary head) 5.3e-6 on one CPU, 6.3e-6 under
# ATEN_CPU_CAPABILITY=default, 1.39e-5 on an AVX-512 Xeon, every other tensor <= 3e-6. The bar
# is 7x the worst seen and still 1000x below what a layout bug does (a missing reduction or
# a skipped update moves a tensor by 1e-1 or more); the losses keep the 1e-5 fp32 bar.
ADAM_WEIGHT_BAR = 1e-4


def reassembled_errors(
    weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], structure: dict
) -> tuple[dict[str, float], float]:
    """(relative L2 error of every tensor of ``weights`` against ``ref``, key biases left out;
    the largest key-bias magnitude in either). The key entries of ``qkv.bias`` get an exactly
    zero gradient (softmax ignores the q.b_k added to every score of a query), so they and
    their differences are Adam-normalised FP32 rounding noise in every run: callers check them
    to stay noise-sized instead (tests/test_distributed_optimizer.py does the same)."""
    assert sorted(weights) == sorted(ref)  # the same canonical names, nothing missing or extra
    errors, key_bias = {}, 0.0
    for name, r in ref.items():
        keep = ~key_bias_mask(name, r, structure)
        w = weights[name]
        assert w.shape == r.shape, name
        errors[name] = ((w[keep] - r[keep]).norm() / r[keep].norm().clamp(min=1e-30)).item()
        if not keep.all():
            key_bias = max(key_bias, w[~keep].abs().max().item(), r[~keep].abs().max().item())
    return errors, key_bias

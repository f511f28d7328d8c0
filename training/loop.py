"""The training loop: micro-batches with accumulation, DP reduction, clipping, step, log, eval,
checkpoint, resume. Megatron semantics: the logged loss is the mean over the log interval."""

from __future__ import annotations

import functools
import math
import os
import time

import torch
import torch.distributed as dist

from data.sampler import micro_batches
from fp8train import device as devices
from fp8train.machine_cache import remember
from fp8train.optim_states import grad_of
from fp8train.param_state import grad_slot
from parallel.topology import gather_texts
from training.checkpointer import checkpoint_files, make_saver, restore
from training.config import Config, ConfigError, config_to_dict
from training.flops import measure_cpu_peak_tflops, peak_tflops_for
from training.forward_backward import forward_backward, forward_only
from training.memory import model_state_bytes
from training.metrics import MetricsWriter, format_console_line
from training.optimizer import clip_grad_norm
from training.resume_check import find_resume, read_resume_metadata
from training.run_lock import acquire_run_lock
from training.setup import RunState, build_run, num_microbatches
from training.signals import StopSignals

__all__ = ["TrainingError", "pretrain"]


def _print(rank_logs: bool, *args) -> None:
    if rank_logs:
        print(*args, flush=True)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def _sum_over_replicas(values: torch.Tensor, state: RunState) -> torch.Tensor:
    """Sum over data-parallel replicas and pipeline stages (only the last holds the loss)."""
    if state.groups.data is not None:
        dist.all_reduce(values, group=state.groups.data)
    if state.groups.pipeline is not None:
        dist.all_reduce(values, group=state.groups.pipeline.collectives)
    return values


def _sync_shared_embedding(state: RunState) -> None:
    """Sum the gradients of parameters two stages hold (a tied embedding's first- and
    last-stage copies)."""
    for shared in state.model.shared_parameters():
        grad = state.optimizer.grad_of(shared)
        dist.all_reduce(grad, group=state.groups.embedding)
        state.meter.record_collective(
            "embedding_all_reduce", "all_reduce", "embedding", grad.dtype, grad.nbytes, 2
        )


def _per_metric(state: RunState, reduced: torch.Tensor, clamp: bool = False) -> dict[str, float]:
    """``{metric: sum / count}`` from the ``[sum, count, ...]`` totals of the family."""
    out = {}
    for i, name in enumerate(state.metrics):
        count = reduced[2 * i + 1].clamp(min=1) if clamp else reduced[2 * i + 1]
        out[name] = float(reduced[2 * i] / count)
    return out


def train_step(
    state: RunState, data_iter, n_micro: int, health: bool = False, grad_hook=None
) -> dict:
    """One optimizer step over ``n_micro`` micro-batches. Returns step statistics.

    ``health``: measure FP8 cast underflow/saturation on the last micro-batch (for logging).
    ``grad_hook(state)``: called once the gradients are final (summed over pipeline copies,
    averaged over replicas, unscaled) and before clipping; tests read them there.
    """
    opt, scaler = state.optimizer, state.scaler
    batches = [_to_device(next(data_iter), state.device) for _ in range(n_micro)]
    state.meter.reset_step()
    opt.buffers.start_step(n_micro)  # buckets reduce as backward fills them
    loss_and_tokens = forward_backward(state, batches, health=health)
    # Wait for the buckets; the tied embedding's two pipeline copies are summed before its
    # own (held-back) bucket is averaged over the replicas.
    opt.buffers.finish(before_held=lambda: _sync_shared_embedding(state))
    grads, slots = opt.grads(), opt.grad_slots()
    fp8_elements, all_elements = opt.grad_elements()
    if scaler.loss_scale != 1.0:
        unscale = 1.0 / scaler.loss_scale
        if grads:
            torch._foreach_mul_(grads, unscale)
        for slot in slots:
            slot.mul_(unscale)  # exact: only the FP8 slot's scale changes
    if grad_hook is not None:
        grad_hook(state)
    stats = {}
    pipeline = state.groups.pipeline
    grad_norm = clip_grad_norm(
        grads,
        state.cfg.training.clip_grad,
        slots,
        tp_group=state.groups.tensor,
        sharded=opt.sharded_flags(),
        pp_group=pipeline.collectives if pipeline is not None else None,
        counted=opt.counted_flags(),
        dp_group=opt.norm_group,
        device=state.device,
    )
    norm = float(grad_norm)
    finite = math.isfinite(norm)
    if finite:
        opt.step()
    else:  # named before the gradients are zeroed, for the error if skips go on
        stats["nonfinite"] = _first_nonfinite_gradient(state)
    comm = state.meter.step_summary()  # after the step: includes the weights' all-gather
    if state.bytes_per_param is None and finite:
        # Measured once, after the step (optimizer states exist) while gradients are alive.
        state.bytes_per_param = model_state_bytes(state.model, opt)
    scaler.update(found_inf=not finite)
    state.scheduler.step(1)
    opt.zero_grad()
    losses = _per_metric(state, _sum_over_replicas(loss_and_tokens, state))
    headline = state.metrics[0]
    stats.update(loss=losses[headline], losses=losses, grad_norm=norm, skipped=not finite)
    stats.setdefault("nonfinite", None)
    # Wire bytes per gradient element: of the FP8 weight-gradient collectives alone when there
    # are any (the "1 byte per element" claim at W=2), and of every gradient collective
    # together (neither the pipeline's activation sends nor the weights' all-gather are
    # gradient traffic). Per collective: bytes per element it carried, overhead included.
    fp8_bytes = sum(comm.get(k, 0) for k in ("reduce_scatter_fp8", "all_gather_fp8"))
    grad_bytes = sum(
        v for k, v in comm.items() if not k.startswith(("pipeline_", "all_gather_params"))
    )
    stats["comm"] = comm
    stats["comm_per_element"] = state.meter.bytes_per_element()
    stats["fp8_logged"] = health
    stats["wire"] = fp8_bytes / fp8_elements if fp8_elements else None
    stats["wire_all"] = grad_bytes / max(all_elements, 1)
    return stats


class TrainingError(RuntimeError):
    """A run that cannot go on (e.g. diverged); the message says why and what to change."""


def _first_nonfinite_gradient(state: RunState) -> str:
    """``"{name} (rank r)"`` of the first parameter whose gradient is not finite, the lowest
    rank that holds one first; "none found" when only the norm overflowed. Collective."""
    opt, found = state.optimizer, ""
    for name, p in opt.param_names.items():
        main = grad_slot(p)  # the FP32 buffer view, or an FP8 slot
        grad = main if isinstance(main, torch.Tensor) else grad_of(p)
        if grad is not None and not bool(torch.isfinite(grad).all()):
            found = name
            break
    for rank, name in enumerate(gather_texts(found, state.device)):
        if name:
            return f"{name} (rank {rank})"
    return "none found"


def _check_skips(state: RunState, consecutive: int, iteration: int, stats: dict) -> None:
    limit = state.cfg.training.max_consecutive_skips
    if limit and consecutive >= limit:
        raise TrainingError(
            f"training: {consecutive} consecutive steps skipped for non-finite gradients, up to "
            f"iteration {iteration} (training.max_consecutive_skips={limit}); first non-finite "
            f"gradient: {stats['nonfinite']}; loss {stats['loss']:.4g}, loss scale "
            f"{state.scaler.loss_scale:g}. Lower optimizer.lr, check the data, or resume from "
            "an earlier checkpoint"
        )


@torch.no_grad()
def evaluate(state: RunState, n_micro: int) -> dict[str, float]:
    """Mean validation value of each metric over eval_iters global batches, always the same
    samples."""
    t = state.cfg.training
    topo = state.groups.topology
    state.model.eval()
    workers = state.family.loader_workers(state.cfg)
    it = micro_batches(
        state.valid_ds, 0, t.micro_batch_size, topo.dp_rank, topo.data, num_workers=workers
    )
    batches = []
    for _ in range(t.eval_iters * n_micro):
        try:
            batches.append(_to_device(next(it), state.device))
        except StopIteration:
            break
    totals = forward_only(state, batches)
    state.model.train()
    return _per_metric(state, _sum_over_replicas(totals, state), clamp=True)


def _peak(state: RunState) -> tuple[float, str]:
    cfg = state.cfg
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops, "configured"
    name = devices.device_name(state.device)
    known = peak_tflops_for(name, state.recipe.gemm)
    if known is not None:
        return known, f"dense {state.recipe.gemm} peak of {name}"
    peak, source = remember("fp32-matmul-tflops", state.device, measure_cpu_peak_tflops, best=max)
    return float(peak), f"fp32 matmul rate of {name}, {source}"


def _already_complete(cfg: Config, path, saved: dict) -> dict:
    """A run whose checkpoint has reached training.train_iters: say so and build nothing (no
    process group, data, model or empty TensorBoard file). Every rank reads the same
    checkpoint and returns here alike; the rank that would log prints."""
    iteration = saved["iteration"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _print(
        int(os.environ.get("RANK", "0")) == world - 1,
        f"training already complete: {path} is at iteration {iteration} of "
        f"training.train_iters={cfg.training.train_iters}; raise training.train_iters to "
        "train further",
    )
    return {"iteration": iteration, "consumed_samples": saved["consumed_samples"],
            "stopped_by": None}  # fmt: skip


def pretrain(cfg: Config, family: str | None = None) -> dict:
    """Train per ``cfg`` (its model family is its ``model`` section's; ``family``, when
    given, must agree); returns a summary (last logged losses, iterations run, ...)."""
    if family is not None and family != cfg.family:
        raise ConfigError(
            f"config: the model section is a {cfg.family!r} one, this run trains {family!r} "
            f"(load the config with family={family!r})"
        )
    family = cfg.family
    resume_from, weights_only = find_resume(cfg)
    # A resumed run keeps the FP8 GEMM backend its checkpoint used: same arithmetic.
    saved_backend, saved_structure = None, None
    if resume_from is not None:  # checked before anything is built
        saved = read_resume_metadata(resume_from, family)
        if not weights_only:  # a fine-tune picks its own backend and vocabulary padding
            saved_backend = saved.get("fp8_gemm_backend")
            saved_structure = saved.get("model_structure")
            if saved["iteration"] >= cfg.training.train_iters:
                return _already_complete(cfg, resume_from, saved)
    state = build_run(cfg, gemm_backend=saved_backend, saved_structure=saved_structure)
    topo = state.groups.topology
    # One job per checkpoint directory, held until this process ends.
    state.run_lock = acquire_run_lock(cfg.resolved_checkpoint_dir(), topo.rank, state.device)
    t, log = cfg.training, cfg.logging
    # The loss lives on the last pipeline stage; of its data-parallel ranks the last one logs.
    logs = topo.rank == topo.world_size - 1
    announce = functools.partial(_print, logs)  # a line from the logging rank only
    n_micro = num_microbatches(cfg, topo.data)

    iteration, consumed = 0, 0
    counters = {"skipped": 0, "nan": 0}
    if resume_from is not None and weights_only:
        restore(state, resume_from, weights_only=True, log=announce)
        _print(logs, f"loaded the weights of {resume_from}: fine-tuning from iteration 0")
    elif resume_from is not None:
        iteration, consumed = restore(state, resume_from, log=announce)
        counters.update(state.resumed_counters)
        _print(logs, f"resumed from {resume_from} at iteration {iteration}")
    writer = MetricsWriter(
        log.dir,
        enabled=logs,
        tensorboard=log.tensorboard,
        resumed_at=iteration if resume_from is not None and not weights_only else None,
        loss_names=state.metrics,
    )
    flops = state.family.flops_per_step(state.model_config, t.global_batch_size)
    # Only the logging rank reports MFU: the others skip measuring a CPU peak (~0.5 s each).
    peak, peak_source = _peak(state) if logs else (math.nan, "not measured on this rank")
    n_params = sum(p.numel() for p in state.model.parameters())
    r = state.recipe
    _print(
        logs,
        f"> fp8train: level {r.level} (GEMM {r.gemm}, grad comm {r.grad_comm}, weight {r.weight}, "
        f"master {r.master_weight or '-'}, weight grad {r.weight_grad}, Adam {r.adam_m}+{r.adam_v})"
        f" | world {topo.world_size} (tp {topo.tensor} pp {topo.pipeline} dp {topo.data}) | "
        f"{n_params / 1e6:.2f}M parameters on this rank | {n_micro} micro-batches/step | "
        f"fp8 gemm backend {state.gemm_backend} | MFU peak {peak:.3f} TFLOP/s ({peak_source})",
    )
    _print(
        logs,
        f"> run: metrics {log.dir}/metrics.jsonl"
        + (f", TensorBoard {log.dir}/tensorboard" if log.tensorboard else "")
        + f", checkpoints {cfg.resolved_checkpoint_dir()}",
    )
    writer.text("config", f"```\n{config_to_dict(cfg)}\n```")
    writer.text("mfu-peak", f"{peak:.3f} TFLOP/s: {peak_source}")

    data_iter = micro_batches(
        state.train_ds, consumed, t.micro_batch_size, topo.dp_rank, topo.data,
        num_workers=state.family.loader_workers(cfg),
    )  # fmt: skip
    interval_loss, interval_steps, interval_start = {}, 0, time.perf_counter()
    last = {}
    start_time = time.time()
    first_iteration, run_start = iteration, time.perf_counter()  # for the ETA
    printed_bytes = False
    consecutive = 0  # skipped steps in a row
    stopped_by = None
    saver = make_saver(state, announce)
    signals = StopSignals(cfg.checkpoint.save_on_signal).__enter__()
    try:
        while iteration < t.train_iters:
            health_every = log.fp8_stats_interval or log.interval
            fp8_log = (
                log.log_fp8_stats and state.recipe.fp8_gemm and (iteration + 1) % health_every == 0
            )
            stats = train_step(state, data_iter, n_micro, health=fp8_log)
            if not printed_bytes and state.bytes_per_param:
                printed_bytes = True
                _print(logs, "> model-state bytes per parameter (this rank): " + _bytes_line(state))
                stages = _stage_memory(state)
                if stages:
                    _print(logs, "> per pipeline stage: " + _stages_line(stages))
            if fp8_log:  # per-layer FP8 health: amax, scale, underflow, saturation
                fp8 = _gather_fp8_stats(state)
            if fp8_log and logs:
                writer.scalars(
                    iteration + 1,
                    {
                        f"fp8/{layer}/{k}": v
                        for layer, roles in fp8.items()
                        for k, v in roles.items()
                    },
                )
            iteration += 1
            consumed += t.global_batch_size
            counters["skipped"] += int(stats["skipped"])
            consecutive = consecutive + 1 if stats["skipped"] else 0
            _check_skips(state, consecutive, iteration, stats)
            counters["nan"] += int(not math.isfinite(stats["loss"]))
            for name, value in stats["losses"].items():
                interval_loss[name] = interval_loss.get(name, 0.0) + value
            interval_steps += 1
            eval_due = t.eval_iters > 0 and (
                iteration % t.eval_interval == 0 or iteration == t.train_iters
            )
            if iteration % log.interval == 0 or iteration == t.train_iters or eval_due:
                elapsed = (time.perf_counter() - interval_start) / interval_steps
                valid = evaluate(state, n_micro) if eval_due else None
                last = _log(
                    state,
                    writer,
                    iteration,
                    consumed,
                    {k: v / interval_steps for k, v in interval_loss.items()},
                    stats,
                    elapsed,
                    flops,
                    peak,
                    counters,
                    logs,
                    valid,
                    eta=_eta(run_start, iteration - first_iteration, t.train_iters - iteration),
                )
                interval_loss, interval_steps, interval_start = {}, 0, time.perf_counter()
            stop = t.exit_interval and iteration % t.exit_interval == 0
            if t.time_limit_minutes and time.time() - start_time > 60 * t.time_limit_minutes:
                stop = True
            stopped_by = signals.agreed(state.device)
            stop = stop or stopped_by is not None
            saver.poll()  # publishes a background save once every rank has written it
            save_every = cfg.checkpoint.save_interval
            if save_every and iteration % save_every == 0 or iteration == t.train_iters or stop:
                saver.save(iteration, *checkpoint_files(state, consumed, counters))
                if stop or iteration == t.train_iters:
                    saver.finish()  # the run's last checkpoint is published before it ends
                interval_start = time.perf_counter()  # saving is not training time
            if stopped_by is not None:
                _print(
                    logs,
                    f"received {stopped_by}: saved checkpoint at iteration {iteration} to "
                    f"{cfg.resolved_checkpoint_dir()}; the same command resumes from it",
                )
            if stop:
                break
    except TrainingError:  # raised on every rank at the same step: they can still agree
        saver.finish()
        raise
    except BaseException:  # maybe on this rank alone: no agreement, nothing published
        saver.abandon()
        raise
    finally:
        signals.__exit__()
    writer.close()
    state.run_lock.release()
    return {"iteration": iteration, "consumed_samples": consumed, "stopped_by": stopped_by,
            **last}  # fmt: skip


def _eta(run_start: float, done: int, remaining: int) -> float:
    """Seconds left at this run's mean wall time per iteration so far (evaluations and saves
    included: they recur at the same rate)."""
    return (time.perf_counter() - run_start) / max(done, 1) * remaining


def _stages_line(stages: dict[str, float]) -> str:
    parts = []
    for stage in range(len(stages) // 3):
        n = stages[f"mem-stage{stage}/num-parameters"]
        b = stages[f"mem-stage{stage}/model-state-bytes"]
        peak = stages[f"mem-stage{stage}/peak-bytes"]
        parts.append(
            f"stage {stage}: {n / 1e6:.2f}M params, model state {b / 2**20:.1f} MiB, "
            f"peak {peak / 2**20:.0f} MiB"
        )
    return " | ".join(parts)


def _bytes_line(state: RunState) -> str:
    parts = []
    for category, roles in state.bytes_per_param.items():
        detail = ", ".join(
            f"{r} {roles[r]:.2f}" for r in ("weights", "grads", "master", "optimizer")
        )
        parts.append(f"{category} {roles['total']:.2f} ({detail})")
    return " | ".join(parts)


def _stage_memory(state: RunState) -> dict[str, float]:
    """Per pipeline stage (collective over the stages; {} without a pipeline): parameters,
    model-state bytes and peak memory of each stage's rank in this pipeline."""
    pipeline = state.groups.pipeline
    if pipeline is None:
        return {}
    whole = (state.bytes_per_param or {}).get("all", {})
    n = whole.get("num-parameters", 0.0)
    peak = max(devices.memory_stats(state.device).values(), default=0)
    # On the run's device: nccl gathers no CPU tensors.
    values = [n, n * whole.get("total", 0.0), float(peak)]
    mine = torch.tensor(values, dtype=torch.float64, device=state.device)
    gathered = [torch.zeros_like(mine) for _ in pipeline.ranks]
    dist.all_gather(gathered, mine, group=pipeline.collectives)
    out = {}
    for stage, (params, state_bytes, peak_bytes) in enumerate(t.tolist() for t in gathered):
        out[f"mem-stage{stage}/num-parameters"] = params
        out[f"mem-stage{stage}/model-state-bytes"] = state_bytes
        out[f"mem-stage{stage}/peak-bytes"] = peak_bytes
    return out


def _gather_fp8_stats(state: RunState) -> dict:
    """Every stage's per-layer FP8 health at the rank that logs (layer names are global)."""
    stats = state.model.fp8_stats()
    pipeline = state.groups.pipeline
    if pipeline is None:
        return stats
    # Plain dicts of floats between this job's own processes; nothing read from files.
    gathered = [None] * len(pipeline.ranks)
    dist.all_gather_object(gathered, stats, group=pipeline.collectives)
    return {k: v for part in gathered for k, v in part.items()}


def _log(
    state,
    writer,
    iteration,
    consumed,
    losses,
    stats,
    step_time,
    flops,
    peak,
    counters,
    logs,
    valid,
    eta=None,
) -> dict:
    """``losses``: each metric's mean over the log interval; ``valid``: the validation values
    (None when no evaluation was due); ``eta``: estimated seconds to train_iters."""
    topo = state.groups.topology
    tflops = flops / (step_time * 1e12 * topo.world_size)
    bpp = state.bytes_per_param or {}
    by_role = {f"{cat}/{role}": v for cat, roles in bpp.items() for role, v in roles.items()}
    m = {
        "iteration": iteration,
        "consumed-samples": consumed,
        **losses,
        "learning-rate": state.optimizer.param_groups[0]["lr"],
        "grad-norm": stats["grad_norm"],
        "loss-scale": state.scaler.loss_scale,
        "batch-size": state.cfg.training.global_batch_size,
        "iteration-time": step_time,
        "samples-per-second": state.cfg.training.global_batch_size / step_time,
        "throughput": tflops,
        "mfu": tflops / peak,
        "bytes-per-param": bpp.get("all", {}).get("total"),
        "bytes-per-param-by-role": by_role,
        "comm-bytes": stats["comm"],
        "wire-bytes-per-grad-element": stats["wire"],
        "wire-bytes-per-grad-element-all": stats["wire_all"],
        "wire-bytes-per-element": stats["comm_per_element"],
        "skipped-iterations": counters["skipped"],
        "nan-iterations": counters["nan"],
        "eta-seconds": eta,
    }
    family = state.family
    for name, value in (valid or {}).items():
        m[f"{name} validation"] = value
        if name in family.perplexity_metrics:
            m[f"{name} validation ppl"] = math.exp(min(value, 20.0))
    mem = devices.memory_stats(state.device)
    for key, value in mem.items():  # Megatron's names: mem-allocated-bytes, ...
        m[f"mem-{key.replace('_', '-')}-bytes"] = value
    m.update(_stage_memory(state))
    if logs:
        train_iters = state.cfg.training.train_iters
        print(
            format_console_line(iteration, train_iters, m, state.metrics, family.sample_unit),
            flush=True,
        )
        if valid is not None:
            parts = [f" validation loss at iteration {iteration}"]
            for name, value in valid.items():
                parts.append(f"{name} value: {value:.6E}")
                if name in family.perplexity_metrics:
                    parts.append(f"{name} PPL: {m[f'{name} validation ppl']:.6E}")
            print(" | ".join(parts) + " |", flush=True)
        scalars = {k: v for k, v in m.items() if isinstance(v, int | float)}
        scalars.pop("iteration")
        for role, value in m["bytes-per-param-by-role"].items():
            scalars[f"bytes-per-param/{role}"] = value
        for name, value in m["comm-bytes"].items():
            scalars[f"comm-bytes/{name}"] = value
        for name, value in m["wire-bytes-per-element"].items():
            scalars[f"wire-bytes-per-element/{name}"] = value
        writer.scalars(iteration, scalars, samples=consumed)
        writer.record(m)
        writer.flush()
    return m

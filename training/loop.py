"""The training loop: micro-batches with accumulation, DP reduction, clipping, step, log, eval,
checkpoint, resume. Megatron semantics: the logged loss is the mean over the log interval."""

from __future__ import annotations

import functools
import math
import os
import time
from dataclasses import replace

import torch

from data.sampler import micro_batches
from training.checkpointer import checkpoint_files, make_saver, restore
from training.config import Config, ConfigError, config_to_dict
from training.metrics import RunMetrics, bytes_line, stage_memory, stages_line
from training.resume_check import resume_plan
from training.run_lock import acquire_run_lock
from training.run_plan import RunPlan, plan_parallel
from training.setup import RunState, build_run
from training.signals import StopSignals
from training.step import SkipCounter, StepStats, TrainingError, evaluate, train_step

__all__ = ["pretrain"]


def _print(rank_logs: bool, *args) -> None:
    if rank_logs:
        print(*args, flush=True)


def _already_complete(cfg: Config, plan: RunPlan) -> dict:
    """A run whose checkpoint has reached training.train_iters: say so and build nothing (no
    process group, data, model or empty TensorBoard file). Every rank reads the same
    checkpoint and returns here alike; the rank that would log prints."""
    resume = plan.resume
    _print(
        int(os.environ.get("RANK", "0")) == plan.logging_rank,
        f"training already complete: {resume.path} is at iteration {resume.iteration} of "
        f"training.train_iters={cfg.training.train_iters}; raise training.train_iters to "
        "train further",
    )
    consumed = resume.metadata["consumed_samples"]
    return {"iteration": resume.iteration, "consumed_samples": consumed, "stopped_by": None}


def pretrain(cfg: Config, family: str | None = None, plan: RunPlan | None = None) -> dict:
    """Train per ``cfg`` (its model family is its ``model`` section's; ``family``, when
    given, must agree) as the pre-flight's ``plan`` says (without one, e.g. from a test or a
    tool: the layout is checked and the checkpoint to resume found here); returns a summary
    (last logged losses, iterations run, ...)."""
    if family is not None and family != cfg.family:
        raise ConfigError(
            f"config: the model section is a {cfg.family!r} one, this run trains {family!r} "
            f"(load the config with family={family!r})"
        )
    if plan is None:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        plan = replace(plan_parallel(cfg, world), resume=resume_plan(cfg))
    resume = plan.resume
    if resume and not resume.weights_only and resume.iteration >= cfg.training.train_iters:
        return _already_complete(cfg, plan)
    run = _Run(build_run(cfg, plan))
    with StopSignals(cfg.checkpoint.save_on_signal) as signals:
        try:
            while run.iteration < cfg.training.train_iters:
                stats = run.step()
                run.log_if_due(stats)
                if run.save_if_due(signals):
                    break
        except TrainingError:  # raised on every rank at the same step: they can still agree
            run.saver.finish()
            raise
        except BaseException:  # maybe on this rank alone: no agreement, nothing published
            run.saver.abandon()
            raise
    return run.close()


class _Run:
    """One run's loop state around ``train_step``: position (iteration, samples), counters,
    the log interval's sums, the metrics writer and the checkpoint saver."""

    def __init__(self, state: RunState):
        cfg, topo, resume = state.cfg, state.groups.topology, state.plan.resume
        self.state, self.cfg, self.t = state, cfg, cfg.training
        # One job per checkpoint directory, held until this process ends.
        state.run_lock = acquire_run_lock(cfg.resolved_checkpoint_dir(), topo.rank, state.device)
        self.logs = topo.rank == state.plan.logging_rank
        self.announce = functools.partial(_print, self.logs)  # from the logging rank only
        self.n_micro = state.plan.micro_batches
        self.iteration, self.consumed = 0, 0
        self.counters = {"skipped": 0, "nan": 0}
        resumed = resume is not None and not resume.weights_only
        if resume is not None:
            self.iteration, self.consumed = restore(state, resume, log=self.announce)
        if resumed:
            self.counters.update(state.resumed_counters)
            self.announce(f"resumed from {resume.path} at iteration {self.iteration}")
        elif resume is not None:
            self.announce(f"loaded the weights of {resume.path}: fine-tuning from iteration 0")
        # The writer, FLOPs per step and MFU peak; each interval's record (training/metrics.py).
        self.metrics = RunMetrics(state, self.logs, self.iteration if resumed else None)
        self._announce_start()
        self.data_iter = micro_batches(
            state.train_ds, self.consumed, self.t.micro_batch_size, topo.dp_rank, topo.data,
            num_workers=state.family.loader_workers(cfg),
        )  # fmt: skip
        self.interval_loss, self.interval_steps = {}, 0
        self.unread: list[torch.Tensor] = []  # the steps' device losses not read yet
        self.skips = SkipCounter(state, self.counters["skipped"])  # read with the losses
        self.interval_start = time.perf_counter()
        self.last, self.start_time = {}, time.time()
        self.first_iteration, self.run_start = self.iteration, time.perf_counter()  # for ETA
        self.printed_bytes, self.stopped_by = False, None
        self.saver = make_saver(state, self.announce)

    def _announce_start(self) -> None:
        state, cfg, log = self.state, self.cfg, self.cfg.logging
        metrics = self.metrics
        peak, peak_source, writer = metrics.peak, metrics.peak_source, metrics.writer
        topo, r = state.groups.topology, state.recipe
        n_params = sum(p.numel() for p in state.model.parameters())
        self.announce(
            f"> fp8train: level {r.level} (GEMM {r.gemm}, grad comm {r.grad_comm}, weight "
            f"{r.weight}, master {r.master_weight or '-'}, weight grad {r.weight_grad}, Adam "
            f"{r.adam_m}+{r.adam_v}) | param_dtype={r.other_params} "
            f"({state.param_dtype_source}) | world {topo.world_size} (tp {topo.tensor} pp "
            f"{topo.pipeline} dp {topo.data}) | {n_params / 1e6:.2f}M parameters on this rank | "
            f"{self.n_micro} micro-batches/step | fp8 gemm backend {state.gemm_backend} | MFU "
            f"peak {peak:.3f} TFLOP/s ({peak_source})"
        )
        self.announce(
            f"> run: metrics {log.dir}/metrics.jsonl"
            + (f", TensorBoard {log.dir}/tensorboard" if log.tensorboard else "")
            + f", checkpoints {cfg.resolved_checkpoint_dir()}"
        )
        writer.text("config", f"```\n{config_to_dict(cfg)}\n```")
        writer.text("mfu-peak", f"{peak:.3f} TFLOP/s: {peak_source}")

    def step(self) -> StepStats:
        """One optimizer step, the FP8 health it was asked to measure, and the counters."""
        state, log = self.state, self.cfg.logging
        health_every = log.fp8_stats_interval or log.interval
        fp8_log = (
            log.log_fp8_stats and state.recipe.fp8_gemm and (self.iteration + 1) % health_every == 0
        )
        stats = train_step(state, self.data_iter, self.n_micro, health=fp8_log)
        if not self.printed_bytes and state.bytes_per_param:
            self.printed_bytes = True
            self.announce("> model-state bytes per parameter (this rank): " + bytes_line(state))
            stages = stage_memory(state)  # collective over the pipeline stages
            if stages:
                self.announce("> per pipeline stage: " + stages_line(stages))
        if fp8_log:  # per-layer FP8 health: amax, scale, underflow, saturation (collective)
            self.metrics.fp8_health(self.iteration + 1)
        self.iteration += 1
        self.consumed += self.t.global_batch_size
        self.skips.record(stats, self.iteration)  # on the device: checked when read
        self.unread.append(stats.means)  # read with the others when they are logged or saved
        self.interval_steps += 1
        return stats

    def _read_losses(self) -> None:
        """Fold the steps' losses, kept on the device since they ran, into the interval's sums
        and the NaN counter, and the device's count of skipped steps into the counters (raising
        training.max_consecutive_skips's error if a run of skips reached it: SkipCounter):
        one host read for all of them, made where the log or a checkpoint needs them (a read
        per step would make the host wait for the device every step). The sums are the same
        Python float additions, in the same order, as reading every step (float32 losses
        widen to float64 exactly)."""
        if not self.unread:
            return
        n = len(self.state.metrics)
        flat = torch.cat([torch.stack(self.unread).double().flatten(), self.skips.values]).tolist()
        skips = flat[-SkipCounter.SIZE :]
        rows = [flat[i : i + n] for i in range(0, n * len(self.unread), n)]
        self.unread = []
        for row in rows:
            self.counters["nan"] += int(not math.isfinite(row[0]))  # the headline metric
            for name, value in zip(self.state.metrics, row):
                self.interval_loss[name] = self.interval_loss.get(name, 0.0) + value
        self.counters["skipped"] = self.skips.check(self.state, skips)

    def log_if_due(self, stats: StepStats) -> None:
        """The interval's line (with an evaluation when one is due)."""
        t, iteration = self.t, self.iteration
        eval_due = t.eval_iters > 0 and (
            iteration % t.eval_interval == 0 or iteration == t.train_iters
        )
        if not (
            iteration % self.cfg.logging.interval == 0 or iteration == t.train_iters or eval_due
        ):
            return
        self._read_losses()  # first: the read waits for the interval's last step to finish
        elapsed = (time.perf_counter() - self.interval_start) / self.interval_steps
        valid = evaluate(self.state, self.n_micro) if eval_due else None
        losses = {k: v / self.interval_steps for k, v in self.interval_loss.items()}
        eta = _eta(self.run_start, iteration - self.first_iteration, t.train_iters - iteration)
        self.last = self.metrics.interval(
            iteration, self.consumed, losses, stats, elapsed, valid, eta, self.counters
        )
        self.interval_loss, self.interval_steps = {}, 0
        self.interval_start = time.perf_counter()

    def save_if_due(self, signals: StopSignals) -> bool:
        """Save when the interval, the end, or a stop (exit interval, time limit, a signal
        every rank agreed on) says so; True when the run stops here."""
        t, iteration = self.t, self.iteration
        stop = bool(t.exit_interval and iteration % t.exit_interval == 0)
        if t.time_limit_minutes and time.time() - self.start_time > 60 * t.time_limit_minutes:
            stop = True
        self.stopped_by = signals.agreed(self.state.device)
        stop = stop or self.stopped_by is not None
        self.saver.poll()  # publishes a background save once every rank has written it
        every = self.cfg.checkpoint.save_interval
        if every and iteration % every == 0 or iteration == t.train_iters or stop:
            self._read_losses()  # the checkpoint's NaN counter counts every step
            self.saver.save(iteration, *checkpoint_files(self.state, self.consumed, self.counters))
            if stop or iteration == t.train_iters:
                self.saver.finish()  # the run's last checkpoint is published before it ends
            self.interval_start = time.perf_counter()  # saving is not training time
        if self.stopped_by is not None:
            self.announce(
                f"received {self.stopped_by}: saved checkpoint at iteration {iteration} to "
                f"{self.cfg.resolved_checkpoint_dir()}; the same command resumes from it"
            )
        return stop

    def close(self) -> dict:
        self.metrics.close()
        self.state.run_lock.release()
        return {"iteration": self.iteration, "consumed_samples": self.consumed,
                "stopped_by": self.stopped_by, **self.last}  # fmt: skip


def _eta(run_start: float, done: int, remaining: int) -> float:
    """Seconds left at this run's mean wall time per iteration so far (evaluations and saves
    included: they recur at the same rate)."""
    return (time.perf_counter() - run_start) / max(done, 1) * remaining

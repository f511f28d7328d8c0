"""A run's metrics: what each log interval records (``RunMetrics``: the losses the loop hands
over, rates, MFU against ``mfu_peak``, bytes per parameter and on the wire, memory), the
collectives some of them need (per-stage memory, per-layer FP8 health), and where the numbers
go: the console line, TensorBoard (Megatron's tag names) and metrics.jsonl.

Only the rank that holds the loss writes (the last pipeline stage; with data parallelism its
last rank, as Megatron does), so every file has exactly one writer; every rank assembles the
record, since its collectives need them all. The loop (training/loop.py) keeps the reads of
the steps' losses: when they happen is what its host-sync count is about.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from data.progress import format_duration
from families.base import LOOP_METRICS
from fp8train import device as devices
from fp8train.machine_cache import remember
from training.flops import measure_cpu_peak_tflops, peak_tflops_for

if TYPE_CHECKING:
    from training.setup import RunState
    from training.step import StepStats

__all__ = [
    "MetricsWriter", "RunMetrics", "bytes_line", "format_console_line", "format_validation_line",
    "gather_fp8_stats", "mfu_peak", "stage_memory", "stages_line",
]  # fmt: skip

# Tags that also get a "<tag> vs samples" twin, as Megatron writes them (plus the losses).
_SAMPLE_TWINS = ("learning-rate", "loss-scale", "grad-norm", "batch-size")


def format_console_line(
    iteration: int,
    train_iters: int,
    m: dict,
    loss_names: tuple[str, ...],
    unit: str = "samples",
    labels: dict[str, str] | None = None,
) -> str:
    """Megatron's training log line, field for field where the field exists here; one field
    per loss of the model family (under its console label, ``labels``: the family's
    ``console_labels``), and the samples (``unit``: images for ViT) per second."""
    labels = labels or {}
    parts = [
        f" iteration {iteration:8d}/{train_iters:8d}",
        *(
            [f"ETA: {format_duration(m['eta-seconds'])}"]
            if m.get("eta-seconds") is not None
            else []
        ),
        f"consumed samples: {m['consumed-samples']:12d}",
        f"elapsed time per iteration (ms): {m['iteration-time'] * 1000:.1f}",
        f"{unit}/s: {m['samples-per-second']:.1f}",
        f"throughput per GPU (TFLOP/s/GPU): {m['throughput']:.3f}",
        f"MFU: {m['mfu'] * 100:.2f}%",
        f"learning rate: {m['learning-rate']:.6E}",
        f"global batch size: {m['batch-size']:5d}",
        *(f"{labels.get(name, name)}: {m[name]:.6E}" for name in loss_names),
        f"loss scale: {m['loss-scale']:.1f}",
        f"grad norm: {m['grad-norm']:.3f}",
        f"number of skipped iterations: {m['skipped-iterations']:3d}",
        f"number of nan iterations: {m['nan-iterations']:3d}",
    ]
    return " | ".join(parts) + " |"


def format_validation_line(
    iteration: int,
    valid: dict[str, float],
    perplexity: tuple[str, ...] = (),
    labels: dict[str, str] | None = None,
) -> str:
    """Megatron's validation line: each metric's value, and the perplexity of those in
    ``perplexity`` (the family's ``perplexity_metrics``), under the console labels
    ``labels`` (the family's ``console_labels``: "<name>" and "<name> PPL")."""
    labels = labels or {}
    parts = [f" validation loss at iteration {iteration}"]
    for name, value in valid.items():
        parts.append(f"{labels.get(name, name)} value: {value:.6E}")
        if name in perplexity:
            ppl = math.exp(min(value, 20.0))
            parts.append(f"{labels.get(f'{name} PPL', f'{name} PPL')}: {ppl:.6E}")
    return " | ".join(parts) + " |"


class MetricsWriter:
    """TensorBoard + JSON lines in ``log_dir``; inert on ranks that do not log."""

    def __init__(
        self,
        log_dir: str,
        enabled: bool,
        tensorboard: bool = True,
        resumed_at: int | None = None,
        loss_names: tuple[str, ...] = (),
    ):
        """``resumed_at``: the iteration a resumed run continues from (None: a run from
        scratch, which starts metrics.jsonl afresh)."""
        self.enabled = enabled
        self.twins = (*loss_names, *_SAMPLE_TWINS)
        self.writer = None
        self.jsonl = None
        if not enabled:
            return
        path = Path(log_dir)
        path.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(path / "tensorboard"), max_queue=100)
        # A resumed run appends after dropping what a stopped or killed attempt logged past
        # its checkpoint (it logs those iterations again), so each iteration has one record;
        # a run from scratch starts the file afresh so two runs' records never interleave.
        jsonl = path / "metrics.jsonl"
        if resumed_at is not None:
            _drop_records_after(jsonl, resumed_at)
        self.jsonl = open(jsonl, "a" if resumed_at is not None else "w", buffering=1)  # noqa: SIM115

    def scalars(self, iteration: int, values: dict[str, float], samples: int | None = None):
        if not self.enabled or self.writer is None:
            return
        for tag, value in values.items():
            if value is None or not isinstance(value, int | float) or math.isnan(value):
                continue
            self.writer.add_scalar(tag, value, iteration)
            if samples is not None and tag in self.twins:
                self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def record(self, record: dict) -> None:
        """One JSON object per logged iteration."""
        if self.enabled:
            self.jsonl.write(json.dumps(record, sort_keys=False) + "\n")

    def text(self, tag: str, text: str) -> None:
        if self.enabled and self.writer is not None:
            self.writer.add_text(tag, text, 0)

    def flush(self) -> None:
        if self.enabled and self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            self.writer.close()
        self.jsonl.close()


def _drop_records_after(jsonl: Path, iteration: int) -> None:
    """Rewrite ``jsonl`` without its records past ``iteration`` (atomically: a kill leaves the
    old file or the new one). A line that does not parse, e.g. one cut short by a kill, is
    dropped too."""
    if not jsonl.exists():
        return
    kept, dropped = [], 0
    for line in jsonl.read_text().splitlines():
        try:
            record = json.loads(line)
            keep = int(record["iteration"]) <= iteration
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            kept.append(line + "\n")
        else:
            dropped += 1
    if not dropped:
        return
    tmp = jsonl.with_name(jsonl.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, jsonl)


def mfu_peak(state: RunState) -> tuple[float, str]:
    """What MFU divides by (TFLOP/s) and where it comes from: the config, the device's dense
    peak at the GEMM dtype, or the CPU's FP32 matmul rate (measured once per machine)."""
    cfg = state.cfg
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops, "configured"
    name = devices.device_name(state.device)
    known = peak_tflops_for(name, state.recipe.gemm)
    if known is not None:
        return known, f"dense {state.recipe.gemm} peak of {name}"
    peak, source = remember("fp32-matmul-tflops", state.device, measure_cpu_peak_tflops, best=max)
    return float(peak), f"fp32 matmul rate of {name}, {source}"


class RunMetrics:
    """One run's metrics around its loop: the writer, the FLOPs per step and the peak MFU
    divides by, each log interval's record (assembled on every rank: the per-stage memory is a
    collective) and its output on the logging rank (``logs``)."""

    def __init__(self, state: RunState, logs: bool, resumed_at: int | None):
        """``resumed_at``: the iteration a resumed run continues from (None: from scratch)."""
        log = state.cfg.logging
        self.state, self.logs = state, logs
        self.writer = MetricsWriter(
            log.dir, enabled=logs, tensorboard=log.tensorboard, resumed_at=resumed_at,
            loss_names=state.metrics,
        )  # fmt: skip
        batch = state.cfg.training.global_batch_size
        self.flops = state.family.flops_per_step(state.model_config, batch)
        # Only the logging rank reports MFU: the others skip measuring a CPU peak (~0.5 s).
        self.peak, self.peak_source = mfu_peak(state) if logs else (math.nan, "not measured here")

    def fp8_health(self, iteration: int) -> None:
        """Per-layer FP8 health (amax, scale, underflow, saturation) into the logging rank's
        TensorBoard; a collective over the pipeline stages, so every rank calls it."""
        fp8 = gather_fp8_stats(self.state)
        if self.logs:
            scalars = {f"fp8/{layer}/{k}": v for layer, roles in fp8.items()
                       for k, v in roles.items()}  # fmt: skip
            self.writer.scalars(iteration, scalars)

    def interval(
        self,
        iteration: int,
        consumed: int,
        losses: dict,
        stats: StepStats,
        step_time: float,
        valid: dict | None,
        eta: float,
        counters: dict,
    ) -> dict:
        """The record of the log interval that ends at ``iteration`` (``consumed`` samples so
        far), written out at the logging rank; every rank calls it (``stage_memory`` is a
        collective). ``losses``: each metric's mean over the log interval; ``valid``: the
        validation values (None when no evaluation was due); ``eta``: estimated seconds to
        train_iters; ``counters``: the skipped and NaN iterations."""
        state, flops, peak = self.state, self.flops, self.peak
        topo = state.groups.topology
        tflops = flops / (step_time * 1e12 * topo.world_size)
        bpp = state.bytes_per_param or {}
        by_role = {f"{cat}/{role}": v for cat, roles in bpp.items() for role, v in roles.items()}
        values = {
            "iteration": iteration,
            "consumed-samples": consumed,
            "learning-rate": state.optimizer.param_groups[0]["lr"],
            "grad-norm": stats.grad_norm,
            "loss-scale": state.scaler.loss_scale,
            "batch-size": state.cfg.training.global_batch_size,
            "iteration-time": step_time,
            "samples-per-second": state.cfg.training.global_batch_size / step_time,
            "throughput": tflops,
            "mfu": tflops / peak,
            "bytes-per-param": bpp.get("all", {}).get("total"),
            "bytes-per-param-by-role": by_role,
            "comm-bytes": stats.comm,
            "wire-bytes-per-grad-element": stats.wire,
            "wire-bytes-per-grad-element-all": stats.wire_all,
            "wire-bytes-per-element": stats.comm_per_element,
            "skipped-iterations": counters["skipped"],
            "nan-iterations": counters["nan"],
            "eta-seconds": eta,
        }
        if set(values) != set(LOOP_METRICS):  # the registry refuses family metrics by it
            raise RuntimeError(f"loop metrics {sorted(values)} drifted from LOOP_METRICS")
        # The families' metrics go after the first two keys (the registry's LOOP_METRICS).
        m = {k: values[k] for k in LOOP_METRICS[:2]} | losses
        m.update((k, values[k]) for k in LOOP_METRICS[2:])
        family = state.family
        for name, value in (valid or {}).items():
            m[f"{name} validation"] = value
            if name in family.perplexity_metrics:
                m[f"{name} validation ppl"] = math.exp(min(value, 20.0))
        mem = devices.memory_stats(state.device)
        for key, value in mem.items():  # Megatron's names: mem-allocated-bytes, ...
            m[f"mem-{key.replace('_', '-')}-bytes"] = value
        m.update(stage_memory(state))  # collective: every rank, not only the one that logs
        if self.logs:
            self._emit(m, valid, iteration, consumed)
        return m

    def _emit(self, m: dict, valid: dict | None, iteration: int, consumed: int) -> None:
        """The logging rank's output of one interval's metrics ``m``: the console line (and
        the validation line), TensorBoard scalars and the metrics.jsonl record."""
        state, family = self.state, self.state.family
        labels = family.console_labels
        train_iters = state.cfg.training.train_iters
        print(
            format_console_line(
                iteration, train_iters, m, state.metrics, family.sample_unit, labels
            ),
            flush=True,
        )
        if valid is not None:
            line = format_validation_line(iteration, valid, family.perplexity_metrics, labels)
            print(line, flush=True)
        scalars = {k: v for k, v in m.items() if isinstance(v, int | float)}
        scalars.pop("iteration")
        for group in ("bytes-per-param-by-role", "comm-bytes", "wire-bytes-per-element"):
            prefix = "bytes-per-param" if group == "bytes-per-param-by-role" else group
            scalars.update((f"{prefix}/{name}", value) for name, value in m[group].items())
        self.writer.scalars(iteration, scalars, samples=consumed)
        self.writer.record(m)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def stages_line(stages: dict[str, float]) -> str:
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


def bytes_line(state: RunState) -> str:
    parts = []
    for category, roles in state.bytes_per_param.items():
        detail = ", ".join(
            f"{r} {roles[r]:.2f}" for r in ("weights", "grads", "master", "optimizer")
        )
        parts.append(f"{category} {roles['total']:.2f} ({detail})")
    return " | ".join(parts)


def stage_memory(state: RunState) -> dict[str, float]:
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


def gather_fp8_stats(state: RunState) -> dict:
    """Every stage's per-layer FP8 health at the rank that logs (layer names are global)."""
    stats = state.model.fp8_stats()
    pipeline = state.groups.pipeline
    if pipeline is None:
        return stats
    # Plain dicts of floats between this job's own processes; nothing read from files.
    gathered = [None] * len(pipeline.ranks)
    dist.all_gather_object(gathered, stats, group=pipeline.collectives)
    return {k: v for part in gathered for k, v in part.items()}

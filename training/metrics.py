"""Where numbers go: the console line, TensorBoard (Megatron's tag names) and metrics.jsonl.

Only the rank that holds the loss writes (the last pipeline stage; with data parallelism its
last rank, as Megatron does), so every file has exactly one writer.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from data.progress import format_duration

__all__ = ["MetricsWriter", "format_console_line", "format_validation_line"]

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

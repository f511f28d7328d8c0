"""Per-machine measurements, made once and remembered: the CPU's MFU peak and the ``auto``
FP8 GEMM backend.

Measured at every start, both followed the machine's load of the moment (a CPU peak of 0.023
to 0.093 TFLOP/s across runs of one afternoon; the ``auto`` backend flipping between runs), so
MFU was not comparable between runs. Here the first run on a machine measures and stores the
value in ``$FP8TRAIN_CACHE_DIR/machine.json`` (default ``~/.cache/fp8train``), keyed by what
the value depends on (CPU model, core and thread counts, torch version; the GPU's name);
later runs reuse it and say so. A rate is measured again by every run (a fraction of a
second) and the cache keeps the best, so a first measurement on a busy machine does not stay.
Delete the file to start over.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from fp8train import device as devices

__all__ = ["cache_file", "machine_key", "remember"]


def cache_file() -> Path:
    root = os.environ.get("FP8TRAIN_CACHE_DIR") or Path.home() / ".cache" / "fp8train"
    return Path(root) / "machine.json"


def machine_key(device: torch.device) -> str:
    """What a measurement on ``device`` depends on."""
    name = devices.device_name(device)
    if device.type == "cpu":
        return (
            f"cpu|{platform.machine()}|{name}|{os.cpu_count()} cores|"
            f"{torch.get_num_threads()} threads|torch {torch.__version__}"
        )
    return f"{device.type}|{name}|torch {torch.__version__}"


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # missing or damaged: measure again
        return {}
    return data if isinstance(data, dict) else {}


def remember(
    what: str,
    device: torch.device,
    measure: Callable[[], object],
    best: Callable[[object, object], object] | None = None,
) -> tuple[object, str]:
    """``(value, where it came from)``: the stored ``what`` for this machine, else
    ``measure()``, stored (atomically; an unwritable cache only means measuring next time).

    ``best`` (e.g. ``max`` for a peak rate): measure every time anyway and keep
    ``best(stored, new)``. A machine busy at the first measurement then only delays the true
    value instead of fixing a low one for good (seen: a peak measured while the test suite ran
    put MFU at 99%)."""
    path, key = cache_file(), machine_key(device)
    entry = _read(path).get(key, {}).get(what)
    if entry is not None and best is None:
        return entry["value"], f"cached in {path}, measured {entry['when']}"
    value = measure()
    if entry is not None:
        kept = best(entry["value"], value)
        if kept == entry["value"]:
            return kept, f"best measured on this machine ({entry['when']}), cached in {path}"
        value = kept
    when = time.strftime("%Y-%m-%d %H:%M")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data.setdefault(key, {})[what] = {"value": value, "when": when}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        return value, "measured now (cache not writable)"
    return value, f"measured now, cached in {path}"

"""Per-machine measurements, made once and remembered: the CPU's MFU peak and the ``auto``
FP8 GEMM backend.

Measured at every start, both followed the machine's load of the moment (a CPU peak of 0.023
to 0.093 TFLOP/s across runs of one afternoon; the ``auto`` backend flipping between runs), so
MFU was not comparable between runs. Here the first process on a machine measures and stores
the value in ``$FP8TRAIN_CACHE_DIR/machine.json`` (default ``~/.cache/fp8train``), keyed by
what the value depends on (CPU model, core and thread counts, torch version; the GPU's name);
later processes reuse it and say so. Processes that start together (the ranks of one run, the
workers of a test suite) take turns on a lock file: one measures, the others wait and read
its value, instead of each measuring (and disturbing the others' timings). A rate is measured
again by every run (a fraction of a second) and the cache keeps the best, so a first
measurement on a busy machine does not stay. Delete the file to start over.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from fp8train import device as devices

try:  # POSIX; elsewhere processes measure independently (as before the lock)
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

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


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path``'s ``.lock`` file for the block; no lock (and no error)
    where the directory cannot be written: the caller then measures on its own."""
    handle = None
    if fcntl is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle = open(path.with_name(path.name + ".lock"), "a")  # noqa: SIM115
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        except OSError:
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            handle.close()


def _store(path: Path, key: str, what: str, value: object) -> bool:
    """Write ``value`` for ``(key, what)`` atomically; False if the cache cannot be written
    (then the next process simply measures again)."""
    when = time.strftime("%Y-%m-%d %H:%M")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read(path)
        data.setdefault(key, {})[what] = {"value": value, "when": when}
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        return False
    return True


def remember(
    what: str,
    device: torch.device,
    measure: Callable[[], object],
    best: Callable[[object, object], object] | None = None,
) -> tuple[object, str]:
    """``(value, where it came from)``: the stored ``what`` for this machine, else
    ``measure()``, stored (atomically; an unwritable cache only means measuring next time).
    Concurrent callers measure one at a time, and a caller that waited reads the value the
    one before it stored.

    ``best`` (e.g. ``max`` for a peak rate): measure every time anyway and keep
    ``best(stored, new)``. A machine busy at the first measurement then only delays the true
    value instead of fixing a low one for good (seen: a peak measured while the test suite ran
    put MFU at 99%)."""
    path, key = cache_file(), machine_key(device)
    if best is not None:
        # Every process measures anyway, at the same time (serialised, the ranks of a run
        # would wait for each other); only the read-compare-write takes the lock.
        value = measure()
        with _locked(path):
            entry = _read(path).get(key, {}).get(what)
            if entry is not None:
                kept = best(entry["value"], value)
                if kept == entry["value"]:
                    return (
                        kept,
                        f"best measured on this machine ({entry['when']}), cached in {path}",
                    )
                value = kept
            if not _store(path, key, what, value):
                return value, "measured now (cache not writable)"
        return value, f"measured now, cached in {path}"
    entry = _read(path).get(key, {}).get(what)
    if entry is not None:  # the common case: no lock taken
        return entry["value"], f"cached in {path}, measured {entry['when']}"
    with _locked(path):
        entry = _read(path).get(key, {}).get(what)
        if entry is not None:  # stored while this process waited
            return entry["value"], f"cached in {path}, measured {entry['when']}"
        value = measure()
        if not _store(path, key, what, value):
            return value, "measured now (cache not writable)"
    return value, f"measured now, cached in {path}"

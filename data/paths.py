"""Can a directory be created and written, asked without creating or writing anything; and an
output folder that a failed tool leaves as it found it.

The pre-flight checks (training/preflight.py, the families' ``preflight``) ask this of
``logging.dir``, ``checkpoint.dir`` and ``data.cache_dir`` before any worker starts, so a path
under a regular file or on a read-only mount costs one line naming the key instead of a
traceback from the first ``mkdir`` (or, worse, from a save hours into the run).

The tools that write (tools/convert_checkpoint.py, export_hf.py, preprocess_data.py,
preprocess_images.py) check their input before they write, and write inside
``output_folder``: whatever still fails midway leaves nothing behind at ``--output``.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["directory_problem", "check_directory", "output_folder"]


def directory_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be used as a directory to write into, or None when it can: an
    existing directory must be writable; a missing one needs its nearest existing ancestor to
    be a writable directory (``mkdir -p`` would create the rest). Nothing is created."""
    target = Path(os.path.abspath(os.fspath(path)))
    probe = target
    while not os.path.lexists(probe) and probe != probe.parent:
        probe = probe.parent
    if os.path.isdir(probe):  # follows a symlink to a directory
        if os.access(probe, os.W_OK | os.X_OK):  # False on a read-only mount, even for root
            return None
        return f"{probe} is not writable"
    if probe == target:
        return f"{target} exists and is not a directory"
    kind = "a broken symbolic link" if os.path.islink(probe) else "not a directory"
    return f"{probe} is {kind}"


def check_directory(key: str, path: str | os.PathLike[str]) -> None:
    """Raise ``ValueError("{key}={path} cannot be created or written: ...")`` when
    ``directory_problem`` finds one."""
    problem = directory_problem(path)
    if problem:
        raise ValueError(f"{key}={os.fspath(path)} cannot be created or written: {problem}")


@contextmanager
def output_folder(folder: str | os.PathLike[str], *, owned: bool = False) -> Iterator[Path]:
    """``folder``, created with its missing ancestors, for a tool to write into. When the
    block raises, the folders made here are removed again (each only once empty: files the
    block wrote are its own to remove) and the error goes on. ``owned``: the folder must be
    absent or empty, and on failure everything in it is removed too (a tool's whole output)."""
    folder = Path(folder)
    problem = directory_problem(folder)
    if problem:
        raise ValueError(f"{folder} cannot be created or written: {problem}")
    if owned and folder.is_dir() and any(folder.iterdir()):
        raise ValueError(f"{folder}: output directory exists and is not empty")
    made: list[Path] = []  # deepest first
    probe = folder
    while not os.path.lexists(probe) and probe != probe.parent:
        made.append(probe)
        probe = probe.parent
    for path in reversed(made):
        path.mkdir()
    try:
        yield folder
    except BaseException:
        if owned and folder.is_dir():
            for child in folder.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
        for path in made:
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
        raise

"""Can a directory be created and written, asked without creating or writing anything.

The pre-flight checks (training/preflight.py, the families' ``preflight``) ask this of
``logging.dir``, ``checkpoint.dir`` and ``data.cache_dir`` before any worker starts, so a path
under a regular file or on a read-only mount costs one line naming the key instead of a
traceback from the first ``mkdir`` (or, worse, from a save hours into the run).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["directory_problem", "check_directory"]


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
